"""Unverified runs (a decision made without the gate's record: no nonce): one unverified row
for each run, however it ends. A run killed with its pool child gets its row from the main
process, a run that died unseen gets it from its redelivered copy's start, and a signal that
fires twice writes one."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import gate_settings, queue_messages, running_worker, unused_port, wait_until

pytestmark = pytest.mark.celery
KEYS = Keys()


def rows(client: redis.Redis) -> list[dict[str, Any]]:
    found = []
    for key in sorted(client.scan_iter(match=KEYS.window_rows(0).replace(":0:", ":*:"))):
        found += [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    return found


def runs(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(RUNS_KEY, 0, -1)]


def wait_rows(client: redis.Redis, count: int, log: Path) -> list[dict[str, Any]]:
    assert wait_until(lambda: len(rows(client)) >= count, 30), log.read_text()
    time.sleep(1.0)  # a duplicate signal, if any, would land now
    return rows(client)


def unverified_publish(redis_url: str, redis_client: redis.Redis, task: str, **kw: Any) -> str:
    """Publish ``task`` with the gate's Redis unreachable: reserved, no record, no nonce."""
    down = f"redis://127.0.0.1:{unused_port()}/0"
    app = create_app(gate_settings(down, redis_timeout_s=0.2), redis_url)
    job = str(app.tasks[task].apply_async(kwargs=kw).id)
    (message,) = queue_messages(redis_client, "reserved")
    assert message["headers"]["gatekeeper_reason"] == "gate_unavailable"
    assert "gatekeeper_nonce" not in message["headers"]
    return job


def shown(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["job_id"], row["attempt"], row["outcome"], row["path"], row["verified"]


def test_a_sigkilled_unverified_run_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    job = unverified_publish(redis_url, redis_client, "tests.sleepy")
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="reserved"):
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        os.kill(runs(redis_client)[0]["pid"], signal.SIGKILL)
        (row,) = wait_rows(redis_client, 1, log)
    assert shown(row) == (job, 1, "killed", "reserved", False)
    assert row["retry_tax"] == 0.0 and 0 <= row["queue_wait_ms"] < 60_000
    assert "reason=WorkerLostError" in log.read_text()
    assert redis_client.hget(KEYS.totals, "unverified:killed") is None  # not a priced total
    assert redis_client.hget(KEYS.stats, "unverified_runs") == b"1"


def test_a_hard_time_limit_on_an_unverified_run_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # On Celery 5.7 the main process sends task_failure twice: still one row, one line.
    job = unverified_publish(redis_url, redis_client, "tests.hard")
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="reserved"):
        (row,) = wait_rows(redis_client, 1, log)
        time.sleep(1.0)
    assert shown(row) == (job, 1, "killed", "reserved", False)
    text = log.read_text()
    assert text.count("event=ledger_row") == 1 and "reason=TimeLimitExceeded" in text, text


def test_an_unverified_run_that_died_unseen_is_rowed_by_its_redelivered_copy(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # acks_late and reject_on_worker_lost: no signal when the child dies; the broker delivers
    # the message again, and that run's start finds the run before it without its row.
    job = unverified_publish(redis_url, redis_client, "tests.lost_late")
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="reserved"):
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        os.kill(runs(redis_client)[0]["pid"], signal.SIGKILL)
        first, second = wait_rows(redis_client, 2, log)
    assert [r["id"] for r in runs(redis_client)] == [job, job]
    assert shown(first) == (job, 1, "killed", "reserved", False)
    assert shown(second) == (job, 1, "ok", "reserved", False)
    assert "reason=worker_lost_redelivered" in log.read_text()
    assert redis_client.hget(KEYS.stats, "unverified_runs") == b"2"
    assert redis_client.ttl(KEYS.unverified(job, 1)) > 0  # kept a while, not for good
