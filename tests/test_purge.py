"""A purged free queue stops holding the queue's age up after ``gatekeeper sweep`` (and the
replayer's sweep, every minute), without forgetting messages that left the list but still
wait (prefetched by a worker); stale admissions are dropped by the gate itself, bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.ops.cli import main
from gatekeeper.redis.keys import ATTEMPTS, Keys
from gatekeeper.redis.store import GateStore
from gatekeeper.redis.sweep import PURGE_GRACE_S, forget_purged
from tests.apps.gated_app import create_app
from tests.calls import gate_call
from tests.conftest import REPO_ROOT, gate_settings, queue_messages, running_worker, wait_until
from tests.test_worker_ledger import runs

pytestmark = pytest.mark.celery
KEYS = Keys()


def celery_purge(redis_url: str, queue: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(GATEKEEPER_REDIS_URL=redis_url, GATEKEEPER_BROKER_URL=redis_url,
               GATEKEEPER_TEST_WORKER="1", PYTHONPATH=str(REPO_ROOT))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.gated_app", "purge", "-Q", queue, "-f"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def sweep(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["sweep"])
    assert result.exit_code == 0, result.output
    return result.output


def test_after_a_purge_and_a_sweep_the_next_publish_is_admitted(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(gate_settings(redis_url, max_queue_age_s=1), redis_url)
    embed = app.tasks["tests.embed"]
    for n in range(3):
        embed.delay(n)
    assert len(queue_messages(redis_client, "free")) == 3
    time.sleep(1.2)  # older than the age cap, with no worker to take them
    celery_purge(redis_url, "free")
    assert redis_client.llen("free") == 0
    embed.delay("before the sweep")  # the purged messages still count: the age cap defers it
    (deferred,) = queue_messages(redis_client, "defer")
    assert deferred["headers"]["gatekeeper_reason"] == "queue_age_cap"
    time.sleep(4)  # past the sweep's grace for messages still on their way to the broker
    assert "forgotten=3" in sweep(redis_url, monkeypatch)
    assert (
        redis_client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 0
        and redis_client.hlen(KEYS.inflight) == 0
    )
    with running_worker(redis_url, tmp_path / "w.log"):  # an idle free worker
        job = embed.delay("after the sweep").id
        assert redis_client.hget(KEYS.run(job, 1), "decision") == b"admit_free"
        assert wait_until(lambda: [r["queue"] for r in runs(redis_client)] == ["free"])


def test_a_prefetched_message_is_not_forgotten(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(gate_settings(redis_url), redis_url)
    with running_worker(redis_url, tmp_path / "w.log"):  # one slot, prefetch multiplier 1
        app.tasks["tests.embed"].delay("busy", sleep_s=9)
        published = time.monotonic()
        waiting = app.tasks["tests.embed"].delay("prefetched").id
        assert wait_until(lambda: redis_client.llen("free") == 0)  # both left the list
        assert redis_client.hlen("unacked") >= 1
        # Past the sweep's grace (5 s from the admission, not from the fetch), the second still
        # waits behind the first: about 3.5 s to spare on a loaded machine.
        time.sleep(max(0.0, published + 5.5 - time.monotonic()))
        assert "forgotten=0" in sweep(redis_url, monkeypatch)
        assert redis_client.zscore(KEYS.free_waiting, f"{waiting}:1") is not None
        assert wait_until(
            lambda: redis_client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 0, timeout_s=20
        )
    assert redis_client.hlen(KEYS.inflight) == 0


def test_a_sweep_leaves_an_admission_whose_message_may_still_be_on_its_way_alone(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ordinary path decides before Celery publishes: for a moment the admission is in
    the waiting set with no message in the broker. A sweep then (the replayer's, every
    minute) must not take it for purged: it would give back its reservation and count the run
    twice. Past the grace (5 s) it is forgotten."""
    store = GateStore(redis_client, KEYS)
    now = time.time()
    store.score(gate_call(now_s=now, job_id="on-its-way", window_id=1, tokens_in=10))
    assert redis_client.llen("free") == 0
    assert "forgotten=0" in sweep(redis_url, monkeypatch)
    assert redis_client.zscore(KEYS.free_waiting, "on-its-way:1") is not None
    assert redis_client.hget(KEYS.inflight, "on-its-way:1") is not None
    assert forget_purged(store, set(), round((now + PURGE_GRACE_S + 1) * 1000)) == 1
    assert redis_client.hget(KEYS.inflight, "on-its-way:1") is None


@pytest.mark.parametrize("named", [True, False], ids=["unacked_key_given", "not_given"])
def test_a_sweep_reads_delivered_messages_where_the_transport_options_keep_them(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, named: bool
) -> None:
    """kombu keeps the messages a worker holds (prefetched, waiting on an ETA) in the hash
    ``unacked_key`` names: read elsewhere, the sweep would take a held message for purged and
    give back its admission's reservation while it is still to run."""
    store = GateStore(redis_client, KEYS)
    store.score(gate_call(now_s=time.time() - 10, job_id="held", window_id=1, tokens_in=10))
    message = {"headers": {"id": "held", "gatekeeper_attempt": 1}, "properties": {}}
    redis_client.hset("held_by_workers", "tag", json.dumps([message, "", "free"]))
    if named:
        monkeypatch.setenv("GATEKEEPER_BROKER_TRANSPORT_OPTIONS",
                           json.dumps({"unacked_key": "held_by_workers"}))  # fmt: skip
    forgotten = "forgotten=0" if named else "forgotten=1"  # (not named: kombu's "unacked")
    assert forgotten in sweep(redis_url, monkeypatch)
    assert (redis_client.hget(KEYS.inflight, "held:1") is not None) is named


def test_admissions_past_the_horizon_are_dropped_by_the_gate_a_few_at_a_time(
    redis_client: redis.Redis,
) -> None:
    """Without any sweep, ``waiting`` and ``inflight`` stay bounded: each decision drops up
    to 16 admissions past the horizon and gives back what they reserved."""
    store = GateStore(redis_client, KEYS, horizon_s=60)
    now = time.time()
    for n in range(40):  # admitted long ago, never started (their messages were purged)
        store.score(gate_call(now_s=now - 120, job_id=f"old{n}", window_id=1, tokens_in=10))
    assert redis_client.hlen(KEYS.inflight) == 40
    scored = store.score(gate_call(now_s=now, job_id="new", window_id=2, tokens_in=10))
    assert scored.queue_age_s == 0  # the stale ones no longer count, dropped or not
    assert redis_client.hlen(KEYS.inflight) == 40 - 16 + 1
    for n in range(2):
        store.score(gate_call(now_s=now, job_id=f"next{n}", window_id=2, tokens_in=10))
    assert redis_client.hlen(KEYS.inflight) == 3  # the 40 are gone
    assert float(redis_client.hget(KEYS.window(1), "exposure") or 0) == 0
    assert redis_client.hget(KEYS.run("old0", 1), "reserved") == b"0"


def test_a_task_id_holding_run_does_not_keep_what_stale_admissions_reserved(
    redis_client: redis.Redis,
) -> None:
    """gate.lua builds a stale admission's window and record keys from the prefix of the
    deciding attempt's record key: a caller's task id holding ``:run:`` must not move it."""
    store = GateStore(redis_client, KEYS, horizon_s=60)
    now = time.time()
    store.score(gate_call(now_s=now - 120, job_id="old", window_id=1, tokens_in=10))
    assert float(redis_client.hget(KEYS.window(1), "exposure") or 0) > 0
    store.score(gate_call(now_s=now, job_id="a:run:b", window_id=2, tokens_in=10))
    assert redis_client.hget(KEYS.run("old", 1), "reserved") == b"0"
    assert float(redis_client.hget(KEYS.window(1), "exposure") or 0) == 0


def test_an_older_versions_in_flight_entry_is_dropped_by_the_gate_and_the_sweep(
    redis_client: redis.Redis,
) -> None:
    """An in-flight entry written before entries named their window (``<reserved>`` alone): the
    gate's horizon and the sweep's purge check drop it like any other (a reviewer: the gate
    failed the decision closed, with the entry already gone; the sweep raised)."""
    store = GateStore(redis_client, KEYS, horizon_s=60)
    now = time.time()
    for job in ("by-gate", "by-sweep"):
        redis_client.zadd(KEYS.free_waiting, {f"{job}:1": (now - 120) * 1000})
        redis_client.hset(KEYS.inflight, f"{job}:1", "5")
    scored = store.score(gate_call(now_s=now, job_id="new", window_id=2, tokens_in=10))
    assert scored.decision.value == "admit_free"
    assert redis_client.hget(KEYS.inflight, "by-gate:1") is None
    redis_client.zadd(KEYS.free_waiting, {"by-sweep:1": (now - 30) * 1000})  # not yet stale
    redis_client.hset(KEYS.inflight, "by-sweep:1", "5")
    assert forget_purged(store, {"new:1"}, round(now * 1000)) == 1
    assert redis_client.hget(KEYS.inflight, "by-sweep:1") is None
