"""The runs of an attempt the gate has no record of (``unverified.lua``), and their rows.

A message with no nonce (a publisher that predates records, or a decision made without Redis)
gets an unverified row for each run, as a gated run does: its runs are counted in a small hash
of their own, ``unverified:<job_id>:<attempt>`` (keys.py, kept ``RECORD_RETENTION_S``), so
the main process can give a run whose pool child was killed its row, the next run of a
redelivered message finds the run that died before it, and a signal that fires twice writes
one row. Such messages are rare (the gate's Redis was down when they were published), so a
worker pays for this only then.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import redis

from gatekeeper.core.ledger import LedgerRow, window_id
from gatekeeper.defaults import RECORD_RETENTION_S
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.run_start import StartCall, Started
from gatekeeper.redis.runs import TOTALLED, RunLedger
from gatekeeper.redis.scripts import load_lua, text_of

__all__ = ["UnverifiedRuns"]


class UnverifiedRuns:
    """Unverified runs in the run ledger's namespace, through its connection (its line)."""

    def __init__(self, runs: RunLedger, ttl_s: int = RECORD_RETENTION_S) -> None:
        self.runs = runs
        self.ttl_s = str(ttl_s)
        self._script = runs.client.register_script(load_lua("unverified.lua"))

    def send_start(self, job_id: str, attempt: int, now_ms: int) -> StartCall:
        """Count a run of the attempt, sent as a gated run's start is (read when it ends,
        gatekeeper/redis/run_start.py); its :class:`Started` says ``unverified``, the run's
        number and the run before it that never got its row, if any."""
        keys = [self.runs.keys.unverified(job_id, attempt), self.runs.keys.stats]
        args = ["start", str(now_ms), self.ttl_s, secrets.token_hex(8)]
        return StartCall.send(f"{job_id}:{attempt}", self.runs.line, self.runs.client,
                              self._script, keys, args, self.runs.call, _started)  # fmt: skip

    def latest(self, job_id: str, attempt: int) -> tuple[int, int] | None:
        """The attempt's latest run and its start time (ms), when it has no row yet."""
        try:
            runs, rowed, started = self.runs.client.hmget(
                self.runs.keys.unverified(job_id, attempt), "runs", "rowed", "started_ms"
            )
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot read run {job_id}:{attempt}: {exc}") from exc
        if runs is None or int(rowed or 0) >= int(runs):
            return None
        return int(runs), int(started or 0)

    def write(self, row: LedgerRow, run: int, now_ms: int) -> bool:
        """Write the row of the attempt's run ``run`` (unpriced: no tax, no exposure, never
        counted toward a freeze or against a clean hour); False when it had one already."""
        window = window_id(now_ms / 1000, self.runs.window_seconds)
        keys = self.runs.keys
        entry = {**row.to_json(), "retry_tax": 0.0, "verified": False}
        args = ["row", str(run), json.dumps(entry), row.outcome.value, str(self.runs.retention_s),
                TOTALLED.get(row.outcome, "")]  # fmt: skip
        try:
            (written,) = self.runs.call(self._script, [
                keys.unverified(row.job_id, row.attempt), keys.window_rows(window),
                keys.window(window), keys.totals,
            ], args)  # fmt: skip
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot write an unverified row: {exc}") from exc
        return bool(written)


def _started(reply: Any) -> Started:
    """``unverified.lua``'s start reply as a :class:`Started` (refused: ``unverified``)."""
    run, dead_run, dead_ms = (text_of(part) for part in reply)
    return Started(run=int(run), dead_run=int(dead_run), dead=None, refused="unverified",
                   dead_started_ms=int(dead_ms))  # fmt: skip
