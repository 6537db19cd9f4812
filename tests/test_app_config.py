"""Gatekeeper configured from the Celery app: ``app.conf.gatekeeper_*`` (Django's
``CELERY_GATEKEEPER_*``), read when first needed; an eager app never needs Redis; the
``celery -A proj gatekeeper`` command."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from celery import Celery

import gatekeeper
from gatekeeper.redis.keys import Keys
from tests.apps.conf_app import create_app
from tests.conftest import REPO_ROOT, queue_messages, wait_until

pytestmark = pytest.mark.celery
KEYS = Keys()


def env_for(redis_url: str) -> dict[str, str]:
    """A process with no GATEKEEPER_* variable: everything comes from the app's config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(CONF_APP_REDIS_URL=redis_url, PYTHONPATH=str(REPO_ROOT))
    return env


def run(redis_url: str, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], env=env_for(redis_url),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip


@contextmanager
def conf_worker(redis_url: str, log: Path) -> Iterator[None]:
    name = f"conf-{time.monotonic_ns()}@%h"
    command = [sys.executable, "-m", "celery", "-A", "tests.apps.conf_app", "worker", "-Q",
               "free", "-P", "prefork", "-c", "1", "-l", "INFO", "--without-heartbeat",
               "--without-gossip", "--without-mingle", "-n", name]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env=env_for(redis_url), cwd=REPO_ROOT)  # fmt: skip
    try:
        assert wait_until(lambda: b"ready." in log.read_bytes(), timeout_s=60), log.read_text()
        yield
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_an_app_configured_django_style_gates_defers_replays_and_writes_its_ledger(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = create_app(redis_url)  # installed before its config was loaded, like Django's
    embed = app.tasks["conf.embed"]
    first = embed.delay(1).id
    assert [m["headers"]["gatekeeper_reason"] for m in queue_messages(redis_client, "free")] == [
        "fits"
    ]
    time.sleep(0.6)  # older than the app's age cap (CELERY_GATEKEEPER_MAX_QUEUE_AGE_S)
    second = embed.delay(2).id
    (deferred,) = queue_messages(redis_client, "defer")
    assert deferred["headers"]["gatekeeper_reason"] == "queue_age_cap"
    with conf_worker(redis_url, tmp_path / "w.log"):
        assert wait_until(lambda: redis_client.hget(KEYS.run(first, 1), "rowed") == b"1")
        replayed = run(redis_url, "gatekeeper", "-A", "tests.apps.conf_app:app", "replay",
                       "--once")  # fmt: skip
        assert replayed.returncode == 0, replayed.stderr
        assert "to_free=1" in replayed.stdout
        assert wait_until(lambda: redis_client.hget(KEYS.run(second, 1), "rowed") == b"1")
    pattern = KEYS.window_rows(0).replace(":0:", ":*:")
    rows = [raw for key in redis_client.scan_iter(match=pattern)
            for raw in redis_client.lrange(key, 0, -1)]  # fmt: skip
    assert len(rows) == 2  # both ran on free, one row each


def test_the_celery_command_reads_the_apps_config(
    redis_url: str, redis_client: redis.Redis
) -> None:
    status = run(redis_url, "celery", "-A", "tests.apps.conf_app", "gatekeeper", "status")
    assert status.returncode == 0, status.stderr
    assert "flag dwell_gate_enabled=true (settings)" in status.stdout  # the app's own setting
    assert "state=initialised" in status.stdout


def test_config_loaded_after_install_is_the_one_used(redis_url: str) -> None:
    app = Celery("late", broker="memory://")
    gate = gatekeeper.install(app)
    app.conf.gatekeeper_redis_url = redis_url
    app.conf.gatekeeper_canary_percent = 37
    assert gate.settings.canary_percent == 37 and gate.settings.redis_url == redis_url


def test_an_eager_app_with_no_redis_imports_and_runs_its_gated_tasks() -> None:
    app = Celery("eager")  # no broker, no GATEKEEPER_* variable, no gatekeeper_* key
    app.conf.task_always_eager = True
    gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=1, tokens_in=5, deadline_s=60)
    @app.task(name="eager.embed", shared=False)
    def embed(x: int) -> int:
        return x * 2

    assert embed.delay(21).get(timeout=5) == 42


def test_with_no_gate_redis_a_gated_publish_fails_closed_and_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    app = Celery("nowhere", broker="memory://")
    app.conf.gatekeeper_dwell_gate_enabled = True
    app.conf.gatekeeper_canary_percent = 100
    gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=1, tokens_in=5, deadline_s=60)
    @app.task(name="nowhere.embed", shared=False)
    def embed(x: int) -> int:
        return x

    embed.delay(1)  # published, not raised
    with app.connection_for_read() as connection:
        message = connection.SimpleQueue("reserved").get(timeout=2)
        assert message.headers["gatekeeper_reason"] == "gate_unavailable"
        message.ack()
    err = capsys.readouterr().err
    assert "reason=gate_unavailable" in err
    # memory:// is no broker gatekeeper can read: deferred work would have nothing able to
    # read it, so gating is refused, and the line says why and what is expected.
    refused = next(line for line in err.splitlines() if "event=broker_unsupported" in line)
    assert "broker=memory" in refused and "RabbitMQ (amqp://" in refused
