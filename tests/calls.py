"""Building the gate script's inputs in tests: every field the script takes, with defaults."""

from __future__ import annotations

from typing import Any

from gatekeeper.core.ledger import BudgetMode
from gatekeeper.redis.push import new_nonce
from gatekeeper.redis.store import GateCall

DEFAULTS: dict[str, Any] = dict(
    window_id=1, job_id="job", attempt=1, expected_service_s=1.0, retry_tax_s=0.0,
    deadline_slack_s=60.0, max_queue_age_s=30.0, tokens_in=1, budget_units=1e9,
    queue_wait_unit_per_second=0.0, budget_mode=BudgetMode.EXPOSURE,
)  # fmt: skip


def gate_call(now_s: float, **fields: Any) -> GateCall:
    """A :class:`GateCall` at ``now_s``: a fresh nonce, published now, the rest as given."""
    fields.pop("deadline_slack_ms", None)  # derived from the slack by the store
    values = {**DEFAULTS, **fields}
    values.setdefault("nonce", new_nonce())
    values.setdefault("published_s", now_s)
    values.setdefault("deadline_s", now_s + values["deadline_slack_s"])
    return GateCall(now_s=now_s, **values)
