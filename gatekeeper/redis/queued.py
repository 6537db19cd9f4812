"""A batch of commands on the thread's line: sent as they are made, replies read as they come.

The replayer's batches (its records read, its gate scripts, its handoffs kept) go through
:class:`Queued`: on the thread's :class:`~gatekeeper.redis.wire.Line`, a few commands to a
write, packed by hiredis, so the server runs the first while the rest are made, and each
reply read when the caller wants it, so the caller works on one while the server runs the
next. Through redis-py's pipeline a command costs several times the CPU (every argument
checked and packed in Python: ``bench/replay.py --profile``), and the two sides take turns.
Where a line cannot be had (a cluster, a client of one connection, the line awaiting another
reply) the batch goes through redis-py's pipeline, sent when its replies are asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError

from gatekeeper.redis.wire import Line

__all__ = ["SENT_TOGETHER", "Queued", "send_all"]

SENT_TOGETHER = 8
"""Commands :class:`Queued` sends in one write."""


class Queued:
    """Commands sent as they are added, a few at a time, on this thread's ``line`` when there
    is one and it is free (else through a redis-py pipeline, sent when the replies are
    asked for), and their replies read one at a time, in order (:meth:`replies`): the server
    runs the first while the rest are made, and the caller works on each reply while the
    server runs the next. A command is never sent once the replies are asked for."""

    def __init__(
        self, line: Line | None, client: redis.Redis, together: int = SENT_TOGETHER
    ) -> None:
        self._client = client
        self._together = together
        self._channel = line.take(client.connection_pool) if line is not None else None
        self._commands: list[Sequence[str]] = []
        self._unsent = 0
        self._lost: Exception | None = None

    def add(self, command: Sequence[str]) -> None:
        self._commands.append(command)
        self._unsent += 1
        if self._unsent >= self._together:
            self._send()

    def _send(self) -> None:
        channel, unsent, self._unsent = self._channel, self._unsent, 0
        if channel is None or not unsent or self._lost is not None:
            return
        first = unsent == len(self._commands)
        try:
            channel.send_many(self._commands[-unsent:], first)
        except Exception as exc:  # a command that cannot be packed is a batch not sent too
            self._lost = exc if isinstance(exc, redis.RedisError) else redis.ConnectionError(
                f"cannot send a batch to the gate's Redis: {exc!r}"
            )  # fmt: skip
            channel.close()

    def replies(self, send: bool = True) -> Iterator[Any]:
        """Each command's reply, or its error in its place. When no answer came (a
        connection error, a timeout), that error stands for every reply not read: those
        commands may have run. Through redis-py, other errors of the round trip raise.
        ``send`` false: the commands not sent yet never are (none, through redis-py), and
        the replies are those of the commands sent."""
        if not send:
            del self._commands[len(self._commands) - self._unsent :]
            self._unsent = 0
        if self._channel is None:
            if send:
                yield from _pipelined(self._client, self._commands)
            return
        self._send()
        channel, read, refused = self._channel, 0, False
        try:
            for _ in self._commands:
                if self._lost is None:
                    try:
                        reply = channel.next_reply()
                    except (redis.ConnectionError, redis.TimeoutError) as exc:
                        self._lost = exc
                        channel.close()  # it may hold half a reply
                    else:
                        refused |= isinstance(reply, redis.RedisError) and not isinstance(
                            reply, NoScriptError
                        )  # fmt: skip
                read += 1
                yield self._lost if self._lost is not None else reply
            if self._lost is None and channel.sock is not None and channel.reader.has_data():
                channel.close()  # more than was asked for: never trust this line again
        finally:
            if self._lost is None and (refused or read < len(self._commands)):
                # Left unread (the caller stopped): out of step with its replies. Or an error
                # reply (READONLY, LOADING, MASTERDOWN: a failover that moved the address
                # leaves this line on a replica), as a single call's closes it (GateStore.score).
                channel.close()
            channel.release()


def send_all(
    line: Line | None, client: redis.Redis, commands: Sequence[Sequence[str]]
) -> list[Any]:
    """Each command's reply, or its error in its place, in order and in one round trip
    (:class:`Queued`): on this thread's ``line`` replies come as the server sent them
    (``HGETALL``'s a flat list), through redis-py as redis-py makes them."""
    queued = Queued(line, client, together=len(commands))  # one write: nothing to wait for
    for command in commands:
        queued.add(command)
    return list(queued.replies())


def _pipelined(client: redis.Redis, commands: Sequence[Sequence[str]]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for command in commands:
        parts: list[str | int] = list(command)
        if parts[0] == "EVALSHA":  # a cluster's pipeline finds the keys by the count, an int
            parts[2] = int(parts[2])  # (redis-py 5.0; later ones take text too)
        pipe.execute_command(*parts)  # type: ignore[no-untyped-call]
    try:
        return list(pipe.execute(raise_on_error=False))
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return [exc] * len(commands)
