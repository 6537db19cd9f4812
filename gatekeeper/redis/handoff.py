"""What the replayer handed a deferred message on as, kept in the gate's record of its attempt.

The replayer scores a deferred message (the gate writes a new nonce into the record), then
hands the rewritten message on. On RabbitMQ the two are not one step: the original is acked
only once the rewritten copy is confirmed, so a replayer that dies in between leaves the
original to come back. Scored again, it would be a second decision for one attempt (and the
first copy, if it was published, a message whose nonce is no longer the record's). So the
handoff is kept in the record: ``handoff_from`` (the nonce of the message that was handed
on) and ``handoff`` (the queue and the header changes, JSON). The message that comes back
carries ``handoff_from``'s nonce and is handed on again exactly as the first time; the worker
runs one of the copies (:mod:`gatekeeper.celery.duplicates`). On Redis the handoff is atomic
(``move.lua``), and this covers a replayer killed between scoring and moving.

The JSON of a handoff is some 250 bytes: one value past 64 would make the record a hash table
for good, about four times a compact record's memory for its whole retention (the handoff
stays after the cut: :mod:`gatekeeper.redis.kept`). So a longer one is kept in parts of at
most :data:`~gatekeeper.redis.kept.COMPACT_VALUE` bytes: ``handoff`` the first,
``handoff:1``, ``handoff:2``, ... the rest, and ``handoff_parts`` how many, all in one
``HSET`` (a later handoff of the attempt with fewer parts leaves the older ones unread). A
record without ``handoff_parts`` holds its handoff in one field, as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from gatekeeper.core.headers import H_NONCE
from gatekeeper.redis.kept import COMPACT_VALUE
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.store import GateStore

__all__ = ["HANDOFF", "HANDOFF_FROM", "HANDOFF_PARTS", "Handoff", "Kept", "as_scored",
           "laid_out", "recalled", "remember", "remember_all"]  # fmt: skip

HANDOFF_FROM = "handoff_from"
HANDOFF = "handoff"
HANDOFF_PARTS = "handoff_parts"
"""How many parts a handoff is kept in (``handoff``, ``handoff:1``, ...); absent: one."""


def laid_out(text: str) -> dict[str, str]:
    """The record's fields for a handoff's JSON (ASCII: ``json.dumps`` escapes the rest):
    one ``handoff`` when it is short enough for a compact hash, else its parts."""
    if len(text) <= COMPACT_VALUE:
        return {HANDOFF: text, HANDOFF_PARTS: "1"}
    parts = [text[at : at + COMPACT_VALUE] for at in range(0, len(text), COMPACT_VALUE)]
    fields = {HANDOFF: parts[0], HANDOFF_PARTS: str(len(parts))}
    fields.update({f"{HANDOFF}:{n}": part for n, part in enumerate(parts[1:], 1)})
    return fields


def _joined(record: Mapping[str, str]) -> str:
    """A handoff's JSON, from its parts (or its one field)."""
    count = int(record.get(HANDOFF_PARTS) or 1)
    first = record.get(HANDOFF) or ""
    return first + "".join(record[f"{HANDOFF}:{n}"] for n in range(1, count))


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


def remember(runs: RunLedger, job_id: str, attempt: int, nonce: str, handoff: Handoff) -> None:
    """Keep one handoff (:func:`remember_all`); raises redis-py's error when it was not."""
    (error,) = remember_all(runs, [(job_id, attempt, nonce, handoff)])
    if error is not None:
        raise error


def remember_all(runs: RunLedger, kept: Sequence[Kept]) -> list[redis.RedisError | None]:
    """Keep each handoff in its record, as the handing on of the message carrying its nonce
    (the record exists: the gate wrote it when it scored the message), in one round trip.
    Returns, for each, None once kept or the error that kept it from being (one bad record
    fails its own only); raises redis-py's errors when the round trip failed: then none may be
    kept. A message that comes back with no handoff kept is scored again (:func:`as_scored`)."""
    pipe = runs.client.pipeline(transaction=False)
    for job_id, attempt, nonce, handoff in kept:
        document = {"queue": handoff.queue, "set": handoff.set, "drop": list(handoff.drop),
                    "wait_s": handoff.wait_s}  # fmt: skip
        fields: dict[Any, Any] = {HANDOFF_FROM: nonce, **laid_out(json.dumps(document))}
        pipe.hset(runs.keys.run(job_id, attempt), mapping=fields)
    replies = pipe.execute(raise_on_error=False)
    return [reply if isinstance(reply, redis.RedisError) else None for reply in replies]


def recalled(record: Mapping[str, str], nonce: str) -> Handoff | None:
    """The handoff of the message carrying ``nonce``, when the record kept one for it."""
    if not nonce or record.get(HANDOFF_FROM) != nonce:
        return None
    try:
        document = json.loads(_joined(record))
        return Handoff(str(document["queue"]), dict(document["set"]),
                       tuple(document["drop"]), float(document.get("wait_s") or 0))  # fmt: skip
    except (ValueError, TypeError, KeyError):
        return None


def as_scored(
    store: GateStore, job_id: str, attempt: int, record: dict[str, str], headers: dict[str, Any]
) -> None:
    """A message the gate scored (its nonce is the record's ``prev_nonce``: the decision
    replaced it) with no handoff kept: its replayer died in between and no copy left. It is
    the gate's message still: what that decision admitted is given back (no message carries
    it), and the message is taken as the record's own, as parked, to be scored again."""
    if record.get("decision") == "admit_free" and record.get("window", "").isdigit():
        store.release(job_id, attempt, int(record["window"]), unpublished=True)
    headers[H_NONCE] = record["nonce"]
    record["decision"] = "defer"
