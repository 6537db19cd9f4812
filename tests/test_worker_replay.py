"""``celery worker --gatekeeper-replay``: the replayer in a worker's main process."""

from __future__ import annotations

import json
import os
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
