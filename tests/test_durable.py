"""A rollback outlives a restart of the gate's Redis that loses only its latest writes
(SPEC: state loss must not silently undo a rollback): a snapshotting server (RDB, Redis's
default) came back with the marker of its last snapshot and the flags as they were then."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.ops.cli import main
from gatekeeper.ops.embedded import EmbeddedRedis, find_redis_server
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from tests.conftest import REPO_ROOT, gate_settings, unused_port, wait_until
from tests.test_state_loss import cli

KEYS = Keys()


@pytest.fixture()
def snapshotting() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(args=("--save", "900", "1")) as server:  # RDB: a snapshot every 15 min
        yield server


def the_flag(url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    (line,) = [
        line
        for line in cli(url, monkeypatch, "status").splitlines()
        if line.startswith("flag free_path_enabled=")
    ]
    return line


def test_a_rollback_outlives_a_restart_that_loses_the_writes_since_the_last_snapshot(
    snapshotting: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = snapshotting.url
    assert "on_disk=rdb" in cli(url, monkeypatch, "init", "--open")
    redis.Redis.from_url(url).save()  # the server's own snapshot, as a save point takes it
    rollback = ["flags", "set", "free_path_enabled", "false", "--reason", "page 4411"]
    assert "on_disk=rdb" in cli(url, monkeypatch, *rollback)
    snapshotting.kill()  # SIGKILL: no snapshot at shutdown
    snapshotting.start(port=snapshotting.port)
    assert "state=initialised" in cli(url, monkeypatch, "status")
    assert the_flag(url, monkeypatch).startswith("flag free_path_enabled=false (redis) changed ")


def test_an_aof_server_says_how_its_write_reached_the_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    with EmbeddedRedis(args=("--appendonly", "yes")) as server:
        out = cli(server.url, monkeypatch, "init", "--open")
        # WAITAOF from Redis 7.2 on; before it, appendfsync everysec
        assert "on_disk=aof\n" in out or "on_disk=aof_everysec " in out, out


def test_a_server_with_no_disk_or_one_that_will_not_say_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with EmbeddedRedis() as bare:  # --save '' --appendonly no
        out = cli(bare.url, monkeypatch, "init", "--open")
        assert "on_disk=none: " in out and "nothing then goes to free until gatekeeper init" in out
        bare.kill()
        bare.start(port=bare.port)  # no snapshot was taken for it: the marker is gone
        assert "state=MISSING" in cli(bare.url, monkeypatch, "status")
    with EmbeddedRedis(args=("--rename-command", "CONFIG", "")) as managed:  # as some clouds do
        out = cli(managed.url, monkeypatch, "init", "--open")
        assert "on_disk=unknown (" not in out and "on_disk=unknown: " in out, out
        assert "GATEKEEPER_FREE_PATH_ENABLED=false" in out


def test_a_snapshot_for_a_flag_write_begins_after_the_fork_running_then(
    snapshotting: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork already running neither makes the command say ``rdb`` for a snapshot that was
    never begun (an AOF rewrite: ``BGSAVE SCHEDULE`` only schedules one), nor leaves the
    auto-freeze's write off the disk (a slow snapshot begun before the write holds none of
    it): the command waits and begins its own, the freeze has one begun once it ends."""
    url = snapshotting.url
    server = redis.Redis.from_url(url)
    cli(url, monkeypatch, "init", "--open")
    server.mset({f"filler:{n}": "x" * 100 for n in range(20)})
    server.config_set("rdb-key-save-delay", 50_000)  # 50 ms a key: about a second a fork
    server.execute_command("BGREWRITEAOF")  # a fork that is no snapshot (BGSAVE SCHEDULE waits)
    rollback = ["flags", "set", "free_path_enabled", "false", "--reason", "page 4411"]
    assert "on_disk=rdb" in cli(url, monkeypatch, *rollback)
    assert int(server.info("persistence")["rdb_changes_since_last_save"]) == 0
    server.execute_command("BGSAVE")  # another slow one, begun before the freeze's write
    store = FlagStore(server, gate_settings(url))  # a worker's: it does not wait
    store.set("canary_percent", "7", "the auto-freeze's kind of write", "test", time.time())
    assert store.persisted == "rdb_pending"
    server.config_set("rdb-key-save-delay", 0)
    assert wait_until(lambda: int(server.info("persistence")["rdb_changes_since_last_save"]) == 0)
    snapshotting.kill()
    snapshotting.start(port=snapshotting.port)
    assert "flag canary_percent=7.0 (redis)" in cli(url, monkeypatch, "status")


CHILD = """
import os, sys, time
import redis
from celery import Celery
from celery.signals import worker_process_shutdown
import gatekeeper
from gatekeeper.redis.flags import FlagStore
from gatekeeper.settings import GatekeeperSettings

url = sys.argv[1]
gatekeeper.install(Celery("child", broker=url))  # connects the worker's shutdown handlers
server = redis.Redis.from_url(url)
store = FlagStore(server, GatekeeperSettings(redis_url=url))  # a worker's: it does not wait
store.set("free_path_enabled", "false", "the auto-freeze", "worker", time.time())
print(store.persisted, flush=True)
if sys.argv[2] == "signal":
    worker_process_shutdown.send(sender=None, pid=os.getpid(), exitcode=0)
os._exit(0)  # as a prefork pool child ends: its threads with it
"""


@pytest.mark.parametrize("ends", ["signal", "bare"])
def test_an_auto_freeze_made_while_a_snapshot_ran_is_on_disk_when_its_pool_child_ends(
    snapshotting: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    # A worker's write while another snapshot is being written begins its own once that ends,
    # from a thread (rdb_pending): a pool child that ended first (os._exit) ended the thread,
    # and a restart then undid the freeze. worker_process_shutdown now waits for it.
    url = snapshotting.url
    server = redis.Redis.from_url(url)
    cli(url, monkeypatch, "init", "--open")
    # 50 ms a key: about five seconds a snapshot, so that it still runs when the child, a new
    # Python process, has imported Celery and writes (a second was too short on a loaded CI
    # machine: the write's own snapshot then began, rdb_started).
    server.mset({f"filler:{n}": "x" * 100 for n in range(100)})
    server.config_set("rdb-key-save-delay", 50_000)
    server.execute_command("BGSAVE")  # begun before the freeze's write: holds none of it
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.run([sys.executable, "-c", CHILD, url, ends], capture_output=True,
                           text=True, timeout=60, env=env)  # fmt: skip
    assert child.returncode == 0 and child.stdout.strip() == "rdb_pending", child.stderr
    server.config_set("rdb-key-save-delay", 0)
    assert wait_until(lambda: not int(server.info("persistence")["rdb_bgsave_in_progress"]))
    snapshotting.kill()  # SIGKILL: no snapshot at shutdown
    snapshotting.start(port=snapshotting.port)
    flag = the_flag(url, monkeypatch)
    if ends == "signal":
        assert flag.startswith("flag free_path_enabled=false (redis)"), flag
    else:  # without the signal (a SIGKILLed child) nothing could: the write was lost
        assert flag.startswith("flag free_path_enabled=true"), flag


def test_a_rollback_a_replica_has_not_acknowledged_is_said_and_exits_1(
    gate_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reviewer: with the replica stalled, ``flags set free_path_enabled false`` exited 0
    after WAIT's 0.5 s, silent; a failover to that replica then undid the rollback. It now
    waits as long as for the disk, says ``replicated=0/1`` and what a failover would do, and
    exits 1 (the rollback stands on the primary); with the replica back, ``replicated=1/1``.
    (Under the CLI's 5 s socket timeout: a longer WAIT was cut off, and said nothing.)"""
    replica = subprocess.Popen(
        [find_redis_server(), "--port", str(unused_port()), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--replicaof", "127.0.0.1", str(gate_server.port)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    primary = redis.Redis.from_url(gate_server.url)
    try:
        assert wait_until(lambda: primary.info("replication")["connected_slaves"] == 1)
        assert wait_until(lambda: primary.execute_command("WAIT", 1, 100) == 1)  # in sync
        os.kill(replica.pid, signal.SIGSTOP)  # stalled: connected, acknowledging nothing
        monkeypatch.setenv("GATEKEEPER_REDIS_URL", gate_server.url)
        rollback = ["flags", "set", "free_path_enabled", "false", "--reason", "page 7"]
        stalled = CliRunner().invoke(main, rollback)
        assert stalled.exit_code == 1, stalled.output
        said = "replicated=0/1: in force on the primary, but not every replica had it within 4 s"
        assert said in stalled.output, stalled.output
        assert "GATEKEEPER_FREE_PATH_ENABLED=false" in stalled.output
        assert primary.hget(KEYS.flags, "free_path_enabled") == b"false"
        os.kill(replica.pid, signal.SIGCONT)
        again = CliRunner().invoke(main, ["flags", "set", "canary_percent", "50"])
        assert again.exit_code == 0 and "replicated=1/1" in again.output, again.output
    finally:
        os.kill(replica.pid, signal.SIGCONT)
        replica.kill()
        replica.wait()
