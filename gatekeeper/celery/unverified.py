"""The worker side of unverified runs: a message with no nonce, whose runs each get an
unverified row however they end (gatekeeper/redis/unverified.py keeps their count, and what a
row needs).

A run ends in its pool child as a gated run does; one whose child was killed (a hard time
limit, a SIGKILL, a revoke that terminates it) is ended by the main process, which finds the
attempt's latest run without its row; one that died unseen (``acks_late`` and
``reject_on_worker_lost``: no signal) is found by the start of its redelivered copy, and one
whose whole worker vanished by the sweep. Unpriced rows: no tax, no exposure, never counted
toward a freeze or against a clean hour (SPEC section 2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gatekeeper.celery.message import unverified
from gatekeeper.celery.running import Running
from gatekeeper.core.ledger import Outcome
from gatekeeper.redis.run_start import StartCall, Started
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.unverified import ROW_FIELDS, UnverifiedRuns

__all__ = ["UnverifiedSide"]

OWN = ("worker", "time_limit_s")
"""The fields of :data:`ROW_FIELDS` the worker knows itself (``own_fields``), not the message."""


class UnverifiedSide:
    """Unverified runs on one run ledger, their ``ledger_row`` lines on ``log``."""

    def __init__(self, runs: RunLedger, log: Any, now_ms: Callable[[], int]) -> None:
        self.runs = runs
        self.store = UnverifiedRuns(runs)
        self.log = log
        self.now_ms = now_ms

    def send_start(
        self, task: Any, job_id: str, attempt: int, headers: dict[str, Any],
        own: dict[str, str], now_ms: int,
    ) -> StartCall:  # fmt: skip
        """Count this run, with what its row needs (``own``: the worker's own fields)."""
        record = unverified(task, headers, now_ms)
        fields = {name: own[name] if name in OWN else str(getattr(record, name))
                  for name in ROW_FIELDS}  # fmt: skip
        return self.store.send_start(job_id, attempt, now_ms, fields)

    @staticmethod
    def running(
        task: Any, attempt: int, headers: dict[str, Any], started: Started, now_ms: int
    ) -> Running | None:
        """The run to end when it ends; None when the start was refused otherwise."""
        if started.refused != "unverified":
            return None
        return Running(attempt, started.run, unverified(task, headers, now_ms), False)

    def end_dead(
        self, task: Any, job_id: str, attempt: int, headers: dict[str, Any], started: Started
    ) -> None:
        """The row of the run before this one, dead with its worker and never rowed."""
        if started.dead_run:
            dead = unverified(task, headers, started.dead_started_ms)
            self.end(job_id, Running(attempt, started.dead_run, dead, False), Outcome.KILLED,
                     "worker_lost_redelivered")  # fmt: skip

    def end_latest(self, job_id: str, attempt: int, reason: str) -> None:
        """From the main process: the attempt's latest run, killed, unless it has its row."""
        latest = self.store.latest(job_id, attempt)
        if latest is not None:
            run, record = latest
            self.end(job_id, Running(attempt, run, record, False), Outcome.KILLED, reason)

    def end(
        self, job_id: str, running: Running, outcome: Outcome, reason: str,
        tokens_in: int | None = None, tokens_out: int | None = None,
    ) -> None:  # fmt: skip
        """The run's row, and its line when this call wrote it (a signal may fire twice)."""
        now = self.now_ms()
        row = self.runs.row_for(job_id, running.attempt, running.record, outcome, now,
                                tokens_in, tokens_out)  # fmt: skip
        if self.store.write(row, running.run, now):
            self.log.info("ledger_row", task=running.record.task, job_id=job_id,
                          attempt=running.attempt, path=row.path.value,
                          outcome=row.outcome.value, reason=reason, verified=False,
                          retry_tax=0.0)  # fmt: skip
