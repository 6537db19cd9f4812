"""The replayer runs the sweep (README: "It also runs the sweep every minute"): a deployment
with no ``gatekeeper sweep`` cron still gets its ``killed`` row, and its exposure back, for a
run whose whole worker was SIGKILLed, once that worker's heartbeat is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.celery.replay import SWEEP_EVERY_S, Replayer
from gatekeeper.ops.cli import main
from gatekeeper.redis.kept import unpack
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger, RunRecord
from gatekeeper.redis.scripts import text_of
from gatekeeper.redis.sweep import _alive
from tests.conftest import gate_settings, running_worker, wait_until
from tests.test_worker_ledger import app_for, rows, runs, the_killed_row

pytestmark = pytest.mark.celery
KEYS = Keys()
STALE_S = 1.0
"""``stale_attempt_s`` for these tests: a run older than this, its worker gone, is killed."""


@contextmanager
def a_long_run(
    redis_url: str, client: redis.Redis, log: Path, hostname: str | None = None, started: int = 1
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A real worker, in a process group of its own with a heartbeat each second (a key of
    3 s), running a gated ``tests.sleepy`` of 30 s: the worker and its hostname (``started``:
    how many runs are started in all once this one is)."""
    with running_worker(redis_url, log, hostname=hostname, session=True,
                        GATEKEEPER_WORKER_HEARTBEAT_S="1") as worker:  # fmt: skip
        job = app_for(redis_url).tasks["tests.sleepy"].delay().id
        assert wait_until(lambda: len(runs(client)) == started)
        assert wait_until(lambda: client.zcard(KEYS.started) == started)
        record = {text_of(k): text_of(v) for k, v in client.hgetall(KEYS.run(job, 1)).items()}
        hostname = unpack(record)["worker"]
        assert hostname and client.exists(KEYS.worker(hostname))
        yield worker, hostname


def kill_whole(worker: subprocess.Popen[bytes], client: redis.Redis, hostname: str) -> None:
    """SIGKILL the worker's whole group (main process and pool child: no signal handler,
    no row, no goodbye), then wait for its heartbeat key to expire."""
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    assert wait_until(lambda: not client.exists(KEYS.worker(hostname)), timeout_s=10)
    assert rows(client) == [] and client.zcard(KEYS.started) == 1


def test_a_replay_pass_records_a_sigkilled_workers_run_as_killed_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gatekeeper replay --once`` (a cron's replayer, no sweep cron): one ``killed`` row,
    the window's exposure back to 0, nothing left started; a second pass writes no other."""
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    monkeypatch.setenv("GATEKEEPER_STALE_ATTEMPT_S", str(STALE_S))
    with a_long_run(redis_url, redis_client, tmp_path / "w.log") as (worker, hostname):
        time.sleep(STALE_S + 0.2)
        alive = CliRunner().invoke(main, ["replay", "--once"])
        assert alive.exit_code == 0, alive.output
        assert rows(redis_client) == []  # merely long: its worker is alive
        kill_whole(worker, redis_client, hostname)
    first = CliRunner().invoke(main, ["replay", "--once"])
    assert first.exit_code == 0, first.output
    the_killed_row(redis_client)  # one row, killed, priced; every window's exposure 0
    assert redis_client.zcard(KEYS.started) == 0 and redis_client.hlen(KEYS.inflight) == 0
    again = CliRunner().invoke(main, ["replay", "--once"])
    assert again.exit_code == 0, again.output
    assert len(rows(redis_client)) == 1


def test_workers_sharing_a_name_keep_each_others_runs_neither_alive_nor_dead(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two live workers of one ``-n`` (two units on one host, each ``celery@%h``; a worker
    restarted under its name while the dead one's runs are open): a run of the one alive is
    left alone whichever began or beat last, and the run of the one SIGKILLed whole is swept
    as killed while the other still beats under that name."""
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    monkeypatch.setenv("GATEKEEPER_STALE_ATTEMPT_S", str(STALE_S))
    name = f"same-{os.getpid()}@%h"
    with a_long_run(redis_url, redis_client, tmp_path / "a.log", name) as (first, was):
        (dead,) = [text_of(m).rpartition(":")[0] for m in redis_client.zrange(KEYS.started, 0, -1)]
        node = was.partition("#")[0]
        beating = lambda: set(redis_client.scan_iter(match=KEYS.worker(node) + "#*"))  # noqa: E731
        with running_worker(redis_url, tmp_path / "b.log", queues="reserved", hostname=name,
                            GATEKEEPER_WORKER_HEARTBEAT_S="1"):  # fmt: skip
            assert wait_until(lambda: len(beating()) == 2)  # one name, two processes
            time.sleep(STALE_S + 0.2)  # the run is stale now, its worker alive
            alive = CliRunner().invoke(main, ["sweep"])
            assert alive.exit_code == 0, alive.output
            assert rows(redis_client) == []
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
            assert wait_until(lambda: not redis_client.exists(KEYS.worker(was)), timeout_s=10)
            assert len(beating()) == 1 and redis_client.exists(KEYS.worker(node))
            swept = CliRunner().invoke(main, ["sweep"])
            assert swept.exit_code == 0, swept.output
            found = rows(redis_client)  # the sweep wrote its rows before it returned
            assert [(row["job_id"], row["outcome"], row["path"]) for row in found] == [
                (dead, "killed", "free")
            ]
            assert redis_client.zcard(KEYS.started) == 0


def test_a_run_an_earlier_build_recorded_is_alive_while_its_node_beats(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A run whose worker is the node's name alone (recorded before the process id) is
    alive while any worker of that name beats ``worker:<hostname>``, as before; one that
    names a process is alive only while that process beats."""
    ledger = RunLedger(redis_client, KEYS, window_seconds=900, queue_wait_unit_per_second=1.0)
    started = str(int(time.time() * 1000) - 60_000)
    earlier = RunRecord.from_fields({"started_ms": started, "worker": "old@host"})
    current = RunRecord.from_fields({"started_ms": started, "worker": "old@host#0a1b2c3d"})
    now_ms = int(time.time() * 1000)
    assert not _alive(ledger, earlier, now_ms) and not _alive(ledger, current, now_ms)
    redis_client.set(KEYS.worker("old@host"), "1")  # a worker of that name beats
    assert _alive(ledger, earlier, now_ms) and not _alive(ledger, current, now_ms)
    redis_client.set(KEYS.worker("old@host#0a1b2c3d"), "1")
    assert _alive(ledger, current, now_ms)
    redis_client.delete(KEYS.worker("old@host"), KEYS.worker("old@host#0a1b2c3d"))


def test_a_running_replayer_sweeps_again_once_a_minute_has_passed(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The long-running replayer sweeps at its first pass, then once every minute (its
    clock moved on by a minute; the passes between do not sweep)."""
    ahead = [0.0]
    settings = gate_settings(redis_url, stale_attempt_s=STALE_S, replay_poll_s=0.1)
    client = redis.Redis.from_url(redis_url)
    replayer = Replayer(settings, client, client, clock=lambda: time.time() + ahead[0])
    stop = threading.Event()
    thread = threading.Thread(target=replayer.run, args=(stop,), daemon=True)

    def passes(count: int) -> None:
        """Wait until ``count`` more passes have completed (the sweep runs after the mark of
        its pass: the mark of the next one says it is over)."""
        seen = {redis_client.get(KEYS.replayer_last_pass)}

        def another() -> bool:
            seen.add(redis_client.get(KEYS.replayer_last_pass))
            return len(seen) > count

        assert wait_until(another, 10)

    try:
        with a_long_run(redis_url, redis_client, tmp_path / "w.log") as (worker, hostname):
            time.sleep(STALE_S + 0.2)
            thread.start()
            passes(2)  # the first pass swept: the run is stale, but its worker alive
            assert rows(redis_client) == []
            kill_whole(worker, redis_client, hostname)
        passes(3)  # within the minute: no sweep, the dead run still counts
        assert rows(redis_client) == [] and redis_client.zcard(KEYS.started) == 1
        ahead[0] = SWEEP_EVERY_S + 1
        assert wait_until(lambda: len(rows(redis_client)) == 1, timeout_s=10)
        the_killed_row(redis_client)
        assert redis_client.zcard(KEYS.started) == 0 and redis_client.hlen(KEYS.inflight) == 0
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=10)
        client.close()
    assert not thread.is_alive()
