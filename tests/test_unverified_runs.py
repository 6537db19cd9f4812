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

import celery
import pytest
import redis

from gatekeeper.celery.message import unverified
from gatekeeper.celery.running import Running
from gatekeeper.celery.worker import WorkerSide
from gatekeeper.core.ledger import Outcome
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.sweep import sweep
from gatekeeper.redis.unverified import UnverifiedRuns
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


def test_a_revoke_that_terminates_an_unverified_run_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    job = unverified_publish(redis_url, redis_client, "tests.sleepy")
    app = create_app(gate_settings(redis_url), redis_url)
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="reserved"):
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        app.control.revoke(job, terminate=True, signal="SIGKILL")
        (row,) = wait_rows(redis_client, 1, log)
    assert shown(row) == (job, 1, "killed", "reserved", False)
    assert "reason=revoked" in log.read_text()


def test_an_unverified_run_whose_whole_worker_vanished_is_swept(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # No signal at all (the main process dies too): the sweep rows it from what its start
    # kept of the message, once its worker's heartbeat is gone.
    job = unverified_publish(redis_url, redis_client, "tests.sleepy")
    settings = gate_settings(redis_url)
    ledger = RunLedger.from_settings(redis_client, settings)
    with running_worker(redis_url, tmp_path / "w.log", queues="reserved", session=True,
                        GATEKEEPER_WORKER_HEARTBEAT_S="1") as worker:  # fmt: skip
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        assert sweep(ledger, round(time.time() * 1000), 0) == []  # merely long: alive
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    assert rows(redis_client) == []
    assert wait_until(lambda: not list(redis_client.scan_iter(match=KEYS.worker("*"))), 10)
    (swept,) = sweep(ledger, round(time.time() * 1000), 0)
    (row,) = rows(redis_client)
    assert (swept.job_id, swept.outcome.value) == (job, "killed")
    assert shown(row) == (job, 1, "killed", "reserved", False)
    assert row["tokens_in"] == 1200 and row["retry_tax"] == 0.0
    assert sweep(ledger, round(time.time() * 1000), 0) == []  # once
    assert redis_client.zcard(KEYS.unverified_started) == 0


def worker_side(redis_url: str, redis_client: redis.Redis) -> tuple[WorkerSide, Any]:
    settings = gate_settings(redis_url)
    app = create_app(settings, redis_url)
    side = WorkerSide(app, settings, redis_client, FlagStore(redis_client, settings))
    return side, app.tasks["tests.sleepy"]


def test_a_dead_runs_row_that_fails_costs_the_running_run_nothing(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    side, task = worker_side(redis_url, redis_client)
    written: list[int] = []
    real = UnverifiedRuns.write

    def flaky(self: UnverifiedRuns, row: Any, run: int, now_ms: int) -> bool:
        written.append(run)
        if run == 1:  # the dead run's row: Redis fails it
            raise LedgerUnavailable("cannot write an unverified row: connection reset")
        return real(self, row, run, now_ms)

    monkeypatch.setattr(UnverifiedRuns, "write", flaky)
    task.push_request(id="J", gatekeeper_decision="reserved", gatekeeper_attempt=1, retries=0,
                      delivery_info={"redelivered": True})  # fmt: skip
    try:
        side.on_prerun(sender=task, task_id="J")  # run 1 died unseen: it starts run 2
        side.on_prerun(sender=task, task_id="J")
        side.on_success(sender=task)
    finally:
        task.pop_request()
    assert written[-2:] == [1, 2]
    assert [(r["attempt"], r["outcome"]) for r in rows(redis_client)] == [(1, "ok")]


def test_a_row_kept_past_its_hash_expiry_leaves_nothing_for_good(
    redis_url: str, redis_client: redis.Redis
) -> None:
    side, task = worker_side(redis_url, redis_client)
    record = unverified(task, {"gatekeeper_decision": "reserved"}, 1000)
    side.unverified.end("J", Running(1, 1, record, False), Outcome.OK, "ok")
    side.unverified.end("J", Running(1, 1, record, False), Outcome.KILLED, "twice")
    assert [r["outcome"] for r in rows(redis_client)] == ["ok"]
    assert redis_client.ttl(KEYS.unverified("J", 1)) > 0


def test_a_start_sent_again_with_its_token_counts_one_run(
    redis_url: str, redis_client: redis.Redis
) -> None:
    store = UnverifiedRuns(RunLedger.from_settings(redis_client, gate_settings(redis_url)))
    keys = [KEYS.unverified("J", 1), KEYS.stats, KEYS.unverified_started]
    first = store._script(keys=keys, args=["start", "J:1", "1000", "100", "t1"])
    again = store._script(keys=keys, args=["start", "J:1", "2000", "100", "t1"])
    second = store._script(keys=keys, args=["start", "J:1", "3000", "100", "t2"])
    assert first == again == [1, 0, b"0"]
    assert second == [2, 1, b"1000"]  # run 1 never got its row: dead, with its start
    assert redis_client.hget(KEYS.stats, "unverified_runs") == b"2"


def test_an_unverified_child_killed_under_retry_on_worker_lost_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Celery 5.7 retries it from the main process, with task_retry, not task_failure.
    job = unverified_publish(redis_url, redis_client, "tests.lost_retry")
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="free,reserved"):
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        os.kill(runs(redis_client)[0]["pid"], signal.SIGKILL)
        retried = hasattr(celery.Task, "retry_on_worker_lost")
        assert wait_until(lambda: len(runs(redis_client)) == 1 + retried, 30), log.read_text()
        killed = wait_rows(redis_client, 1, log)[0]
    assert shown(killed) == (job, 1, "killed", "reserved", False), log.read_text()
    assert [r["attempt"] for r in rows(redis_client) if r["outcome"] == "killed"] == [1]
