"""State loss fails closed (SPEC section 4): a gate's Redis that lost its data sends nothing
to free until an operator runs ``gatekeeper init``, and serves normally after it.

Real processes: one publisher running across the loss, one started after it; the broker on
the suite's Redis, the gate on a Redis of its own that is flushed or restarted without
persistence.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.ops.cli import main
from gatekeeper.ops.embedded import EmbeddedRedis, find_redis_server
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, queue_messages, unused_port, wait_until

pytestmark = pytest.mark.celery
REPO = Path(__file__).resolve().parent.parent


def decided(client: redis.Redis, queue: str) -> list[tuple[str, float, str]]:
    """(tag, decision time, reason) of every message in a queue."""
    found = []
    for message in queue_messages(client, queue):
        args = json.loads(base64.b64decode(message["body"]))[0]
        headers: dict[str, Any] = message["headers"]
        found.append((str(args[0]).split("-")[0], float(headers["gatekeeper_published_at"]),
                      str(headers.get("gatekeeper_reason"))))  # fmt: skip
    return found


class Publishers:
    """Publisher processes (tests/apps/publisher.py), stopped together."""

    def __init__(self, broker: str, gate: str, folder: Path) -> None:
        self.broker, self.gate, self.stop = broker, gate, folder / "stop"
        self.children: list[subprocess.Popen[str]] = []

    def start(self, tag: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.apps.publisher", self.broker, self.gate, tag,
             str(self.stop)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, cwd=REPO,
        )  # fmt: skip
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        self.children.append(child)

    def close(self) -> None:
        self.stop.touch()
        for child in self.children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


@pytest.fixture()
def gate_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


def cli(url: str, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", url)
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("loss", ["flushdb", "restart"])
def test_nothing_goes_to_free_after_a_state_loss_until_init(
    redis_url: str,
    redis_client: redis.Redis,
    gate_server: EmbeddedRedis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    loss: str,
) -> None:
    gate = redis.Redis.from_url(gate_server.url)
    assert "initialised" in cli(gate_server.url, monkeypatch, "init", "--open")  # a new one
    publishers = Publishers(redis_url, gate_server.url, tmp_path)
    try:
        publishers.start("across")
        assert wait_until(lambda: len(decided(redis_client, "free")) >= 5)
        if loss == "flushdb":
            gate.flushdb()
        else:
            gate_server.kill()
            gate_server.start(port=gate_server.port)  # --save '' --appendonly no: empty
        # From here on every publish is decided against the lost state (one that read its
        # clock before the FLUSHDB reached the server may have been decided before it).
        lost_at = time.time()
        publishers.start("after")
        time.sleep(3.0)  # both publish against the lost state (flag caches expire meanwhile)
        after_loss = [m for m in decided(redis_client, "free") if m[1] > lost_at]
        assert after_loss == []
        reserved = [m for m in decided(redis_client, "reserved") if m[1] > lost_at]
        assert {tag for tag, _, why in reserved if why == "state_missing"} == {"across", "after"}
        assert "state=MISSING" in cli(gate_server.url, monkeypatch, "status")
        # Acknowledged: not a re-open, the free path stays closed (free_path_disabled now).
        assert "free_path_enabled=false" in cli(gate_server.url, monkeypatch, "init")
        time.sleep(1.5)  # both publishers' flag caches
        closed_at = time.time()
        time.sleep(1.0)
        assert [m for m in decided(redis_client, "free") if m[1] > lost_at] == []
        closed = [m for m in decided(redis_client, "reserved") if m[1] > closed_at]
        assert closed and {why for _, _, why in closed} == {"free_path_disabled"}
        # The operator re-opens (no clean hour since the init, so by force): normal service,
        # both publishers admit to free again once their flags are re-read.
        reopened = time.time()
        cli(gate_server.url, monkeypatch, "flags", "set", "free_path_enabled", "true", "--force")
        assert wait_until(lambda: {tag for tag, at, _ in decided(redis_client, "free")
                                   if at > reopened} == {"across", "after"})  # fmt: skip
    finally:
        publishers.close()
    assert "state=initialised" in cli(gate_server.url, monkeypatch, "status")


def test_init_is_not_a_re_open(redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
                               redis_url: str) -> None:  # fmt: skip
    redis_client.flushdb()
    redis_client.hset(Keys().flags, "free_path_enabled", "false")  # a freeze before the loss
    redis_client.flushdb()  # the loss: the freeze goes with it
    cli(redis_url, monkeypatch, "init", "--reason", "page 88: state lost")
    flags = FlagStore(redis_client, gate_settings(redis_url), Keys())
    assert flags.current().free_path_enabled is False  # the lost freeze cannot be undone
    # No killed rows anywhere, but the hour before now was not recorded after the init.
    result = CliRunner().invoke(main, ["flags", "set", "free_path_enabled", "true"])
    assert result.exit_code != 0 and "initialised at" in result.output
    assert "nothing changed" in cli(redis_url, monkeypatch, "init")
    assert flags.current().free_path_enabled is False


def test_a_namespace_never_initialised_sends_nothing_to_free(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    redis_client.flushdb()
    app = create_app(gate_settings(redis_url), redis_url)
    app.tasks["tests.embed"].delay(1)
    (message,) = queue_messages(redis_client, "reserved")
    assert message["headers"]["gatekeeper_reason"] == "state_missing"
    assert "reason=state_missing" in capsys.readouterr().err


def waits(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def test_flag_writes_wait_for_a_replica(gate_server: EmbeddedRedis) -> None:
    primary = redis.Redis.from_url(gate_server.url)
    flags = FlagStore(primary, gate_settings(gate_server.url), Keys())
    flags.initialise("new", "test", time.time())
    assert waits(primary) == 0  # no replica: nothing to wait for
    port = unused_port()
    replica_server = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--replicaof", "127.0.0.1", str(gate_server.port)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        replica = redis.Redis(port=port)
        assert wait_until(
            lambda: (
                primary.info("replication")["connected_slaves"] == 1
                and replica.info("replication").get("master_link_status") == "up"
            )
        )
        flags.set("free_path_enabled", "false", "rollback", "oncall", time.time())
        assert waits(primary) == 1
        # WAIT returned: the replica has the rollback (a failover to it keeps it).
        assert replica.hget(Keys().flags, "free_path_enabled") == b"false"
        assert replica.hget(Keys().flags, "initialised_at") is not None
    finally:
        replica_server.kill()
        replica_server.wait()


def test_the_free_path_stays_closed_while_the_gate_redis_may_evict(
    redis_url: str, redis_client: redis.Redis, gate_server: EmbeddedRedis,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    gate = redis.Redis.from_url(gate_server.url)
    cli(gate_server.url, monkeypatch, "init", "--open")
    gate.config_set("maxmemory-policy", "allkeys-lru")
    app = create_app(gate_settings(gate_server.url), redis_url)
    app.tasks["tests.embed"].delay(1)
    (message,) = queue_messages(redis_client, "reserved")
    assert message["headers"]["gatekeeper_reason"] == "eviction_policy"
    assert "maxmemory_policy=allkeys-lru" in capsys.readouterr().err
    assert "maxmemory-policy=allkeys-lru" in cli(gate_server.url, monkeypatch, "status")
    gate.config_set("maxmemory-policy", "noeviction")
    time.sleep(0.3)  # the publisher's flag cache
    app.tasks["tests.embed"].delay(2)
    assert [m["headers"]["gatekeeper_reason"] for m in queue_messages(redis_client, "free")] == [
        "fits"
    ]
