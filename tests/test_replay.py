"""The replayer: deferred tasks scored again, handed on, never lost, never doubled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.celery.broker import RedisBroker, check_broker
from gatekeeper.celery.replay import Replayer
from gatekeeper.errors import ConfigError
from gatekeeper.ops.cli import main
from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import (
    REPO_ROOT,
    gate_settings,
    queue_messages,
    running_worker,
    unused_port,
    wait_until,
)

KEYS = Keys()
QUEUES = ("free", "defer", "reserved", "dead_letter", "defer:replaying")


def defer_tasks(
    redis_url: str, client: redis.Redis, count: int, fast_publish: str = "auto", **options: Any
) -> list[str]:
    """Publish gated tasks that the age cap defers (a stale entry makes the free queue old)."""
    app = create_app(gate_settings(redis_url, max_queue_age_s=1.0, fast_publish=fast_publish),
                     redis_url)  # fmt: skip
    client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})
    ids = [app.tasks["tests.embed"].apply_async((n,), **options).id for n in range(count)]
    client.zrem(KEYS.free_waiting, "stale:1")
    assert client.llen("defer") == count
    return ids


def replay_once(redis_url: str, client: redis.Redis, **overrides: Any) -> dict[str, int]:
    replayer = Replayer(gate_settings(redis_url, **overrides), broker=client, gate=client)
    return dict(replayer.run(threading.Event(), once=True))


def ids_in(client: redis.Redis, queue: str) -> list[str]:
    return [m["headers"]["id"] for m in queue_messages(client, queue)]


def claimed(client: redis.Redis) -> int:
    """Messages claimed by replayers: every tenure's processing list and the legacy one."""
    lists = client.scan_iter(match="defer:replaying*", _type="list")
    return sum(client.llen(name) for name in lists)


def test_a_deferred_task_is_scored_again_and_sent_to_free(
    redis_url: str, redis_client: redis.Redis
) -> None:
    (job,) = defer_tasks(redis_url, redis_client, 1)
    (parked,) = queue_messages(redis_client, "defer")
    counts = replay_once(redis_url, redis_client)
    assert counts == {"to_free": 1}
    (sent,) = queue_messages(redis_client, "free")
    before, after = parked["headers"], sent["headers"]
    assert after["id"] == job and after["gatekeeper_decision"] == "admit_free"
    assert after["gatekeeper_attempt"] == before["gatekeeper_attempt"] == 1
    assert after["gatekeeper_deadline_at"] == before["gatekeeper_deadline_at"]
    assert after["gatekeeper_attempt_published_at"] == before["gatekeeper_attempt_published_at"]
    assert after["gatekeeper_replays"] == 1
    assert sent["properties"]["delivery_info"] == {"exchange": "", "routing_key": "free"}
    assert sent["properties"]["delivery_tag"] != parked["properties"]["delivery_tag"]
    assert sent["body"] == parked["body"]


def test_a_task_deferred_again_waits_out_its_backoff(
    redis_url: str, redis_client: redis.Redis
) -> None:
    defer_tasks(redis_url, redis_client, 1)
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})  # still old
    # A backoff of 30 s: the second pass is within it however slow the machine.
    slow = {"max_queue_age_s": 1.0, "replay_backoff_s": 30.0}
    assert replay_once(redis_url, redis_client, **slow) == {"deferred_again": 1}
    (parked,) = queue_messages(redis_client, "defer")
    assert parked["headers"]["gatekeeper_replay_after"] > time.time() + 20
    assert replay_once(redis_url, redis_client, **slow) == {"not_due": 1}


def test_the_backoff_doubles_up_to_its_maximum_and_is_never_an_eta(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Deferred again four times: waits of 0.2, 0.4, then 0.5 twice (the maximum), each in the
    # headers of a message that stays in defer; Celery's eta stays unset (an ETA message
    # would wait in the broker's unacked hash and run twice past its visibility timeout).
    defer_tasks(redis_url, redis_client, 1)
    backoff = {"max_queue_age_s": 1.0, "replay_backoff_s": 0.2, "replay_backoff_max_s": 0.5}
    for expected in (0.2, 0.4, 0.5, 0.5):
        # Still old (each pass's sweep drops this member: it has no message in free).
        redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})
        before = time.time()
        assert replay_once(redis_url, redis_client, **backoff) == {"deferred_again": 1}
        after = time.time()
        (parked,) = queue_messages(redis_client, "defer")
        due = parked["headers"]["gatekeeper_replay_after"]
        assert before + expected <= due <= after + expected
        assert parked["headers"].get("eta") is None
        assert not redis_client.hlen("unacked")
        time.sleep(max(0.0, due - time.time()) + 0.01)
    assert parked["headers"]["gatekeeper_replays"] == 4


def test_a_passed_deadline_goes_to_dead_letter_with_an_abandoned_row_and_an_alert(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Attempt 1 of the job was admitted to free (the gate's record says so); its retry,
    # attempt 2, is deferred and its deadline passes there.
    redis_client.hset(KEYS.run("ran-free", 1), mapping={"decision": "admit_free",
                                                        "free_admitted": "1"})  # fmt: skip
    headers = {"gatekeeper_deadline_s": 2.5}
    (job,) = defer_tasks(redis_url, redis_client, 1, headers=headers, task_id="ran-free",
                         retries=1)  # fmt: skip
    time.sleep(2.6)
    assert replay_once(redis_url, redis_client) == {"dead_lettered": 1}
    assert ids_in(redis_client, "dead_letter") == [job]
    rows_key = next(iter(redis_client.scan_iter(match="gatekeeper:*:rows")))
    (row,) = [json.loads(raw) for raw in redis_client.lrange(rows_key, 0, -1)]
    assert (row["job_id"], row["outcome"], row["retry_tax"]) == (job, "abandoned", 0)
    assert row["deadline_slack_ms"] <= 0
    err = capsys.readouterr().err
    assert "event=task_abandoned" in err
    (miss,) = [line for line in err.splitlines() if "slack_miss=true" in line]
    assert "decision=admit_free" in miss and f"job_id={job}" in miss


def test_a_callers_free_admitted_header_makes_no_slack_miss_when_abandoned(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Only the gate's record can say a job ran free: a header claiming it is not believed.
    headers = {"gatekeeper_deadline_s": 2.5, "gatekeeper_free_admitted": True}
    (_job,) = defer_tasks(redis_url, redis_client, 1, headers=headers)
    time.sleep(2.6)
    assert replay_once(redis_url, redis_client) == {"dead_lettered": 1}
    err = capsys.readouterr().err
    assert "event=task_abandoned" in err and "slack_miss=true" not in err
    windows = redis_client.scan_iter(match="gatekeeper:*:window:*", _type="hash")
    assert not any(int(redis_client.hget(key, "slack_misses") or 0) for key in windows)


REPLAYERS_OWN = {"gatekeeper_replay_after": 1e15, "gatekeeper_replays": "many",
                 "gatekeeper_copy": "mine", "gatekeeper_replay_errors": "x"}  # fmt: skip
"""Headers only the replayer writes, as a caller might set them: held past its deadline, its
replays failing (then dead-lettered), passed off as a copy."""


@pytest.mark.parametrize("fast_publish", ["on", "off"])
@pytest.mark.parametrize("header", sorted(REPLAYERS_OWN))
def test_a_callers_replayer_headers_do_not_decide_a_deferred_tasks_fate(
    redis_url: str, redis_client: redis.Redis, header: str, fast_publish: str
) -> None:
    given = {header: REPLAYERS_OWN[header]}
    (job,) = defer_tasks(redis_url, redis_client, 1, fast_publish, headers=given)
    (parked,) = queue_messages(redis_client, "defer")
    assert header not in parked["headers"]  # not forwarded by the routed publish
    assert replay_once(redis_url, redis_client) == {"to_free": 1}  # it fits now
    assert ids_in(redis_client, "free") == [job]


def test_a_task_held_for_its_backoff_is_abandoned_once_its_deadline_passes(
    redis_url: str, redis_client: redis.Redis
) -> None:
    (job,) = defer_tasks(redis_url, redis_client, 1, headers={"gatekeeper_deadline_s": 2.5})
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})  # still old
    slow = {"max_queue_age_s": 1.0, "replay_backoff_s": 30.0}
    assert replay_once(redis_url, redis_client, **slow) == {"deferred_again": 1}
    time.sleep(2.6)  # its deadline passes while it waits out its backoff of 30 s
    assert replay_once(redis_url, redis_client, **slow) == {"dead_lettered": 1}
    assert ids_in(redis_client, "dead_letter") == [job]


@pytest.mark.parametrize(("carried", "counted"), [("many", 1), (-1, 1), (1e6, 1), (5000, 5001)])
def test_a_replays_count_is_read_defensively(
    redis_url: str, redis_client: redis.Redis, carried: Any, counted: int
) -> None:
    # On a message in defer (an older publisher forwarded a caller's): a count the replayer
    # never writes counts 0, and a long-replayed one's backoff is its maximum, not 2**4999 s.
    defer_tasks(redis_url, redis_client, 1)
    message = json.loads(redis_client.rpop("defer"))
    message["headers"]["gatekeeper_replays"] = carried
    redis_client.lpush("defer", json.dumps(message))
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})  # still old
    backoff = {"max_queue_age_s": 1.0, "replay_backoff_s": 0.2, "replay_backoff_max_s": 0.5}
    before = time.time()
    assert replay_once(redis_url, redis_client, **backoff) == {"deferred_again": 1}
    (parked,) = queue_messages(redis_client, "defer")
    assert parked["headers"]["gatekeeper_replays"] == counted
    assert parked["headers"]["gatekeeper_replay_after"] <= time.time() + 0.5
    assert parked["headers"]["gatekeeper_replay_after"] >= before + 0.2


def test_nothing_goes_to_free_while_the_free_path_is_disabled(
    redis_url: str, redis_client: redis.Redis
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 5)
    redis_client.hset(KEYS.flags, "free_path_enabled", "false")
    assert replay_once(redis_url, redis_client) == {"to_reserved": 5}
    assert redis_client.llen("free") == 0
    assert sorted(ids_in(redis_client, "reserved")) == sorted(jobs)
    reasons = {m["headers"]["gatekeeper_reason"] for m in queue_messages(redis_client, "reserved")}
    assert reasons == {"free_path_disabled"}


def test_a_malformed_message_is_dead_lettered_not_dropped(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.lpush("defer", b"not json")
    assert replay_once(redis_url, redis_client) == {"malformed": 1}
    assert redis_client.lrange("dead_letter", 0, -1) == [b"not json"]


def test_a_message_left_claimed_by_an_older_versions_replayer_is_put_back(
    redis_url: str, redis_client: redis.Redis
) -> None:
    (job,) = defer_tasks(redis_url, redis_client, 1)
    redis_client.rpoplpush("defer", "defer:replaying")  # its one list; then it died
    assert replay_once(redis_url, redis_client) == {"to_free": 1}
    assert ids_in(redis_client, "free") == [job]
    assert redis_client.llen("defer:replaying") == 0


def start_replayer(
    redis_url: str, log: Path, *command: str, **env_overrides: str
) -> subprocess.Popen[bytes]:
    """A replayer process: ``gatekeeper replay`` unless ``command`` (Python's arguments)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(
        GATEKEEPER_REDIS_URL=redis_url,
        GATEKEEPER_DWELL_GATE_ENABLED="true",
        GATEKEEPER_CANARY_PERCENT="100",
        GATEKEEPER_REPLAY_LOCK_TTL_S="1",
        GATEKEEPER_BUDGET_UNITS="5000",  # 50 of the 300 fit: the rest go to reserved
        PYTHONPATH=str(REPO_ROOT),
    )
    env.update(env_overrides)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, *(command or ("-m", "gatekeeper", "replay"))],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
        )  # fmt: skip


@pytest.mark.celery
def test_a_replayer_killed_mid_batch_loses_nothing_and_runs_nothing_twice(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 300)
    log = tmp_path / "replay.log"
    # Batches of 10: the pass takes 30 of them, so a kill after the first claim still lands
    # with most of the work ahead on a loaded machine (batches of 100 drain 300 in ~0.15 s).
    first = start_replayer(redis_url, log, GATEKEEPER_REPLAY_BATCH_SIZE="10")
    try:
        assert wait_until(lambda: redis_client.llen("defer") < 295, timeout_s=30, every_s=0.005)
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
    assert redis_client.llen("defer") > 0, "the kill came too late to be mid-batch"
    second = start_replayer(redis_url, log)
    try:
        assert wait_until(
            lambda: redis_client.llen("defer") + claimed(redis_client) == 0,
            timeout_s=30,
        ), log.read_text()
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=10)
    placed = ids_in(redis_client, "free") + ids_in(redis_client, "reserved")
    assert sorted(placed) == sorted(jobs)  # every task once: none lost, none doubled
    free = ids_in(redis_client, "free")
    with running_worker(redis_url, tmp_path / "worker.log"):
        assert wait_until(lambda: redis_client.llen(RUNS_KEY) >= len(free), timeout_s=60)
        time.sleep(1.0)
    ran = [json.loads(raw)["id"] for raw in redis_client.lrange(RUNS_KEY, 0, -1)]
    assert sorted(ran) == sorted(free)


def test_a_message_that_keeps_failing_is_dead_lettered_after_five_tries(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    (job,) = defer_tasks(redis_url, redis_client, 1)
    raw = redis_client.rpop("defer")
    message = json.loads(raw)
    message["headers"]["retries"] = "not a number"  # makes scoring raise
    redis_client.lpush("defer", json.dumps(message))
    outcomes = [replay_once(redis_url, redis_client, replay_backoff_max_s=0.001) for _ in range(5)]
    assert outcomes[:4] == [{"replay_error": 1}] * 4
    assert outcomes[4] == {"dead_lettered_after_errors": 1}
    assert ids_in(redis_client, "dead_letter") == [job]
    assert "event=replay_gave_up" in capsys.readouterr().err


def test_replay_once_with_redis_unreachable_fails_with_a_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", f"redis://127.0.0.1:{unused_port()}/0")
    monkeypatch.delenv("GATEKEEPER_BROKER_URL", raising=False)
    result = CliRunner().invoke(main, ["replay", "--once"])
    assert result.exit_code == 1, result.output
    assert "pass_failed=1" in result.output and "the pass failed" in result.output
    assert isinstance(result.exception, SystemExit)  # not a traceback


def test_replay_once_while_another_replayer_holds_the_lock_says_so(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_client.set(Keys().replayer_lock, "another-host:1234", px=60_000)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    monkeypatch.delenv("GATEKEEPER_BROKER_URL", raising=False)
    result = CliRunner().invoke(main, ["replay", "--once"])
    assert result.exit_code == 1 and "holds the lock" in result.output, result.output
    assert redis_client.get(Keys().replayer_lock) == b"another-host:1234"


def test_a_replayer_whose_lock_expired_never_drops_or_extends_its_successors(
    redis_url: str, redis_client: redis.Redis
) -> None:
    settings = gate_settings(redis_url, replay_lock_ttl_s=1.0)  # 1 s: room for what follows
    first = Replayer(settings, broker=redis_client, gate=redis_client)
    second = Replayer(settings, broker=redis_client, gate=redis_client)
    assert first.acquire()
    time.sleep(1.2)  # first stalled past its lock's TTL
    assert second.acquire()
    successor = redis_client.get(Keys().replayer_lock)
    first.release()  # too late: the lock is the successor's now
    assert redis_client.get(Keys().replayer_lock) == successor
    assert not first.acquire()  # and it cannot take or refresh it back
    assert redis_client.pttl(Keys().replayer_lock) > 0
    assert second.acquire()  # refreshed by its holder
    second.release()
    assert redis_client.get(Keys().replayer_lock) is None


def test_a_message_put_in_defer_by_a_caller_runs_on_reserved_unscored(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # An ungated task published straight to defer with gatekeeper headers of its own: the
    # replayer does not score it from them (no record of the gate's deferred it).
    app = create_app(gate_settings(redis_url, dwell_gate_enabled=False), redis_url)
    app.tasks["tests.plain"].apply_async(task_id="intruder", queue="defer", headers={
        "gatekeeper_attempt": 1, "gatekeeper_expected_service_s": 0.1,
        "gatekeeper_tokens_in": 5, "gatekeeper_deadline_at": time.time() + 60,
        "gatekeeper_nonce": "made-up"})  # fmt: skip
    assert replay_once(redis_url, redis_client) == {"unverified": 1}
    assert ids_in(redis_client, "reserved") == ["intruder"] and redis_client.llen("free") == 0
    assert not redis_client.exists(KEYS.run("intruder", 1))


@pytest.mark.parametrize("stop_with", [signal.SIGINT, signal.SIGTERM])
def test_a_running_replayer_stops_on_sigint_or_sigterm_and_gives_up_its_lock(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, stop_with: signal.Signals
) -> None:
    # The README: without --once the replayer runs until SIGINT or SIGTERM; it exits 0 and
    # lets go of the lock, so that a successor need not wait out its TTL.
    log = tmp_path / "replay.log"
    replayer = start_replayer(redis_url, log, GATEKEEPER_REPLAY_LOCK_TTL_S="30")
    try:
        assert wait_until(lambda: redis_client.exists(KEYS.replayer_lock), timeout_s=30)
        replayer.send_signal(stop_with)
        assert replayer.wait(timeout=15) == 0, log.read_text()
    finally:
        replayer.kill()
    assert not redis_client.exists(KEYS.replayer_lock), log.read_text()


CELERY_PRIORITIES = {
    "priority_steps": list(range(10)),
    "sep": ":",
    "queue_order_strategy": "priority",
}
"""Celery's documented broker options for Redis message priorities (a list per priority)."""


def test_deferred_tasks_of_every_priority_are_found_where_kombu_put_them(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # The app names its priority lists `defer:5` (Celery's documented Redis priority options):
    # read in kombu's default `defer\x06\x163`, a deferred priority-5 task was never replayed,
    # never abandoned, and the sweep forgot its free admission as gone from the broker.
    settings = gate_settings(redis_url, max_queue_age_s=1.0,
                             broker_transport_options=CELERY_PRIORITIES)  # fmt: skip
    app = create_app(settings, redis_url)
    app.conf.broker_transport_options = CELERY_PRIORITIES
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})
    jobs = {p: app.tasks["tests.embed"].apply_async((p,), priority=p).id for p in (0, 5, 9)}
    redis_client.zrem(KEYS.free_waiting, "stale:1")
    assert {p: redis_client.llen("defer" if p == 0 else f"defer:{p}") for p in jobs} == {
        0: 1, 5: 1, 9: 1
    }  # fmt: skip
    broker = RedisBroker(redis_client, settings)
    assert broker.length("defer") == 3
    replayer = Replayer(settings, broker=broker, gate=redis_client)
    assert dict(replayer.run(threading.Event(), once=True)) == {"to_free": 3}
    assert broker.length("defer") == 0 and broker.length("free") == 3
    for priority, job in jobs.items():  # each at its own priority, where a worker pops it
        (sent,) = queue_messages(redis_client, "free" if priority == 0 else f"free:{priority}")
        assert sent["headers"]["id"] == job
    assert broker.waiting("free") == {f"{job}:1" for job in jobs.values()}  # the sweep sees them


def test_transport_options_kombu_could_not_use_are_refused_by_name() -> None:
    for options, named in (({"priority_steps": [9, 0]}, "priority_steps"),
                           ({"priority_steps": "0369"}, "priority_steps"),
                           ({"sep": 7}, "sep"), ({"unacked_key": ""}, "unacked_key")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"broker_transport_options: {named}: expected"):
            check_broker("redis://127.0.0.1:6379/0", options=options)
    assert check_broker("redis://127.0.0.1:6379/0", options=CELERY_PRIORITIES) == "redis"


@pytest.mark.parametrize("deadline", [-1e306, "-Infinity", "-1" + "0" * 400])
def test_a_message_put_in_defer_with_a_deadline_no_millisecond_holds_is_abandoned(
    redis_url: str, redis_client: redis.Redis, deadline: float | str
) -> None:
    # Found in review: its row's slack in milliseconds overflowed (OverflowError), so the
    # message was struck five times (a minute and a half) before the dead letters took it.
    app = create_app(gate_settings(redis_url, dwell_gate_enabled=False), redis_url)
    app.tasks["tests.plain"].apply_async(task_id="intruder", queue="defer", headers={
        "gatekeeper_attempt": 1, "gatekeeper_deadline_at": 0.0})  # fmt: skip
    (raw,) = redis_client.lrange("defer", 0, -1)
    redis_client.delete("defer")  # the same message, its deadline as JSON can write it
    redis_client.lpush(
        "defer",
        raw.replace(
            b'"gatekeeper_deadline_at": 0.0', f'"gatekeeper_deadline_at": {deadline}'.encode()
        ),
    )
    assert replay_once(redis_url, redis_client) == {"dead_lettered": 1}
    (row,) = [json.loads(r) for key in redis_client.scan_iter(match="gatekeeper:*:rows")
              for r in redis_client.lrange(key, 0, -1)]  # fmt: skip
    assert (row["outcome"], row["deadline_slack_ms"], row["verified"]) == (
        "abandoned", -10**15, False)  # fmt: skip
