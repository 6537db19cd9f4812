"""The gate script's connections: a call is sent, other work runs, then its reply is read.

Each thread has a :class:`Line` of its own to the gate's Redis, outside the client's pool:
redis-py connects it (address, TLS, AUTH, SELECT, as the client is configured), and the gate
script's request and reply then go straight through its socket, packed and parsed by hiredis
when it is installed. Through redis-py's per-command machinery a round trip costs several
times the CPU of the socket calls themselves, and the publish path pays that on every task.
Without hiredis, or when redis-py's connection lacks the socket attribute this relies on
(``_sock``, checked by the test suite), or without ``select.poll`` (an eventlet worker:
its monkey patching deletes it), the line uses redis-py's own ``send_command`` and
``read_response``.

A call made while this thread's line awaits a reply (a signal handler that publishes
mid-decision) goes through redis-py instead (the store's fallback): replies come back in
order, so two calls in flight on one socket could swap answers.

The worker's two scripts of a run (``start.lua``, ``finish.lua``) take the same way, on a
line of their own (:mod:`gatekeeper.redis.sent`); where a line cannot be had
(:func:`has_lines`: a cluster, a client of one connection) they go through redis-py. The
replayer's batches take the line too (:mod:`gatekeeper.redis.queued`). Fast publish's gate
call may leave its reply owed on the line (:mod:`gatekeeper.redis.later`).
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

import redis
from redis.exceptions import NoScriptError, ReadOnlyError

from gatekeeper.redis.cluster import is_cluster

hiredis: Any
try:
    import hiredis
except ImportError:  # pragma: no cover - hiredis is optional
    hiredis = None

__all__ = ["IDLE_PROVEN_S", "Channel", "Line", "has_lines"]

RAW = hiredis is not None and hasattr(hiredis, "pack_command")
"""hiredis packs and parses; without it, redis-py's connection does both."""
IDLE_PROVEN_S = 60.0
"""A line that has had no answer for this long may be a flow a NAT or a load balancer has
forgotten (nothing closes it, nothing answers): a call sent on it is not taken as on its way
(:attr:`Sent.unproven`). Cloud NATs forget idle flows after 4 to 10 minutes."""


class Line(threading.local):
    """This thread's :class:`Channel` to the gate's Redis; a new one after a fork (the
    parent's is the parent's to read and close)."""

    channel: Channel | None = None

    def take(self, pool: redis.ConnectionPool, keep_owed: bool = False) -> Channel | None:
        """This thread's channel, marked busy; None when a call on it still awaits its reply.
        A reply owed on it (:mod:`gatekeeper.redis.later`) is read and settled first, unless
        ``keep_owed`` (the caller reads it, after sending its own call)."""
        channel = self.channel
        if channel is None or channel.pid != os.getpid():
            channel = self.channel = Channel()
        return channel.take(pool, keep_owed)

    def settle(self) -> None:
        """Read the reply owed on this thread's channel now: this thread's calls run in order."""
        channel = self.channel
        if channel is not None and channel.pid == os.getpid():
            channel.settle_owed()


class Channel:
    """One thread's connection for the gate script. Only its thread sends on it; the
    process's settler (:mod:`gatekeeper.redis.later`) may read a reply owed on it, under
    :attr:`lock`, while its thread is between calls."""

    def __init__(self) -> None:
        self.conn: Any = None
        self.sock: Any = None
        self.reader: Any = None
        self.poller: Any = None
        self.pid, self.busy = os.getpid(), False
        self.answered_at = 0.0
        """``time.monotonic()`` of the last reply read on this line."""
        self.known: set[str] | None = None
        """The scripts (SHA1s) this connection has had answered: a new one (perhaps to another
        server, after a restart or a failover) knows none, and its server may lack them."""
        self.lock, self.owed = threading.RLock(), cast(Any, None)  # a later.Owed: reply unread
        self.holder = 0  # the thread inside the lock: a signal handler of its own stays out

    def take(self, pool: redis.ConnectionPool, keep_owed: bool = False) -> Channel | None:
        """This channel, marked busy; None when a call on it still awaits its reply."""
        if self.busy or self.holder == threading.get_ident():
            return None
        if not keep_owed:
            self.settle_owed()  # under the lock: it waits while the settler reads one
        if self.conn is None:
            # RESP2 whatever the client asked for: RESP3 lets the server interleave push
            # messages (redis-py 8 turns on maintenance notifications with it, and they need
            # RESP3, so their settings stay behind), and this line takes the first reply it
            # sees as the script's.
            kwargs = {k: v for k, v in pool.connection_kwargs.items() if k not in _RESP3_ONLY}
            try:
                self.conn = pool.connection_class(**kwargs, protocol=2)
            except Exception:  # settings this line cannot take: the pool's own connections
                return None
        self.busy = True
        return self

    def settle_owed(self, abandon: bool = False) -> None:
        """Read the reply owed on this channel, if any, and settle its call, all under the
        lock (another reader, an exit, a task's end wait for it); ``abandon``: not waited for
        while its store's breaker is open, settled as lost. Raises only an interrupt."""
        with self.lock:
            if self.holder:  # this thread, inside already (a signal handler): not now
                return
            self.holder = threading.get_ident()
            try:
                owed, self.owed = self.owed, None
                if owed is not None:
                    owed.settle(self._owed_reply(owed, abandon))
            finally:
                self.holder = 0

    def _owed_reply(self, owed: Any, abandon: bool) -> Any:
        if abandon and owed.unanswerable():  # (an error reply, which keeps the breaker as is)
            self.close()  # its reply still to come: the line cannot be used again
            return redis.ResponseError("not awaited: the gate's breaker is open")
        try:
            reply, alive = self.owed_reply()
        except Exception as exc:  # a reply that cannot be parsed: the line is unusable
            self.close()
            return redis.ConnectionError(f"unreadable reply: {exc!r}")
        except BaseException:  # an interrupt mid-read: the reply lost, the message held
            self.close()
            owed.hold()
            raise
        if alive and isinstance(reply, Exception) and not isinstance(reply, NoScriptError):
            self.close()  # a replica now (READONLY), a script's error: a new connection
        return reply

    def owed_reply(self) -> tuple[Any, bool]:
        """The next reply, as a gate call's (a table of six) or the error in its place, and
        whether the channel is still up: it is closed when no reply came or it was not a gate
        call's. Under :attr:`lock`."""
        try:
            reply = self._next()
            table = isinstance(reply, list) and len(reply) == 6
            if not table and not isinstance(reply, Exception):
                raise redis.ResponseError(f"unexpected reply {reply!r}")
            return reply, True
        except redis.RedisError as exc:
            self.close()
            return exc, False

    def send(self, parts: Sequence[str]) -> None:
        """Send one command: through the socket when hiredis packs it, else through redis-py."""
        try:
            self._ready()
            if self.sock is not None:
                self.sock.sendall(hiredis.pack_command(tuple(parts)))
            else:
                self.conn.send_command(*parts, check_health=False)
        except OSError as exc:
            raise redis.ConnectionError(f"cannot send to the gate's Redis: {exc}") from exc

    def _ready(self) -> None:
        """Connected, and idle as far as the server is concerned (else connected again)."""
        if self._went_stale():
            self.close()
        if self.known is None or getattr(self.conn, "_sock", None) is None:
            self.known = set()  # a new connection: no script answered on it yet
        if self.sock is None:
            self.conn.connect()
            # Eventlet's monkey patching deletes select.poll: redis-py reads and writes then.
            raw = RAW and hasattr(select, "poll")
            self.sock = getattr(self.conn, "_sock", None) if raw else None
            if self.sock is not None:
                self.reader = hiredis.Reader()
                self.poller = select.poll()
                self.poller.register(self.sock, select.POLLIN)

    def _went_stale(self) -> bool:
        """Readable while idle: the server closed it (a timeout, a restart, CLIENT KILL) or
        sent what nobody asked for. Reconnect before the request, as redis-py's pool does.
        Not while a reply is owed on it: that reply is what it has to read."""
        if self.owed is not None:
            return False
        if self.sock is not None:
            return bool(self.poller.poll(0))
        return getattr(self.conn, "_sock", None) is not None and _stale(self.conn)

    def read(self) -> Any:
        reply = self._next()
        if self.sock is not None and self.reader.has_data():  # more than the one reply asked
            raise redis.ConnectionError("the gate's Redis sent more than one reply")
        if isinstance(reply, Exception):
            raise reply
        return reply

    def send_many(self, commands: Sequence[Sequence[str]], first: bool) -> None:
        """Send ``commands`` in one write (packed by hiredis, else by redis-py's connection),
        their replies read later with :meth:`next_reply`; ``first``: the batch's first write
        (the line is made ready first: later, replies already waiting are not staleness)."""
        try:
            if first:
                self._ready()
            if self.sock is not None:
                self.sock.sendall(b"".join(hiredis.pack_command(tuple(c)) for c in commands))
            else:
                # No health check: its PING would read a reply of the batch as its PONG.
                self.conn.send_packed_command(self.conn.pack_commands(commands), check_health=False)
        except OSError as exc:
            raise redis.ConnectionError(f"cannot send to the gate's Redis: {exc}") from exc

    def next_reply(self) -> Any:
        """The next reply of a batch (:meth:`send_many`): a server's error reply as redis-py's
        error, returned; raises when no reply came."""
        return self._next()

    def _next(self) -> Any:
        """The next reply from the socket; a server's error reply as redis-py's error."""
        if self.sock is None:
            try:
                reply = self.conn.read_response()
            except redis.ResponseError as exc:
                reply = _classified(exc)
            self.answered_at = time.monotonic()
            return reply
        reader = self.reader
        try:
            reply = reader.gets()
            while reply is False:
                data = self.sock.recv(65536)
                if not data:
                    raise redis.ConnectionError("the gate's Redis closed the connection")
                reader.feed(data)
                reply = reader.gets()
        except OSError as exc:
            raise redis.ConnectionError(f"cannot read from the gate's Redis: {exc}") from exc
        self.answered_at = time.monotonic()
        if isinstance(reply, hiredis.ReplyError):
            text = str(reply)
            if text.startswith("NOSCRIPT"):
                return NoScriptError(text)
            return _classified(redis.ResponseError(text))
        return reply

    def close(self) -> None:
        """After an error: the socket may hold half a reply, never reuse it."""
        self.sock = self.reader = self.poller = self.known = None
        self.conn.disconnect()

    def release(self) -> None:
        self.busy = False


def _classified(error: redis.ResponseError) -> redis.RedisError:
    """A ``READONLY`` reply, bare or from inside a script, as a connection error: the server
    is a replica now (a failover), and a call asked again on a new connection reaches the
    primary, as redis-py's Sentinel connections do. Other error replies as they are."""
    text = str(error)  # (redis-py's ReadOnlyError leaves the code out of its text)
    if isinstance(error, ReadOnlyError) or text.startswith("READONLY") or " -READONLY " in text:
        return redis.ConnectionError(f"READONLY: the gate's Redis is a replica now: {text}")
    return error


def has_lines(client: redis.Redis) -> bool:
    """Whether ``client``'s server can be reached on a line: not a cluster (a line is one
    server's socket), nor a client of one connection (redis-py's ``single_connection_client``)
    or with no pool."""
    if is_cluster(client) or getattr(client, "connection", None) is not None:
        return False
    return getattr(client, "connection_pool", None) is not None


_RESP3_ONLY = frozenset(("protocol", "maint_notifications_config",
                         "maint_notifications_pool_handler",
                         "oss_cluster_maint_notifications_handler"))  # fmt: skip
"""Connection settings a RESP2 line must not pass on (redis-py 8 refuses them with RESP2)."""


def _stale(conn: Any) -> bool:
    """Whether an idle redis-py connection has something to read (or is closed)."""
    try:
        return bool(conn.can_read())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return True
