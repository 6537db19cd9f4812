"""The sweep: runs whose worker vanished without any signal, recorded as killed; and the
exposure of admissions that never started (a purged or lost message) given back.

``gatekeeper sweep`` runs it, and the replayer every minute.
"""

from __future__ import annotations

from gatekeeper.core.ledger import LedgerRow, Outcome
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.scripts import text_of
from gatekeeper.redis.store import GateStore

__all__ = ["sweep"]


def sweep(
    ledger: RunLedger, now_ms: int, older_than_s: float, store: GateStore | None = None
) -> list[LedgerRow]:
    """Record runs started more than ``older_than_s`` ago with no row as killed.

    A run of a task with a hard time limit is given at least that limit (plus a minute)
    before it counts as vanished. With ``store``, also give back the exposure of attempts
    admitted more than ``older_than_s`` ago that never started (a purged or lost message).
    """
    rows = []
    for job_id, attempt in ledger.stale(now_ms, older_than_s):
        stored = ledger.record(job_id, attempt)
        if stored is None:  # the run hash expired: nothing to price, just forget it
            ledger.client.zrem(ledger.keys.started, f"{job_id}:{attempt}")
            continue
        run, record = stored
        if record.time_limit_s and now_ms - record.started_ms < (record.time_limit_s + 60) * 1000:
            continue
        row = ledger.row_for(job_id, attempt, record, Outcome.KILLED, now_ms)
        if ledger.finish(row, run, record, now_ms).written:
            rows.append(row)
    if store is not None:
        for member, held in ledger.client.hgetall(ledger.keys.inflight).items():
            job_id, _, number = text_of(member).rpartition(":")
            _, window, admitted_ms = [*text_of(held).split("|"), "0", "0"][:3]
            if now_ms - float(admitted_ms) < older_than_s * 1000:
                continue
            if ledger.record(job_id, int(number)) is None:  # admitted, never started
                store.release(job_id, int(number), int(window))
    return rows
