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
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from gatekeeper.core.headers import H_NONCE
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.store import GateStore

__all__ = ["HANDOFF", "HANDOFF_FROM", "Handoff", "Kept", "as_scored", "recalled", "remember",
           "remember_all"]  # fmt: skip

HANDOFF_FROM = "handoff_from"
HANDOFF = "handoff"


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
        pipe.hset(runs.keys.run(job_id, attempt),
                  mapping={HANDOFF_FROM: nonce, HANDOFF: json.dumps(document)})  # fmt: skip
    replies = pipe.execute(raise_on_error=False)
    return [reply if isinstance(reply, redis.RedisError) else None for reply in replies]


def recalled(record: Mapping[str, str], nonce: str) -> Handoff | None:
    """The handoff of the message carrying ``nonce``, when the record kept one for it."""
    if not nonce or record.get(HANDOFF_FROM) != nonce:
        return None
    try:
        document = json.loads(record.get(HANDOFF) or "")
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
