"""What ``gatekeeper metrics`` reads of a namespace at scrape time, and what the replayer
writes for it.

A scrape reads one small bounded hash of lifetime counters (``totals``), a few fields of the
current window, the head of two sorted sets, the flags, the stats and the replayer's last
pass, in one transaction (every key shares the namespace's hash tag, so one cluster slot),
then ``INFO memory``: never a whole large hash or list. Key names and lifetimes are in
:mod:`gatekeeper.redis.keys`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from gatekeeper.core.headers import H_ATTEMPT, H_DEADLINE_AT
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.cluster import home
from gatekeeper.redis.keys import ATTEMPTS, Keys
from gatekeeper.redis.scripts import evalsha, load_lua, text_of

__all__ = [
    "WINDOW_FIELDS",
    "Snapshot",
    "forget_deferred",
    "pass_completed",
    "read_snapshot",
    "read_waiting",
    "waiting_of",
]

WINDOW_FIELDS = ("tax_units", "exposure", "admitted_free", "slack_misses")
"""The current window's fields a scrape reads (``gatekeeper status`` prints them)."""


@dataclass(frozen=True)
class Snapshot:
    """One namespace's state as read in one transaction, as text."""

    totals: dict[str, str]
    window: dict[str, str]
    oldest_waiting_ms: float | None
    """The score of the free queue's oldest waiting admission (None: none waiting)."""
    waiting: int
    next_deadline_ms: float | None
    """The nearest deadline among deferred attempts (None: none deferred)."""
    flags: dict[str, str]
    stats: dict[str, str]
    last_pass_s: float | None
    """When a replayer last completed a pass (None: never)."""
    policy: str | None = None
    """The server's ``maxmemory-policy`` (``unknown`` when it does not say)."""
    decisions: dict[tuple[str, str, str], int] = field(default_factory=dict)
    """The ``decided:<decision>:<reason>:<task>`` totals as (task, decision, reason) -> n."""


def _text(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {text_of(k): text_of(v) for k, v in raw.items()}


def _head(pair: list[tuple[Any, float]]) -> float | None:
    return float(pair[0][1]) if pair else None


def read_waiting(pipe: Any, keys: Keys) -> None:
    """Queue on ``pipe`` (a transaction) the reads :func:`waiting_of` takes, three replies:
    the oldest attempt waiting, the set's size and its pad (scored ``+inf``, keys.py; the
    README's ACL has no ``ZCOUNT``)."""
    pipe.zrangebyscore(keys.free_waiting, "-inf", ATTEMPTS, start=0, num=1, withscores=True)
    pipe.zcard(keys.free_waiting)
    pipe.zrangebyscore(keys.free_waiting, "+inf", "+inf")


def waiting_of(oldest: Any, members: Any, pads: Any) -> tuple[float | None, int]:
    """The oldest waiting attempt's due time (ms; None: none waits) and how many wait, from
    :func:`read_waiting`'s replies."""
    return _head(oldest), int(members) - len(pads)


def read_snapshot(client: redis.Redis, keys: Keys, window_id: int) -> Snapshot:
    """The namespace's state for a scrape; :class:`LedgerUnavailable` when Redis cannot be
    read (a timeout on a hung server included: the caller's client sets how long)."""
    try:
        server = home(client, keys.totals, fresh=True)  # a cluster's MULTI, INFO: its primary
        pipe = server.pipeline(transaction=True)
        pipe.hgetall(keys.totals)
        pipe.hmget(keys.window(window_id), list(WINDOW_FIELDS))
        read_waiting(pipe, keys)
        pipe.zrange(keys.deferred, 0, 0, withscores=True)
        pipe.hgetall(keys.flags)
        pipe.hgetall(keys.stats)
        pipe.get(keys.replayer_last_pass)
        totals, window, *waiting, nearest, flags, stats, last = pipe.execute()
        policy = server.info("memory").get("maxmemory_policy")
    except redis.RedisError as exc:
        raise LedgerUnavailable(f"cannot read the gate's Redis: {exc}") from exc
    counted = _text(totals)
    decisions = {}
    for name, value in counted.items():
        kind, _, rest = name.partition(":")
        decision, _, rest = rest.partition(":")
        reason, _, task = rest.partition(":")
        if kind == "decided" and task and (count := _whole(value)) is not None:
            decisions[(task, decision, reason)] = count
    oldest_ms, count = waiting_of(*waiting)
    return Snapshot(
        totals=counted,
        window={n: text_of(v) for n, v in zip(WINDOW_FIELDS, window, strict=True) if v},
        oldest_waiting_ms=oldest_ms,
        waiting=count,
        next_deadline_ms=_head(nearest),
        flags=_text(flags),
        stats=_text(stats),
        last_pass_s=_finite(text_of(last)) if last is not None else None,
        policy=str(policy) if policy else "unknown",
        decisions=decisions,
    )


def _whole(text: str) -> int | None:
    """A counter as a whole number; None for one gatekeeper did not write (a scrape leaves
    it out rather than fail whole)."""
    number = _finite(text)
    return None if number is None else int(number)


def _finite(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def forget_deferred(client: redis.Redis, keys: Keys, *headers: Mapping[str, Any]) -> None:
    """Deferred messages (their headers) left defer for good (handed on, dead-lettered):
    their deadlines no longer count, all forgotten in one call of ``forget.lua``, each only
    while its member's deadline is the message's (a dead-lettered copy of an earlier life
    of the attempt must not forget a later one deferred meanwhile). Best effort: a member
    left behind is trimmed after its deadline."""
    pairs: list[str] = []
    for h in headers:
        if h.get("id") is not None and type(h.get(H_ATTEMPT)) is int:
            deadline, ms = h.get(H_DEADLINE_AT), ""
            with contextlib.suppress(OverflowError, ValueError):  # a caller's 1e306
                if isinstance(deadline, (int, float)) and math.isfinite(deadline):
                    ms = str(round(deadline * 1000))
            pairs += [f"{h.get('id')}:{h.get(H_ATTEMPT)}", ms]
    if pairs:
        with contextlib.suppress(redis.RedisError):
            try:
                evalsha(client, client.register_script(_FORGET), [keys.deferred], pairs)
            except redis.ResponseError:  # refused (out of memory: ZADD is, ZREM is not)
                client.zrem(keys.deferred, *pairs[::2])  # as before forget.lua: every member


_FORGET = load_lua("forget.lua")


def pass_completed(
    client: redis.Redis, keys: Keys, began_s: float, now_s: float, backoff_max_s: float
) -> None:
    """A replayer completed, at ``now_s``, a pass that began at ``began_s``: record the time,
    and drop the deferred deadlines older than ``backoff_max_s`` before it began (a message
    still in defer with such a deadline would have been abandoned in this pass: it was purged
    or lost)."""
    pipe = home(client, keys.replayer_last_pass, fresh=True).pipeline(transaction=True)
    pipe.set(keys.replayer_last_pass, repr(now_s))
    pipe.zremrangebyscore(keys.deferred, "-inf", f"({(began_s - backoff_max_s) * 1000!r}")
    pipe.execute()
