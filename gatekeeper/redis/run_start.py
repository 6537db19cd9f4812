"""A run's ``start.lua`` call, sent as the run begins and read as it ends.

The task does not wait for the start: its request goes out on the run ledger's line before
the task's body runs (:func:`gatekeeper.redis.wire.send_script`), Redis applies it meanwhile,
and the worker reads the reply when the run ends, before its row. A worker killed in between
has still recorded the start (the request left before the body ran), so the sweep finds the
run as before. The call is safe to send twice (its token), so a reply lost to a connection
error is asked for once more, as when the start waited.

Only a server that has the script applies an ``EVALSHA``: one that has not (a new server, a
failover to a replica, a restart) replies ``NOSCRIPT`` and applies nothing. So a start sent on
a new connection is read at once, and the script loaded then if need be; a connection that
has answered a script call is to a server that has it. (A ``SCRIPT FLUSH`` on a connected
server is the exception: that run's start is then applied when it ends, and a run killed
before that has no start for the sweep to find.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import redis
from redis.commands.core import Script

from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.wire import Line, Sent, send_script

if TYPE_CHECKING:
    from gatekeeper.redis.runs import RunRecord

__all__ = ["StartCall", "Started"]

T = TypeVar("T")


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


class StartCall(Generic[T]):
    """One run's start: ``sent`` on the line (None: not sent yet, or its sending failed),
    ``call`` sends it again and waits, ``parse`` reads the reply."""

    def __init__(
        self, member: str, call: Callable[[], Any], sent: Sent | None, failed: bool,
        parse: Callable[[Any], T],
    ) -> None:  # fmt: skip
        self.member = member
        self._call, self._sent, self._failed, self._parse = call, sent, failed, parse
        self._read: Any = None

    @classmethod
    def send(
        cls, member: str, line: Line | None, client: redis.Redis, script: Script,
        keys: Sequence[str], args: Sequence[str],
        call: Callable[[Script, list[str], list[str]], Any], parse: Callable[[Any], T],
    ) -> StartCall[T]:  # fmt: skip
        """Send the start on ``line`` (``call`` sends it and waits where there is no line,
        or when it is busy, when the reply is asked for)."""
        sent, failed = None, False
        if line is not None:
            try:
                sent = send_script(line, client, script, keys, args)
            except redis.RedisError:
                failed = True
        started = cls(member, lambda: call(script, list(keys), list(args)), sent, failed, parse)
        if sent is not None and sent.fresh:  # a new connection: the script may be missing
            started.started()
        return started

    def started(self) -> T:
        """The start's reply; raises :class:`LedgerUnavailable` when Redis cannot give it."""
        if self._read is None:
            self._read = self._reply()
        return self._parse(self._read)

    def _reply(self) -> Any:
        sent, self._sent = self._sent, None
        try:
            if self._failed:  # its sending failed: one more try, as after a lost reply
                reply = self._call()
            else:
                try:
                    reply = sent.reply() if sent is not None else self._call()
                except (redis.ConnectionError, redis.TimeoutError):
                    reply = self._call()  # safe: the token
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot record the start of {self.member}: {exc}") from exc
        return reply
