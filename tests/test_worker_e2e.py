"""End to end with a real prefork worker that consumes only the free queue."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import ATTEMPTS, Keys
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import gate_settings, queue_messages, running_worker, wait_until

pytestmark = pytest.mark.celery


def rows(client: redis.Redis) -> list[dict[str, Any]]:
    found = []
    for key in sorted(client.scan_iter(match=Keys().window_rows(0).replace(":0:", ":*:"))):
        found += [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    return found


def runs(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(RUNS_KEY, 0, -1)]


def test_admitted_tasks_run_on_free_and_the_others_wait_in_their_queues(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = create_app(gate_settings(redis_url), redis_url)
    embed = app.tasks["tests.embed"]
    with running_worker(redis_url, tmp_path / "worker.log"):
        admitted = [embed.delay(n).id for n in range(3)]
        reserved = embed.apply_async((9,), headers={"gatekeeper_deadline_s": 1.5}).id
        deferred = embed.apply_async((8,), headers={"gatekeeper_expected_service_s": 0}).id
        assert wait_until(lambda: len(runs(redis_client)) >= 3)
    ran = runs(redis_client)
    assert sorted(run["id"] for run in ran) == sorted(admitted)
    assert {run["queue"] for run in ran} == {"free"}
    assert [m["headers"]["id"] for m in queue_messages(redis_client, "reserved")] == [reserved]
    assert [m["headers"]["id"] for m in queue_messages(redis_client, "defer")] == [deferred]


def test_a_started_task_leaves_the_free_queues_waiting_set(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = create_app(gate_settings(redis_url), redis_url)
    embed = app.tasks["tests.embed"]
    waiting = Keys().free_waiting
    job = embed.delay(1).id
    assert redis_client.zscore(waiting, f"{job}:1") is not None  # no worker yet: it waits
    with running_worker(redis_url, tmp_path / "worker.log"):
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        assert wait_until(lambda: redis_client.zcount(waiting, "-inf", ATTEMPTS) == 0)


def test_a_retry_is_scored_again_as_attempt_two_with_the_same_deadline(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = create_app(gate_settings(redis_url), redis_url)
    log = tmp_path / "worker.log"
    with running_worker(redis_url, log):
        job = app.tasks["tests.flaky"].delay().id
        assert wait_until(lambda: len(runs(redis_client)) == 2)
    first, second = runs(redis_client)
    assert (first["id"], second["id"]) == (job, job)
    assert (first["gatekeeper_attempt"], second["gatekeeper_attempt"]) == (1, 2)
    assert second["queue"] == "free" and second["gatekeeper_decision"] == "admit_free"
    assert second["gatekeeper_deadline_at"] == first["gatekeeper_deadline_at"]
    assert second["gatekeeper_first_published_at"] == first["gatekeeper_first_published_at"]
    assert second["gatekeeper_published_at"] > first["gatekeeper_published_at"]
    decisions = [line for line in log.read_text().splitlines() if "event=gate_decision" in line]
    assert len(decisions) == 1  # the retry, published from the worker
    assert f"job_id={job} attempt=2" in decisions[0] and "retries=1" in decisions[0]


def test_a_retry_the_gate_sent_to_free_is_decided_again_once_the_gate_is_off(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Celery sends a retry to the queue its attempt ran from. With the gate turned off after
    # attempt 1 was admitted to free, the retry went to free undecided: unadmitted, unpriced,
    # and its row unverified (an audit). Free is the gate's choice, not the task's route: the
    # retry is decided as if the gate were on, and its run gets a verified row.
    app = create_app(gate_settings(redis_url), redis_url)
    job = app.tasks["tests.flaky"].delay().id  # attempt 1: admitted to free
    flags = FlagStore(redis_client, gate_settings(redis_url))
    flags.set("dwell_gate_enabled", "false", "gate off", "test", time.time())
    log = tmp_path / "worker.log"
    with running_worker(redis_url, log):
        assert wait_until(lambda: len([r for r in rows(redis_client) if r["job_id"] == job]) == 2)
    first, second = sorted((r for r in rows(redis_client) if r["job_id"] == job),
                           key=lambda row: row["attempt"])  # fmt: skip
    assert (first["attempt"], first["outcome"]) == (1, "killed")  # it raised Retry
    assert (second["attempt"], second["path"], second["outcome"]) == (2, "free", "ok")
    assert "verified" not in second, second  # from the gate's own record
    decisions = [line for line in log.read_text().splitlines() if "event=gate_decision" in line]
    (retry,) = decisions  # the retry's own decision, made in the worker
    assert f"job_id={job} attempt=2" in retry and "decision=admit_free" in retry, retry
