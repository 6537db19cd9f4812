"""The worker's main process tells which received request ended (gatekeeper/celery/received.py),
against Celery's own bookkeeping of the requests it holds (``celery.worker.state``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery.worker import state

from gatekeeper.celery import received as received_module
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


def ledger(client: redis.Redis) -> RunLedger:
    return RunLedger(client, Keys(), window_seconds=900, queue_wait_unit_per_second=200)


def test_a_request_that_never_started_is_never_told_for_a_forged_copys_end(
    redis_client: redis.Redis, held: list[Any]
) -> None:
    """A reviewer: the gate's free message moved to reserved by the request check (acked,
    never started, in no set of Celery's) holds the record's nonce; its copy runs on
    reserved; a caller's copy with no headers ends past its hard limit. That end is not the
    gate's run's: told to the moved request, its live run was written killed."""
    redis_client.hset(Keys().run("J", 1), mapping={"nonce": "N", "runs": 1})
    received = Received()
    moved_away, running, forged = Request("J"), Request("J", pid=2), Request("J", pid=3)
    moved_away._already_revoked = True  # type: ignore[attr-defined]  # (the request check's)
    received.add(moved_away, headers(1) | {"gatekeeper_nonce": "N"})
    received.add(running, headers(1) | {"gatekeeper_nonce": "N", "gatekeeper_decision": "x"})
    running.time_start = 1.0
    state.active_requests.add(running)
    held.append(running)
    received.add(forged, {})
    forged.time_start = 2.0  # ran; Celery let go of it
    assert received.ended("J", ledger(redis_client)) == (None, NOWHERE)


def test_a_retry_come_before_the_run_it_retries_was_let_go_is_told_by_its_owed_row(
    redis_client: redis.Redis, held: list[Any]
) -> None:
    """A reviewer: both requests' nonces are their own attempts' records'; the retried run
    has its row (its child wrote it), the retry's run, SIGKILLed, is owed one."""
    redis_client.hset(Keys().run("R", 1), mapping={"nonce": "n1", "runs": 1, "rowed": 1})
    redis_client.hset(Keys().run("R", 2), mapping={"nonce": "n2", "runs": 1})
    received = Received()
    first, retry = Request("R", pid=1), Request("R", pid=1)
    first.time_start = 1.0
    state.active_requests.add(first)
    held.append(first)
    received.add(first, headers(1))
    received.add(retry, headers(2))  # came while the first was still held: both kept
    state.active_requests.discard(first)
    retry.time_start = 2.0  # ran; its child SIGKILLed: Celery let go of it
    assert received.ended("R", ledger(redis_client)) == (headers(2), (1, "w@host"))


def test_a_request_waiting_to_run_outlives_another_requests_end_of_its_id(
    held: list[Any],
) -> None:
    """A reviewer: a gated request waiting on a rate limit or an ETA (in no set of Celery's,
    never started) was forgotten when a caller's copy of its id ended first, so its own end
    in the main process later (its child SIGKILLed) found no headers: no row."""
    received = Received()
    waiting, copy = Request("J", pid=41), Request("J", pid=42)
    received.add(waiting, headers(1))
    received.add(copy, {})
    copy.time_start = 1.0  # the copy ran and ended (its hard time limit, say)
    assert received.ended("J") == ({}, (42, "w@host"))  # not ours to row
    revoked = Request("J")
    revoked._already_revoked = True  # type: ignore[attr-defined]  # Celery's, when it revokes
    received.add(revoked, headers(1) | {"gatekeeper_nonce": "other"})  # (_release's ended())
    other = headers(1) | {"gatekeeper_nonce": "other"}
    assert received.ended("J") == (other, (0, "w@host"))  # the revoked one, alone: not waiting
    waiting.time_start = 2.0  # its turn came; it ran, and its child was SIGKILLed
    assert received.ended("J") == (headers(1), (41, "w@host"))


def test_a_full_cache_forgets_requests_let_go_before_a_live_one(
    held: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Requests that never start and that Celery lets go (a broker reconnect drops them) stay
    # until the cache is full; then they go first: the oldest id, a run still going, keeps
    # its headers for its end (a fourth reviewer: it was forgotten, and its end had no row).
    monkeypatch.setattr(received_module, "RECEIVED_CACHE_SIZE", 5)
    received = Received()
    live = Request("LIVE", pid=31)
    received.add(live, headers(1))
    live.time_start = 1.0
    state.active_requests.add(live)
    held.append(live)
    for n in range(12):
        received.add(Request(f"dropped-{n}"), headers(1))  # never started, held by no set
    assert len(received._by_id) == 5
    state.active_requests.discard(live)  # it ended: Celery lets go, then signals
    assert received.ended("LIVE") == (headers(1), (31, "w@host"))
    # Every id held: the cache stays bounded all the same (the oldest goes).
    received = Received()
    for n in range(8):
        request = Request(f"running-{n}")
        request.time_start = 1.0
        state.active_requests.add(request)
        held.append(request)
        received.add(request, headers(1))
    assert len(received._by_id) == 5
    assert "running-7" in received._by_id and "running-0" not in received._by_id
