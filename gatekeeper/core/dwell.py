"""The dwell gate: pure arithmetic that picks free, defer or reserved for one attempt.

SPEC section 1. No Redis, no Celery, no clock, no logging: the drill, the CLI and the
publish hook all call :func:`decide` with numbers they gathered elsewhere.

    dwell_s = queue_age_s + expected_service_s + retry_tax_s (+ delay_s)

``delay_s`` is gatekeeper's one addition to the source's formula: the seconds until a delayed
task (an ETA or a retry countdown) is due, 0 for an ordinary publish. Such a task cannot start
before then, so its dwell carries the delay; the age cap still looks at the queue alone.

The rules, first match wins:

1. any input not finite, ``expected_service_s <= 0``, ``deadline_slack_s <= 0`` (or a negative
   queue age, retry tax or cap, which would under-count dwell the same way) -> ``defer``;
2. ``queue_age_s > max_queue_age_s`` -> ``defer`` (the age cap is a veto, not the whole vote);
3. ``dwell_s > deadline_slack_s`` -> ``reserved``;
4. otherwise -> ``admit_free``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from gatekeeper.defaults import MAX_QUEUE_AGE_S

__all__ = [
    "DECIDED_BY",
    "Decision",
    "GateInputs",
    "GateResult",
    "Reason",
    "decide",
    "guards_pass",
    "retry_tax_s",
]


class Decision(str, Enum):
    """Where a gated attempt goes."""

    ADMIT_FREE = "admit_free"
    DEFER = "defer"
    RESERVED = "reserved"

    def __str__(self) -> str:
        return self.value


class Reason(str, Enum):
    """Why the gate (or the pipeline around it) chose what it chose; machine-readable.

    The one list of reasons: the decision lines, the headers, the review's counters and the
    Lua scripts all use these values."""

    NON_FINITE_INPUT = "non_finite_input"
    BAD_SERVICE_GUESS = "bad_service_guess"
    DEADLINE_PASSED = "deadline_passed"
    NEGATIVE_INPUT = "negative_input"
    QUEUE_AGE_CAP = "queue_age_cap"
    DWELL_OVER_SLACK = "dwell_over_slack"
    FITS = "fits"
    RETRY_TAX_BUDGET = "retry_tax_budget"
    # Not the dwell gate's own: the publish pipeline's steps around it
    # (gatekeeper/redis/gate.py), in the order they are checked.
    GATE_DISABLED = "gate_disabled"
    """``dwell_gate_enabled`` is off: the task keeps its normal route (untouched)."""
    OUTSIDE_CANARY = "outside_canary"
    """The job is outside ``canary_percent``: its normal route (untouched)."""
    FLAGS_UNREAD = "flags_unread"
    """The flags were never read (Redis unreachable since start): its own route, unless free."""
    BAD_INPUT = "bad_input"
    """A declared input cannot be scored: reserved, with the field named."""
    FREE_PATH_DISABLED = "free_path_disabled"
    """``free_path_enabled`` is off (settings or Redis): reserved."""
    GATE_UNAVAILABLE = "gate_unavailable"
    """The gate's Redis could not be reached or its script failed: reserved."""
    GATE_ERROR = "gate_error"
    """A fault in the gate itself: reserved, with the error."""
    DUPLICATE_PUBLISH = "duplicate_publish"
    """Another publish of the same task id and attempt is still live: reserved, unrecorded
    (its run is priced nothing; the live one's record stands)."""
    EVICTION_POLICY = "eviction_policy"
    """The gate's Redis may evict keys (its ``maxmemory-policy`` is not ``noeviction``): an
    evicted window would reset the budget, an evicted flag undo a rollback. Reserved."""
    STATE_MISSING = "state_missing"
    """The gate's state marker is missing from Redis (a restart without persistence, a flush,
    a failover to an empty replica, or never initialised): nothing goes to free until an
    operator runs ``gatekeeper init``. Reserved."""

    def __str__(self) -> str:
        return self.value


DECIDED_BY = {r.value: d.value for d, reasons in (
    (Decision.ADMIT_FREE, (Reason.FITS,)),
    (Decision.DEFER, (Reason.NON_FINITE_INPUT, Reason.BAD_SERVICE_GUESS, Reason.DEADLINE_PASSED,
                      Reason.NEGATIVE_INPUT, Reason.QUEUE_AGE_CAP)),
    (Decision.RESERVED, (Reason.DWELL_OVER_SLACK, Reason.RETRY_TAX_BUDGET, Reason.STATE_MISSING,
                         Reason.FREE_PATH_DISABLED, Reason.DUPLICATE_PUBLISH)),
) for r in reasons}  # fmt: skip
"""The one decision each reason ``gate.lua`` gives comes with (its decision records leave the
decision empty: gatekeeper/core/whatif.py FIELDS)."""


@dataclass(frozen=True)
class GateInputs:
    """Everything one decision looks at, in seconds."""

    queue_age_s: float
    expected_service_s: float
    retry_tax_s: float
    deadline_slack_s: float
    max_queue_age_s: float = MAX_QUEUE_AGE_S
    delay_s: float = 0.0

    @property
    def dwell_s(self) -> float:
        """Wall-clock seconds a task published now can expect to spend on the free path."""
        return self.queue_age_s + self.expected_service_s + self.retry_tax_s + self.delay_s


@dataclass(frozen=True)
class GateResult:
    """A decision with its reason and the dwell it was computed from."""

    decision: Decision
    reason: Reason
    dwell_s: float
    field: str | None = None
    """The input that failed a guard, when a guard fired (for the log line)."""


def retry_tax_s(retries_left: int, expected_service_s: float) -> float:
    """Wall-clock price of the retries a task may still use: one service interval each."""
    return max(retries_left, 0) * expected_service_s


def _first_non_finite(inputs: GateInputs) -> str | None:
    for name in (
        "queue_age_s",
        "expected_service_s",
        "retry_tax_s",
        "deadline_slack_s",
        "max_queue_age_s",
        "delay_s",
    ):
        value = getattr(inputs, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return name
        if not math.isfinite(value):
            return name
    return None


def guards_pass(
    expected_service_s: float,
    retry_tax_s: float,
    deadline_slack_s: float,
    max_queue_age_s: float,
    delay_s: float = 0.0,
) -> bool:
    """True when no guard of :func:`decide` can fire for these inputs (at queue age 0).

    The publish path's cheap check: only when it is False does the full :func:`decide` run
    to name the reason and the field.
    """
    values = (expected_service_s, retry_tax_s, deadline_slack_s, max_queue_age_s, delay_s)
    for value in values:
        if type(value) is not float and type(value) is not int:
            return False  # bools, None, text: decide() names the field
    return (
        0 < expected_service_s < math.inf
        and 0 < deadline_slack_s < math.inf
        and 0 <= retry_tax_s < math.inf
        and 0 <= max_queue_age_s < math.inf
        and 0 <= delay_s < math.inf
    )


def decide(inputs: GateInputs) -> GateResult:
    """Score one attempt: SPEC section 1's decision order, failing closed on bad input."""
    bad = _first_non_finite(inputs)
    if bad is not None:
        try:
            dwell = float(inputs.dwell_s)
        except (TypeError, ValueError):
            dwell = math.nan
        return GateResult(Decision.DEFER, Reason.NON_FINITE_INPUT, dwell, field=bad)
    dwell = inputs.dwell_s
    if inputs.expected_service_s <= 0:
        return GateResult(
            Decision.DEFER, Reason.BAD_SERVICE_GUESS, dwell, field="expected_service_s"
        )
    if inputs.deadline_slack_s <= 0:
        return GateResult(Decision.DEFER, Reason.DEADLINE_PASSED, dwell, field="deadline_slack_s")
    # A negative age, tax or cap can only come from a skewed clock or a typo; each would make
    # the free path look closer than it is, so it fails closed like a bad service guess.
    for name in ("queue_age_s", "retry_tax_s", "max_queue_age_s", "delay_s"):
        if getattr(inputs, name) < 0:
            return GateResult(Decision.DEFER, Reason.NEGATIVE_INPUT, dwell, field=name)
    if inputs.queue_age_s > inputs.max_queue_age_s:
        return GateResult(Decision.DEFER, Reason.QUEUE_AGE_CAP, dwell)
    if dwell > inputs.deadline_slack_s:
        return GateResult(Decision.RESERVED, Reason.DWELL_OVER_SLACK, dwell)
    return GateResult(Decision.ADMIT_FREE, Reason.FITS, dwell)
