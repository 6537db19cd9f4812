"""One batch of the replayer's work: each message's steps, their round trips made together.

The replayer hands deferred messages on a batch at a time (``replay_batch_size`` on a Redis
broker; one at a time on RabbitMQ). What one message goes through is written once, top to
bottom, as a generator (:meth:`gatekeeper.celery.replay.Replayer._handle`): where it needs the
gate's Redis it yields a request (:class:`ReadRecord`, :class:`ReadHandoff`, :class:`Decide`,
:class:`KeepHandoff`) and is sent the answer, or has the error thrown in at that point, as the
call would have raised it there. :func:`run_batch` advances a batch's messages together,
each round making the requests of one kind, all of them in one round trip, in the order a
message makes them (records, kept handoffs, decisions, handoffs to keep). So a batch costs
three round trips on the gate's Redis where each message cost three (a fourth, the kept
handoffs read, only when a message that was handed on before came back), and every rule a
message follows is the code it followed alone.

Two messages of one job in a batch (a copy that came back beside its twin) are not handled
side by side: the second starts once the first is done, and reads the record the first left.

The replayer's lock is checked (``alive``: renewed once a third of its TTL has passed, with no
round trip while fresh) before each round trip and before each step of each message, so a
batch that takes longer than the TTL keeps its lock, and one found lost stops there: what is
still to do is not advanced (no decision, no row, no write), and nothing of the batch moves.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from gatekeeper.errors import GateUnreachable, LedgerUnavailable
from gatekeeper.redis.attempt import Publish
from gatekeeper.redis.gate import Pipeline
from gatekeeper.redis.gate_batch import route_all
from gatekeeper.redis.handoff import Kept, remember_all
from gatekeeper.redis.kept import unpack
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.scripts import text_of
from gatekeeper.redis.store import NO_ANSWER

__all__ = ["Decide", "KeepHandoff", "ReadHandoff", "ReadRecord", "Step", "run_batch"]


@dataclass(frozen=True, slots=True)
class ReadRecord:
    """Answered with the gate's record of the attempt, as text (empty: none);
    :class:`LedgerUnavailable` is thrown when it cannot be read (``RunLedger.fields``'s)."""

    job_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class ReadHandoff:
    """Answered with the attempt's kept handoff, its key's text ("" when there is none);
    :class:`LedgerUnavailable` is thrown when it cannot be read."""

    job_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Decide:
    """Answered with the publish's routing (``Pipeline.route``'s); what its decision raised is
    thrown."""

    publish: Publish


@dataclass(frozen=True, slots=True)
class KeepHandoff:
    """Answered with None once the handoff is kept (``handoff.remember_all``'s); the Redis error
    is thrown when it was not (that handoff's own, or the round trip's)."""

    kept: Kept


Request = ReadRecord | ReadHandoff | Decide | KeepHandoff
Step = Generator[Request, Any, str]
"""One message's replay: yields what it needs of the gate's Redis, returns its label."""
ORDER: tuple[type[Request], ...] = (ReadRecord, ReadHandoff, Decide, KeepHandoff)


def run_batch(
    steps: Sequence[tuple[Hashable, Step]],
    runs: RunLedger,
    pipeline: Pipeline,
    failed: Callable[[int, Exception], str],
    alive: Callable[[], bool] = lambda: True,
) -> list[str]:
    """Run each ``(job, step)`` to its label, in order; a step that raises gets
    ``failed(its index, the error)`` as its label (one bad message does not stop the others).
    Once ``alive()`` is false nothing more is advanced, and the unfinished labels stay ``""``."""
    labels = [""] * len(steps)
    todo = list(range(len(steps)))
    while todo and alive():  # a wave: the first message of each job still to do
        wave: list[int] = []
        later: list[int] = []
        jobs: set[Hashable] = set()
        for i in todo:
            (later if steps[i][0] in jobs else wave).append(i)
            jobs.add(steps[i][0])
        _run_wave(wave, steps, labels, failed, runs, pipeline, alive)
        todo = later
    return labels


def _run_wave(
    wave: list[int],
    steps: Sequence[tuple[Hashable, Step]],
    labels: list[str],
    failed: Callable[[int, Exception], str],
    runs: RunLedger,
    pipeline: Pipeline,
    alive: Callable[[], bool],
) -> None:
    waiting: dict[int, Request] = {}

    def advance(i: int, answer: Any) -> None:
        if not alive():  # lost: this message is left as claimed, its step not run
            return
        step = steps[i][1]
        try:
            request = step.throw(answer) if isinstance(answer, Exception) else step.send(answer)
        except StopIteration as done:
            labels[i] = done.value
        except Exception as exc:
            labels[i] = failed(i, exc)
        else:
            waiting[i] = request

    for i in wave:
        advance(i, None)
    while waiting and alive():
        kind = min((type(request) for request in waiting.values()), key=ORDER.index)
        mine = [i for i, request in waiting.items() if type(request) is kind]
        requests = [waiting.pop(i) for i in mine]
        try:
            answers = _answers(requests, runs, pipeline, alive)
        except Exception as exc:  # the round trip itself failed: each request gets why
            answers = [exc] * len(requests)
        for i, answer in zip(mine, answers, strict=True):
            advance(i, answer)


def _answers(
    requests: list[Request], runs: RunLedger, pipeline: Pipeline, alive: Callable[[], bool]
) -> list[Any]:
    """The answers to requests of one kind, in one round trip."""
    if isinstance(requests[0], ReadRecord):
        return _records([r for r in requests if isinstance(r, ReadRecord)], runs)
    if isinstance(requests[0], ReadHandoff):
        return _handoffs([r for r in requests if isinstance(r, ReadHandoff)], runs)
    if isinstance(requests[0], Decide):
        decided = [r.publish for r in requests if isinstance(r, Decide)]
        return route_all(pipeline, decided, alive)
    try:
        kept = [r.kept for r in requests if isinstance(r, KeepHandoff)]  # for the record's TTL
        return list(remember_all(runs, kept, pipeline.store.record_ttl_s))
    except redis.RedisError as exc:  # the round trip itself: none may be kept
        return [exc] * len(requests)


def _records(requests: list[ReadRecord], runs: RunLedger) -> list[Any]:
    """Each record as ``RunLedger.fields`` reads it, or why it could not be read."""

    def read(fields: Any) -> dict[str, str]:  # a flat list on the line, a dict from redis-py
        flat = fields if isinstance(fields, list) else [x for kv in fields.items() for x in kv]
        pairs = zip(flat[::2], flat[1::2], strict=True)
        return unpack({text_of(k): text_of(v) for k, v in pairs})

    return _each(requests, runs, "run", lambda r: ["HGETALL", runs.keys.run(*r)], read)


def _handoffs(requests: list[ReadHandoff], runs: RunLedger) -> list[Any]:
    """Each kept handoff's text ("" for none), or why it could not be read."""
    return _each(requests, runs, "handoff", lambda r: ["GET", runs.keys.handoff(*r)],
                 lambda text: text_of(text or ""))  # fmt: skip


def _each(
    requests: Sequence[ReadRecord | ReadHandoff],
    runs: RunLedger,
    what: str,
    ask: Callable[[tuple[str, int]], list[str]],
    read: Callable[[Any], Any],
) -> list[Any]:
    """One read per request's attempt, all in one round trip: each answer ``read``, or why it
    could not be read (one bad key, of another type, fails its own message only)."""
    try:
        raw = runs.send_all([ask((request.job_id, request.attempt)) for request in requests])
    except redis.RedisError as exc:
        raw = [exc] * len(requests)
    return [_unread(what, r, answer) if isinstance(answer, Exception) else read(answer)
            for r, answer in zip(requests, raw, strict=True)]  # fmt: skip


def _unread(what: str, request: ReadRecord | ReadHandoff, error: Exception) -> LedgerUnavailable:
    """Why a read failed: :class:`GateUnreachable` when no answer came (``NO_ANSWER``:
    refused, timed out, no master found, loading its data; no message is at fault), else the
    key's own error."""
    kind = GateUnreachable if isinstance(error, NO_ANSWER) else LedgerUnavailable
    return kind(f"cannot read {what} {request.job_id}:{request.attempt}: {error}")
