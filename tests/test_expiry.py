"""A free attempt still waiting when its wait allowance runs out is moved to reserved, with an
``expired`` row (SPEC section 2), by the worker's main process, on a real prefork worker."""

from __future__ import annotations

import base64
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from gatekeeper.celery.hook import install
from gatekeeper.core.ledger import Outcome
from gatekeeper.redis.keys import ATTEMPTS
from gatekeeper.redis.runs import RunLedger
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, queue_messages, running_worker
from tests.test_worker_ledger import KEYS, rows, runs, wait_rows, window_totals

pytestmark = pytest.mark.celery


def waited_past_allowance(
    redis_url: str, redis_client: redis.Redis
) -> tuple[Any, str, dict[str, Any]]:
    """The gate, a job admitted to free and its message, waited past a 0.1 s allowance."""
    app = create_app(gate_settings(redis_url, free_wait_allowance_s=0.1), redis_url)
    gate = install(app)
    job = app.tasks["tests.embed"].delay(1).id
    (message,) = queue_messages(redis_client, "free")
    time.sleep(0.2)
    return gate, job, message


def test_a_free_message_past_its_allowance_runs_on_reserved_with_an_expired_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = create_app(gate_settings(redis_url, free_wait_allowance_s=1.0), redis_url)
    job = app.tasks["tests.embed"].delay(1).id
    assert len(queue_messages(redis_client, "free")) == 1
    time.sleep(1.3)  # no free worker yet: it waits past its allowance
    with running_worker(redis_url, tmp_path / "w.log", queues="free,reserved",
                        GATEKEEPER_FREE_WAIT_ALLOWANCE_S="1"):  # fmt: skip
        found = wait_rows(redis_client, 2)
    by_outcome = {row["outcome"]: row for row in found}
    assert sorted(by_outcome) == ["expired", "ok"] and len(found) == 2
    expired, ran = by_outcome["expired"], by_outcome["ok"]
    assert (expired["job_id"], expired["path"], expired["tokens_in"]) == (job, "free", 0)
    assert expired["retry_tax"] == pytest.approx(200.0)  # the allowance's wait, 1 s x 200
    assert expired["queue_wait_ms"] >= 1300
    assert (ran["job_id"], ran["path"], ran["attempt"]) == (job, "reserved", 1)
    assert [(r["id"], r["queue"]) for r in runs(redis_client)] == [(job, "reserved")]  # once
    assert window_totals(redis_client, "tax_units") == pytest.approx(200.0)
    assert window_totals(redis_client, "exposure") == 0
    assert (
        redis_client.hlen(KEYS.inflight) == 0
        and redis_client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 0
    )
    assert b"event=free_wait_expired" in (tmp_path / "w.log").read_bytes()


def test_a_message_with_expires_that_waits_past_its_allowance_in_the_worker_is_moved(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A reviewer: Celery asks ``revoked()`` at a message's receipt when it has an
    ``expires``; the check, asked once, was spent there (within the allowance), and the
    message then waited on its task's rate limit past the allowance and ran late on free."""
    app = create_app(gate_settings(redis_url, free_wait_allowance_s=1.0), redis_url)
    with running_worker(redis_url, tmp_path / "w.log", queues="free,reserved",
                        GATEKEEPER_FREE_WAIT_ALLOWANCE_S="1"):  # fmt: skip
        first, second = (app.tasks["tests.limited"].apply_async(expires=3600).id for _ in "12")
        found = wait_rows(redis_client, 3, timeout_s=40)
    shown = sorted((r["job_id"] == second, r["path"], r["outcome"]) for r in found)
    assert shown == [(False, "free", "ok"), (True, "free", "expired"), (True, "reserved", "ok")]
    assert [(r["id"], r["queue"]) for r in runs(redis_client)] == [
        (first, "free"), (second, "reserved"),
    ]  # fmt: skip


def test_a_free_message_within_its_allowance_runs_on_free(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = create_app(gate_settings(redis_url, free_wait_allowance_s=30.0), redis_url)
    job = app.tasks["tests.embed"].delay(1).id
    with running_worker(redis_url, tmp_path / "w.log", queues="free,reserved",
                        GATEKEEPER_FREE_WAIT_ALLOWANCE_S="30"):  # fmt: skip
        (row,) = wait_rows(redis_client, 1)
    assert (row["job_id"], row["path"], row["outcome"]) == (job, "free", "ok")
    assert [r["queue"] for r in runs(redis_client)] == ["free"]


def test_a_forged_old_admission_is_not_moved_and_runs_as_an_ordinary_task(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A caller's message that claims an old free admission with a nonce of its own: no
    record knows it, so it is not moved and runs where it was sent, with an unverified row
    (unpriced), as a run whose record a failover lost gets."""
    app = create_app(gate_settings(redis_url, dwell_gate_enabled=False), redis_url)
    forged = {"gatekeeper_decision": "admit_free", "gatekeeper_nonce": uuid.uuid4().hex,
              "gatekeeper_attempt": 1, "gatekeeper_window": 1,
              "gatekeeper_published_at": time.time() - 3600}  # fmt: skip
    job = app.tasks["tests.embed"].apply_async((1,), queue="free", headers=forged).id
    with running_worker(redis_url, tmp_path / "w.log", queues="free,reserved",
                        GATEKEEPER_FREE_WAIT_ALLOWANCE_S="1"):  # fmt: skip
        from tests.conftest import wait_until

        assert wait_until(lambda: len(runs(redis_client)) == 1)
        assert wait_until(lambda: len(rows(redis_client)) == 1)
    assert [(r["id"], r["queue"]) for r in runs(redis_client)] == [(job, "free")]
    found = [(r["job_id"], r["outcome"], r["verified"], r["retry_tax"]) for r in rows(redis_client)]
    assert found == [(job, "ok", False, 0.0)]


def test_expire_sent_twice_writes_one_row_and_says_again(
    redis_url: str, redis_client: redis.Redis
) -> None:
    gate, job, message = waited_past_allowance(redis_url, redis_client)
    headers = message["headers"]
    now = time.time()
    window = headers["gatekeeper_window"]
    first = gate.expiry.expire(job, 1, window, dict(headers), now)
    again = gate.expiry.expire(job, 1, window, dict(headers), now + 0.1)
    assert (first, again) == ("expired", "again")
    assert [r["outcome"] for r in rows(redis_client)] == ["expired"]
    assert window_totals(redis_client, "tax_units") == pytest.approx(0.1 * 200)


def test_an_expiry_in_a_window_gone_past_its_retention_gives_it_no_exposure_back(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # The expired row makes the window again, under the row's TTL; the exposure it held went
    # with it (expire.lua gave it back after the row: a negative exposure).
    gate, job, message = waited_past_allowance(redis_url, redis_client)
    headers = message["headers"]
    window = headers["gatekeeper_window"]
    redis_client.delete(KEYS.window(window))
    assert gate.expiry.expire(job, 1, window, dict(headers), time.time()) == "expired"
    again = redis_client.hgetall(KEYS.window(window))
    assert again[b"rows:expired"] == b"1" and b"exposure" not in again
    assert redis_client.ttl(KEYS.window(window)) > 0
    assert not redis_client.hexists(KEYS.inflight, f"{job}:1")


def _expired_copy_ran(redis_url: str, redis_client: redis.Redis) -> tuple[Any, str, dict[str, Any]]:
    """An admission expired (its copy on reserved is then run by the test)."""
    gate, job, message = waited_past_allowance(redis_url, redis_client)
    headers = message["headers"]
    assert gate.expiry.expire(job, 1, headers["gatekeeper_window"], dict(headers),
                               time.time()) == "expired"  # fmt: skip
    return gate, job, headers


def test_a_spare_copy_of_a_moved_message_is_not_run_again(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The original free message comes back (its ack lost after the republish) once the
    copy on reserved has run: it is acked and skipped, not republished a second time."""
    gate, job, headers = _expired_copy_ran(redis_url, redis_client)
    ledger = RunLedger.from_settings(redis_client, gate.settings)
    now_ms = round(time.time() * 1000)
    started = ledger.start(job, 1, headers["gatekeeper_nonce"], {"task": "tests.embed"}, now_ms)
    assert started.record is not None and started.record.path == "reserved"
    ledger.finish(ledger.row_for(job, 1, started.record, Outcome.OK, now_ms), started.run,
                  started.record, now_ms)  # fmt: skip
    request = SimpleNamespace(id=job, name="tests.embed",
                              message=SimpleNamespace(headers=dict(headers)))  # fmt: skip
    assert gate.expiry.check(request) == "skip"
    assert redis_client.llen("reserved") == 0  # nothing republished


def test_a_failed_republish_is_given_back_to_the_broker_not_run_on_free(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, job, message = waited_past_allowance(redis_url, redis_client)

    def broken(*_: object, **__: object) -> None:
        raise ConnectionError("broker blip")

    monkeypatch.setattr(gate.expiry, "_republish", broken)
    kombu_message = SimpleNamespace(
        headers=dict(message["headers"]), body=base64.b64decode(message["body"]),
        content_type=message["content-type"], content_encoding=message["content-encoding"],
        properties=message["properties"],
    )  # fmt: skip
    request = SimpleNamespace(id=job, name="tests.embed", message=kombu_message)
    assert gate.expiry.check(request) == "requeue"  # the record says reserved: not here
    monkeypatch.undo()
    assert gate.expiry.check(request) == "skip"  # asked again: republished this time
    assert redis_client.llen("reserved") == 1
    assert [r["outcome"] for r in rows(redis_client)] == ["expired"]  # one row
