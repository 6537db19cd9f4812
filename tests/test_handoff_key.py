"""The replayer's handoff is kept in a key of its own, beside the record, which stays a compact
hash (kept in the record, its JSON made the record a hash table for two days), for the
record's TTL; a message that comes back (or a twin of it, replayed later) is handed on as the
handoff kept for its nonce says, in the key or, written by an older replayer, in the
record."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.celery.deadletter import unanswered
from gatekeeper.celery.replay import Replayer
from gatekeeper.ops import dead_letter
from gatekeeper.ops.cli import main
from gatekeeper.redis.handoff import (
    HANDOFF,
    HANDOFF_FROM,
    HANDOFF_NONCE,
    Handoff,
    Superseded,
    as_scored,
    packed,
    recalled,
    remember_all,
)
from gatekeeper.redis.keys import ATTEMPTS, Keys
from gatekeeper.redis.runs import RunLedger
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, queue_messages, running_worker, wait_until
from tests.test_broker_faults import rows_of
from tests.test_dead_letter_result import cli_settings, dead_lettered
from tests.test_replay import claimed, defer_tasks, replay_once
from tests.test_replay_batch import FailingMove
from tests.test_replay_strikes import keep_fails, keeps, keeps_fail, scored_by_a_killed_pass
from tests.test_worker_ledger import runs as recorded_runs

KEYS = Keys()
COMPACT = (b"ziplist", b"listpack")  # a small hash, on Redis 6.2 and 7


def replayed(redis_url: str, client: redis.Redis) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """One task deferred and replayed to free: its id, the parked message and the one sent."""
    (job,) = defer_tasks(redis_url, client, 1)
    (parked,) = queue_messages(client, "defer")
    assert replay_once(redis_url, client) == {"to_free": 1}
    (sent,) = queue_messages(client, "free")
    client.delete("free")
    return job, parked, sent


def record_of(client: redis.Redis, job: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(KEYS.run(job, 1)).items()}


def handoff(queue: str, replays: int, nonce: str) -> str:
    changes = {"gatekeeper_replays": replays, "gatekeeper_nonce": nonce}
    return json.dumps({"queue": queue, "set": changes, "drop": [], "wait_s": 0.0})


def test_a_replayed_record_stays_compact_and_its_handoff_is_kept_beside_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    job, parked, sent = replayed(redis_url, redis_client)
    record = record_of(redis_client, job)
    assert record[HANDOFF_NONCE] == parked["headers"]["gatekeeper_nonce"]
    assert record["nonce"] == sent["headers"]["gatekeeper_nonce"] != record[HANDOFF_NONCE]
    assert HANDOFF not in record and HANDOFF_FROM not in record
    assert redis_client.object("encoding", KEYS.run(job, 1)) in COMPACT
    text = redis_client.get(KEYS.handoff(job, 1)).decode()
    kept = recalled(record, record[HANDOFF_NONCE], text)
    assert kept is not None and kept.queue == "free"
    assert kept.set["gatekeeper_nonce"] == record["nonce"] and "gatekeeper_nonce" not in text
    # As long as the record (the gate set its TTL when it scored the replay), give or take
    # the moment between the two writes.
    record_ttl = redis_client.ttl(KEYS.run(job, 1))
    assert record_ttl - 2 <= redis_client.ttl(KEYS.handoff(job, 1)) <= record_ttl


def test_a_packed_handoff_reads_back_as_it_was_kept() -> None:
    # Gatekeeper's header names lose their prefix in the key; any other name keeps its own,
    # one that starts with the mark ('/') included. A document of the spelled-out form (an
    # older replayer's key) still reads.
    names = {"gatekeeper_replays": 2, "x-trace": "t", "/odd": None, "gatekeeper_": 1,
             "gatekeeper_/x": 3, "/x": 4, "x": 5}  # fmt: skip
    kept = Handoff("reserved", names, ("gatekeeper_replay_after", "/x"), 1.5)
    text = packed(kept)
    assert "gatekeeper_replay" not in text and " " not in text
    record = {HANDOFF_NONCE: "n"}
    assert recalled(record, "n", text) == kept
    assert recalled(record, "n", handoff("free", 3, "m")) == Handoff(
        "free", {"gatekeeper_replays": 3, "gatekeeper_nonce": "m"}, ()
    )
    assert recalled(record, "n", '{"q": "free"}') is None  # not a whole document: none kept


def test_a_twin_replayed_in_a_later_batch_is_handed_on_as_the_first(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Two copies of one deferred message (a publish sent twice: one nonce), in two batches:
    # the second is handed on as the first was, with its nonce, not scored a second time.
    (job,) = defer_tasks(redis_url, redis_client, 1)
    (parked,) = queue_messages(redis_client, "defer")
    redis_client.lpush("defer", json.dumps(parked))
    counts = replay_once(redis_url, redis_client, replay_batch_size=1)
    assert counts == {"to_free": 1, "handed_on_again": 1}
    first, second = queue_messages(redis_client, "free")
    assert first["headers"]["gatekeeper_nonce"] == second["headers"]["gatekeeper_nonce"]
    assert record_of(redis_client, job)["nonce"] == first["headers"]["gatekeeper_nonce"]


def test_an_original_that_comes_back_is_handed_on_as_its_kept_handoff_says(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # As on RabbitMQ (an ack lost): the original comes back while its handoff is kept. It is
    # handed on as the key says (a queue and a count the gate would not have chosen), not
    # scored a second time.
    job, parked, sent = replayed(redis_url, redis_client)
    redis_client.set(
        KEYS.handoff(job, 1), handoff("reserved", 7, sent["headers"]["gatekeeper_nonce"])
    )
    redis_client.lpush("defer", json.dumps(parked))
    assert replay_once(redis_url, redis_client) == {"handed_on_again": 1}
    (again,) = queue_messages(redis_client, "reserved")
    assert again["headers"]["gatekeeper_replays"] == 7
    assert again["headers"]["gatekeeper_nonce"] == sent["headers"]["gatekeeper_nonce"]
    assert not queue_messages(redis_client, "free") and not queue_messages(redis_client, "defer")


def test_an_older_replayers_handoff_in_the_record_is_still_handed_on(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # An older replayer kept the handoff in the record (``handoff_from``, ``handoff``); a
    # newer one kept another, for another message of the attempt, in the key. Each message
    # comes back to the handoff kept for its own nonce.
    job, parked, _ = replayed(redis_url, redis_client)
    old = parked["headers"]["gatekeeper_nonce"]
    older = {HANDOFF_FROM: old, HANDOFF: handoff("reserved", 7, "from-old")}
    redis_client.hset(KEYS.run(job, 1), mapping=older)
    redis_client.hset(KEYS.run(job, 1), HANDOFF_NONCE, "newer")
    redis_client.set(KEYS.handoff(job, 1), handoff("free", 9, "from-newer"))
    other = json.loads(json.dumps(parked))
    other["headers"]["gatekeeper_nonce"] = "newer"
    redis_client.lpush("defer", json.dumps(parked), json.dumps(other))
    assert replay_once(redis_url, redis_client) == {"handed_on_again": 2}
    (to_reserved,) = queue_messages(redis_client, "reserved")
    (to_free,) = queue_messages(redis_client, "free")
    assert to_reserved["headers"]["gatekeeper_replays"] == 7
    assert to_reserved["headers"]["gatekeeper_nonce"] == "from-old"
    assert to_free["headers"]["gatekeeper_replays"] == 9
    assert to_free["headers"]["gatekeeper_nonce"] == "from-newer"


def test_a_handoff_key_that_cannot_be_read_fails_its_own_message_only(
    redis_url: str, redis_client: redis.Redis
) -> None:
    job, parked, _ = replayed(redis_url, redis_client)
    redis_client.delete(KEYS.handoff(job, 1))
    redis_client.hset(KEYS.handoff(job, 1), "not", "a string")  # GET: WRONGTYPE
    redis_client.lpush("defer", json.dumps(parked))
    assert replay_once(redis_url, redis_client) == {"replay_error": 1}
    (kept,) = queue_messages(redis_client, "defer")  # back in defer, never lost
    assert kept["headers"]["gatekeeper_nonce"] == parked["headers"]["gatekeeper_nonce"]
    assert redis_client.type(KEYS.handoff(job, 1)) == b"hash"  # left as it was


def test_a_requeue_keeps_its_handoff_and_a_second_one_hands_on_as_it_says(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = dead_lettered(redis_url, redis_client, monkeypatch)
    (dead,) = queue_messages(redis_client, "dead_letter")
    requeue = ["dead-letter", "requeue", job, "--deadline-s", "120"]
    done = CliRunner().invoke(main, requeue)
    assert done.exit_code == 0 and "to defer (reason" in done.output, done.output
    assert record_of(redis_client, job)[HANDOFF_NONCE] == dead["headers"]["gatekeeper_nonce"]
    assert json.loads(redis_client.get(KEYS.handoff(job, 1)))["q"] == "defer"
    assert redis_client.object("encoding", KEYS.run(job, 1)) in COMPACT
    # A requeue cut short between keeping its handoff and the move (here: its kept handoff
    # made distinct, the dead letter put back): the next requeue hands it on as the key
    # says, not scoring it again.
    redis_client.delete("defer")
    redis_client.set(KEYS.handoff(job, 1), handoff("reserved", 7, "kept"))
    redis_client.lpush("dead_letter", json.dumps(dead))
    again = CliRunner().invoke(main, requeue)
    assert again.exit_code == 0, again.output
    assert "to reserved (reason handed_on_again" in again.output, again.output
    (moved,) = queue_messages(redis_client, "reserved")
    assert moved["headers"]["gatekeeper_replays"] == 7
    assert moved["headers"]["gatekeeper_nonce"] == "kept"


def admissible_dead_letter(
    redis_url: str, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict[str, Any]]:
    """A task deferred (the age cap), its deadline passed in defer: abandoned to the dead
    letters, where a requeue admits it to free; its id and the dead letter. The CLI's
    settings set."""
    (job,) = defer_tasks(redis_url, client, 1, headers={"gatekeeper_deadline_s": 1})
    time.sleep(1.2)
    assert replay_once(redis_url, client) == {"dead_lettered": 1}
    (dead,) = queue_messages(client, "dead_letter")
    cli_settings(redis_url, monkeypatch)
    return job, dead


@pytest.mark.parametrize("fault", ["refused", "unanswered", "cut_short"])
def test_a_requeue_whose_handoff_is_not_kept_leaves_its_task_listed_and_the_next_one_moves_it(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    # Before: a requeue whose handoff's write the gate's Redis refused stopped with a
    # traceback, the admission its decision made held with no message; the next requeue was
    # then a duplicate_publish to reserved (as was one after a requeue cut short between its
    # decision and its handoff). Now the task stays in the dead letters, the decision undone
    # (refused: at once; cut short: by the next requeue), and the next requeue admits it once.
    job, dead = admissible_dead_letter(redis_url, redis_client, monkeypatch)
    restore = keeps_fail(monkeypatch, redis_client, fault)
    requeue = ["dead-letter", "requeue", job, "--deadline-s", "120"]
    failed = CliRunner().invoke(main, requeue)
    assert failed.exit_code == 1, failed.output
    said = {"refused": "refused the handoff of", "unanswered": "no answer keeping the handoff",
            "cut_short": "Aborted!"}[fault]  # fmt: skip
    assert said in failed.output, failed.output
    assert queue_messages(redis_client, "dead_letter") == [dead]  # listed, as it was
    assert not any(redis_client.llen(q) for q in ("free", "defer", "reserved"))
    if fault == "refused":  # undone at once: the record the message's, abandoned, none held
        record = record_of(redis_client, job)
        assert (record["nonce"], record["decision"], record.get("abandoned")) == (
            dead["headers"]["gatekeeper_nonce"], "defer", "1")  # fmt: skip
        assert redis_client.hlen(KEYS.inflight) == 0 and admitted_free(redis_client) == 0
    restore()
    again = CliRunner().invoke(main, requeue)
    assert again.exit_code == 0 and " to free " in again.output, again.output
    # Its new deadline said (an unanswered keep was kept: handed on as that requeue decided)
    assert "deadline in 1" in again.output and "event=deadline_moved" in again.output
    (moved,) = queue_messages(redis_client, "free")
    assert moved["headers"]["gatekeeper_nonce"] == record_of(redis_client, job)["nonce"]
    assert list(redis_client.hgetall(KEYS.inflight)) == [f"{job}:1".encode()]
    assert admitted_free(redis_client) == 1 and not queue_messages(redis_client, "dead_letter")


def test_a_requeue_whose_handoff_to_free_was_kept_before_a_rollback_goes_to_reserved(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reviewer: a requeue admitted the task to free and kept its handoff, then got no
    # answer; the operator rolled back; the next requeue handed it on to free as kept. Now
    # its admission is withdrawn (an `expired` row, the reservation given back) and it goes to
    # reserved, as the replayer withdraws a recalled handoff while the path is closed.
    job, _ = admissible_dead_letter(redis_url, redis_client, monkeypatch)
    restore = keeps_fail(monkeypatch, redis_client, "unanswered")
    requeue = ["dead-letter", "requeue", job, "--deadline-s", "120"]
    assert CliRunner().invoke(main, requeue).exit_code == 1
    restore()
    assert json.loads(redis_client.get(KEYS.handoff(job, 1)))["q"] == "free"  # kept for free
    rollback = ["flags", "set", "free_path_enabled", "false", "--reason", "page 1"]
    assert CliRunner().invoke(main, rollback).exit_code == 0
    again = CliRunner().invoke(main, requeue)
    assert again.exit_code == 0, again.output
    assert " to reserved (reason free_wait_expired" in again.output, again.output
    assert not queue_messages(redis_client, "free")
    (moved,) = queue_messages(redis_client, "reserved")
    said = moved["headers"]
    assert (said["gatekeeper_decision"], said["gatekeeper_reason"], said["gatekeeper_window"]) == (
        "reserved", "free_wait_expired", None)  # fmt: skip
    assert record_of(redis_client, job)["reason"] == "free_wait_expired"
    assert redis_client.hlen(KEYS.inflight) == 0  # the admission given back
    assert sorted(row["outcome"] for row in rows_of(redis_client)) == ["abandoned", "expired"]


@pytest.mark.parametrize("first", ["cut_short", "unsent", "out_of_memory"])
def test_a_refused_requeue_leaves_the_attempt_abandoned_as_it_was(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    # A reviewer: the undo set `abandoned` again only from the record as the failed requeue
    # read it, which a requeue cut short before (Ctrl-C, a restart) had cleared; and a Redis
    # that stays out of memory refused the undo of a decision that admitted nothing (its
    # first write could grow it). A publish of the id was then a duplicate_publish.
    job, dead = admissible_dead_letter(redis_url, redis_client, monkeypatch)
    requeue = ["dead-letter", "requeue", job, "--deadline-s", "120"]
    if first == "out_of_memory":  # decided reserved (no admission); full from the keep on
        redis_client.hset(KEYS.flags, "free_path_enabled", "false")
        send_all = RunLedger.send_all

        def full(self: RunLedger, commands: Any) -> list[Any]:
            if keeps(commands):
                redis_client.config_set("maxmemory", 1)
            return send_all(self, commands)

        monkeypatch.setattr(RunLedger, "send_all", full)
        try:
            refused = CliRunner().invoke(main, requeue)
        finally:
            redis_client.config_set("maxmemory", 0)
    else:
        restore = keeps_fail(monkeypatch, redis_client, first)
        assert CliRunner().invoke(main, requeue).exit_code == 1
        restore()
        restore = keeps_fail(monkeypatch, redis_client, "refused")
        refused = CliRunner().invoke(main, requeue)
        restore()
    assert "refused the handoff of" in refused.output, refused.output
    record = record_of(redis_client, job)
    assert (record["nonce"], record["decision"], record.get("abandoned")) == (
        dead["headers"]["gatekeeper_nonce"], "defer", "1")  # fmt: skip
    redis_client.hdel(KEYS.flags, "free_path_enabled")
    create_app(gate_settings(redis_url), redis_url).tasks["tests.embed"].apply_async(
        (0,), task_id=job)  # fmt: skip
    assert record_of(redis_client, job)["reason"] != "duplicate_publish"
    assert not [k for k in record_of(redis_client, job) if k.startswith("dup:")]


def test_a_requeue_while_a_publish_of_the_id_is_live_says_so_and_changes_nothing(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reviewer: the requeue was decided a duplicate_publish, whose handoff keep.lua never
    # keeps (the record holds the live publish's nonce): each requeue said "requeue it
    # again", and left a dup:<nonce> in the live record. Now it says why, and decides nothing.
    job, _ = admissible_dead_letter(redis_url, redis_client, monkeypatch)
    create_app(gate_settings(redis_url), redis_url).tasks["tests.embed"].apply_async(
        (0,), task_id=job)  # fmt: skip
    before = record_of(redis_client, job)
    requeue = ["dead-letter", "requeue", job, "--deadline-s", "120"]
    for _ in range(2):
        done = CliRunner().invoke(main, requeue)
        assert done.exit_code == 1 and f"a publish of {job} is live" in done.output, done.output
        assert "event=gate_decision" not in done.output
    assert record_of(redis_client, job) == before
    assert len(queue_messages(redis_client, "dead_letter")) == 1


def test_a_superseded_keep_is_an_answer_whatever_the_job_id(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: the error named the record's key, so a task id holding LOADING or READONLY
    # made it look like a replica's reply: no answer, the replayer's pass stopped.
    runs = RunLedger.from_settings(redis_client, gate_settings(redis_url))
    job = "nightly-LOADING-report"
    redis_client.hset(KEYS.run(job, 1), "nonce", "another decision")
    (error,) = remember_all(runs, [(job, 1, "m", Handoff("free", {"gatekeeper_nonce": "d"}, ()))])
    assert isinstance(error, Superseded) and not unanswered(error)


def test_a_decision_whose_handoff_was_kept_meanwhile_is_not_undone(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: a requeue of a twin in the dead letters (on RabbitMQ a replayer killed
    # between publishing a dead letter and acking it leaves one) could undo the replayer's
    # decision after its handoff was kept, and its copy then left with a nonce the record no
    # longer held. unscore.lua now refuses once a handoff is kept for the message.
    (job,) = defer_tasks(redis_url, redis_client, 1)
    (parked,) = queue_messages(redis_client, "defer")
    replayer = Replayer(gate_settings(redis_url), broker=redis_client, gate=redis_client)
    keep_fails(replayer, redis_client, "unanswered")  # kept, its replies lost
    assert dict(replayer.run(threading.Event(), once=True)) == {"pass_failed": 1}
    record = record_of(redis_client, job)
    decided = record["nonce"]
    assert record[HANDOFF_NONCE] == parked["headers"]["gatekeeper_nonce"] != decided
    as_scored(replayer.pipeline.store, job, 1, dict(record), dict(parked["headers"]))
    assert record_of(redis_client, job)["nonce"] == decided  # not undone
    assert list(redis_client.hgetall(KEYS.inflight)) == [f"{job}:1".encode()]


def test_one_requeue_at_a_time(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A requeue concurrent with another of the same task (two operators) found the other's
    # decision with no handoff kept yet, took it for one cut short and undid it: the copy
    # moved then carried a nonce the record no longer held. Requeues now take turns.
    job = dead_lettered(redis_url, redis_client, monkeypatch)
    monkeypatch.setattr(dead_letter, "REQUEUE_WAIT_S", 0.3)
    redis_client.set(KEYS.requeue_lock, "another requeue's", ex=30)
    requeue = ["dead-letter", "requeue", job, "--deadline-s", "120"]
    held = CliRunner().invoke(main, requeue)
    assert held.exit_code == 1 and "another dead-letter requeue is running" in held.output
    assert len(queue_messages(redis_client, "dead_letter")) == 1
    redis_client.delete(KEYS.requeue_lock)
    done = CliRunner().invoke(main, requeue)
    assert done.exit_code == 0 and "to defer (reason" in done.output, done.output
    assert not redis_client.exists(KEYS.requeue_lock)  # given back


def test_a_recall_to_free_while_the_path_is_closed_expires_to_reserved_charged_its_wait(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Reviewers: recalled to free (its copy lost, the original back in defer) after an
    # operator closed the path, it went to free; then, held in defer instead, the replayer's
    # own sweep gave its reservation back as purged, and its expiry charged nothing.
    job, parked, _ = replayed(redis_url, redis_client)
    redis_client.lpush("defer", json.dumps(parked))  # the original comes back
    redis_client.hset(KEYS.flags, "free_path_enabled", "false")  # an operator rolls back
    time.sleep(1)  # it waited
    settings = gate_settings(redis_url)
    counts = Replayer(settings, broker=redis_client, gate=redis_client).run(threading.Event(), True)
    assert counts == {"to_reserved": 1}, counts
    record = record_of(redis_client, job)
    assert (record["decision"], record["reason"]) == ("reserved", "free_wait_expired")
    (row,) = [row for row in rows_of(redis_client) if row["outcome"] == "expired"]
    assert 1 * 200 <= row["retry_tax"] <= 10 * 200  # the wait so far, up to the allowance
    (moved,) = queue_messages(redis_client, "reserved")
    assert moved["headers"]["gatekeeper_decision"] == "reserved"
    assert moved["headers"]["gatekeeper_nonce"] == record["nonce"]
    assert redis_client.llen("free") == 0 and redis_client.hlen(KEYS.inflight) == 0


def twin_in_free_original_back_path_closed(redis_url: str, client: redis.Redis) -> str:
    """A task replayed to free whose copy still waits there while its original comes back to
    defer (a replayer killed between its move and its ack; a publish sent twice), and the free
    path closed; returns its id."""
    job, parked, sent = replayed(redis_url, client)
    client.lpush("free", json.dumps(sent))
    client.lpush("defer", json.dumps(parked))
    client.hset(KEYS.flags, "free_path_enabled", "false")
    return job


def test_a_spare_recall_held_past_its_deadline_is_not_looked_at_every_pass(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # A reviewer: with a passed deadline skipping every hold, a twin recalled while the free
    # path was closed (its copy already run) was recalled and held again on every pass,
    # without a pause: 366 passes in 2 s. A hold is kept; a deferred task's backoff ends by
    # its deadline instead (tests/test_replay.py).
    defer_tasks(redis_url, redis_client, 1, headers={"gatekeeper_deadline_s": 5})
    (parked,) = queue_messages(redis_client, "defer")
    assert replay_once(redis_url, redis_client) == {"to_free": 1}
    with running_worker(redis_url, tmp_path / "w.log", queues="free"):
        assert wait_until(lambda: len(recorded_runs(redis_client)) == 1)  # its copy ran
    redis_client.lpush("defer", json.dumps(parked))  # its twin comes back
    redis_client.hset(KEYS.flags, "free_path_enabled", "false")
    time.sleep(max(0.0, parked["headers"]["gatekeeper_deadline_at"] - time.time()) + 0.2)
    replayer = Replayer(gate_settings(redis_url), broker=redis_client, gate=redis_client)
    stop = threading.Event()
    threading.Timer(2.0, stop.set).start()
    counts = replayer.run(stop)
    assert counts["held_free_path_closed"] <= 2, dict(counts)


def test_a_recall_withdrawn_while_its_twin_waits_in_free_runs_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # A reviewer: the copy of the kept handoff still waited in free (a replayer killed
    # between its move and its ack; a publish sent twice) when the path closed and the
    # original was recalled and withdrawn to reserved: both copies ran, the free one
    # untaxed with a reserved row. A free copy of a withdrawn admission is now skipped.
    job = twin_in_free_original_back_path_closed(redis_url, redis_client)
    settings = gate_settings(redis_url)
    counts = Replayer(settings, broker=redis_client, gate=redis_client).run(threading.Event(), True)
    assert counts == {"to_reserved": 1}, counts
    with running_worker(redis_url, tmp_path / "w.log", queues="free,reserved"):
        assert wait_until(lambda: redis_client.llen("free") + redis_client.llen("reserved") == 0)
        time.sleep(1.5)  # a second run, if any, would land now
    ran = [run["queue"] for run in recorded_runs(redis_client) if run["id"] == job]
    assert ran == ["reserved"], ran
    assert "event=duplicate_skipped" in (tmp_path / "w.log").read_text()


def test_a_withdrawn_recall_whose_copy_to_reserved_never_went_runs_once_after_a_reopen(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # A reviewer: the withdrawal was written, then the move to reserved failed (a replayer
    # killed or failing between its decisions and its move); the path reopened, the original
    # was recalled to free, and every free copy was skipped as a duplicate of a withdrawn
    # admission: the task never ran. A recall of a withdrawn admission now goes to reserved.
    job = twin_in_free_original_back_path_closed(redis_url, redis_client)
    settings = gate_settings(redis_url)
    failing = FailingMove(redis_client, settings)
    assert Replayer(settings, broker=failing, gate=redis_client).run(threading.Event(), True) == {
        "pass_failed": 1
    }  # decided (withdrawn), not moved
    assert record_of(redis_client, job)["reason"] == "free_wait_expired"
    redis_client.hdel(KEYS.flags, "free_path_enabled")  # the path reopens
    counts = Replayer(settings, broker=redis_client, gate=redis_client).run(threading.Event(), True)
    assert counts == {"to_reserved": 1}, counts
    with running_worker(redis_url, tmp_path / "w.log", queues="free,reserved"):
        assert wait_until(lambda: redis_client.llen("free") + redis_client.llen("reserved") == 0)
        time.sleep(1.5)
    ran = [run["queue"] for run in recorded_runs(redis_client) if run["id"] == job]
    assert ran == ["reserved"], ran


def test_a_dead_letter_requeue_of_a_withdrawn_recall_goes_to_reserved(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its kept handoff says free, but the replayer withdrew the admission since: a free copy
    of it is skipped, so to free it would never run (as the replayer's own recall)."""
    job, parked, _ = replayed(redis_url, redis_client)
    redis_client.lpush("defer", json.dumps(parked))
    redis_client.hset(KEYS.flags, "free_path_enabled", "false")
    settings = gate_settings(redis_url)
    counts = Replayer(settings, broker=redis_client, gate=redis_client).run(threading.Event(), True)
    assert counts == {"to_reserved": 1}
    redis_client.delete("reserved")  # as if its copy there were lost, and the original
    redis_client.lpush("dead_letter", json.dumps(parked))  # dead-lettered instead
    redis_client.hdel(KEYS.flags, "free_path_enabled")
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    done = CliRunner().invoke(main, ["dead-letter", "requeue", job, "--deadline-s", "120"])
    assert done.exit_code == 0, done.output
    assert redis_client.llen("free") == 0
    (moved,) = queue_messages(redis_client, "reserved")
    assert moved["headers"]["gatekeeper_decision"] == "reserved"


@pytest.mark.parametrize("fault", ["refused", "unanswered"])
def test_a_handoff_not_kept_holds_its_message_and_a_twin_later_goes_on_as_it(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str], fault: str
) -> None:
    # Before: a copy was handed on even when its handoff's write failed, and a twin of the
    # message (a publish sent twice) then took the decision as scored and never handed on:
    # it gave back the admission of the copy waiting in free. Now the message waits in defer
    # ("refused": Redis out of memory refused both writes; "unanswered": both were written,
    # their replies lost), and comes back handed on once; its twin goes on as it did.
    (job,) = defer_tasks(redis_url, redis_client, 1)
    twin = redis_client.lindex("defer", 0)
    nonce = json.loads(twin)["headers"]["gatekeeper_nonce"]
    replayer = Replayer(gate_settings(redis_url, replay_backoff_s=0.3), broker=redis_client,
                        gate=redis_client)  # fmt: skip
    keep_fails(replayer, redis_client, fault)
    if fault == "refused":
        assert dict(replayer.run(threading.Event(), once=True)) == {"handoff_unrecorded": 1}
        assert "event=replay_handoff_unrecorded" in capsys.readouterr().err
        (waiting,) = queue_messages(redis_client, "defer")
        assert waiting["headers"]["gatekeeper_nonce"] == nonce  # as it came
        assert replay_once(redis_url, redis_client) == {"not_due": 1}  # its backoff
        time.sleep(0.35)
    else:  # no answer: the pass stops, its batch claimed (as for any round trip's)
        assert dict(replayer.run(threading.Event(), once=True)) == {"pass_failed": 1}
        assert claimed(redis_client) == 1
    assert not queue_messages(redis_client, "free")
    expected = "to_free" if fault == "refused" else "handed_on_again"
    assert replay_once(redis_url, redis_client) == {expected: 1}
    (sent,) = queue_messages(redis_client, "free")
    held = redis_client.hgetall(KEYS.inflight)
    assert list(held) == [f"{job}:1".encode()]  # one admission: the refused one given back
    assert redis_client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 1
    redis_client.lpush("defer", twin)
    assert replay_once(redis_url, redis_client) == {"handed_on_again": 1}
    assert redis_client.hgetall(KEYS.inflight) == held
    copies = queue_messages(redis_client, "free")
    assert [m["headers"]["gatekeeper_nonce"] for m in copies] == [
        sent["headers"]["gatekeeper_nonce"]
    ] * 2


def test_a_decision_held_past_its_deadline_is_no_slack_miss_of_its_own_admission(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # A reviewer: a first attempt admitted to free by the replay, its handoff refused and the
    # deadline passing while it waited, was abandoned with the record's free_admitted, set by
    # the admission as_scored had given back: a slack miss the free path never had (enough
    # of them freeze it). Only an earlier attempt that ran free makes one
    # (tests/test_reused_id.py: the abandonment after a decision never handed on).
    (job,) = defer_tasks(redis_url, redis_client, 1, headers={"gatekeeper_deadline_s": 2.5})
    replayer = Replayer(gate_settings(redis_url, replay_backoff_s=3.0), broker=redis_client,
                        gate=redis_client)  # fmt: skip
    keep_fails(replayer, redis_client)
    assert dict(replayer.run(threading.Event(), once=True)) == {"handoff_unrecorded": 1}
    assert redis_client.hget(KEYS.run(job, 1), "free_admitted") == b"0"  # given back at once
    assert not redis_client.hgetall(KEYS.inflight)
    time.sleep(3.1)
    capsys.readouterr()
    assert replay_once(redis_url, redis_client) == {"dead_lettered": 1}
    assert "slack_miss=true" not in capsys.readouterr().err
    assert redis_client.hget(KEYS.run(job, 1), "free_admitted") == b"0"
    assert redis_client.hget(KEYS.totals, "slack_misses") is None
    assert not redis_client.hgetall(KEYS.inflight)


def test_a_handoff_key_refused_beside_its_nonce_written_is_scored_again(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: an ACL refused the handoff's key and let its nonce into the record; the
    # message, held, came back named as handed on with no handoff to read, and went to
    # reserved unverified while its admission stayed held. The nonce is now taken back.
    (job,) = defer_tasks(redis_url, redis_client, 1)
    redis_client.execute_command("ACL", "SETUSER", "nohandoff", "reset", "on", ">pw",
                                 "~gatekeeper:{default}:[^h]*", "~defer*", "~free*",
                                 "+@all")  # fmt: skip
    gate = redis.Redis.from_url(redis_url, username="nohandoff", password="pw")
    replayer = Replayer(gate_settings(redis_url, replay_backoff_s=0.3), broker=redis_client,
                        gate=gate)  # fmt: skip
    assert dict(replayer.run(threading.Event(), once=True)) == {"handoff_unrecorded": 1}
    assert redis_client.hget(KEYS.run(job, 1), "handoff_nonce") is None
    time.sleep(0.35)
    assert replay_once(redis_url, redis_client) == {"to_free": 1}
    assert list(redis_client.hgetall(KEYS.inflight)) == [f"{job}:1".encode()]


@pytest.mark.parametrize("fault", ["refused", "unanswered", "killed"])
def test_a_decision_made_in_process_held_or_killed_is_scored_again_as_the_gates(
    redis_url: str, redis_client: redis.Redis, fault: str
) -> None:
    # A reviewer: record.lua (a decision made in process: here the free path off) wrote no
    # prev_nonce, so its message, held (its handoff refused, or not answered) or left by a
    # killed pass, came back as a stranger's: to reserved unverified, the record left live
    # (the killed pass's case older than this session).
    (job,) = defer_tasks(redis_url, redis_client, 1)
    redis_client.hset(KEYS.flags, "free_path_enabled", "false")
    replayer = Replayer(gate_settings(redis_url, replay_backoff_s=0.3), broker=redis_client,
                        gate=redis_client)  # fmt: skip
    if fault == "killed":
        assert scored_by_a_killed_pass(replayer, redis_client, redis_client) == "reserved"
    else:
        keep_fails(replayer, redis_client, "unsent" if fault == "unanswered" else fault)
        first = dict(replayer.run(threading.Event(), once=True))
        assert first == ({"handoff_unrecorded": 1} if fault == "refused" else {"pass_failed": 1})
        time.sleep(0.35)
    assert replay_once(redis_url, redis_client) == {"to_reserved": 1}
    (sent,) = queue_messages(redis_client, "reserved")
    assert sent["headers"]["gatekeeper_nonce"] == record_of(redis_client, job)["nonce"]


@pytest.mark.parametrize("first", ["refused", "killed"])
def test_a_message_scored_again_whose_next_keep_gets_no_answer_stays_the_gates(
    redis_url: str, redis_client: redis.Redis, first: str
) -> None:
    # A reviewer: a message scored and never handed on (its keep refused, or its pass
    # killed) was scored again, and that keep got no answer: the pass stopped, and the
    # message came back with its own nonce, which the record (its nonce the second
    # decision's, its prev_nonce the first's) no longer named: to reserved unverified, the
    # second decision's admission held with no message. The first decision is now undone in
    # the record (unscore.lua), not in the message.
    (job,) = defer_tasks(redis_url, redis_client, 1)
    settings = gate_settings(redis_url, replay_backoff_s=0.3)
    replayer = Replayer(settings, broker=redis_client, gate=redis_client)
    if first == "killed":
        assert scored_by_a_killed_pass(replayer, redis_client, redis_client) == "free"
    else:
        keep_fails(replayer, redis_client)
        assert dict(replayer.run(threading.Event(), once=True)) == {"handoff_unrecorded": 1}
        time.sleep(0.35)
    again = Replayer(settings, broker=redis_client, gate=redis_client)
    keep_fails(again, redis_client, "unsent")
    assert dict(again.run(threading.Event(), once=True)) == {"pass_failed": 1}
    assert replay_once(redis_url, redis_client) == {"to_free": 1}
    (sent,) = queue_messages(redis_client, "free")
    assert sent["headers"]["gatekeeper_nonce"] == record_of(redis_client, job)["nonce"]
    assert list(redis_client.hgetall(KEYS.inflight)) == [f"{job}:1".encode()]
    assert redis_client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 1


def test_a_sweep_while_a_message_is_held_forgets_no_admission(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # A reviewer: a held message's admission waited in free:waiting with no message in free;
    # a sweep more than 5 s after the decision took it for a purged queue's
    # (free_admissions_forgotten) and released it as published: admitted_free counted one
    # run twice. The admission is now given back when the message is held.
    defer_tasks(redis_url, redis_client, 1)
    replayer = Replayer(gate_settings(redis_url, replay_backoff_s=0.3), broker=redis_client,
                        gate=redis_client)  # fmt: skip
    send_all = replayer.runs.send_all
    keep_fails(replayer, redis_client)
    assert replayer.acquire()
    assert dict(replayer.pass_once()) == {"handoff_unrecorded": 1}
    replayer.runs.send_all = send_all  # type: ignore[method-assign]
    replayer._sweep(time.time() + 6)
    assert "free_admissions_forgotten" not in capsys.readouterr().err
    time.sleep(0.35)
    assert dict(replayer.pass_once()) == {"to_free": 1}
    (window,) = [k for k in redis_client.scan_iter(match=KEYS.window(0).replace(":0", ":*"))
                 if not k.endswith(b":rows")]  # fmt: skip
    assert redis_client.hget(window, "admitted_free") == b"1"


def test_a_replayer_stalled_past_its_lock_undoes_nothing_of_its_successors(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: replayer A's handoff was refused; A read the record to undo its decision,
    # then stalled past its lock. B took the message, undid the decision, scored it again
    # and handed the copy to free. A's release, keyed by the attempt alone, then gave back
    # B's admission (inflight, free:waiting, the window's exposure; the run charged 0). The
    # release is now unscore.lua's, under its check of the decision's nonce.
    (job,) = defer_tasks(redis_url, redis_client, 1)
    settings = gate_settings(redis_url, replay_lock_ttl_s=1.0, replay_backoff_s=0.3)
    a = Replayer(settings, broker=redis_client, gate=redis_client)
    b = Replayer(settings, broker=redis_client, gate=redis_client)
    keep_fails(a, redis_client)
    b_counts: Counter[str] = Counter()
    read = a.runs.fields

    def read_then_stall(*args: Any, **kwargs: Any) -> dict[str, str]:
        record = read(*args, **kwargs)
        time.sleep(1.3)  # past A's lock: B takes the lock and the message
        assert b.acquire()
        b_counts.update(b.pass_once())
        return record

    a.runs.fields = read_then_stall  # type: ignore[method-assign]
    assert a.acquire()
    a.pass_once()
    assert b_counts["to_free"] == 1
    (sent,) = queue_messages(redis_client, "free")
    assert sent["headers"]["gatekeeper_nonce"] == record_of(redis_client, job)["nonce"]
    assert list(redis_client.hgetall(KEYS.inflight)) == [f"{job}:1".encode()]
    assert redis_client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 1


@pytest.mark.parametrize("case", ["twins_in_one_batch", "a_twin_after_two_faults"])
def test_twins_of_a_message_held_run_once(
    redis_url: str, redis_client: redis.Redis, case: str
) -> None:
    # Two reviewers' known gaps, closed by the undo in the record (unscore.lua): twins in one
    # batch whose keeps were both refused, or a twin after a killed pass and a refused keep,
    # each went on with a different nonce (one to reserved unverified): the task ran twice.
    (job,) = defer_tasks(redis_url, redis_client, 1)
    twin = redis_client.lindex("defer", 0)
    settings = gate_settings(redis_url, replay_backoff_s=0.3)
    replayer = Replayer(settings, broker=redis_client, gate=redis_client)
    send_all = replayer.runs.send_all
    if case == "twins_in_one_batch":
        redis_client.lpush("defer", twin)
    else:
        assert scored_by_a_killed_pass(replayer, redis_client, redis_client) == "free"
    keep_fails(replayer, redis_client)
    held = dict(replayer.run(threading.Event(), once=True))
    assert held == {"handoff_unrecorded": 2 if case == "twins_in_one_batch" else 1}
    replayer.runs.send_all = send_all  # type: ignore[method-assign]
    time.sleep(0.35)
    if case == "a_twin_after_two_faults":
        redis_client.lpush("defer", twin)
    counts = replay_once(redis_url, redis_client)
    assert counts == {"to_free": 1, "handed_on_again": 1}
    nonces = {m["headers"]["gatekeeper_nonce"] for m in queue_messages(redis_client, "free")}
    assert nonces == {record_of(redis_client, job)["nonce"]} and not queue_messages(
        redis_client, "reserved")  # fmt: skip
    assert list(redis_client.hgetall(KEYS.inflight)) == [f"{job}:1".encode()]


@pytest.mark.parametrize("gone_by", ["the_sweep", "the_horizon"])
def test_an_undone_admission_given_back_before_is_counted_once(
    redis_url: str, redis_client: redis.Redis, gone_by: str
) -> None:
    # A reviewer (older than this session): a pass killed after its admission; before the
    # next pass the sweep's purge check (5 s on) or gate.lua's horizon (300 s) gave the
    # admission back as published, leaving it in admitted_free; the undo found no entry and
    # left it there too, and the attempt scored again was counted twice (the freeze rule's
    # miss rate diluted).
    (job,) = defer_tasks(redis_url, redis_client, 1)
    replayer = Replayer(gate_settings(redis_url, replay_backoff_s=0.3), broker=redis_client,
                        gate=redis_client)  # fmt: skip
    assert scored_by_a_killed_pass(replayer, redis_client, redis_client) == "free"
    admitted_before = admitted_free(redis_client)
    assert replayer.acquire()
    if gone_by == "the_sweep":
        replayer._sweep(time.time() + 6)
    else:  # another publish finds the admission past the horizon
        redis_client.zadd(KEYS.free_waiting, {f"{job}:1": (time.time() - 400) * 1000})
        create_app(gate_settings(redis_url), redis_url).tasks["tests.embed"].apply_async((9,))
    assert not redis_client.hget(KEYS.inflight, f"{job}:1")
    replayer._last_sweep = float("inf")
    assert dict(replayer.pass_once()) == {"to_free": 1}
    assert admitted_free(redis_client) == admitted_before + (gone_by == "the_horizon")


def admitted_free(client: redis.Redis) -> int:
    """The windows' admitted_free, summed."""
    windows = [k for k in client.scan_iter(match=KEYS.window(0).replace(":0", ":*"))
               if not k.endswith(b":rows")]  # fmt: skip
    return sum(int(client.hget(k, "admitted_free") or 0) for k in windows)
