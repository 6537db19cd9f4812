"""What the replayer handed a deferred message on as, kept beside the gate's record of its
attempt.

The replayer scores a deferred message (the gate writes a new nonce into the record), then
hands the rewritten message on. On RabbitMQ the two are not one step: the original is acked
only once the rewritten copy is confirmed, so a replayer that dies in between leaves the
original to come back. Scored again, it would be a second decision for one attempt (and the
first copy, if it was published, a message whose nonce is no longer the record's). So the
handoff is kept: the queue and the header changes, JSON, in a key of its own
(``handoff:<job_id>:<attempt>``, keys.py), and in the record ``handoff_nonce``, the nonce of the
message that was handed on. The message that comes back carries that nonce and is handed on
again exactly as the first time; the worker runs one of the copies
(:mod:`gatekeeper.celery.duplicates`). On Redis the handoff itself is atomic (``move.lua``),
and this covers a replayer killed between scoring and moving, and a twin of the message (a
publish sent twice, one nonce) that is replayed after it.

The key lives as long as the record (its TTL, ``GateStore.record_ttl_s``, from when the
handoff is kept; never deleted when the message moves: a twin, or a dead letter listed twice,
may still come back, in a later batch, a later pass, or after the deadline). A handoff is
about 420 bytes of JSON (:func:`packed`; 660 spelled out, as before 2026-12-06). Kept in the
record, as an older replayer kept it (``handoff_from`` and ``handoff``, still read), it made
the record a hash table (a value past
``hash-max-ziplist-value``, 64 bytes): 1,872 bytes a cut record on Redis 7.0, 2,076 on 6.2
(bench/memory.py --replayed); beside it, the record stays compact.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import redis
from redis.exceptions import NoScriptError

from gatekeeper.core.headers import H_DEADLINE_AT, H_NONCE
from gatekeeper.defaults import RECORD_RETENTION_S
from gatekeeper.errors import GateUnreachable, LedgerUnavailable
from gatekeeper.redis.breaker import not_answering
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.scripts import evalsha, load_lua, text_of
from gatekeeper.redis.store import NO_ANSWER, GateStore

__all__ = ["HANDOFF", "HANDOFF_FROM", "HANDOFF_NONCE", "KEEP_SHA", "Handoff", "Kept", "Superseded",
           "Where", "as_scored", "handed_on", "packed", "read", "recalled", "remember",
           "remember_all", "scored_unsent"]  # fmt: skip

HANDOFF_NONCE = "handoff_nonce"
"""The record's field naming the message whose handoff its key keeps."""
HANDOFF_FROM = "handoff_from"
HANDOFF = "handoff"
"""An older replayer's fields: the nonce, and the handoff itself, in the record."""
PREFIX = "gatekeeper_"


@dataclass(frozen=True, slots=True)
class Handoff:
    """Where a deferred message went, and how its headers were rewritten."""

    queue: str
    """The queue it was handed to (``defer`` itself when it was deferred again)."""
    set: dict[str, Any]
    drop: tuple[str, ...]
    wait_s: float = 0.0
    """For a message deferred again: how long it waits before it is looked at again."""

    def apply(self, headers: dict[str, Any]) -> None:
        headers.update(self.set)
        for name in self.drop:
            headers.pop(name, None)


Kept = tuple[str, int, str, Handoff]
"""A handoff to keep: the job id, the attempt, the nonce of the message handed on, the handoff."""

Where = Literal["key", "record"] | None


def remember(runs: RunLedger, job_id: str, attempt: int, nonce: str, handoff: Handoff) -> None:
    """Keep one handoff (:func:`remember_all`); raises redis-py's error when it was not."""
    (error,) = remember_all(runs, [(job_id, attempt, nonce, handoff)])
    if error is not None:
        raise error


def remember_all(
    runs: RunLedger, kept: Sequence[Kept], ttl_s: int = RECORD_RETENTION_S
) -> list[redis.RedisError | None]:
    """Keep each handoff in its key, and in its record the nonce of the message it hands on
    (``keep.lua``: only while the record still holds the decision that made it, whose nonce
    the handoff sets; the key's TTL, ``ttl_s`` from now, is the record's), all in one round
    trip. Returns, for each, None once kept or why it was not: :class:`Superseded` (the record
    holds another decision now), or the Redis error (one bad record fails its own only).
    What got no answer (a connection error, a timeout, a ``READONLY`` after a failover) is
    asked once more, on a new connection (a keep can be made twice); still unanswered, it
    gets that error (it may be kept). A message that comes back with no handoff kept is
    scored again (:func:`as_scored`)."""
    commands = [
        ["EVALSHA", KEEP_SHA, "2", runs.keys.handoff(job_id, attempt),
         runs.keys.run(job_id, attempt), packed(handoff), str(ttl_s), nonce,
         str(handoff.set.get(H_NONCE, ""))]
        for job_id, attempt, nonce, handoff in kept
    ]  # fmt: skip
    replies = _sent(runs, commands)
    if again := [i for i, reply in enumerate(replies) if isinstance(reply, NO_ANSWER)]:
        for i, reply in zip(again, _sent(runs, [commands[i] for i in again]), strict=True):
            replies[i] = reply
    return [_kept(reply) for reply in replies]


def _kept(reply: Any) -> redis.RedisError | None:
    """None when ``keep.lua`` kept the handoff; else why not."""
    if isinstance(reply, redis.RedisError):
        return reply
    return None if int(reply) == 1 else Superseded("the record holds another decision now")


def _sent(runs: RunLedger, commands: list[list[str]]) -> list[Any]:
    """``runs.send_all``, ``keep.lua`` loaded first where the server did not have it."""
    replies = runs.send_all(commands)
    if missing := [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]:
        runs.client.script_load(_KEEP)
        for i, reply in zip(missing, runs.send_all([commands[i] for i in missing]), strict=True):
            replies[i] = reply
    return replies


class Superseded(redis.RedisError):
    """A handoff not kept: the attempt's record no longer holds the decision that made it (a
    requeue of a twin undid it, the record expired). Its copy must not leave. An answer, never
    taken for none (not an error reply: its text is not read for ``READONLY`` and the like)."""


def handed_on(record: Mapping[str, str], nonce: str) -> Where:
    """Where the handoff of the message carrying ``nonce`` is kept: ``"key"`` (its own,
    :func:`read`), ``"record"`` (an older replayer's, in ``handoff``), or ``None``: none was
    kept for it."""
    if not nonce:
        return None
    if record.get(HANDOFF_NONCE) == nonce:
        return "key"
    return "record" if record.get(HANDOFF_FROM) == nonce else None


def read(client: redis.Redis, keys: Keys, job_id: str, attempt: int) -> str:
    """The document in the attempt's handoff key ("" when there is none)."""
    try:
        return text_of(client.get(keys.handoff(job_id, attempt)) or "")
    except redis.RedisError as exc:
        raise LedgerUnavailable(f"cannot read handoff {job_id}:{attempt}: {exc}") from exc


def recalled(record: Mapping[str, str], nonce: str, in_key: str = "") -> Handoff | None:
    """The handoff of the message carrying ``nonce``: ``in_key``, its key's document, when
    :func:`handed_on` says ``"key"``; an older replayer's in the record; None when none was
    kept for it, or it does not read back."""
    where = handed_on(record, nonce)
    if where is None:
        return None
    text = in_key if where == "key" else record.get(HANDOFF) or ""
    try:
        document = json.loads(text)
        if "q" in document:  # packed (since 2026-12-06)
            return Handoff(str(document["q"]), {_long(k): v for k, v in document["s"].items()},
                           tuple(map(_long, document["d"])), float(document["w"]))  # fmt: skip
        return Handoff(str(document["queue"]), dict(document["set"]),
                       tuple(document["drop"]), float(document.get("wait_s") or 0))  # fmt: skip
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def packed(handoff: Handoff) -> str:
    """A handoff's document as its key keeps it: JSON without spaces, and gatekeeper's header
    names without their common prefix (another name starts with '/'). A replayed message's
    key takes 552 bytes where the spelled-out document's took 791 (bench/memory.py
    --replayed); :func:`recalled` reads both."""
    document = {"q": handoff.queue, "s": {_short(k): v for k, v in handoff.set.items()},
                "d": list(map(_short, handoff.drop)), "w": handoff.wait_s}  # fmt: skip
    return json.dumps(document, separators=(",", ":"))


def _short(name: str) -> str:
    rest = name[len(PREFIX) :]
    return rest if name.startswith(PREFIX) and not rest.startswith("/") else "/" + name


def _long(name: str) -> str:
    return name[1:] if name.startswith("/") else PREFIX + name


def scored_unsent(record: Mapping[str, str], headers: Mapping[str, Any]) -> bool:
    """Whether the message is one the gate scored and was never handed on: its nonce is the
    record's ``prev_nonce`` (the decision replaced it), no handoff is kept for it (a copy
    leaves only once it is), and it carries the record's deadline. A copy with another
    deadline (one who saw the message, and made it look expired) is not the record's, and
    must not end the attempt (its abandoned row, its failure in the result backend)."""
    nonce, deadline = headers.get(H_NONCE), headers.get(H_DEADLINE_AT)
    return (
        isinstance(nonce, str) and bool(nonce) and record.get("prev_nonce") == nonce
        and handed_on(record, nonce) is None
        and isinstance(deadline, (int, float)) and math.isfinite(deadline)
        and record.get("deadline_ms") == str(round(deadline * 1000))
    )  # fmt: skip


def as_scored(
    store: GateStore,
    job_id: str,
    attempt: int,
    record: dict[str, str],
    headers: dict[str, Any],
    ended: bool = False,
) -> None:
    """A message the gate scored (its nonce is the record's ``prev_nonce``: the decision
    replaced it) with no handoff kept: its replayer died in between, or the handoff's write
    failed (the message then waits in defer), and no copy left. It is the gate's message
    still: the decision is undone (``unscore.lua``, only while the record holds it and no
    handoff is kept for the message, whose copy may have left: what it admitted is given
    back, no message carries it, and the record's nonce is the message's again, decided
    ``defer``), so the message is the record's as parked, in this pass and in any later one
    it comes back to unmoved. When the record refuses (a Redis out of memory),
    or holds another decision now, the message takes the record's nonce, for this pass.
    ``ended``: the attempt was abandoned before the decision (a dead letter's requeue), and
    is again once it is undone."""
    admitted = record.get("decision") == "admit_free" and record.get("window", "").isdigit()
    free = ""
    if admitted:  # its free_admitted was that admission's: the earlier attempt's again
        earlier = attempt > 1 and text_of(store.client.hget(
            store.keys.run(job_id, attempt - 1), "free_admitted") or "") == "1"  # fmt: skip
        free = "1" if earlier else "0"  # (abandoned now, a slack miss only if that ran free)
    mine, key = str(headers[H_NONCE]), store.keys.run(job_id, attempt)
    window = store.keys.window(int(record["window"])) if admitted else key
    keys = [key, store.keys.inflight, store.keys.free_waiting, window]
    try:
        undone = evalsha(store.client, store.client.register_script(_UNSCORE), keys,
                         [record["nonce"], mine, free, f"{job_id}:{attempt}",
                          "1" if admitted else "0", "1" if ended else "0"])  # fmt: skip
    except redis.ResponseError as exc:  # refused (out of memory), or a replica's (no answer)
        if not_answering(exc):
            raise GateUnreachable(f"cannot undo {key}'s decision: {exc}") from exc
        undone = 0
    if undone:
        record.update(nonce=mine, prev_nonce="", window="")
        if free:
            record["free_admitted"] = free
    else:
        headers[H_NONCE] = record["nonce"]
    record["decision"] = "defer"


_UNSCORE = load_lua("unscore.lua")
_KEEP = load_lua("keep.lua")
KEEP_SHA = hashlib.sha1(_KEEP.encode()).hexdigest()
"""``keep.lua``'s SHA1 (its ``EVALSHA``)."""
