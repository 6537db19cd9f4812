"""The runs of an attempt the gate has no record of (``unverified.lua``), and their rows.

A message with no nonce (a publisher that predates records, or a decision made without Redis)
gets an unverified row for each run, as a gated run does: its runs are counted in a small hash
of their own, ``unverified:<job_id>:<attempt>`` (keys.py, kept ``RECORD_RETENTION_S``), with
what a row needs as the worker read it from the message. So the main process can give a run
whose pool child was killed its row, the sweep one whose whole worker vanished
(``unverified:started``), the redelivered copy of a message finds the run that died before
it, and a signal that fires twice writes one row. Such messages are rare (the gate's Redis was
down when they were published, or the gate failed closed), so a worker pays for this only then.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import redis

from gatekeeper.core.ledger import LedgerRow, Outcome, window_id
from gatekeeper.defaults import RECORD_RETENTION_S
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.run_start import StartCall, Started
from gatekeeper.redis.runs import RunLedger, RunRecord
from gatekeeper.redis.scripts import load_lua, text_of

__all__ = ["ROW_FIELDS", "UnverifiedRuns"]

ROW_FIELDS = ("task", "decision", "published_ms", "admitted_ms", "deadline_ms", "tokens_in",
              "tokens_out", "retries", "time_limit_s")  # fmt: skip
"""What an unverified run's hash keeps of its message for the row (:class:`RunRecord`'s names);
each run's start time, pool child and worker are kept apart (``o:<run>``)."""


TOTALLED = {Outcome.KILLED: "killed_rows", Outcome.ABANDONED: "abandoned"}
"""Outcomes of unverified rows counted in the lifetime ``totals`` (keys.py), by their field
there: ledger rows all the same."""


class UnverifiedRuns:
    """Unverified runs in the run ledger's namespace, through its connection (its line)."""

    def __init__(self, runs: RunLedger, ttl_s: int = RECORD_RETENTION_S) -> None:
        self.runs = runs
        self.ttl_s = str(ttl_s)
        self._script = runs.client.register_script(load_lua("unverified.lua"))

    def send_start(
        self, job_id: str, attempt: int, now_ms: int, fields: dict[str, str],
        redelivered: bool, ran_in: tuple[int, str],
    ) -> StartCall:  # fmt: skip
        """Count a run of the attempt (in the pool child and worker ``ran_in`` names), with
        ``fields`` (:data:`ROW_FIELDS`), sent as a gated run's start is (read when it ends,
        gatekeeper/redis/run_start.py); its :class:`Started` says ``unverified``, the run's
        number and, for a ``redelivered`` message, the run before it if that has no row."""
        member = f"{job_id}:{attempt}"
        keys = [self.runs.keys.unverified(job_id, attempt), self.runs.keys.stats,
                self.runs.keys.unverified_started]  # fmt: skip
        args = ["start", member, str(now_ms), self.ttl_s, secrets.token_hex(8),
                "1" if redelivered else "0", str(ran_in[0]), ran_in[1]]  # fmt: skip
        for name in ROW_FIELDS:
            args += [name, fields.get(name, "")]
        return StartCall.send(member, self.runs.line, self.runs.client, self._script, keys,
                              args, self.runs.call, _started)  # fmt: skip

    def open_runs(self, job_id: str, attempt: int) -> list[tuple[int, int, RunRecord]] | None:
        """The attempt's runs without a row: ``(run, pid, record)``, oldest first; None when
        its hash is gone (expired)."""
        try:
            raw = self.runs.client.hgetall(self.runs.keys.unverified(job_id, attempt))
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot read run {job_id}:{attempt}: {exc}") from exc
        if not raw:
            return None
        fields = {text_of(k): text_of(v) for k, v in raw.items()}
        found = []
        for name, value in fields.items():
            if name.startswith("o:"):
                started, pid, worker = [*value.split("|", 2), "", ""][:3]
                worker = worker or fields.get("worker", "")  # a hash an earlier build wrote
                record = RunRecord.from_fields({**fields, "started_ms": started, "worker": worker})
                found.append((int(name[2:]), int(pid or 0), record))
        return sorted(found, key=lambda run: run[0])

    def ended_in(
        self, job_id: str, attempt: int, ran_in: tuple[int, str]
    ) -> tuple[int, RunRecord] | None:
        """The latest run without a row that pool child ``pid`` of ``worker`` ran
        (``ran_in``); with no pid known, the one run without a row. None when there is no
        such run (it has its row: a signal that fired twice), or no telling which."""
        runs = self.open_runs(job_id, attempt) or []
        pid, worker = ran_in
        if pid:
            mine = [(run, rec) for run, ran, rec in runs if ran == pid and rec.worker == worker]
            return mine[-1] if mine else None
        return (runs[0][0], runs[0][2]) if len(runs) == 1 else None

    def stale(self, now_ms: int, older_than_s: float) -> list[tuple[str, int]]:
        """Attempts whose latest start was more than ``older_than_s`` ago, with a run that
        has no row."""
        key = self.runs.keys.unverified_started
        try:
            members = self.runs.client.zrangebyscore(key, "-inf", now_ms - older_than_s * 1000)
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot read started runs: {exc}") from exc
        split = (text_of(member).rpartition(":") for member in members)  # type: ignore[arg-type]
        return [(job_id, int(attempt)) for job_id, _, attempt in split]

    def forget(self, job_id: str, attempt: int) -> None:
        """Drop an attempt from ``unverified:started`` (its hash expired: nothing to row)."""
        self.runs.client.zrem(self.runs.keys.unverified_started, f"{job_id}:{attempt}")

    def write(self, row: LedgerRow, run: int, now_ms: int, token: str | None = None) -> bool:
        """Write the row of the attempt's run ``run`` (unpriced: no tax, no exposure, never
        counted toward a freeze or against a clean hour); False when it had one already. Run
        0 is no run: the attempt's abandonment by the replayer (gatekeeper/celery/deadletter.py). A
        connection lost on the way sends it once more: the run's row is written once, and
        the call that wrote it is told so (``token``, random unless given: the same call
        sent again later, pending.py, is told so too)."""
        window = window_id(now_ms / 1000, self.runs.window_seconds)
        keys = self.runs.keys
        entry = {**row.to_json(), "retry_tax": 0.0, "verified": False}
        args = ["row", f"{row.job_id}:{row.attempt}", str(run), json.dumps(entry),
                row.outcome.value, str(self.runs.retention_s), TOTALLED.get(row.outcome, ""),
                self.ttl_s, token or secrets.token_hex(8)]  # fmt: skip
        written = [keys.unverified(row.job_id, row.attempt), keys.window_rows(window),
                   keys.window(window), keys.totals, keys.unverified_started]  # fmt: skip
        try:
            try:
                (done,) = self.runs.call(self._script, written, args)
            except (redis.ConnectionError, redis.TimeoutError):
                (done,) = self.runs.call(self._script, written, args)  # safe: the token
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot write an unverified row: {exc}") from exc
        return bool(done)


def _started(reply: Any) -> Started:
    """``unverified.lua``'s start reply as a :class:`Started` (refused: ``unverified``)."""
    run, dead_run, dead_ms = (text_of(part) for part in reply)
    return Started(run=int(run), dead_run=int(dead_run), dead=None, refused="unverified",
                   dead_started_ms=int(dead_ms))  # fmt: skip
