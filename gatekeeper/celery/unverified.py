"""The worker side of runs the gate has no record of: forged ones (counted, never rowed), and
unverified ones, a message with no nonce, whose runs each get an unverified row however they
end (gatekeeper/redis/unverified.py keeps their count, and what a row needs).

A run ends in its pool child as a gated run does; one whose child was killed (a hard time
limit, a SIGKILL, a revoke that terminates it) is ended by the main process, which finds the
attempt's run without its row that the dead child ran; one that died unseen (``acks_late`` and
``reject_on_worker_lost``: no signal) is found by the start of its redelivered copy, and one
whose whole worker vanished by the sweep. Unpriced rows: no tax, no exposure, never counted
toward a freeze or against a clean hour (SPEC section 2).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import Any

from gatekeeper.celery.message import nonce_of, own_fields, unverified
from gatekeeper.celery.pending import PendingRows
from gatekeeper.celery.running import Running, Starting
from gatekeeper.core.ledger import LedgerRow, Outcome
from gatekeeper.redis.run_start import StartCall, Started
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.unverified import ROW_FIELDS, UnverifiedRuns

__all__ = ["UnverifiedSide"]

OWN = ("time_limit_s",)
"""The fields of :data:`ROW_FIELDS` the worker knows itself (``own_fields``), not the message."""


class UnverifiedSide:
    """Unverified runs on one run ledger, their ``ledger_row`` lines on ``log``."""

    def __init__(
        self, runs: RunLedger, log: Any, now_ms: Callable[[], int], pending: PendingRows
    ) -> None:
        self.runs = runs
        self.store = UnverifiedRuns(runs)
        self.log = log
        self.now_ms = now_ms
        self.pending = pending

    def send_start(
        self, task: Any, job_id: str, attempt: int, headers: dict[str, Any],
        own: dict[str, str], now_ms: int, redelivered: bool,
    ) -> StartCall:  # fmt: skip
        """Count this run, with what its row needs (``own``: the worker's own fields), in
        this process (the pool child the main process may have to end it for)."""
        record = unverified(task, headers, now_ms)
        fields = {name: own[name] if name in OWN else str(getattr(record, name))
                  for name in ROW_FIELDS}  # fmt: skip
        ran_in = (os.getpid(), own.get("worker", ""))
        return self.store.send_start(job_id, attempt, now_ms, fields, redelivered, ran_in)

    def unrecorded(self, job_id: str, starting: Starting, started: Started) -> Started:
        """``started``, unless ``start.lua`` found no record at all for a message with a
        nonce (``unverified`` and no run: a failover lost what the old master had not
        replicated, README's Sentinel section): its run is then counted as an unverified one,
        started at ``starting.now``, and owed an unverified row as one with no nonce is."""
        if started.refused != "unverified" or started.run:
            return started
        task, headers = starting.task, starting.headers
        call = self.send_start(task, job_id, starting.attempt, headers,
                               own_fields(task, headers), starting.now, starting.again)  # fmt: skip
        return call.started()

    def refused(
        self, task: Any, job_id: str, attempt: int, headers: dict[str, Any], started: Started,
        now_ms: int, running: dict[str, Running],
    ) -> None:  # fmt: skip
        """A message the gate has no record of (``started.refused``): logged once; an
        unverified run is added to ``running``, to be rowed when it ends, and the run before
        it, dead with its worker and never rowed, gets its row now (after: it may fail)."""
        self.log.warning("ledger_unverified_message", task=task.name, job_id=job_id,
                         attempt=attempt, kind=started.refused)  # fmt: skip
        if started.refused == "unverified":
            record = unverified(task, headers, now_ms)
            running[job_id] = Running(attempt, started.run, record, False)
        if started.dead_run:
            dead = unverified(task, headers, started.dead_started_ms)
            self.end(job_id, Running(attempt, started.dead_run, dead, False), Outcome.KILLED,
                     "worker_lost_redelivered")  # fmt: skip

    def forged(self, task: Any, job_id: str) -> None:
        """A message that claims the gate's decision with an attempt the gate never writes:
        logged once and counted as forged, as ``start.lua`` counts the others."""
        self.log.warning("ledger_unverified_message", task=task.name, job_id=job_id,
                         kind="forged", reason="attempt_not_the_gates")  # fmt: skip
        self.runs.client.hincrby(self.runs.keys.stats, "forged_runs", 1)

    def end_latest(
        self, task: Any, job_id: str, attempt: int, headers: dict[str, Any], reason: str,
        ran_in: tuple[int, str],
    ) -> None:  # fmt: skip
        """From the main process: the run its pool child ran (``ran_in``: its pid and the
        worker's name, gatekeeper/celery/received.py), killed, unless it has its row. A
        message with a nonce and no record whose child died before it read its start
        (:meth:`unrecorded`) has no unverified run yet: one is counted now, for its row."""
        ended = self.store.ended_in(job_id, attempt, ran_in)
        if ended is None and nonce_of(headers) and self.store.open_runs(job_id, attempt) is None:
            self.log.warning("ledger_unverified_message", task=getattr(task, "name", ""),
                             job_id=job_id, attempt=attempt, kind="unverified")  # fmt: skip
            now = self.now_ms()
            own = own_fields(task, headers)
            started = self.send_start(task, job_id, attempt, headers, own, now, False).started()
            ended = started.run, unverified(task, headers, now)
        if ended is not None:
            run, record = ended
            self.end(job_id, Running(attempt, run, record, False), Outcome.KILLED, reason)

    def end(
        self, job_id: str, running: Running, outcome: Outcome, reason: str,
        tokens_in: int | None = None, tokens_out: int | None = None,
    ) -> None:  # fmt: skip
        """The run's row, and its line when this call wrote it (a signal may fire twice); a
        write Redis gave no answer to is kept and sent again, as it was (pending.py)."""
        now = self.now_ms()
        row = self.runs.row_for(job_id, running.attempt, running.record, outcome, now,
                                tokens_in, tokens_out)  # fmt: skip
        token = secrets.token_hex(8)  # the same if sent again
        self.pending.write(
            job_id, running.run, lambda: self._write(row, running, reason, now, token)
        )

    def _write(self, row: LedgerRow, running: Running, reason: str, now: int, token: str) -> bool:
        written = self.store.write(row, running.run, now, token)
        if written:
            self.log.info("ledger_row", task=running.record.task, job_id=row.job_id,
                          attempt=row.attempt, path=row.path.value,
                          outcome=row.outcome.value, reason=reason, verified=False,
                          retry_tax=0.0)  # fmt: skip
        return written
