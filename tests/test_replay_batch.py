"""The replayer's batches on a Redis broker, and what tries to break them: a batch costs a few
round trips, not a few per message; a batch decided for longer than the lock's TTL, or whose
tenure ended before its move, moves nothing; a replayer killed or failing between a batch's
decisions and its move leaves every message claimed, to be handed on once, as decided."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.celery.broker import RedisBroker, Taken
from gatekeeper.celery.replay import Replayer
from gatekeeper.ops.cli import main
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import load_lua
from gatekeeper.redis.wire import Line
from tests.conftest import REPO_ROOT, gate_settings, initialised, wait_until
from tests.test_replay import claimed, defer_tasks, ids_in

KEYS = Keys()


def placed(client: redis.Redis) -> Counter[str]:
    """How many times each task id is in free or reserved."""
    return Counter(ids_in(client, "free") + ids_in(client, "reserved"))


class Counted(redis.Connection):
    """A real connection that counts its round trips: each wait for a reply that follows a
    request (a command, a pipeline, or commands sent one after the other, then read)."""

    round_trips = 0
    _sent = False

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self._sent = True
        super().send_packed_command(command, check_health)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        if self._sent:
            Counted.round_trips += 1
            self._sent = False
        return super().read_response(*args, **kwargs)


class CountedLine(Line):
    """The gate script's own line, counted as :class:`Counted` counts (its connection is a
    ``Counted`` too, but with hiredis the line sends and reads past it, through the socket)."""

    _sent_raw = False

    def send(self, parts: Any) -> None:
        super().send(parts)
        self._sent_raw = self.sock is not None  # else Counted counted it

    def read(self) -> Any:
        if self._sent_raw:
            Counted.round_trips += 1
            self._sent_raw = False
        return super().read()


def round_trips_of_a_pass(
    redis_url: str, n: int, batch_size: int, monkeypatch: pytest.MonkeyPatch
) -> int:
    """The round trips of a pass that hands ``n`` deferred tasks on to free."""
    monkeypatch.setattr("gatekeeper.redis.store.Line", CountedLine)
    client = redis.Redis.from_url(redis_url, connection_class=Counted)
    client.flushdb()
    initialised(client)
    jobs = defer_tasks(redis_url, client, n)
    # Flags read once a minute, not every 0.2 s: a pass slowed down by a loaded machine must
    # not read them more often than a quick one.
    settings = gate_settings(redis_url, budget_units=1e9, replay_batch_size=batch_size,
                             flag_cache_s=60)  # fmt: skip
    replayer = Replayer(settings, broker=client, gate=client)
    assert replayer.acquire()
    replayer.pass_once()  # the first pass's once-a-minute sweep is made here
    jobs += defer_tasks(redis_url, client, n)
    Counted.round_trips = 0
    assert replayer.pass_once() == {"to_free": n}
    round_trips = Counted.round_trips
    assert placed(client) == Counter(jobs)  # every one handed on once
    assert client.zcard(KEYS.deferred) == 0  # and its deadline forgotten
    client.close()
    return round_trips


@pytest.mark.parametrize("batch_size", [1, 10, 100])
def test_a_batch_costs_six_round_trips_not_six_per_message(
    redis_url: str, batch_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Six per batch: the claim, the records, the decisions, the handoffs, the move, the
    # deadlines; and the pass's own few (the lock's recovery, one length per priority list,
    # the pass's record: a dozen; a renewal of the lock or a read of the flags, if due).
    batches = -(-60 // batch_size)
    assert round_trips_of_a_pass(redis_url, 60, batch_size, monkeypatch) <= 6 * batches + 20


def test_a_batch_is_not_moved_once_its_tenure_is_over(
    redis_url: str, redis_client: redis.Redis
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 5)
    broker = RedisBroker(redis_client, gate_settings(redis_url))
    broker.begin("replayer-a")
    (batch,) = broker.take_batches("defer", 10)
    assert len(batch) == 5
    for taken in batch:
        assert taken.message is not None
        broker.send(taken, "free", taken.message)
    assert redis_client.llen("free") == 0  # nothing moves before the batch's one step
    # Its tenure ends (a replayer that found its lock lost; or, stalled, its heartbeat
    # expired) before the move: move.lua itself refuses, whatever was decided.
    broker.end()
    broker.hand_on(batch)
    assert redis_client.llen("free") == 0 and claimed(redis_client) == 5
    # The next tenure takes them back, and moves what it claims.
    broker.begin("replayer-b")
    assert broker.recover() == 5
    (batch,) = broker.take_batches("defer", 10)
    for taken in batch:
        broker.send(taken, "free", taken.message)
    broker.hand_on(batch)
    assert sorted(ids_in(redis_client, "free")) == sorted(jobs) and claimed(redis_client) == 0


def test_a_batch_stalled_longer_than_the_lock_ttl_stops_and_is_not_moved(
    redis_url: str, redis_client: redis.Redis
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 10)
    settings = gate_settings(redis_url, replay_lock_ttl_s=1.0, budget_units=1e9,
                             replay_batch_size=10)  # fmt: skip
    reads = [0]

    def clock() -> float:  # the 3rd message's first step stalls for longer than the TTL
        reads[0] += 1
        if reads[0] == 4:  # the 1st reading is the pass's own
            time.sleep(1.2)
        return time.time()

    replayer = Replayer(settings, broker=redis_client, gate=redis_client, clock=clock)
    assert replayer.acquire()
    assert replayer.pass_once() == {"lock_lost": 1}  # found lost at its next step
    assert claimed(redis_client) == 10 and redis_client.llen("free") == 0
    # Stalled before the batch's decisions: none was made, no handoff kept.
    assert not any(redis_client.hget(KEYS.run(job, 1), "handoff") for job in jobs)
    assert replayer.acquire()  # a new tenure: takes the claims back and decides them
    assert replayer.pass_once() == {"to_free": 10}
    assert placed(redis_client) == Counter(jobs)


class StallAfterMove(RedisBroker):
    """A broker whose batch moves are followed by a stall of the replayer longer than its TTL."""

    def __init__(self, client: redis.Redis, settings: Any, now: list[float]) -> None:
        super().__init__(client, settings)
        self.now = now

    def hand_on(self, batch: list[Taken]) -> None:
        super().hand_on(batch)
        self.now[0] += self.settings.replay_lock_ttl_s + 1


def test_a_replayer_that_lost_its_lock_claims_no_further_batch(
    redis_url: str, redis_client: redis.Redis
) -> None:
    defer_tasks(redis_url, redis_client, 10)
    settings = gate_settings(redis_url, budget_units=1e9, replay_batch_size=5)
    now = [0.0]
    broker = StallAfterMove(redis_client, settings, now)
    replayer = Replayer(settings, broker=broker, gate=redis_client, monotonic=lambda: now[0])
    assert replayer.acquire()
    assert replayer.pass_once() == {"to_free": 5, "lock_lost": 1}
    # Found lost before the second claim: nothing claimed into (nor re-registered for) the
    # tenure that ended.
    assert claimed(redis_client) == 0 and redis_client.llen("defer") == 5


class FailingMove(RedisBroker):
    """A broker whose first batch move fails, after every decision of the batch was made."""

    failures = 1

    def hand_on(self, batch: list[Taken]) -> None:
        if self.failures:
            self.failures -= 1
            raise redis.ConnectionError("the broker went away before the move")
        super().hand_on(batch)


def test_an_error_between_a_batchs_decisions_and_its_move_loses_and_doubles_nothing(
    redis_url: str, redis_client: redis.Redis
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 30)
    settings = gate_settings(redis_url, budget_units=1e9, replay_batch_size=10)
    broker = FailingMove(redis_client, settings)
    replayer = Replayer(settings, broker=broker, gate=redis_client)
    first = replayer.run(threading.Event(), once=True)
    assert first == {"pass_failed": 1}
    assert claimed(redis_client) == 10 and redis_client.llen("defer") == 20
    assert not placed(redis_client)
    second = Replayer(settings, broker=broker, gate=redis_client).run(threading.Event(), True)
    # The failed batch's messages were decided and their handoffs kept: handed on as decided.
    assert second == {"handed_on_again": 10, "to_free": 20}
    assert placed(redis_client) == Counter(jobs) and claimed(redis_client) == 0


class FailingSecondMove(RedisBroker):
    """A broker whose second batch move fails (the first is made)."""

    moves = 0

    def hand_on(self, batch: list[Taken]) -> None:
        self.moves += 1
        if self.moves == 2:
            raise redis.ConnectionError("the broker went away before the move")
        super().hand_on(batch)


def test_a_pass_that_fails_midway_still_counts_what_it_moved(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # `replay --once` printed `pass_failed=1` alone for a pass that had handed on 1,257
    # messages before its connection was cut (an audit on RabbitMQ).
    defer_tasks(redis_url, redis_client, 30)
    settings = gate_settings(redis_url, budget_units=1e9, replay_batch_size=10)
    broker = FailingSecondMove(redis_client, settings)
    counts = Replayer(settings, broker=broker, gate=redis_client).run(threading.Event(), True)
    assert counts == {"to_free": 10, "pass_failed": 1}
    assert len(placed(redis_client)) == 10


def test_a_replayer_killed_before_a_batchs_move_leaves_it_to_be_handed_on_once(
    redis_url: str, redis_client: redis.Redis
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 30)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(GATEKEEPER_REDIS_URL=redis_url, GATEKEEPER_DWELL_GATE_ENABLED="true",
               GATEKEEPER_CANARY_PERCENT="100", GATEKEEPER_BUDGET_UNITS="1e9",
               GATEKEEPER_REPLAY_LOCK_TTL_S="1", GATEKEEPER_REPLAY_BATCH_SIZE="10",
               GATEKEEPER_TEST_KILL_AT="15", PYTHONPATH=str(REPO_ROOT))  # fmt: skip
    killed = subprocess.run([sys.executable, "-m", "tests.apps.killed_replayer"], env=env,
                            capture_output=True, cwd=REPO_ROOT, timeout=60)  # fmt: skip
    assert killed.returncode == -9, killed.stderr.decode()
    # SIGKILLed before the move of its 2nd batch: the 1st moved, the 2nd decided and
    # claimed, the 3rd still in defer.
    assert sum(placed(redis_client).values()) == 10
    assert claimed(redis_client) == 10 and redis_client.llen("defer") == 10

    # Its lock and its tenure's heartbeat expire (1 s); a successor takes back its claims.
    def gone() -> bool:
        heartbeats = list(redis_client.scan_iter(match="defer:replayer:*"))
        return not (redis_client.exists(KEYS.replayer_lock) or heartbeats)

    assert wait_until(gone, timeout_s=5)
    settings = gate_settings(redis_url, budget_units=1e9, replay_lock_ttl_s=1)
    counts = Replayer(settings, broker=redis_client, gate=redis_client).run(
        threading.Event(), once=True
    )
    assert counts == {"handed_on_again": 10, "to_free": 10}
    assert placed(redis_client) == Counter(jobs)  # each once: none lost, none doubled


def test_a_move_to_a_target_that_is_not_a_list_moves_nothing_and_loses_nothing(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.rpush("proc", b"m1", b"m2", b"m3")
    redis_client.set("heartbeat", 1)
    redis_client.set("bad", "not a list")
    move = redis_client.register_script(load_lua("move.lua"))
    with pytest.raises(redis.ResponseError, match="target bad holds a string"):
        move(keys=["proc", "heartbeat", "free", "bad", "free"],
             args=[b"m1", b"n1", b"m2", b"n2", b"m3", b"n3"])  # fmt: skip
    assert redis_client.lrange("proc", 0, -1) == [b"m1", b"m2", b"m3"]  # all still claimed
    assert redis_client.llen("free") == 0


@pytest.mark.parametrize("refusal", ["heartbeat_lapsed", "one_copy_taken_back"])
def test_messages_whose_move_is_refused_are_counted_given_back_and_handed_on_later(
    redis_url: str, redis_client: redis.Redis, refusal: str
) -> None:
    # Between the lock's last check and the batch's move (a replayer paused there) either the
    # tenure's heartbeat lapses (move.lua refuses the whole batch) or a successor takes one
    # claimed copy back to defer (move.lua refuses that one). The pass must not count what
    # did not move as handed on, nor forget its deadline: it waits for the lock's holder.
    jobs = defer_tasks(redis_url, redis_client, 5)
    settings = gate_settings(redis_url, budget_units=1e9, replay_batch_size=10)
    replayer = Replayer(settings, broker=redis_client, gate=redis_client)
    assert replayer.acquire()
    broker = replayer.broker
    assert isinstance(broker, RedisBroker) and broker.claims is not None
    claims, hand_on = broker.claims, broker.hand_on

    def paused_before_the_move(batch: list[Taken]) -> None:
        if refusal == "heartbeat_lapsed":
            redis_client.delete(claims.heartbeat_of(claims.tenure))
        else:
            assert redis_client.lrem(batch[2].at, 1, batch[2].raw) == 1
            redis_client.lpush("defer", batch[2].raw)
        hand_on(batch)

    broker.hand_on = paused_before_the_move  # type: ignore[method-assign]
    counts = replayer.pass_once()
    left = 5 if refusal == "heartbeat_lapsed" else 1
    assert counts == +Counter({"given_back": left, "to_free": 5 - left}), counts
    assert redis_client.llen("free") == 5 - left
    assert claimed(redis_client) + redis_client.llen("defer") == left
    assert redis_client.zcard(KEYS.deferred) == left  # their deadlines kept
    replayer.release()
    # The lock's next holder takes back what is claimed and hands each on once: as decided
    # the first time (its kept handoff), or scored again.
    counts = Replayer(settings, broker=redis_client, gate=redis_client).run(
        threading.Event(), once=True
    )
    assert sum(counts.values()) == left and set(counts) <= {"to_free", "handed_on_again"}, counts
    assert placed(redis_client) == Counter(jobs) and claimed(redis_client) == 0
    assert redis_client.zcard(KEYS.deferred) == 0


def moves_refused(monkeypatch: pytest.MonkeyPatch, client: redis.Redis) -> Callable[[], None]:
    """Every batch's moves refused: the tenure's heartbeat lapses between the lock's last
    check and the batch's move, as a paused replayer's would. Returns what undoes it."""
    hand_on = RedisBroker.hand_on

    def paused_before_the_move(broker: RedisBroker, batch: list[Taken]) -> None:
        assert broker.claims is not None
        client.delete(broker.claims.heartbeat_of(broker.claims.tenure))
        hand_on(broker, batch)

    monkeypatch.setattr(RedisBroker, "hand_on", paused_before_the_move)
    return lambda: monkeypatch.setattr(RedisBroker, "hand_on", hand_on)


def test_replay_once_that_gave_messages_back_exits_1_saying_how_many(
    redis_url: str,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A cron job or a Kubernetes Job running `replay --once` must tell a pass that handed on
    # all it took from one whose moves were refused (its tenure's heartbeat lapses between
    # the lock's last check and the batch's move, as a paused replayer's would).
    jobs = defer_tasks(redis_url, redis_client, 5)
    moves_back = moves_refused(monkeypatch, redis_client)
    for name, value in (("REDIS_URL", redis_url), ("DWELL_GATE_ENABLED", "true"),
                        ("CANARY_PERCENT", "100"), ("BUDGET_UNITS", "1e9")):  # fmt: skip
        monkeypatch.setenv(f"GATEKEEPER_{name}", value)
    given_back = CliRunner().invoke(main, ["replay", "--once"])
    assert given_back.exit_code == 1, given_back.output
    said = given_back.output + capsys.readouterr().err  # one line for the refused moves
    assert said.count("event=replay_given_back reason=move_refused messages=5 ") == 1, said
    assert all(job in said for job in jobs)
    assert isinstance(given_back.exception, SystemExit)  # a message, not a traceback
    assert "given_back=5: 5 messages not handed on" in given_back.output, given_back.output
    assert not placed(redis_client) and claimed(redis_client) == 5
    # The next pass hands them on, and exits 0.
    moves_back()
    handed_on = CliRunner().invoke(main, ["replay", "--once"])
    assert handed_on.exit_code == 0, handed_on.output
    assert placed(redis_client) == Counter(jobs) and claimed(redis_client) == 0


def test_an_abandon_given_back_is_said_again_by_the_pass_that_hands_it_on_and_rowed_once(
    redis_url: str,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The README: an alert may repeat but is never lost. A task whose deadline passed in
    # defer, its move to the dead letters refused (the tenure ended before the move): the
    # next pass moves it and says its task_abandoned alert again; its row is written once.
    soon = {"headers": {"gatekeeper_deadline_s": 1, "gatekeeper_expected_service_s": 0}}
    (job,) = defer_tasks(redis_url, redis_client, 1, **soon)
    time.sleep(1.2)  # its deadline gone
    moves_back = moves_refused(monkeypatch, redis_client)
    for name, value in (("REDIS_URL", redis_url), ("DWELL_GATE_ENABLED", "true"),
                        ("CANARY_PERCENT", "100")):  # fmt: skip
        monkeypatch.setenv(f"GATEKEEPER_{name}", value)
    given_back = CliRunner().invoke(main, ["replay", "--once"])
    assert given_back.exit_code == 1, given_back.output
    said = given_back.output + capsys.readouterr().err
    assert f"reason=move_refused messages=1 queue=defer job_ids={job}" in said, said
    assert not redis_client.llen("dead_letter") and claimed(redis_client) == 1
    moves_back()
    handed_on = CliRunner().invoke(main, ["replay", "--once"])
    assert handed_on.exit_code == 0, handed_on.output
    said_again = handed_on.output + capsys.readouterr().err
    alerts = [line for line in said_again.splitlines() if "event=task_abandoned" in line]
    assert len(alerts) == 1 and f"job_id={job}" in alerts[0], said_again
    assert ids_in(redis_client, "dead_letter") == [job] and claimed(redis_client) == 0
    rows = [row for key in redis_client.scan_iter(match=f"{Keys().base}:window:*:rows")
            for row in redis_client.lrange(key, 0, -1)]  # fmt: skip
    assert len(rows) == 1 and b'"outcome": "abandoned"' in rows[0], rows
