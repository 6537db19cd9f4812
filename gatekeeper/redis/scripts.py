"""Gatekeeper's Lua scripts as package files, and the small helpers every store shares.

Each script under ``gatekeeper/lua/`` opens with a header listing its KEYS, ARGV and reply;
every key it touches is passed in KEYS (one hash tag per namespace, so Redis Cluster can run
it) and ``now`` always comes in ARGV, but for keys named by what it reads (the window an
in-flight entry names, the attempts ``gate.lua``'s horizon drops): those are built from a
passed key's prefix up to its hash tag (the same slot) and read before the script's first
write, so that a cluster moving the slot refuses the call whole rather than halfway (but for
``gate.lua``'s horizon, whose give-backs are each a step of their own).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError, RedisClusterException

from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.keys import Keys

__all__ = ["evalsha", "load_lua", "read_rows", "read_windows", "text_of"]


@cache
def load_lua(name: str) -> str:
    """The text of ``gatekeeper/lua/<name>``."""
    return resources.files("gatekeeper").joinpath("lua").joinpath(name).read_text(encoding="utf-8")


def evalsha(
    client: redis.Redis, script: Script, keys: list[str], args: Sequence[str | bytes]
) -> Any:
    """EVALSHA without redis-py's per-call Script wrapper; loads the script when missing."""
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        client.script_load(script.script)
        return client.evalsha(script.sha, len(keys), *keys, *args)


_NOT_COUNTERS = (b"hash_table", "hash_table")


def read_windows(client: redis.Redis, keys: Keys, ids: Iterable[int]) -> list[dict[str, str]]:
    """Window hashes as text, in the order of ``ids``, in one pipelined round trip (without
    ``hash_table``, which only keeps the hash a hash table: keys.py)."""
    try:
        pipe = client.pipeline(transaction=False)
        for ident in ids:
            pipe.hgetall(keys.window(ident))
        raw = pipe.execute()
    except (redis.RedisError, RedisClusterException) as exc:  # a cluster's own, too
        raise LedgerUnavailable(f"cannot read the ledger windows: {exc}") from exc
    return [{text_of(k): text_of(v) for k, v in fields.items() if k not in _NOT_COUNTERS}
            for fields in raw]  # fmt: skip


def read_rows(client: redis.Redis, keys: Keys, window_id: int) -> list[dict[str, Any]]:
    """The ledger rows stored for one window, oldest first."""
    try:
        raw = client.lrange(keys.window_rows(window_id), 0, -1)
    except (redis.RedisError, RedisClusterException) as exc:
        raise LedgerUnavailable(f"cannot read window {window_id}: {exc}") from exc
    try:
        return [json.loads(text_of(item)) for item in raw]
    except ValueError as exc:  # not gatekeeper's writing
        raise LedgerUnavailable(f"window {window_id} holds a row that is not JSON: {exc}") from exc


def text_of(value: bytes | str | int | float) -> str:
    """A Redis reply as text (replies are bytes unless the client decodes them)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
