"""The sweep: runs whose worker vanished without any signal, recorded as killed; and the
exposure of admissions that never started (a purged or lost message) given back.

``gatekeeper sweep`` runs it, and the replayer every minute.
"""

from __future__ import annotations

from typing import NamedTuple

from gatekeeper.core.ledger import LedgerRow, Outcome
from gatekeeper.redis.runs import RunLedger, RunRecord
from gatekeeper.redis.scripts import text_of
from gatekeeper.redis.store import GateStore
from gatekeeper.redis.unverified import UnverifiedRuns

__all__ = ["PURGE_GRACE_S", "Swept", "forget_purged", "sweep"]

PURGE_GRACE_S = 5.0
"""An admission younger than this is never taken for purged: its message may still be on
its way to the broker (the ordinary path decides, then publishes)."""


class Swept(NamedTuple):
    """A row the sweep wrote; ``verified`` false for an unverified run's (its message had no
    nonce: unpriced), which its ``ledger_row`` line says as the worker's lines do."""

    row: LedgerRow
    verified: bool


def sweep(
    ledger: RunLedger, now_ms: int, older_than_s: float, store: GateStore | None = None
) -> list[Swept]:
    """Record runs started more than ``older_than_s`` ago with no row as killed.

    A run of a task with a hard time limit is given at least that limit (plus a minute)
    before it counts as vanished. With ``store``, also give back the exposure of attempts
    admitted more than ``older_than_s`` ago, and longer than the store's horizon (when the
    gate script stops counting them), that never started (a purged or lost message).
    """
    rows = []
    for job_id, attempt in ledger.stale(now_ms, older_than_s):
        stored = ledger.record(job_id, attempt)
        if stored is None:  # the run hash expired: nothing to price, just forget it
            ledger.client.zrem(ledger.keys.started, f"{job_id}:{attempt}")
            continue
        run, record = stored
        if _alive(ledger, record, now_ms):
            continue
        row = ledger.row_for(job_id, attempt, record, Outcome.KILLED, now_ms)
        if ledger.finish(row, run, record, now_ms).written:
            rows.append(Swept(row, True))
    unverified = UnverifiedRuns(ledger)  # runs of messages with no nonce: unverified rows
    for job_id, attempt in unverified.stale(now_ms, older_than_s):
        runs = unverified.open_runs(job_id, attempt)
        if not runs:  # expired, or rowed meanwhile
            unverified.forget(job_id, attempt)
        for run, _, record in runs or []:
            if record.started_ms > now_ms - older_than_s * 1000 or _alive(ledger, record, now_ms):
                continue
            row = ledger.row_for(job_id, attempt, record, Outcome.KILLED, now_ms)
            if unverified.write(row, run, now_ms):
                rows.append(Swept(row, False))
    if store is not None:  # never before the gate itself would (its horizon)
        given_back_s = max(older_than_s, store.horizon_s)
        for member, held in ledger.client.hgetall(ledger.keys.inflight).items():
            job_id, _, number = text_of(member).rpartition(":")
            _, window, admitted_ms = [*text_of(held).split("|"), "0", "0"][:3]
            if now_ms - float(admitted_ms) < given_back_s * 1000:
                continue
            if ledger.record(job_id, int(number)) is None:  # admitted, never started
                store.release(job_id, int(number), int(window))
    return rows


def _alive(ledger: RunLedger, record: RunRecord, now_ms: int) -> bool:
    """Whether a run may still be going: the worker process it started in is alive (the
    heartbeat of ``<hostname>#<process id>``: gatekeeper/celery/heartbeat.py; a run an earlier
    build recorded names the node alone), or its hard time limit (plus a minute) has not
    passed."""
    if record.worker and ledger.client.exists(ledger.keys.worker(record.worker)):
        return True
    return bool(record.time_limit_s) and (
        now_ms - record.started_ms < (record.time_limit_s + 60) * 1000
    )


def forget_purged(
    store: GateStore, present: set[str], now_ms: int, grace_s: float = PURGE_GRACE_S
) -> int:
    """Stop counting admissions whose message is no longer in the broker (``celery purge -Q
    free``, a deleted queue): each leaves the free queue's waiting set and gives back what it
    reserved. ``present`` is every attempt still waiting in the broker, prefetched and ETA
    messages included (:func:`gatekeeper.celery.lists.waiting_attempts`). Returns how many.
    """
    client, keys = store.client, store.keys
    forgotten = 0
    for member in client.zrangebyscore(keys.free_waiting, "-inf", now_ms - grace_s * 1000):
        text = str(text_of(member))  # type: ignore[arg-type]
        if text in present:
            continue
        job_id, _, number = text.rpartition(":")
        # release.lua gives back to the window the in-flight entry names; 0 is only for an
        # entry that names none (an older version's), whose window is unknown: none written.
        store.release(job_id, int(number), 0)
        forgotten += 1
    return forgotten
