"""A run's ``start.lua`` call, sent as the run begins and read as it ends.

The task does not wait for the start: its request goes out on the run ledger's line before
the task's body runs (:func:`gatekeeper.redis.sent.send_script`), Redis applies it meanwhile,
and the worker reads the reply when the run ends, before its row. A worker killed in between
has still recorded the start (the request left before the body ran), so the sweep finds the
run as before. The call is safe to send twice (its token), so a reply lost to a connection
error is asked for once more, as when the start waited.

It is waited for, as before, whenever it is not surely applied while the run goes on:
- it could not go on the line (no line: a Redis Cluster, a client of one connection; the line
  busy with another reply, as for a task run inside a task; a failed send);
- the line's connection has not had ``start.lua`` answered yet. Only a server that has the
  script applies an ``EVALSHA``; one that has not (a new server, a failover to a replica, a
  restart) replies ``NOSCRIPT`` and applies nothing, so the first start on each connection
  is read at once and the script loaded then if need be. (A ``SCRIPT FLUSH`` on a server
  still connected is the exception: that run's start is applied when it ends, and if the
  run is killed first the sweep does not see it.) Nor on a line that has had no answer for
  a minute (``wire.IDLE_PROVEN_S``): a flow a NAT forgot takes a request and says nothing,
  and waiting finds it out (the start is then sent again on a new connection).
- the message was redelivered (the worker's choice: the row of the run that died before it
  is written before this run can die too). Both brokers the replayer reads, Redis and
  RabbitMQ, mark a redelivered message in ``delivery_info``.

Under gevent or eventlet each task runs in a greenlet of its own, whose line is new: every
start there is waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from redis.commands.core import Script

from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.sent import Sent, send_script
from gatekeeper.redis.wire import Line

if TYPE_CHECKING:
    from gatekeeper.redis.runs import RunRecord

__all__ = ["StartCall", "Started"]


@dataclass(frozen=True)
class Started:
    """A run that started; ``dead`` is an earlier run of the attempt that never got its row."""

    run: int
    dead_run: int
    dead: RunRecord | None
    record: RunRecord | None = None
    """The run's record; None when the message is not the gate's (``refused`` says why)."""
    refused: str = ""
    """``unverified`` (no nonce: an old publisher, or decided without Redis) or ``forged``."""
    dead_started_ms: int = 0
    """An unverified run's dead run's start (it has no record for ``dead``)."""


class StartCall:
    """One run's start: on its way (``sent``) or already answered; :meth:`started` gives the
    reply as a :class:`Started` (``parse``: the run ledger's reading of ``start.lua``'s)."""

    def __init__(
        self, member: str, call: Callable[[], Any], sent: Sent | None,
        parse: Callable[[Any], Started],
    ) -> None:  # fmt: skip
        self.member = member
        self._call, self._sent, self._parse = call, sent, parse
        self._reply: Any = None

    @classmethod
    def send(
        cls, member: str, line: Line | None, client: redis.Redis, script: Script,
        keys: Sequence[str], args: Sequence[str],
        call: Callable[[Script, list[str], list[str]], Any], parse: Callable[[Any], Started],
    ) -> StartCall:  # fmt: skip
        """Send the start on ``line``, and wait for it (through ``call``) unless it is on its
        way to a server known to have the script."""
        sent = None
        if line is not None:
            with suppress(redis.RedisError):  # not sent: sent again below, and waited for
                sent = send_script(line, client, script, keys, args)
        start = cls(member, lambda: call(script, list(keys), list(args)), sent, parse)
        if sent is None or sent.unproven:
            # Not on its way (no line: a cluster, a client of one connection; a line busy with
            # another reply; a failed send), or perhaps unknown to the server: applied now.
            start.started()
        return start

    def started(self) -> Started:
        """The start's reply; raises :class:`LedgerUnavailable` when Redis cannot give it."""
        if self._reply is None:
            self._reply = self._read()
        return self._parse(self._reply)

    def _read(self) -> Any:
        sent, self._sent = self._sent, None
        try:
            try:
                return sent.reply() if sent is not None else self._call()
            except (redis.ConnectionError, redis.TimeoutError):
                return self._call()  # safe: the token
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot record the start of {self.member}: {exc}") from exc
