"""A fault strikes the message it belongs to, not its batch: one record that cannot be read,
or one handoff that cannot be kept, fails its own message only; a batch's decisions that
got no answer are asked again; a message's count of failed replays starts again once a
replay hands it on; and a batch reads a record as the ledger reads it."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from gatekeeper.celery.batch import ReadRecord, _records
from gatekeeper.celery.deadletter import H_REPLAY_ERRORS
from gatekeeper.celery.replay import Replayer
from gatekeeper.core.headers import H_REPLAY_AFTER
from gatekeeper.defaults import RECORD_RETENTION_S
from gatekeeper.errors import GateUnreachable, LedgerUnavailable
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis import wire
from gatekeeper.redis.attempt import carried_publish
from gatekeeper.redis.breaker import no_retry
from gatekeeper.redis.connect import client_for
from gatekeeper.redis.decisions import read_records
from gatekeeper.redis.gate_batch import route_all
from gatekeeper.redis.handoff import HANDOFF_NONCE, KEEP_SHA, Handoff, Superseded, remember_all
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.scripts import load_lua
from gatekeeper.settings import GatekeeperSettings
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, initialised, queue_messages, wait_until
from tests.test_replay import claimed, defer_tasks, ids_in, replay_once

KEYS = Keys()


def test_one_unreadable_record_fails_its_own_message_not_its_batch(
    redis_url: str, redis_client: redis.Redis
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 20)
    redis_client.delete(KEYS.run(jobs[7], 1))
    redis_client.set(KEYS.run(jobs[7], 1), "not a hash")  # HGETALL: WRONGTYPE
    counts = replay_once(redis_url, redis_client, budget_units=1e9)
    assert counts == {"to_free": 19, "replay_error": 1}
    assert sorted(ids_in(redis_client, "free")) == sorted(jobs[:7] + jobs[8:])
    assert ids_in(redis_client, "defer") == [jobs[7]]


@contextmanager
def deferred_on_a_gate(
    redis_url: str, count: int, **overrides: Any
) -> Iterator[tuple[EmbeddedRedis, redis.Redis, GatekeeperSettings, list[str]]]:
    """``count`` tasks deferred (the free queue old) by a gate Redis of their own, the broker
    the suite's: that server, a client of it made as the replayer's own is (its timeouts),
    the settings, the task ids."""
    with EmbeddedRedis() as gate_server:
        gate = client_for(gate_server.url, 0.3)
        initialised(gate)
        settings = gate_settings(gate_server.url, max_queue_age_s=1.0, redis_timeout_s=0.3,
                                 breaker_open_s=0, **overrides)  # fmt: skip
        app = create_app(settings, redis_url)  # the broker stays up on redis_url
        gate.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})  # free is old
        jobs = [app.tasks["tests.embed"].apply_async((n,)).id for n in range(count)]
        gate.zrem(KEYS.free_waiting, "stale:1")
        yield gate_server, gate, settings, jobs


def held(client: redis.Redis) -> list[dict[str, Any]]:
    """Every message in defer or claimed by a replayer's tenure."""
    lists = ["defer", *client.scan_iter(match="defer:replaying*", _type="list")]
    return [m for name in lists for m in queue_messages(client, name)]


def test_a_gate_redis_that_stops_answering_mid_pass_strikes_no_message(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A failover or a restart of the gate's Redis is no fault of the messages: the pass
    # stops there and strikes none. Struck instead, every message in defer was held for
    # replay_backoff_max_s whatever its deadline, and five blips dead-lettered the queue (an
    # audit: a 2 s failover abandoned 1,300 tasks with 20 s of slack left).
    with deferred_on_a_gate(redis_url, 10, replay_batch_size=4, budget_units=1e9) as (
        gate_server, gate, settings, jobs
    ):  # fmt: skip
        replayer = Replayer(settings, broker=redis_client, gate=gate)
        take_batches = replayer.broker.take_batches
        assert gate_server.process is not None
        pid = gate_server.process.pid

        def the_gate_hangs_after_the_first_claim(queue: str, size: int) -> Any:
            for batch in take_batches(queue, size):
                os.kill(pid, signal.SIGSTOP)  # its records not read yet: no answer comes
                yield batch

        replayer.broker.take_batches = the_gate_hangs_after_the_first_claim  # type: ignore[method-assign]
        assert replayer.acquire()
        try:
            with pytest.raises(GateUnreachable):  # run() logs replay_pass_failed, waits, goes on
                replayer.pass_once()
        finally:
            os.kill(pid, signal.SIGCONT)
        # The batch stays claimed by the tenure (nothing written to the queues while the
        # gate is silent), taken back by the next pass; the rest were never taken.
        assert claimed(redis_client) == 4
        messages = held(redis_client)
        assert sorted(m["headers"]["id"] for m in messages) == sorted(jobs)  # none moved
        for message in messages:
            assert H_REPLAY_ERRORS not in message["headers"]  # no strike
            assert H_REPLAY_AFTER not in message["headers"]  # no backoff: due next pass
        assert not redis_client.exists("dead_letter", "free", "reserved")
        replayer.broker.take_batches = take_batches  # type: ignore[method-assign]
        assert replayer.acquire()  # the gate answers again
        second = replayer.pass_once()
    assert second == {"to_free": 10}, second
    assert sorted(ids_in(redis_client, "free")) == sorted(jobs)
    assert claimed(redis_client) == 0 and redis_client.llen("defer") == 0


def test_a_gate_redis_that_stops_answering_at_an_abandonment_strikes_no_message(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # The records read, then the gate goes silent as the first abandoned row is written: that
    # raw timeout struck the message (a reviewer) where the reads' stopped the pass.
    with deferred_on_a_gate(redis_url, 3) as (gate_server, gate, settings, jobs):
        later = time.time() + 120  # past their 60 s deadlines: each is abandoned
        replayer = Replayer(settings, broker=redis_client, gate=gate, clock=lambda: later)
        assert gate_server.process is not None
        pid, write = gate_server.process.pid, replayer.runs.abandon

        def silent_at_the_first_row(*args: Any, **kwargs: Any) -> Any:
            os.kill(pid, signal.SIGSTOP)
            return write(*args, **kwargs)

        replayer.runs.abandon = silent_at_the_first_row  # type: ignore[method-assign]
        assert replayer.acquire()
        try:
            with pytest.raises(LedgerUnavailable):  # the pass stops (run() says why)
                replayer.pass_once()
        finally:
            os.kill(pid, signal.SIGCONT)
    messages = held(redis_client)
    assert sorted(m["headers"]["id"] for m in messages) == sorted(jobs)  # none moved
    assert not [m["headers"] for m in messages if H_REPLAY_ERRORS in m["headers"]]  # none struck
    assert not redis_client.exists("dead_letter")


def test_one_handoff_that_cannot_be_kept_fails_its_own_only(
    redis_url: str, redis_client: redis.Redis
) -> None:
    runs = RunLedger.from_settings(redis_client, gate_settings(redis_url))
    redis_client.set(KEYS.run("bad", 1), "not a hash")  # HGET: WRONGTYPE
    for job in ("one", "two", "moved"):  # the decision's nonce, as gate.lua writes it
        redis_client.hset(KEYS.run(job, 1), "nonce", "decided" if job != "moved" else "other")
    handoff = Handoff("free", {"a": 1, "gatekeeper_nonce": "decided"}, ())
    kept = [(job, 1, f"nonce-{job}", handoff) for job in ("one", "bad", "two", "moved")]
    first, bad, second, moved = remember_all(runs, kept)
    assert first is None and second is None
    assert isinstance(bad, redis.ResponseError) and "WRONGTYPE" in str(bad)
    assert isinstance(moved, Superseded)  # the record holds another decision: nothing kept
    assert not redis_client.exists(KEYS.handoff("moved", 1))
    assert redis_client.hget(KEYS.run("moved", 1), HANDOFF_NONCE) is None
    for job in ("one", "two"):  # the nonce in the record, the handoff in its own key
        assert redis_client.hget(KEYS.run(job, 1), HANDOFF_NONCE) == f"nonce-{job}".encode()
        kept_handoff = json.loads(redis_client.get(KEYS.handoff(job, 1)))
        assert kept_handoff == {"q": "free", "s": {"/a": 1, "nonce": "decided"}, "d": [],
                                "w": 0.0}  # fmt: skip
        assert 0 < redis_client.ttl(KEYS.handoff(job, 1)) <= RECORD_RETENTION_S


def test_a_replay_that_hands_a_message_on_drops_its_count_of_failed_replays(
    redis_url: str, redis_client: redis.Redis
) -> None:
    defer_tasks(redis_url, redis_client, 1)
    message = json.loads(redis_client.rpop("defer"))
    message["headers"][H_REPLAY_ERRORS] = 4  # failed four replays before this one
    redis_client.lpush("defer", json.dumps(message))
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})  # still old
    assert replay_once(redis_url, redis_client, max_queue_age_s=1.0) == {"deferred_again": 1}
    (parked,) = [json.loads(raw) for raw in redis_client.lrange("defer", 0, -1)]
    assert H_REPLAY_ERRORS not in parked["headers"]  # the next failure is the first in a row


class StallsTheFirstBatch(redis.Connection):
    """A real connection; the first batch of gate scripts it sends finds the server asleep
    (``DEBUG SLEEP``, sent just before from ``side``) for longer than the read timeout: the
    scripts run once the server wakes, and their replies are never read. (Sent through the
    line's socket, the batch is stalled by the ``stalled`` fixture instead.)"""

    side: redis.Connection | None = None

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        side = StallsTheFirstBatch.side
        if (
            side is not None
            and isinstance(command, list)
            and b"".join(command).count(b"EVALSHA") > 1
        ):
            StallsTheFirstBatch.side = None
            side.send_command("DEBUG", "SLEEP", "0.3")
            time.sleep(0.02)  # asleep before the pipeline arrives
        super().send_packed_command(command, check_health)


@pytest.fixture(params=["socket", "redis-py"])
def stalled(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the gate's line sends a batch: straight through its socket (hiredis packs), or
    through redis-py's connection (no hiredis), whose ``send_packed_command`` stalls it."""
    if request.param == "redis-py":
        monkeypatch.setattr(wire, "RAW", False)
        return request.param
    send_many = wire.Channel.send_many

    def stalling(line: wire.Channel, commands: Any, first: bool) -> None:
        side = StallsTheFirstBatch.side
        if side is not None and sum(c[0] == "EVALSHA" for c in commands) > 1:
            StallsTheFirstBatch.side = None
            side.send_command("DEBUG", "SLEEP", "0.3")
            time.sleep(0.02)  # asleep before the batch arrives
        send_many(line, commands, first)

    monkeypatch.setattr(wire.Channel, "send_many", stalling)
    return request.param


def test_a_batch_whose_decisions_time_out_is_answered_with_the_decisions_made(
    redis_url: str, redis_client: redis.Redis, stalled: str
) -> None:
    jobs = defer_tasks(redis_url, redis_client, 10)
    settings = gate_settings(redis_url, budget_units=1e9)
    gate = redis.Redis.from_url(redis_url, socket_timeout=0.2, connection_class=StallsTheFirstBatch,
                                **no_retry())  # fmt: skip
    replayer = Replayer(settings, broker=redis_client, gate=gate)
    assert replayer.acquire()
    side = redis.Redis.from_url(redis_url, single_connection_client=True).connection
    assert side is not None  # its own connection, across redis-py 5 to 8
    StallsTheFirstBatch.side = side
    try:
        assert replayer.pass_once() == {"to_free": 10}
        assert StallsTheFirstBatch.side is None  # it did stall
    finally:
        StallsTheFirstBatch.side = None
        side.disconnect()
    # Each message carries the decision the gate recorded for it (none orphaned, none twice).
    carried = {m["headers"]["id"]: m["headers"]["gatekeeper_nonce"]
               for m in queue_messages(redis_client, "free")}  # fmt: skip
    assert carried == {job: redis_client.hget(KEYS.run(job, 1), "nonce").decode() for job in jobs}
    replayer.release()


def test_a_batch_reads_a_cut_record_as_the_ledger_does(
    redis_url: str, redis_client: redis.Redis
) -> None:
    runs = RunLedger.from_settings(redis_client, gate_settings(redis_url))
    redis_client.hset(KEYS.run("cut", 1), mapping={"nonce": "n", "decision": "admit_free",
                                                   "kept": "1000|2000|3|42"})  # fmt: skip
    (record,) = _records([ReadRecord("cut", 1)], runs)
    assert record == runs.fields("cut", 1)
    assert record["window"] == "42"  # what as_scored releases an admission from


@pytest.mark.parametrize("raw", [True, False], ids=["socket", "redis-py"])
def test_a_batch_sent_to_a_server_that_lost_its_scripts_is_decided_once_each(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, raw: bool
) -> None:
    if raw and not wire.RAW:
        pytest.skip("the raw line needs hiredis")
    monkeypatch.setattr(wire, "RAW", raw)
    jobs = defer_tasks(redis_url, redis_client, 10)
    redis_client.script_flush()  # a restart or a failover: every script of the batch NOSCRIPT
    assert replay_once(redis_url, redis_client, budget_units=1e9) == {"to_free": 10}
    carried = {m["headers"]["id"]: m["headers"]["gatekeeper_nonce"]
               for m in queue_messages(redis_client, "free")}  # fmt: skip
    assert carried == {job: redis_client.hget(KEYS.run(job, 1), "nonce").decode() for job in jobs}
    scored = Counter(r.job_id for r in read_records(redis_client, KEYS, 0).records)
    assert scored == {job: 2 for job in jobs}  # deferred at publish, admitted once by the replay


def keeps(commands: Any) -> bool:
    """Whether a run ledger's round trip keeps handoffs (``keep.lua``)."""
    return any(command[:2] == ["EVALSHA", KEEP_SHA] for command in commands)


def failing_keep(
    send_all: Callable[[Any], list[Any]], client: redis.Redis, how: str
) -> Callable[[Any], list[Any]]:
    """``send_all`` (a run ledger's round trip) whose handoff keeps (:func:`keeps`) fail on
    the real server: ``refused`` (out of memory for that round trip: both writes refused),
    ``unanswered`` (written, the replies lost), ``unsent`` (not sent: a restart, no answer),
    ``cut_short`` (the process stops before it sends them)"""

    def keep(commands: Any) -> list[Any]:
        if not keeps(commands):
            return send_all(commands)
        if how == "unanswered":
            client.script_load(load_lua("keep.lua"))  # written (not refused as unknown)
            send_all(commands)
            return [redis.TimeoutError("Timeout reading from socket")] * len(commands)
        if how == "unsent":
            return [redis.ConnectionError("Connection refused")] * len(commands)
        if how == "cut_short":
            raise KeyboardInterrupt
        client.config_set("maxmemory", 1)
        try:
            return send_all(commands)
        finally:
            client.config_set("maxmemory", 0)

    return keep


def keeps_fail(
    monkeypatch: pytest.MonkeyPatch, client: redis.Redis, how: str
) -> Callable[[], None]:
    """Every run ledger's handoff keeps fail (:func:`failing_keep`), a CLI's too, until the
    function returned is called."""
    send_all = RunLedger.send_all
    monkeypatch.setattr(RunLedger, "send_all", lambda self, commands: failing_keep(
        functools.partial(send_all, self), client, how)(commands))  # fmt: skip
    return lambda: monkeypatch.setattr(RunLedger, "send_all", send_all)


def keep_fails(replayer: Replayer, client: redis.Redis, how: str = "refused") -> None:
    """The replayer's handoff keeps fail on the real server (:func:`failing_keep`)."""
    send_all = failing_keep(replayer.runs.send_all, client, how)
    replayer.runs.send_all = send_all  # type: ignore[method-assign]


def scored_by_a_killed_pass(replayer: Replayer, broker: redis.Redis, gate: redis.Redis) -> str:
    """A pass scored the one deferred message and died before its handoff: the queue it
    decided."""
    (message,) = held(broker)
    headers = message["headers"]
    fields = gate.hgetall(KEYS.run(headers["id"], headers["gatekeeper_attempt"]))
    label = {k.decode(): v.decode() for k, v in fields.items()}.get("label", "")
    publish = carried_publish(headers, "replay", label)
    return str(route_all(replayer.pipeline, [publish])[0].queue)


@pytest.mark.parametrize("from_", ["a_killed_pass", "the_keep"])
def test_a_gate_redis_out_of_memory_sends_a_held_message_to_reserved_not_the_dead_letters(
    redis_url: str, redis_client: redis.Redis, from_: str
) -> None:
    # A reviewer: as_scored's write of free_admitted, refused by a Redis out of memory,
    # struck the message five times and dead-lettered it (no abandonment, no failure in the
    # backend), where before it went to reserved (the gate script refused) and ran.
    with deferred_on_a_gate(redis_url, 1, replay_backoff_s=0.05, replay_backoff_max_s=0.05) as (
        _server, gate, settings, jobs
    ):  # fmt: skip
        replayer = Replayer(settings, broker=redis_client, gate=gate)
        assert replayer.acquire()
        if from_ == "a_killed_pass":
            assert scored_by_a_killed_pass(replayer, redis_client, gate) == "free"
            gate.config_set("maxmemory", 1)
        else:
            send_all = replayer.runs.send_all

            def full_from_the_keep_on(commands: Any) -> list[Any]:
                if keeps(commands):
                    gate.config_set("maxmemory", 1)
                return send_all(commands)

            replayer.runs.send_all = full_from_the_keep_on  # type: ignore[method-assign]
        try:
            for _ in range(8):
                with contextlib.suppress(LedgerUnavailable, redis.RedisError):
                    replayer.pass_once()  # (its pass_completed write is refused too)
                time.sleep(0.1)
        finally:
            gate.config_set("maxmemory", 0)
        assert replayer.counts["to_reserved"] == 1, dict(replayer.counts)
        assert not replayer.counts["replay_error"]
        assert not queue_messages(redis_client, "dead_letter")
        assert ids_in(redis_client, "reserved") == jobs


def test_a_message_scored_never_handed_on_past_its_deadline_waits_out_an_open_breaker(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: taken as the record's own before the deadline check, its admission given
    # back while the gate's breaker was open (a timeout a moment before) was refused, and
    # the message struck and held for replay_backoff_max_s. The breaker's refusal is no
    # answer (nothing asked): the pass stops, nothing struck, and the next one abandons it.
    with deferred_on_a_gate(redis_url, 1, replay_backoff_max_s=30) as (
        _server, gate, settings, _jobs
    ):  # fmt: skip
        settings = settings.model_copy(update={"breaker_open_s": 0.5})
        first = Replayer(settings, broker=redis_client, gate=gate)
        assert scored_by_a_killed_pass(first, redis_client, gate) == "free"
        later = time.time() + 120
        replayer = Replayer(settings, broker=redis_client, gate=gate, clock=lambda: later)
        replayer._last_sweep = later  # no sweep in these passes
        assert replayer.pipeline.store.breaker is not None
        replayer.pipeline.store.breaker.failed(redis.TimeoutError("a blip"))
        assert replayer.acquire()
        # Since the undo is unscore.lua's, asked of Redis itself (not through the publish
        # path's breaker), an open breaker delays nothing: abandoned at once, not struck.
        assert dict(replayer.pass_once()) == {"dead_lettered": 1}


def test_a_failover_met_at_a_held_admissions_release_strikes_no_message(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: a READONLY reply (the gate's Redis a replica after a failover) is no answer
    # to the breaker, but the replayer struck the message whose release met it: held for
    # replay_backoff_max_s and one strike nearer the dead letters (older than this session).
    with deferred_on_a_gate(redis_url, 1) as (server, gate, settings, jobs):
        settings = settings.model_copy(update={"breaker_open_s": 5.0})
        first = Replayer(settings, broker=redis_client, gate=gate)
        assert scored_by_a_killed_pass(first, redis_client, gate) == "free"
        replayer = Replayer(settings, broker=redis_client, gate=gate)
        replayer._last_sweep = float("inf")  # no sweep in this pass
        assert replayer.acquire()
        with EmbeddedRedis() as other:  # B takes A's data; A turns a replica of B
            b = redis.Redis.from_url(other.url)
            b.replicaof("127.0.0.1", server.port)
            assert wait_until(lambda: b.exists(KEYS.run(jobs[0], 1)) == 1, 10)
            b.replicaof("NO", "ONE")
            gate.replicaof("127.0.0.1", other.port)
            assert wait_until(
                lambda: gate.info("replication").get("master_link_status") == "up", 10
            )
            try:
                with pytest.raises(LedgerUnavailable, match="READONLY"):
                    replayer.pass_once()
                assert [H_REPLAY_ERRORS in m["headers"] for m in held(redis_client)] == [False]
            finally:
                gate.replicaof("NO", "ONE")
