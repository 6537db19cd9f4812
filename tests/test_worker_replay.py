"""``celery worker --gatekeeper-replay``: the replayer in a worker's main process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import REPO_ROOT, gate_settings, queue_messages, wait_until

pytestmark = pytest.mark.celery


def test_a_worker_started_with_the_option_replays_deferred_work(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = create_app(gate_settings(redis_url, max_queue_age_s=0.5), redis_url)
    embed = app.tasks["tests.embed"]
    embed.delay(1)
    time.sleep(0.6)  # the free queue is older than the cap: the next one is deferred
    deferred = embed.delay(2).id
    assert [m["headers"]["id"] for m in queue_messages(redis_client, "defer")] == [deferred]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(GATEKEEPER_TEST_WORKER="1", GATEKEEPER_BROKER_URL=redis_url,
               GATEKEEPER_REDIS_URL=redis_url, GATEKEEPER_DWELL_GATE_ENABLED="true",
               GATEKEEPER_CANARY_PERCENT="100", GATEKEEPER_REPLAY_POLL_S="0.2",
               PYTHONPATH=str(REPO_ROOT))  # fmt: skip
    log = tmp_path / "w.log"
    command = [sys.executable, "-m", "celery", "-A", "tests.apps.gated_app", "worker", "-Q",
               "free,reserved", "-c", "1", "-l", "INFO", "--without-heartbeat",
               "--without-gossip", "--without-mingle", "--gatekeeper-replay"]  # fmt: skip
    with log.open("wb") as out:
        worker = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  cwd=REPO_ROOT)  # fmt: skip
    try:
        ran = lambda: [json.loads(r)["id"] for r in redis_client.lrange(RUNS_KEY, 0, -1)]  # noqa: E731
        assert wait_until(lambda: deferred in ran(), timeout_s=60), log.read_text()
    finally:
        worker.terminate()
        worker.wait(timeout=20)
    text = log.read_text()
    assert "event=replay_started" in text and "where=worker" in text
    assert redis_client.llen("defer") == 0
    assert not redis_client.exists("gatekeeper:{default}:replayer:lock")  # given back at stop


def replay_worker(redis_url: str, log: Path, name: str) -> subprocess.Popen[bytes]:
    """A worker with ``--gatekeeper-replay`` in a process group of its own (a test may kill it
    whole), its replay lock 2 s long."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(GATEKEEPER_TEST_WORKER="1", GATEKEEPER_BROKER_URL=redis_url,
               GATEKEEPER_REDIS_URL=redis_url, GATEKEEPER_DWELL_GATE_ENABLED="true",
               GATEKEEPER_CANARY_PERCENT="100", GATEKEEPER_REPLAY_POLL_S="0.2",
               GATEKEEPER_REPLAY_LOCK_TTL_S="2", PYTHONPATH=str(REPO_ROOT))  # fmt: skip
    command = [sys.executable, "-m", "celery", "-A", "tests.apps.gated_app", "worker", "-Q",
               "free,reserved", "-c", "1", "-l", "INFO", "--without-heartbeat",
               "--without-gossip", "--without-mingle", "-n", f"{name}@%h",
               "--gatekeeper-replay"]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO_ROOT, start_new_session=True)  # fmt: skip


def saying(logs: dict[str, Path], event: str) -> list[str]:
    """The workers whose log has a line of ``event``."""
    return [name for name, log in logs.items() if f"event={event}" in log.read_text()]


def test_two_workers_with_the_option_replay_as_one_and_the_survivor_takes_over(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # README: the lock keeps it to one replayer however many workers have the option.
    app = create_app(gate_settings(redis_url, max_queue_age_s=0.5), redis_url)
    embed = app.tasks["tests.embed"]
    ran = lambda: [json.loads(r)["id"] for r in redis_client.lrange(RUNS_KEY, 0, -1)]  # noqa: E731
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    workers = {name: replay_worker(redis_url, log, name) for name, log in logs.items()}
    try:
        taken = lambda: saying(logs, "replay_lock_taken")  # noqa: E731
        waiting = lambda: saying(logs, "replay_waiting_for_lock")  # noqa: E731
        assert wait_until(lambda: len(taken()) == 1 and len(waiting()) == 1, 60), [
            log.read_text() for log in logs.values()]  # fmt: skip
        (holder,), (other,) = taken(), waiting()
        deferred = []
        for i in range(6):  # each deferred: the free queue is older than the cap
            embed.delay(100 + i)
            time.sleep(0.6)
            deferred.append(embed.delay(i).id)
        assert wait_until(lambda: set(deferred) <= set(ran()), 60), ran()
        time.sleep(1.0)  # a second copy, if any, would run now
        assert sorted(r for r in ran() if r in deferred) == sorted(deferred)  # each once
        assert taken() == [holder]  # the other never took the lock while its holder lived
        os.killpg(workers[holder].pid, signal.SIGKILL)  # the holder dies without a word
        workers[holder].wait(timeout=20)
        assert wait_until(lambda: other in taken(), 30), logs[other].read_text()
        embed.delay(200)
        time.sleep(0.6)
        late = embed.delay(201).id
        assert wait_until(lambda: late in ran(), 60), logs[other].read_text()
        assert ran().count(late) == 1 and redis_client.llen("defer") == 0
    finally:
        for worker in workers.values():
            if worker.poll() is None:
                worker.terminate()
                worker.wait(timeout=20)
