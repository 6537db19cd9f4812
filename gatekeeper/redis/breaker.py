"""A circuit breaker for the gate's Redis, and the gate client's retry policy.

A Redis that is stopped, or that accepts connections and never answers, costs every call the
client's full timeout. On the publish path that is every gated publish: a producer
publishing a night's batch would move at two tasks a second. After one call finds the server
not answering (a timeout or a connection error; an error *reply* is an answer), the
:class:`Breaker` opens: until a probe finds the server back, the gate store and the flag
store raise :class:`~gatekeeper.errors.LedgerUnavailable` at once, without touching a socket,
and the pipeline decides as it does with Redis unreachable (reserved, ``gate_unavailable``;
the flags last read stay in force, stale: not to send a task to free on its own route).
Nothing goes to free.

The probe is a daemon thread of its own, started when the breaker opens: every
``breaker_open_s`` it sends one ``PING`` through the client (its timeout, no retry; on a
Redis Cluster, ``EXISTS`` of a namespace key, which asks the slot's primary) and closes the
breaker on the first answer, then ends. No publish waits for it; the cost is a
thread while the server is away. Letting one caller through per interval instead would make
one publish in each interval wait the whole timeout.

One breaker per client: :meth:`gatekeeper.redis.gate.Pipeline.create` builds one and gives it
to the gate store and the flag store of one install. The state is per process: a forked child
(a prefork pool's worker) starts with every breaker closed and no probe thread (the parent's
does not exist in it), and opens its own on its own first timeout.

:func:`no_retry` is the gate client's retry policy: none. redis-py 6 and later retry a timed
out command with backoff by default (redis-py 8: ten times), which multiplies what a hung
server costs a publish, and re-sends scripts whose first send may have run (``record.lua``
counts its decision again). A timeout opens the breaker instead and the publish fails closed;
scripts that must survive a lost reply are sent again by the store itself, where they are
safe to send twice (``fallback.lua``, ``start.lua``: keyed by the request).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, ClusterError, ReadOnlyError, TryAgainError
from redis.retry import Retry

from gatekeeper.defaults import BREAKER_OPEN_S
from gatekeeper.errors import GateUnreachable
from gatekeeper.forks import renew_in_children
from gatekeeper.redis.cluster import is_cluster

__all__ = ["NOT_ANSWERING", "Breaker", "no_retry", "not_answering"]

NOT_ANSWERING = (redis.ConnectionError, redis.TimeoutError)
"""The errors that say the server did not answer (redis-py's ``BusyLoadingError`` among them)."""
LOST_REPLIES = re.compile(r"\b(READONLY|LOADING|MASTERDOWN|CLUSTERDOWN|TRYAGAIN)\b")
"""Error replies that say this server is not the gate's primary any more (a replica after a
failover, one still loading, one cut from its primary; on a Redis Cluster, a slot served by
nobody while a replica is promoted): a lost connection, not an answer, or the gate would fail
closed until a restart. The client's connections are dropped, so the next ones find the
server again (a failover that moved a DNS name or an address); a cluster client finds the
slot's new primary itself. Read from the text as the gate's own line (:mod:`gatekeeper.redis.
wire`) hands it over, and from the class redis-py parses it into (its message drops the
code)."""
LOST_ERRORS = (ReadOnlyError, ClusterDownError, TryAgainError, ClusterError)
"""redis-py's classes for those replies (``MASTERDOWN`` is a ``ClusterDownError``; ``LOADING``
a ``BusyLoadingError``, so a ``ConnectionError``), and a cluster's redirections that never
came to an end (``ClusterError``, "TTL exhausted")."""


def not_answering(exc: BaseException) -> bool:
    """Whether ``exc`` says the gate's Redis did not answer (an error reply is an answer,
    unless it is one of :data:`LOST_REPLIES`)."""
    if isinstance(exc, (*NOT_ANSWERING, *LOST_ERRORS)):
        return True
    return isinstance(exc, redis.ResponseError) and LOST_REPLIES.search(str(exc)) is not None


def no_retry() -> dict[str, Any]:
    """Client keyword arguments for no automatic retry (redis-py 5.0 to 8)."""
    return {"retry": Retry(NoBackoff(), 0), "retry_on_timeout": False}


class Breaker:
    """Whether calls to one Redis client are made at all; opened by a call that got no answer,
    closed by its probe."""

    def __init__(
        self,
        client: Any,
        open_s: float = BREAKER_OPEN_S,
        log: Any = None,
        probe: Callable[[], object] | None = None,
    ) -> None:
        self.client = client
        self.open_s = open_s
        self.log = log
        self.probe = probe or (lambda: self.client.ping())
        """What the probe sends (a ``PING``; :func:`gatekeeper.redis.cluster.probe_of`)."""
        self.error: str | None = None
        """Why the breaker is open (the error that opened it); None while closed."""
        self.trips = 0
        """Calls that found the server not answering (each waited its timeout or failed)."""
        self._opened_at = 0.0
        self._lock = threading.Lock()
        self._probe: threading.Thread | None = None
        self._mine = threading.local()
        """``opened``: this thread's call opened the breaker (see :meth:`opened_here`)."""
        renew_in_children(self)

    @property
    def is_open(self) -> bool:
        return self.error is not None

    @property
    def probing(self) -> bool:
        """A probe thread of this process is running."""
        probe = self._probe
        return probe is not None and probe.is_alive()

    def check(self, what: str) -> None:
        """Raise :class:`GateUnreachable` (a :class:`LedgerUnavailable`: no answer, not
        asked) at once while the breaker is open."""
        error = self.error
        if error is not None:
            self._mine.opened = False
            raise GateUnreachable(
                f"{what}: the gate's Redis did not answer ({error}); breaker open, not asked "
                "until a probe finds it back"
            )

    def failed(self, exc: BaseException) -> bool:
        """Open the breaker when ``exc`` says the server did not answer; True when it did."""
        if not not_answering(exc):
            return False
        # A lost reply (the gate's line says a READONLY as a lost connection): this server is
        # not the primary any more, so the pool's connections to it go too.
        lost_reply = not isinstance(exc, NOT_ANSWERING) or LOST_REPLIES.search(str(exc))
        if lost_reply and not is_cluster(self.client):
            with contextlib.suppress(Exception):
                self.client.connection_pool.disconnect()
        with self._lock:
            self.trips += 1
            opened = self.error is None
            self.error = str(exc) or type(exc).__name__
            if opened:
                self._opened_at = time.monotonic()
                self._mine.opened = True
            if self._probe is None:
                self._probe = threading.Thread(
                    target=self._probing, name="gatekeeper-breaker-probe", daemon=True
                )
                self._probe.start()
        if opened:
            self._say("gate_breaker_open", error=self.error, probe_every_s=self.open_s)
        return True

    def opened_here(self) -> bool:
        """Whether the breaker is open because of this thread's last call, asked once: the
        request that opened it may finish what it began (a fast publish's fallback push,
        which then waits its own timeouts); the calls of any later request are refused."""
        mine = bool(getattr(self._mine, "opened", False))
        self._mine.opened = False
        return mine and self.error is not None

    def answered(self) -> None:
        """A call got an answer after all: close the breaker (its probe ends when it wakes)."""
        if self.error is not None:
            with self._lock:
                was, self.error = self.error, None
            if was is not None:
                self._say("gate_breaker_closed", by="answer", open_s=self._open_for())

    def _probing(self) -> None:
        """Until the server answers (or a call's answer closed the breaker): wait, probe.
        Runs in the probe thread, which alone clears ``_probe``, so that a breaker open again
        always has a probe."""
        while True:
            time.sleep(self.open_s)
            if self.error is not None:
                try:
                    self.probe()
                except Exception as exc:  # an error reply is an answer: calls decide again
                    if not_answering(exc):
                        continue
            with self._lock:
                was, self.error, self._probe = self.error, None, None
            if was is not None:
                self._say("gate_breaker_closed", by="probe", open_s=self._open_for())
            return

    def _open_for(self) -> float:
        return round(time.monotonic() - self._opened_at, 3)

    def _say(self, event: str, **fields: Any) -> None:
        if self.log is not None:
            with contextlib.suppress(Exception):  # a closed log stream changes nothing here
                self.log.warning(event, **fields)

    def _forked(self) -> None:
        """In a forked child: closed, no probe (its thread is the parent's), a fresh lock (the
        parent's may have been held by a thread the child does not have)."""
        self._lock = threading.Lock()
        self._mine = threading.local()
        self.error, self._probe, self.trips = None, None, 0
