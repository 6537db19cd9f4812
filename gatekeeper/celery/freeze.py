"""What a run's written row says: its ``ledger_row`` line, its slack miss, and the auto-freeze
(slack misses over the error budget turn the free path off in Redis).

The rule is the core's (:func:`gatekeeper.core.health.should_freeze`); this writes the flag
(with its reason, as actor ``gatekeeper:auto-freeze``, counting ``freezes`` in the lifetime
totals in the same transaction) and the alert line.
"""

from __future__ import annotations

from typing import Any

import redis

from gatekeeper.core.flagvalues import closed_by
from gatekeeper.core.health import WindowHealth, should_freeze
from gatekeeper.core.ledger import LedgerRow, Path
from gatekeeper.defaults import WINDOW_RETENTION_S
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.runs import Finished, RunRecord

__all__ = ["maybe_freeze", "row_written"]


def row_written(
    log: Any, alerts: Any, flags: FlagStore, now: float, record: RunRecord, row: LedgerRow,
    run: int, reason: str, done: Finished,
) -> None:  # fmt: skip
    """A run's row was written (``done``, finish.lua's reply): its line, and a slack miss's
    alert, which may freeze the free path."""
    job_id, attempt = row.job_id, row.attempt
    log.info(
        "ledger_row", task=record.task, job_id=job_id, attempt=attempt, run=run,
        path=row.path.value, outcome=row.outcome.value, reason=reason,
        queue_wait_ms=row.queue_wait_ms, tokens_in=row.tokens_in, retry_tax=done.retry_tax,
        deadline_slack_ms=row.deadline_slack_ms,
    )  # fmt: skip
    if done.slack_miss:  # not a rerun's after the attempt's ok row (finish.lua)
        alerts.error(
            "slack_miss", decision="admit_free", slack_miss=True, task=record.task,
            job_id=job_id, attempt=attempt, dwell_s=record.dwell_s,
            deadline_slack_s=row.deadline_slack_ms / 1000, retries=record.retries,
        )  # fmt: skip
    # A free row of a window with misses checks it too (a reviewer: misses counted before
    # `miss_min_admissions` admissions were never checked again), once per window.
    if done.slack_miss or (row.path is Path.FREE and done.slack_misses):
        try:  # the row is written: a check that gets no answer never sends it again (pending)
            maybe_freeze(flags, alerts, done.window, done.slack_misses, done.admitted_free,
                         now, once=not done.slack_miss)  # fmt: skip
        except (LedgerUnavailable, redis.RedisError) as exc:
            log.warning("freeze_check_failed", job_id=job_id, attempt=attempt, error=repr(exc))


def maybe_freeze(
    flags: FlagStore, alerts: Any, window: int, misses: int, admitted: int, now: float,
    once: bool = False,
) -> bool:  # fmt: skip
    """Freeze the free path when a window's misses exceed the error budget; True if frozen.
    ``once`` (a check made without a new miss): only if this window never froze it (nor
    found it closed), so that an operator's re-open holds until the window misses again."""
    settings = flags.settings
    health = WindowHealth(window_id=window, admitted_free=admitted, slack_misses=misses)
    budget = settings.miss_error_budget
    if not should_freeze(health, budget, settings.miss_min_admissions):
        return False
    froze = flags.keys.window_froze(window)
    if once and flags.client.exists(froze):
        return False
    if closed_by(flags.stored()):
        flags.client.set(froze, "1", ex=WINDOW_RETENTION_S)  # found closed: this window's once
        return False
    reason = (
        f"slack misses {misses}/{admitted} = {misses / admitted:.1%} of free admissions in "
        f"window {window} exceed miss_error_budget {budget:.1%}"
    )
    change = flags.close(reason, "gatekeeper:auto-freeze", now)  # (a failed write: no mark,
    flags.client.set(froze, "1", ex=WINDOW_RETENTION_S)  # so the next row checks again)
    if change is None:
        return False  # another worker froze it meanwhile: one freeze, one line
    alerts.error(
        "free_path_frozen", window=window, slack_misses=misses, admitted_free=admitted,
        miss_error_budget=budget, reason=reason, on_disk=flags.persisted,
        **({"replicated": flags.replicas} if flags.replicas else {}),
    )  # fmt: skip
    return True
