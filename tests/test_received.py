"""The worker's main process tells which received request ended (gatekeeper/celery/received.py),
against Celery's own bookkeeping of the requests it holds (``celery.worker.state``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery.worker import state

from gatekeeper.celery.received import NOWHERE, PRUNE_EVERY, Received
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger


class Request:
    """As Celery's: an id, no ``__eq__``; ``time_start`` set once a pool child accepted it."""

    def __init__(self, job_id: str, pid: int = 0) -> None:
        self.id, self.worker_pid, self.hostname = job_id, pid, "w@host"
        self.time_start: float | None = None


def headers(attempt: int) -> dict[str, Any]:
    return {"gatekeeper_decision": "admit_free", "gatekeeper_attempt": attempt,
            "gatekeeper_nonce": f"n{attempt}"}  # fmt: skip


@pytest.fixture()
def held() -> Iterator[list[Any]]:
    """Requests put in Celery's sets by a test, taken out afterwards."""
    requests: list[Any] = []
    yield requests
    for request in requests:
        state.active_requests.discard(request)
        state.reserved_requests.discard(request)


def test_a_retry_is_told_apart_from_the_run_before_it(held: list[Any]) -> None:
    received = Received()
    first = Request("J", pid=11)
    received.add(first, headers(1))
    first.time_start = 1.0  # it ran, in its child, and ended there (its retry published)
    second = Request("J", pid=12)
    received.add(second, headers(2))
    second.time_start = 2.0
    state.active_requests.add(second)
    held.append(second)
    state.active_requests.discard(second)  # its hard time limit: Celery lets go, then signals
    assert received.ended("J") == (headers(2), (12, "w@host"))


def test_a_request_waiting_on_its_eta_outlives_a_prune(held: list[Any]) -> None:
    received = Received()
    waiting = Request("ETA")  # received, not started, in no set of Celery 5.5's
    received.add(waiting, headers(1))
    for n in range(PRUNE_EVERY):
        other = Request(f"other-{n}")
        other.time_start = 1.0  # started and ended: pruned
        received.add(other, headers(1))
    waiting.time_start = 3.0  # its countdown over, it ran and ended in the main process's view
    assert received.ended("ETA") == (headers(1), (0, "w@host"))
    assert received.ended("other-0") == ({}, (0, ""))  # forgotten by the prune


def test_two_requests_with_one_id_the_one_that_ended_is_named(held: list[Any]) -> None:
    received = Received()
    mine, copy = Request("J", pid=21), Request("J", pid=22)
    for request in (mine, copy):
        received.add(request, headers(1))
        request.time_start = 1.0
        state.active_requests.add(request)
        held.append(request)
    state.active_requests.discard(mine)
    assert received.ended("J") == (headers(1), (21, "w@host"))


@pytest.mark.parametrize("recorded", ["new", "old", "other", None])
def test_two_ended_requests_of_one_id_the_records_nonce_names_the_one(
    redis_client: redis.Redis, recorded: str | None
) -> None:
    """``Task.replace``: the replaced request and its replacement (another nonce) both ended
    by the time the main process ends the replacement; the gate's record holds the nonce of
    the one still owed its end. No record's nonce among them (or none read): nothing told."""
    keys = Keys()
    if recorded is not None:
        redis_client.hset(keys.run("J", 1), "nonce", recorded)
    received = Received()
    replaced, replacement = Request("J", pid=31), Request("J", pid=32)
    received.add(replaced, {**headers(1), "gatekeeper_nonce": "old"})
    received.add(replacement, {**headers(1), "gatekeeper_nonce": "new"})
    for request in (replaced, replacement):
        request.time_start = 1.0  # both ran, and Celery holds neither
    runs = RunLedger(redis_client, keys, window_seconds=900, queue_wait_unit_per_second=200)
    told = {"new": ({**headers(1), "gatekeeper_nonce": "new"}, (32, "w@host")),
            "old": ({**headers(1), "gatekeeper_nonce": "old"}, (31, "w@host"))}  # fmt: skip
    assert received.ended("J", runs) == told.get(recorded or "", (None, NOWHERE))


def test_two_ended_requests_of_one_id_with_no_ledger_tell_nothing() -> None:
    received = Received()
    requests = [Request("J"), Request("J")]
    for request, nonce in zip(requests, ("old", "new"), strict=True):
        received.add(request, {**headers(1), "gatekeeper_nonce": nonce})
    for request in requests:
        request.time_start = 1.0
    assert received.ended("J") == (None, NOWHERE)
