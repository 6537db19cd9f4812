"""A worker process's rows that the gate's Redis did not answer for, sent again until it does.

A run's row is safe to send twice: each write carries a token (``finish.lua``'s ``rowed_by``,
``unverified.lua``'s ``r:<run>``), and the same call sent again writes nothing more and gets
the same reply. So a write that got no answer at all (a restart, a failover, a server paused:
the client's timeout, twice) is not given up: the call, with its row, run and token as they
were, is kept in this process's list (at most :data:`PENDING_ROWS_MAX`) and sent again,
unchanged, until Redis answers (``event=ledger_row_pending``, then
``event=ledger_row_pending_written`` beside the row's own ``ledger_row`` line):

- by a thread of the process's own, started when a row is kept and gone once none is left,
  one second after the failure, then at doubling intervals up to ``worker_heartbeat_s``. It
  runs in whichever process kept the row: a prefork pool child (where the task ran, and
  where no heartbeat thread runs) as the main process (a row it writes for a lost child,
  and every row of the threads, gevent, eventlet and solo pools);
- before the start of the process's next run, and after the row of its next run;
- at the process's clean exit (``worker_process_shutdown`` in a pool child,
  ``worker_shutdown`` in the main process): once more, after the retry thread's resend if one
  is under way (as long as a row with no answer takes, at least :data:`EXIT_WAIT_S`), and
  what is still unanswered then is logged as lost (``event=ledger_rows_lost``).

What is not kept: a process killed outright (SIGKILL, the OOM killer) loses its list, and a
row still unanswered at its exit is lost; the run is then still in ``started`` (or
``unverified:started``), and ``gatekeeper sweep`` writes it ``killed`` once the worker's
heartbeat is gone, as for any run whose worker vanished. A write that Redis answered with an
error (a refusal, not silence) is logged and dropped as before (``ledger_write_failed``). A
child forked from a process with rows kept drops its copy: they are its parent's to send.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.store import NO_ANSWER
from gatekeeper.settings import GatekeeperSettings

__all__ = ["PENDING_ROWS_MAX", "PendingRows", "unanswered"]

PENDING_ROWS_MAX = 10_000
"""Rows one worker process keeps to send again (a few hundred bytes each): a Redis gone for
long enough to pass it loses the newest rows, logged, and the sweep writes their runs killed."""

FIRST_RETRY_S = 1.0
"""The first resend's delay after a write got no answer (then doubled, up to the heartbeat)."""

EXIT_WAIT_S = 5.0
"""At exit, the least the last send waits for a resend the retry thread has under way (a row
with no answer takes it twice the gate's Redis timeout: the worker waits that, plus a second,
when it is longer)."""


def unanswered(exc: BaseException) -> bool:
    """Whether a ledger write failed because Redis gave no answer (a lost connection, a
    timeout, a ``READONLY`` old master): it may be sent again as it was."""
    return isinstance(exc, LedgerUnavailable) and isinstance(exc.__cause__, NO_ANSWER)


@dataclass(frozen=True)
class _Pending:
    job_id: str
    run: int
    write: Callable[[], bool]
    since: float


class PendingRows:
    """One process's unanswered row writes (thread-safe; see the module's docstring)."""

    def __init__(
        self, log: Any, max_interval_s: float, limit: int = PENDING_ROWS_MAX,
        exit_wait_s: float = EXIT_WAIT_S,
    ) -> None:  # fmt: skip
        self.log = log
        self.max_interval_s = max(FIRST_RETRY_S, max_interval_s)
        self.limit = limit
        self.exit_wait_s = exit_wait_s
        self._fresh()

    @classmethod
    def for_settings(cls, log: Any, settings: GatekeeperSettings) -> PendingRows:
        """Resent up to every ``worker_heartbeat_s``; at exit, a resend under way waited for
        as long as a row with no answer takes (twice ``redis_timeout_s``), and a second."""
        wait = max(EXIT_WAIT_S, 2 * settings.redis_timeout_s + 1)
        return cls(log, settings.worker_heartbeat_s, exit_wait_s=wait)

    def _fresh(self) -> None:
        """New, empty state for this process (a forked child's locks may be held)."""
        self._pid = os.getpid()
        self._rows: deque[_Pending] = deque()
        self._lock = threading.Lock()  # guards _rows and _thread
        self._sending = threading.Lock()  # one resend at a time: a row's line logged once
        self._thread = False
        self._silent_at = 0.0  # time.monotonic() of the last write that got no answer

    def _mine(self) -> None:
        if self._pid != os.getpid():
            self._fresh()

    def __len__(self) -> int:
        self._mine()
        return len(self._rows)

    def write(self, job_id: str, run: int, write: Callable[[], bool]) -> None:
        """Call ``write`` (a row's write, which logs the row and says whether this call
        wrote it); kept to send again when Redis gave no answer, raised when it answered
        with an error."""
        try:
            write()
        except LedgerUnavailable as exc:
            if not unanswered(exc):
                raise
            self._silent_at = time.monotonic()
            self._keep(_Pending(job_id, run, write, self._silent_at), exc)

    def _keep(self, pending: _Pending, exc: Exception) -> None:
        self._mine()
        with self._lock:
            if len(self._rows) >= self.limit:
                full = True
            else:
                full = False
                self._rows.append(pending)
                start, self._thread = not self._thread, True
        if full:
            self.log.error("ledger_rows_lost", job_id=pending.job_id, run=pending.run,
                           reason="pending_full", kept=self.limit, error=repr(exc))  # fmt: skip
            return
        self.log.warning("ledger_row_pending", job_id=pending.job_id, run=pending.run,
                         pending=len(self._rows), error=repr(exc))  # fmt: skip
        if start:
            threading.Thread(target=self._retry, name="gatekeeper-pending-rows",
                             daemon=True).start()  # fmt: skip

    def send(self, via: str) -> None:
        """Send the kept rows again, oldest first, until one gets no answer (Redis is still
        silent: the rest wait too). Another thread sending them already, or a run's call
        within half a second of a write Redis gave no answer to: nothing."""
        self._mine()
        if not self._rows or (
            via.startswith("run") and time.monotonic() - self._silent_at < FIRST_RETRY_S / 2
        ):
            return
        if not self._sending.acquire(blocking=False):
            return
        try:
            self._send_held(via)
        finally:
            self._sending.release()

    def _send_held(self, via: str) -> None:
        """:meth:`send`'s loop, ``_sending`` held."""
        while self._rows:
            pending = self._rows[0]
            try:
                written = pending.write()
            except Exception as exc:  # a ledger fault must never end the worker
                if unanswered(exc):
                    self._silent_at = time.monotonic()
                    return
                self.log.warning("ledger_write_failed", step="pending", error=repr(exc),
                                 job_id=pending.job_id, run=pending.run)  # fmt: skip
            else:  # not written: the run had its row meanwhile (the sweep's, say)
                self.log.info("ledger_row_pending_written" if written else
                              "ledger_row_pending_rowed_already", job_id=pending.job_id,
                              run=pending.run, via=via,
                              waited_s=round(time.monotonic() - pending.since, 3))  # fmt: skip
            with self._lock:
                if self._rows and self._rows[0] is pending:  # (at_exit may have taken it)
                    self._rows.popleft()

    def at_exit(self) -> None:
        """The process ends: one last send, once a resend under way (the retry thread's)
        has ended (``exit_wait_s`` at most); what is left is lost (the sweep's, later). The
        retry thread sends nothing more meanwhile (unless the wait ran out: then it may
        still write a row logged lost)."""
        self._mine()
        held = self._sending.acquire(timeout=self.exit_wait_s)
        try:
            if held:
                self._send_held("exit")
            with self._lock:
                lost, self._rows = list(self._rows), deque()
        finally:
            if held:
                self._sending.release()
        for pending in lost:  # a line each, as the runbook greps (at most PENDING_ROWS_MAX)
            self.log.error("ledger_rows_lost", reason="exit", job_id=pending.job_id,
                           run=pending.run)  # fmt: skip

    def _retry(self) -> None:
        pid, interval = os.getpid(), FIRST_RETRY_S
        while True:
            time.sleep(interval)
            if pid != os.getpid():
                return  # (a thread does not survive a fork; belt and braces)
            self.send("retry")
            with self._lock:
                if not self._rows:
                    self._thread = False
                    return
            interval = min(self.max_interval_s, interval * 2)
