"""One decision's request to ``gate.lua`` and the script's reply, as the gate store sends and
reads them (:mod:`gatekeeper.redis.store`); the script's header documents every argument."""

from __future__ import annotations

from dataclasses import dataclass

from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.core.ledger import BudgetMode
from gatekeeper.core.whatif import NOTHING_KNOWN
from gatekeeper.redis.keys import OTHER_TASK
from gatekeeper.redis.push import Push

__all__ = ["DECISIONS", "REASONS", "GateCall", "ScoredAttempt"]


@dataclass(slots=True)
class GateCall:
    """One decision's inputs to ``gate.lua`` (documented at the top of the script).

    Not frozen, like the other objects made on every publish: a frozen dataclass's
    ``__init__`` costs several times a plain one's."""

    now_s: float
    window_id: int
    job_id: str
    attempt: int
    expected_service_s: float
    retry_tax_s: float
    deadline_slack_s: float
    max_queue_age_s: float
    tokens_in: int
    budget_units: float
    queue_wait_unit_per_second: float
    budget_mode: BudgetMode
    nonce: str
    published_s: float
    """This attempt's first publish (a replayed attempt keeps it: its wait includes defer)."""
    deadline_s: float = 0.0
    """The attempt's deadline, Unix seconds (kept in the record)."""
    prev_nonce: str = ""
    """The nonce the message already carries for this attempt (a replay), else ''."""
    delay_s: float = 0.0
    wait_allowance_s: float = 0.0
    """``free_wait_allowance_s``: the wait an admission reserves (0: its tokens alone)."""
    task: str = OTHER_TASK
    """The task's label in the lifetime totals (:func:`gatekeeper.redis.attempt.label_of`)."""
    publisher: str = NOTHING_KNOWN
    """The decision record's ``p`` field (:mod:`gatekeeper.core.whatif`): what the publisher
    knew and the script does not (the declared and learned service times, the retries left,
    the wait allowance)."""
    push: Push | None = None


@dataclass(slots=True)
class ScoredAttempt:
    """What the gate script decided for one attempt."""

    decision: Decision
    reason: Reason
    queue_age_s: float
    dwell_s: float
    projected_tax: float
    free_admitted: bool
    """This attempt or an earlier one of the job was admitted to free (the gate's record)."""


DECISIONS: dict[bytes | str, Decision] = {
    **{d.value: d for d in Decision},
    **{d.value.encode(): d for d in Decision},
}
REASONS: dict[bytes | str, Reason] = {
    **{r.value: r for r in Reason},
    **{r.value.encode(): r for r in Reason},
}
"""The scripts' replies (bytes, or text from a decoding client) to the core's enums."""
