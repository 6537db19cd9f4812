"""Script calls on a thread's line whose reply is read when the caller wants it.

The worker's two scripts of a run (``start.lua``, ``finish.lua``) take the thread's
:class:`~gatekeeper.redis.wire.Line` (:func:`call_script`); ``start.lua`` is sent as the run
starts and its reply read as it ends (:func:`send_script`), so the task does not wait for it.
Where a line cannot be had they go through redis-py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from gatekeeper.redis import wire
from gatekeeper.redis.scripts import evalsha
from gatekeeper.redis.wire import Channel, Line

__all__ = ["Sent", "call_script", "send_script"]


class Sent:
    """A script call whose request is on its way and whose reply :meth:`reply` reads later:
    until then the thread's line stays taken, so calls made meanwhile go through redis-py."""

    def __init__(
        self, line: Channel, client: redis.Redis, script: Script, keys: Sequence[str],
        args: Sequence[str],
    ) -> None:  # fmt: skip
        self._line: Channel | None = line
        idle = time.monotonic() - line.answered_at > wire.IDLE_PROVEN_S
        self.unproven = idle or script.sha not in (line.known or ())
        """Sent on a connection that has not had this script answered: its server may not
        have it (``NOSCRIPT``: nothing applied until :meth:`reply` loads it); or on one idle
        past :data:`IDLE_PROVEN_S`, which may no longer reach the server at all."""
        self._client, self._script = client, script
        self._keys, self._args = list(keys), list(args)

    def reply(self) -> Any:
        """The script's table; a server without the script has it loaded first. Raises
        redis-py's errors (the line is then closed: it may hold half a reply)."""
        channel, self._line = self._line, None
        if channel is None:
            raise RuntimeError("this call's reply was read already")
        if channel.pid != os.getpid():  # forked since: the socket is the parent's to read
            channel.release()
            raise redis.ConnectionError("the process forked before the reply was read")
        sha = self._script.sha
        try:
            reply = channel.read()
            if not isinstance(reply, list):  # not a script's table: out of step with its replies
                raise redis.ResponseError(f"unexpected reply {reply!r}")
            if channel.known is not None:
                channel.known.add(sha)
            return reply
        except NoScriptError:
            pass  # a restarted or flushed Redis: loaded below, once the line is free again
        except BaseException:
            channel.close()
            raise
        finally:
            channel.release()
        self._client.script_load(self._script.script)
        reply = evalsha(self._client, self._script, self._keys, self._args)
        if channel.known is not None:  # loaded on the line's server (the client's)
            channel.known.add(sha)
        return reply


def send_script(
    line: Line, client: redis.Redis, script: Script, keys: Sequence[str], args: Sequence[str]
) -> Sent | None:
    """Send ``script``'s call on this thread's ``line`` without waiting for its reply; None
    when the line awaits another reply (call through redis-py then). Raises redis-py's
    errors (the line is closed and free again)."""
    channel = line.take(client.connection_pool)
    if channel is None:
        return None
    try:
        channel.send(["EVALSHA", script.sha, str(len(keys)), *keys, *args])
    except BaseException:
        channel.close()
        channel.release()
        raise
    return Sent(channel, client, script, keys, args)


def call_script(
    line: Line, client: redis.Redis, script: Script, keys: Sequence[str], args: Sequence[str]
) -> Any:
    """``script``'s reply (a table) through this thread's ``line``, or through redis-py when
    the line awaits another reply; a server without the script has it loaded first. Raises
    redis-py's errors (the line is then closed: it may hold half a reply)."""
    sent = send_script(line, client, script, keys, args)
    if sent is None:
        return evalsha(client, script, list(keys), args)
    return sent.reply()
