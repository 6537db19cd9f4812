"""One replayer at a time, really: the lock is checked before every batch's decisions and
again before its moves, a replayer that lost it decides and moves nothing more, and only dead
replayers' claims are taken back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from gatekeeper.celery.replay import Replayer
from gatekeeper.redis.keys import Keys
from tests.conftest import gate_settings, wait_until
from tests.test_replay import claimed, defer_tasks, ids_in, start_replayer

KEYS = Keys()
REGISTRY = "defer:replayers"

STALLING_REPLAYER = """
import os, signal, sys, threading, time
import redis
from gatekeeper.celery.replay import Replayer
from gatekeeper.lines import flush
from gatekeeper.settings import load_settings

settings = load_settings()
reads, stop_at = 0, int(sys.argv[1])

def monotonic():  # the clock the lock is checked with: this process stops at one reading
    global reads
    if sys._getframe(2).f_code.co_name != "_replay_batch":  # not one of a batch's two checks
        return time.monotonic()
    reads += 1
    if reads == stop_at:
        flush()  # the lines of what it decided before it stops, as a page would read them
        print("event=stopping_itself", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return time.monotonic()

client = redis.Redis.from_url(settings.redis_url)
replayer = Replayer(settings, client, client, monotonic=monotonic)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
totals = replayer.run(stop)
print("totals " + " ".join(f"{k}={v}" for k, v in sorted(totals.items())), flush=True)
"""
"""``gatekeeper replay``'s loop with one change: the monotonic clock its lock is checked with
SIGSTOPs the process at the ``argv[1]``-th of the readings made by a batch's own two checks:
once it is claimed (before its decisions) and once it is decided (before its moves); the
others (the take, before each claim, between a batch's steps) are not counted. With batches
of ``BATCH``, the 3rd stops the process with the second batch claimed and undecided, the 4th
with it decided and not moved."""
BATCH = 50


def decisions(log: Path) -> int:
    return log.read_text().count("event=gate_decision")


def has_stopped(process: subprocess.Popen[bytes]) -> bool:
    pid, status = os.waitpid(process.pid, os.WUNTRACED | os.WNOHANG)
    assert not pid or os.WIFSTOPPED(status), f"the replayer exited (status {status})"
    return bool(pid)


def placed(client: redis.Redis) -> list[str]:
    return ids_in(client, "free") + ids_in(client, "reserved")


def stalled(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, stop_at: int
) -> tuple[str, dict[str, str], int, list[bytes]]:
    """200 deferred tasks, a replayer that stops itself at its ``stop_at``-th lock reading
    and stays stopped past its lock's TTL while a successor replays everything, then resumes:
    the log of the successor, the stopped one's totals, its decisions and what it left
    claimed when it stopped. Checks that each task was handed on once, none lost or doubled,
    and that the resumed replayer found its lock lost and decided nothing more."""
    jobs = defer_tasks(redis_url, redis_client, 200)
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    batches = {"GATEKEEPER_REPLAY_BATCH_SIZE": str(BATCH)}
    first = start_replayer(redis_url, first_log, "-c", STALLING_REPLAYER, str(stop_at), **batches)
    second = None
    try:
        assert wait_until(lambda: has_stopped(first), timeout_s=30), first_log.read_text()
        before = decisions(first_log)
        (tenure,) = redis_client.smembers(REGISTRY)
        left_claimed = redis_client.lrange(b"defer:replaying:" + tenure, 0, -1)
        assert redis_client.llen("defer") == 200 - 2 * BATCH  # two batches claimed
        # Stopped past the TTL (1 s): its lock and its heartbeat expire; a successor takes
        # over, takes back the claims and replays everything.
        assert wait_until(
            lambda: not redis_client.exists(KEYS.replayer_lock, b"defer:replayer:" + tenure),
            timeout_s=10,
        )
        second = start_replayer(redis_url, second_log, **batches)
        assert wait_until(lambda: len(placed(redis_client)) == 200, timeout_s=30), (
            second_log.read_text()
        )
        assert "event=replay_recovered" in second_log.read_text()
        # Held by the successor (a 1 s lock it renews: a pause of it under load may let it
        # lapse for a moment before it takes it again).
        assert wait_until(lambda: bool(redis_client.exists(KEYS.replayer_lock)), timeout_s=5)
        first.send_signal(signal.SIGCONT)
        resumed = lambda: first_log.read_text().split("event=stopping_itself", 1)[1]  # noqa: E731
        assert wait_until(lambda: "event=replay_waiting_for_lock" in resumed(), timeout_s=10)
        time.sleep(1.0)  # time to misbehave, if it were going to
        assert "event=replay_lock_lost" in resumed()
        assert decisions(first_log) == before  # no scoring after it resumed
        assert sorted(placed(redis_client)) == sorted(jobs)  # each once: none lost or doubled
        assert claimed(redis_client) == 0 and redis_client.llen("defer") == 0
        assert tenure not in redis_client.smembers(REGISTRY)
    finally:
        first.send_signal(signal.SIGCONT)
        for process in (first, second):
            if process is not None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=10)
    (totals,) = re.findall(r"^totals (.*)$", first_log.read_text(), re.MULTILINE)
    counts = dict(pair.split("=") for pair in totals.split())
    return second_log.read_text(), counts, before, left_claimed


def moved(counts: dict[str, str]) -> int:
    return sum(int(n) for name, n in counts.items() if name.startswith("to_"))


def test_a_replayer_stopped_past_its_lock_ttl_decides_and_moves_nothing_once_resumed(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    successor, counts, before, left_claimed = stalled(redis_url, redis_client, tmp_path, 3)
    assert (before, len(left_claimed)) == (BATCH, BATCH)  # the 2nd batch claimed, undecided
    assert (moved(counts), counts.get("lock_lost")) == (before, "1")  # no move after it resumed
    assert "event=replay_handed_on_again" not in successor  # nothing of it was decided
    assert successor.count("event=gate_decision") == 200 - BATCH


def test_a_replayer_that_loses_its_lock_mid_batch_moves_none_of_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    successor, counts, before, left_claimed = stalled(redis_url, redis_client, tmp_path, 4)
    # Stopped between the 2nd batch's decisions and its moves: decided, handoffs kept, and
    # none of it moved once resumed (the lock is checked again before the moves).
    assert (before, len(left_claimed)) == (2 * BATCH, BATCH)
    assert (moved(counts), counts.get("lock_lost")) == (BATCH, "1")
    # The successor hands each one on as it was decided, not scoring it a second time.
    assert successor.count("event=replay_handed_on_again") == BATCH
    assert successor.count("event=gate_decision") == 200 - 2 * BATCH


def test_a_stall_longer_than_the_ttl_loses_the_lock_though_redis_still_has_it(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 2)
    settings = gate_settings(redis_url)  # a 30 s lock
    now = [0.0]
    replayer = Replayer(settings, broker=redis_client, gate=redis_client,
                        monotonic=lambda: now[0])  # fmt: skip
    assert replayer.acquire()
    now[0] += settings.replay_lock_ttl_s + 1  # stopped for longer than the TTL
    assert redis_client.exists(KEYS.replayer_lock)  # Redis's clock did not see the stall
    assert replayer.pass_once() == {"lock_lost": 1}
    lost = [line for line in capsys.readouterr().err.splitlines() if "replay_lock_lost" in line]
    assert len(lost) == 1 and "this holder stalled" in lost[0]  # not "another replayer"
    assert redis_client.llen("defer") == 2 and claimed(redis_client) == 0
    assert not redis_client.exists(KEYS.replayer_lock)  # ours still: given back
    assert replayer.acquire()  # a new tenure
    assert replayer.pass_once() == {"to_free": 2}
    assert sorted(ids_in(redis_client, "free")) == sorted(jobs)


def test_the_lock_is_renewed_during_a_pass_longer_than_its_ttl(
    redis_url: str, redis_client: redis.Redis
) -> None:
    defer_tasks(redis_url, redis_client, 30)
    # One batch of the default size: it takes several TTLs, and is renewed as it goes (its
    # lock is checked between its steps, with no round trip while fresh).
    # A TTL of 1 s: a loaded machine's pause of a few tenths between checks still renews it.
    settings = gate_settings(redis_url, replay_lock_ttl_s=1.0, budget_units=1e9)
    assert settings.replay_batch_size >= 30

    def slow_clock() -> float:  # each message takes a while: the pass lasts about 3 s
        time.sleep(0.05)
        return time.time()

    replayer = Replayer(settings, broker=redis_client, gate=redis_client, clock=slow_clock)
    assert replayer.acquire()
    started = time.monotonic()
    assert replayer.pass_once() == {"to_free": 30}
    assert time.monotonic() - started > 2 * settings.replay_lock_ttl_s
    assert redis_client.pttl(KEYS.replayer_lock) > 0  # still held: renewed as it went
    assert replayer.acquire()
    replayer.release()


def test_a_live_replayers_claim_is_not_taken_back_by_another(
    redis_url: str, redis_client: redis.Redis
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 3)
    settings = gate_settings(redis_url)
    now = [0.0]
    first = Replayer(settings, broker=redis_client, gate=redis_client,
                     monotonic=lambda: now[0])  # fmt: skip
    second = Replayer(settings, broker=redis_client, gate=redis_client)
    assert first.acquire()
    held = first.broker.claims.claim("defer")  # first is deciding this one...
    first_claims = first.broker.claims.current
    redis_client.delete(KEYS.replayer_lock)  # ...when its lock goes (a failover lost it)
    assert second.acquire()
    assert second.pass_once() == {"to_free": 2}  # the other two, not first's claim
    assert redis_client.lrange(first_claims, 0, -1) == [held]
    now[0] += settings.replay_lock_ttl_s / 2  # first's next check asks Redis
    assert first.pass_once() == {"lock_lost": 1}  # no decision, no move, no take-back
    assert redis_client.lrange(first_claims, 0, -1) == [held]
    assert second.pass_once() == {"to_free": 1}  # first's tenure ended: taken back now
    assert sorted(ids_in(redis_client, "free")) == sorted(jobs)
    assert claimed(redis_client) == 0


def test_a_dead_replayers_claims_are_taken_back_once_its_heartbeat_expires(
    redis_url: str, redis_client: redis.Redis
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 5)
    settings = gate_settings(redis_url, replay_lock_ttl_s=1.0)
    dead = Replayer(settings, broker=redis_client, gate=redis_client)
    assert dead.acquire()
    for _ in range(3):
        assert dead.broker.claims.claim("defer") is not None
    heartbeat = dead.broker.claims.heartbeat_of(dead.broker.claims.tenure)  # then it died
    assert redis_client.exists(heartbeat)
    assert wait_until(lambda: not redis_client.exists(KEYS.replayer_lock, heartbeat), 10)
    successor = Replayer(settings, broker=redis_client, gate=redis_client)
    assert successor.run(threading.Event(), once=True) == {"to_free": 5}
    assert sorted(ids_in(redis_client, "free")) == sorted(jobs)  # none lost, none doubled
    assert claimed(redis_client) == 0
    assert dead.broker.claims.tenure.encode() not in redis_client.smembers(REGISTRY)


@pytest.mark.celery
def test_replay_once_whose_lock_is_lost_mid_pass_exits_1_saying_so_and_loses_nothing(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # README: `replay --once` exits 1 when the lock was lost mid-pass (`lock_lost`). Stopped
    # mid-pass past its lock's TTL while another replayer takes the lock, then let go on.
    jobs = defer_tasks(redis_url, redis_client, 1500)
    log = tmp_path / "r.log"
    replayer = start_replayer(redis_url, log, "-m", "gatekeeper", "replay", "--once",
                              GATEKEEPER_REPLAY_BATCH_SIZE="5")  # fmt: skip
    try:
        assert wait_until(lambda: redis_client.llen("defer") < 1400, 30), log.read_text()
        os.kill(replayer.pid, signal.SIGSTOP)
        assert redis_client.llen("defer") > 0, "the pass ended before it could be stopped"
        time.sleep(1.5)  # past the lock's TTL (1 s): it expires
        assert redis_client.set(KEYS.replayer_lock, "another-host:1234", px=60_000, nx=True)
    finally:
        os.kill(replayer.pid, signal.SIGCONT)
    assert replayer.wait(timeout=60) == 1, log.read_text()
    text = log.read_text()
    assert "event=replay_lock_lost" in text and "the lock was lost mid-pass" in text, text
    assert redis_client.get(KEYS.replayer_lock) == b"another-host:1234"  # not taken back
    kept = [*ids_in(redis_client, "defer"), *ids_in(redis_client, "free"),
            *ids_in(redis_client, "reserved")]  # fmt: skip
    assert len(kept) + claimed(redis_client) == len(jobs)  # nothing lost (claims wait)
