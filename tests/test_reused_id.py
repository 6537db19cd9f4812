"""The ceiling holds for a task id used again, and for a delayed admission, against a real Redis
and the real scripts (gate.lua, start.lua, finish.lua, the sweep), as publisher and worker call
them. Both were found by an audit of the budget ceiling."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.celery.replay import Replayer
from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.core.ledger import BudgetMode, Outcome, Path, make_row, window_id
from gatekeeper.ops.cli import main
from gatekeeper.redis.call import GateCall
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.snapshot import forget_deferred
from gatekeeper.redis.store import GateStore
from gatekeeper.redis.sweep import sweep
from tests.apps.gated_app import create_app
from tests.calls import gate_call
from tests.conftest import gate_settings, initialised, queue_messages
from tests.test_replay import defer_tasks, ids_in, replay_once
from tests.test_replay_strikes import scored_by_a_killed_pass

KEYS = Keys()
WINDOW_S = 60
BUDGET = 7000.0  # room for two reservations of 3200 (1200 tokens + 10 s x 200), not three
T0 = 2_000_000_090.0  # 10 s before a window ends: the next publishes fall in the next window


def call(now_s: float, job: str, **fields: object) -> GateCall:
    values: dict[str, object] = dict(
        window_id=window_id(now_s, WINDOW_S), job_id=job, tokens_in=1200,
        deadline_slack_s=3600.0, budget_units=BUDGET, queue_wait_unit_per_second=200.0,
        budget_mode=BudgetMode.EXPOSURE, wait_allowance_s=10.0, task="t",
    )  # fmt: skip
    values.update(fields)
    return gate_call(now_s, **values)


class Night:
    """A publisher and a worker on one Redis."""

    def __init__(self, client: redis.Redis) -> None:
        initialised(client)
        self.client = client
        self.store = GateStore(client, KEYS)
        self.runs = RunLedger(client, KEYS, window_seconds=WINDOW_S,
                              queue_wait_unit_per_second=200.0, wait_allowance_s=10.0)  # fmt: skip

    def publish(self, now_s: float, job: str, **fields: object) -> tuple[str, str]:
        """(the decision's ``decision/reason``, the nonce its message carries)"""
        published = call(now_s, job, **fields)
        scored = self.store.score(published)
        return f"{scored.decision.value}/{scored.reason.value}", published.nonce

    def run(self, start_s: float, end_s: float, job: str, nonce: str, outcome: Outcome) -> str:
        """A worker runs the message carrying ``nonce``: its row's path, or why none."""
        started = self.runs.start(job, 1, nonce, {"task": "t", "worker": "w"},
                                  round(start_s * 1000))  # fmt: skip
        if started.record is None:
            return str(started.refused)
        row = self.runs.row_for(job, 1, started.record, outcome, round(end_s * 1000))
        assert self.runs.finish(row, started.run, started.record, round(end_s * 1000)).written
        return row.path.value

    def window(self, now_s: float) -> tuple[float, float]:
        """A window's (tax_units, exposure)."""
        fields = self.client.hgetall(KEYS.window(window_id(now_s, WINDOW_S)))
        return float(fields.get(b"tax_units", 0)), float(fields.get(b"exposure", 0))


ADMITTED = f"{Decision.ADMIT_FREE.value}/{Reason.FITS.value}"


def test_a_task_id_used_again_cannot_charge_a_window_past_its_budget(
    redis_client: redis.Redis,
) -> None:
    # J ran to its row; J was published again (a reused id: it starts again) and, before that
    # publish ran, once more. The third publish found the record's counts of J's first life
    # (runs=1 rowed=1) and was decided afresh, not as a duplicate of a live one: it took the
    # record from the second, its reservation never reached its window (the second's in-flight
    # entry stood), and two more admissions fitted there. That window was charged 3 x 3200
    # against a budget of 7000, and the first kept 3200 of exposure for good.
    night = Night(redis_client)
    first = night.publish(T0, "J")[1]
    assert night.run(T0 + 1, T0 + 2, "J", first, Outcome.OK) == "free"
    decided, second = night.publish(T0 + 8, "J")
    assert decided == ADMITTED  # started again, in the first window
    assert night.publish(T0 + 10, "J")[0] == "reserved/duplicate_publish"
    later = [night.publish(T0 + 10, job) for job in ("X", "Y", "Z")]
    assert [d for d, _ in later] == [ADMITTED, ADMITTED, "reserved/retry_tax_budget"]
    for job, (_, nonce) in zip(("X", "Y"), later, strict=False):
        assert night.run(T0 + 22, T0 + 23, job, nonce, Outcome.KILLED) == "free"
    assert night.run(T0 + 30, T0 + 31, "J", second, Outcome.KILLED) == "free"  # verified
    for at in (T0, T0 + 10):
        tax, exposure = night.window(at)
        assert tax <= BUDGET and exposure == 0, (at, tax, exposure)
    assert redis_client.hlen(KEYS.inflight) == 0
    assert redis_client.hget(KEYS.stats, "forged_runs") is None


def test_a_delayed_admission_keeps_its_reservation_until_it_is_due(
    redis_client: redis.Redis,
) -> None:
    # A countdown longer than the sweep's age: its in-flight entry carried the time of the
    # decision, so the replayer's minute sweep (1800 s) gave back the reservation of a message
    # still waiting for its ETA, and its killed run was then charged nothing.
    night = Night(redis_client)
    decided, nonce = night.publish(T0, "E", delay_s=1900.0, budget_units=1e9)
    assert decided == ADMITTED
    assert night.window(T0)[1] == 3200
    sweep(night.runs, round((T0 + 1801) * 1000), 1800.0, night.store)
    assert night.window(T0)[1] == 3200  # still held: the message is not due yet
    assert night.run(T0 + 1900, T0 + 1905, "E", nonce, Outcome.KILLED) == "free"
    assert night.window(T0) == (1200, 0)  # its tokens charged (no wait: it ran when due)


def test_a_finish_sent_again_after_the_id_was_published_again_leaves_the_new_life_alone(
    redis_client: redis.Redis,
) -> None:
    # A reviewer: life 1's finish, its reply lost, is sent again (the same token) after the
    # id was published again and its new life started. Its runs counted anew, the re-sent
    # call was taken for a first one: a second row for life 1, life 2's reservation taken
    # from life 1's window, and life 2's own row refused. The call carries its run's nonce.
    night = Night(redis_client)
    first = night.publish(T0, "J")[1]
    started = night.runs.start("J", 1, first, {"task": "t", "worker": "w"}, round(T0 * 1000))
    assert started.record is not None
    row = night.runs.row_for("J", 1, started.record, Outcome.OK, round((T0 + 1) * 1000))
    once = night.runs.finish(row, started.run, started.record, round((T0 + 1) * 1000), token="t1")
    assert once.written
    decided, second = night.publish(T0 + 15, "J")
    assert decided == ADMITTED
    again = night.runs.finish(row, started.run, started.record, round((T0 + 1) * 1000),
                              token="t1")  # fmt: skip
    assert not again.written
    assert night.run(T0 + 16, T0 + 17, "J", second, Outcome.OK) == "free"
    for at in (T0, T0 + 15):
        exposure = night.window(at)[1]
        assert exposure == 0 and len(redis_client.lrange(
            KEYS.window_rows(window_id(at, WINDOW_S)), 0, -1)) == 1, at  # fmt: skip
    assert redis_client.hlen(KEYS.inflight) == 0


def test_a_task_id_used_again_after_its_abandonment_is_decided_afresh(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: an attempt abandoned in defer (its row written) left its record with no
    # runs, so a publish of the same task id and attempt was `duplicate_publish` for the
    # record's two days, ran on reserved and was counted as forged; and the abandonment's
    # marker refused the row of a second abandonment of that id.
    def abandoned_rows() -> list[str]:
        rows = []
        for key in redis_client.scan_iter(match="gatekeeper:*:rows"):
            rows += [json.loads(raw) for raw in redis_client.lrange(key, 0, -1)]
        return [row["job_id"] for row in rows if row["outcome"] == "abandoned"]

    headers = {"gatekeeper_deadline_s": 2.5}
    for life in (1, 2):
        defer_tasks(redis_url, redis_client, 1, headers=headers, task_id="again")
        time.sleep(2.6)
        assert replay_once(redis_url, redis_client) == {"dead_lettered": 1}, life
        assert abandoned_rows() == ["again"] * life
    app = create_app(gate_settings(redis_url), redis_url)
    app.tasks["tests.embed"].apply_async((1,), task_id="again")
    (message,) = queue_messages(redis_client, "free")
    assert message["headers"]["gatekeeper_reason"] == "fits"
    assert ids_in(redis_client, "dead_letter") == ["again", "again"]


def abandon_in_defer(redis_url: str, client: redis.Redis) -> None:
    defer_tasks(redis_url, client, 1, headers={"gatekeeper_deadline_s": 2.5}, task_id="J")
    time.sleep(2.6)


def abandoned_then_requeued(
    redis_url: str, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """J abandoned in defer, then `gatekeeper dead-letter requeue`d: the message in free."""
    abandon_in_defer(redis_url, client)
    assert replay_once(redis_url, client) == {"dead_lettered": 1}
    for name, value in (("REDIS_URL", redis_url), ("DWELL_GATE_ENABLED", "true"),
                        ("CANARY_PERCENT", "100")):  # fmt: skip
        monkeypatch.setenv(f"GATEKEEPER_{name}", value)
    done = CliRunner().invoke(main, ["dead-letter", "requeue", "J", "--deadline-s", "600"])
    assert done.exit_code == 0, done.output
    (requeued,) = queue_messages(client, "free")
    return requeued


def test_a_requeued_abandonment_is_live_again_and_a_publish_beside_it_is_a_duplicate(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reviewer: a dead-letter requeue (a replay: it presents the record's nonce) left the
    # record marked abandoned, so a publish of the id while the requeued copy was live took
    # its record (two admissions, one reservation) and the requeued copy ran as forged.
    requeued = abandoned_then_requeued(redis_url, redis_client, monkeypatch)
    app = create_app(gate_settings(redis_url), redis_url)
    app.tasks["tests.embed"].apply_async((1,), task_id="J")
    (again,) = queue_messages(redis_client, "reserved")
    assert again["headers"]["gatekeeper_reason"] == "duplicate_publish"
    runs = RunLedger.from_settings(redis_client, gate_settings(redis_url))
    nonce = requeued["headers"]["gatekeeper_nonce"]
    assert runs.start("J", 1, nonce, {"task": "tests.embed", "worker": "w"}, 1).record is not None


def abandoned_rows(client: redis.Redis) -> int:
    rows = [json.loads(raw) for key in client.scan_iter(match="gatekeeper:*:rows")
            for raw in client.lrange(key, 0, -1)]  # fmt: skip
    count = sum(r["job_id"] == "J" and r["outcome"] == "abandoned" for r in rows)
    assert int(client.hget(KEYS.totals, "abandoned") or 0) == count
    return count


def abandoned_by_a_killed_pass(redis_url: str, client: redis.Redis) -> None:
    """J abandoned in defer by a pass that claimed it, wrote its row and was killed before its
    move: the message is left in the pass's claim (its tenure dead: the next pass takes it)."""
    abandon_in_defer(redis_url, client)
    client.rpoplpush("defer", "defer:replaying")
    (left,) = queue_messages(client, "defer:replaying")
    runs = RunLedger.from_settings(client, gate_settings(redis_url))
    row = make_row(job_id="J", attempt=1, path=Path.FREE, outcome=Outcome.ABANDONED,
                   queue_wait_ms=0, tokens_in=0, tokens_out=0, deadline_slack_ms=-1)  # fmt: skip
    assert runs.abandon(row, round(time.time() * 1000), False, left["headers"]["gatekeeper_nonce"])


def test_a_copy_of_an_abandoned_message_left_by_a_killed_pass_is_not_rowed_again(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Two reviewers: the replayer claimed the message, wrote its abandonment and was killed
    # before the move; the id was published again (a new life, the record's nonce new) and
    # deferred. The next pass rowed the new life, then took the copy it took back for a
    # stranger's and wrote it a second, unverified row.
    abandoned_by_a_killed_pass(redis_url, redis_client)
    abandon_in_defer(redis_url, redis_client)  # a new life, deferred
    assert replay_once(redis_url, redis_client) == {"dead_lettered": 2}
    assert abandoned_rows(redis_client) == 2  # one per life


def test_each_life_of_a_reused_id_is_rowed_when_abandoned(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reviewer: a life revived by a dead-letter requeue that then ran to its row, or a
    # record that expired (two days) before the id was used again, left the attempt's marker
    # (eight days) saying "rowed", so the next life's abandonment got no row.
    requeued = abandoned_then_requeued(redis_url, redis_client, monkeypatch)
    runs = RunLedger.from_settings(redis_client, gate_settings(redis_url))
    now_ms = round(time.time() * 1000)
    started = runs.start("J", 1, requeued["headers"]["gatekeeper_nonce"], {"task": "t"}, now_ms)
    assert started.record is not None
    ok = runs.row_for("J", 1, started.record, Outcome.OK, now_ms + 1)
    assert runs.finish(ok, started.run, started.record, now_ms + 1).written
    redis_client.delete("free")
    abandon_in_defer(redis_url, redis_client)  # life 2, after the requeued one ran
    assert replay_once(redis_url, redis_client) == {"dead_lettered": 1}
    assert abandoned_rows(redis_client) == 2
    redis_client.delete(KEYS.run("J", 1))  # its two days pass
    abandon_in_defer(redis_url, redis_client)  # life 3
    assert replay_once(redis_url, redis_client) == {"dead_lettered": 1}
    assert abandoned_rows(redis_client) == 3


def test_an_earlier_versions_marker_does_not_refuse_a_later_lifes_row(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: the per-attempt marker of the version before (8 days) refused the row of
    # every later life of the attempt once its record (2 days) had gone.
    redis_client.set(KEYS.abandoned("J", 1), "1", ex=8 * 86400)
    abandon_in_defer(redis_url, redis_client)
    assert replay_once(redis_url, redis_client) == {"dead_lettered": 1}
    assert abandoned_rows(redis_client) == 1


def second_attempt_deferred(redis_url: str, client: redis.Redis, deadline_s: float) -> None:
    """Task ``J``: its first attempt admitted to free (so an abandonment of the second is a
    slack miss), its second deferred, its deadline ``deadline_s`` away."""
    client.hset(KEYS.run("J", 1), mapping={"decision": "admit_free", "free_admitted": "1"})
    defer_tasks(redis_url, client, 1, headers={"gatekeeper_deadline_s": deadline_s},
                task_id="J", retries=1)  # fmt: skip


def test_an_abandonment_after_a_decision_never_handed_on_is_the_gates_own(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # A reviewer: a pass scored the deferred message (the record's nonce new, the message's
    # now its prev_nonce) and died before handing it on; the next pass, after the deadline,
    # abandoned it as a stranger's: an unverified row, no slack miss (attempt 1 ran free),
    # and the record left live, so the task id was `duplicate_publish` for two days. (Taken
    # back once, when a copy still left with its handoff's write failed: it no longer does.)
    second_attempt_deferred(redis_url, redis_client, 2.5)
    replayer = Replayer(gate_settings(redis_url, max_queue_age_s=1.0), broker=redis_client,
                        gate=redis_client)  # fmt: skip
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})
    assert scored_by_a_killed_pass(replayer, redis_client, redis_client) == "defer"
    redis_client.zrem(KEYS.free_waiting, "stale:1")
    time.sleep(2.6)
    assert replay_once(redis_url, redis_client) == {"dead_lettered": 1}
    rows = [json.loads(raw) for key in redis_client.scan_iter(match="gatekeeper:*:rows")
            for raw in redis_client.lrange(key, 0, -1)]  # fmt: skip
    assert [(r["attempt"], r["outcome"], r.get("verified", True)) for r in rows] == [
        (2, "abandoned", True)
    ]
    assert "slack_miss=true" in capsys.readouterr().err
    app = create_app(gate_settings(redis_url), redis_url)
    app.tasks["tests.embed"].apply_async((1,), task_id="J", retries=1)
    assert [m["headers"]["gatekeeper_reason"] for m in queue_messages(redis_client, "free")] == [
        "fits"
    ]


def test_a_late_twin_of_a_copy_whose_handoff_key_is_gone_leaves_that_copy_alone(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two reviewers: a copy went to free and its handoff's key is gone (here deleted; an
    # older replayer handed a copy on even when the key's write failed), the record's
    # handoff_nonce still naming the message. A twin of the message (a publish sent twice)
    # that came after the deadline was taken as the record's own, scored but never handed
    # on: it gave back the admission the copy waiting in free still held, and its abandonment
    # ended the copy's attempt (a verified row and a slack miss; the copy ran charged nothing).
    # (A copy that left with neither written, as that older replayer could, is now
    # test_handoff_key's: it is held, not handed on.)
    second_attempt_deferred(redis_url, redis_client, 3.0)
    twin = redis_client.lindex("defer", 0)
    assert replay_once(redis_url, redis_client) == {"to_free": 1}
    redis_client.delete(KEYS.handoff("J", 2))
    held = redis_client.hgetall(KEYS.inflight)
    assert list(held) == [b"J:2"]
    time.sleep(3.2)
    capsys.readouterr()
    redis_client.lpush("defer", twin)  # the twin, after the deadline
    assert replay_once(redis_url, redis_client) == {"dead_lettered": 1}
    assert redis_client.hgetall(KEYS.inflight) == held  # the copy in free holds it still
    assert redis_client.hget(KEYS.run("J", 2), "abandoned") is None
    assert "slack_miss=true" not in capsys.readouterr().err


def test_a_dead_lettered_copy_of_an_earlier_life_keeps_the_next_lifes_deadline(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: a copy a killed pass left in defer (life 1, abandoned) and life 2 of the id,
    # deferred again in the same pass: the batch's forgetting of the dead-lettered copy's
    # member took life 2's deadline out of `deferred` (the next-deadline gauge went absent).
    abandoned_by_a_killed_pass(redis_url, redis_client)
    defer_tasks(redis_url, redis_client, 1, task_id="J", headers={"gatekeeper_deadline_s": 600})
    (life2,) = queue_messages(redis_client, "defer")
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})  # still old
    assert replay_once(redis_url, redis_client, max_queue_age_s=1.0) == {
        "deferred_again": 1, "dead_lettered": 1}  # fmt: skip
    deadline = redis_client.zscore(KEYS.deferred, "J:1")
    assert deadline == round(life2["headers"]["gatekeeper_deadline_at"] * 1000)


def test_a_redis_out_of_memory_still_forgets_what_left_defer(redis_client: redis.Redis) -> None:
    # A reviewer: forget.lua reads a score with ZADD, which a Redis out of memory (noeviction)
    # refuses, and the whole batch's members stayed (a plain ZREM, before it, went through).
    # A deadline too large for milliseconds no longer raises.
    redis_client.zadd(KEYS.deferred, {"J:1": 1765050000123, "K:1": 1765050000456})
    policy = redis_client.config_get("maxmemory-policy")["maxmemory-policy"]
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", "1")
    try:
        forget_deferred(redis_client, KEYS, {"id": "J", "gatekeeper_attempt": 1,
                                             "gatekeeper_deadline_at": 1765050000.123})  # fmt: skip
    finally:
        redis_client.config_set("maxmemory", "0")
        redis_client.config_set("maxmemory-policy", policy)
    assert redis_client.zrange(KEYS.deferred, 0, -1) == [b"K:1"]
    for huge in (1e306, 10**400):
        forget_deferred(redis_client, KEYS, {"id": "K", "gatekeeper_attempt": 1,
                                             "gatekeeper_deadline_at": huge})  # fmt: skip
    assert redis_client.zrange(KEYS.deferred, 0, -1) == []


def test_runs_owed_by_an_earlier_life_are_not_owed_by_the_next(redis_client: redis.Redis) -> None:
    """A reviewer: life A's run 2 row passed over run 1 (`owed`), and the id published again
    kept it: life B's run 1 then took two rows, one a second signal's."""
    night = Night(redis_client)
    decided, first = night.publish(T0, "j")
    assert decided == ADMITTED
    own = {"task": "t", "worker": "w"}
    night.runs.start("j", 1, first, own, round((T0 + 1) * 1000))
    again = night.runs.start("j", 1, first, own, round((T0 + 2) * 1000))
    assert again.dead_run == 1 and again.record is not None
    row = night.runs.row_for("j", 1, again.record, Outcome.OK, round((T0 + 3) * 1000))
    assert night.runs.finish(row, 2, again.record, round((T0 + 3) * 1000)).written
    assert redis_client.hget(KEYS.run("j", 1), "owed") == b",1,"
    decided, second = night.publish(T0 + 5, "j")  # the id used again: its attempt anew
    assert decided == ADMITTED and second != first
    started = night.runs.start("j", 1, second, own, round((T0 + 6) * 1000))
    assert started.run == 1 and started.record is not None
    row = night.runs.row_for("j", 1, started.record, Outcome.KILLED, round((T0 + 7) * 1000))
    written = [night.runs.finish(row, 1, started.record, round((T0 + 7) * 1000), token=token)
               for token in ("a", "b")]  # fmt: skip
    assert [w.written for w in written] == [True, False]
    assert redis_client.hget(KEYS.run("j", 1), "owed") is None


def test_a_late_row_sent_as_the_latest_run_leaves_the_live_run_its_reservation(
    redis_client: redis.Redis,
) -> None:
    """A reviewer: a worker sends its own run's row as the latest; kept while Redis was silent,
    it came after a later run's dead-run row had left it owed, while run 3 ran. Taken as
    the latest, it closed the reservation, released all exposure and left `started`: run 3
    was then charged nothing and never swept. A late row is a dead run's."""
    night = Night(redis_client)
    decided, nonce = night.publish(T0, "j")
    assert decided == ADMITTED
    own = {"task": "t", "worker": "gone"}
    one, two, three = (night.runs.start("j", 1, nonce, own, round((T0 + s) * 1000))
                       for s in (1, 2, 3))  # fmt: skip
    assert (two.dead_run, three.dead_run) == (1, 2) and three.dead and one.record
    dead = night.runs.row_for("j", 1, three.dead, Outcome.KILLED, round((T0 + 3) * 1000))
    assert night.runs.finish(dead, 2, three.dead, round((T0 + 3) * 1000), current=False).written
    held = float(redis_client.hget(KEYS.inflight, "j:1").split(b"|")[0])  # type: ignore[union-attr]
    late = night.runs.row_for("j", 1, one.record, Outcome.KILLED, round((T0 + 4) * 1000))
    assert night.runs.finish(late, 1, one.record, round((T0 + 4) * 1000)).written
    rest = float(redis_client.hget(KEYS.inflight, "j:1").split(b"|")[0])  # type: ignore[union-attr]
    assert rest == held - late.retry_tax > 0 and night.window(T0)[1] == rest
    assert redis_client.zscore(KEYS.started, "j:1") is not None
    assert redis_client.hget(KEYS.run("j", 1), "reserved") != redis_client.hget(
        KEYS.run("j", 1), "charged")  # fmt: skip
    swept = sweep(night.runs, round((T0 + 4000) * 1000), 60)  # run 3's worker is gone
    assert [(s.row.attempt, s.row.outcome) for s in swept] == [(1, Outcome.KILLED)]
    assert night.window(T0)[1] == 0


def test_a_publish_onto_what_a_late_row_left_of_a_lost_record_is_rowed(
    redis_client: redis.Redis,
) -> None:
    """A reviewer: Redis lost the record; a run's kept row, sent again, left its marks
    (`rowed`, `charged`, no nonce and no `runs`); the task id published again kept them, and
    its run was told it had its row already (none written)."""
    night = Night(redis_client)
    decided, first = night.publish(T0, "j")
    assert decided == ADMITTED
    own = {"task": "t", "worker": "w"}
    started = night.runs.start("j", 1, first, own, round((T0 + 1) * 1000))
    assert started.record is not None and redis_client.delete(KEYS.run("j", 1)) == 1  # lost
    row = night.runs.row_for("j", 1, started.record, Outcome.KILLED, round((T0 + 2) * 1000))
    assert night.runs.finish(row, 1, started.record, round((T0 + 2) * 1000)).written
    assert redis_client.hget(KEYS.run("j", 1), "nonce") is None
    decided, second = night.publish(T0 + 5, "j")
    assert decided == ADMITTED
    again = night.runs.start("j", 1, second, own, round((T0 + 6) * 1000))
    assert again.run == 1 and again.record is not None
    row = night.runs.row_for("j", 1, again.record, Outcome.OK, round((T0 + 7) * 1000))
    finished = night.runs.finish(row, 1, again.record, round((T0 + 7) * 1000))
    assert finished.written and finished.retry_tax == row.retry_tax > 0


def test_a_row_of_a_run_before_the_latest_start_leaves_the_latest_its_reservation(
    redis_client: redis.Redis,
) -> None:
    """A reviewer: run 1's own row (sent as the latest, kept while Redis was silent) came
    after run 2 had started and before any row of it: taken as the latest run's, it closed
    the reservation, released all exposure and left `started` while run 2 ran."""
    night = Night(redis_client)
    decided, nonce = night.publish(T0, "j")
    assert decided == ADMITTED
    own = {"task": "t", "worker": "gone"}
    one = night.runs.start("j", 1, nonce, own, round((T0 + 1) * 1000))
    two = night.runs.start("j", 1, nonce, own, round((T0 + 2) * 1000))
    assert two.dead_run == 1 and two.dead and one.record
    held = float(redis_client.hget(KEYS.inflight, "j:1").split(b"|")[0])  # type: ignore[union-attr]
    mine = night.runs.row_for("j", 1, one.record, Outcome.KILLED, round((T0 + 4) * 1000))
    assert night.runs.finish(mine, 1, one.record, round((T0 + 4) * 1000), token="a").written
    dead = night.runs.row_for("j", 1, two.dead, Outcome.KILLED, round((T0 + 4) * 1000))
    assert not night.runs.finish(dead, 1, two.dead, round((T0 + 4) * 1000), current=False).written
    rest = float(redis_client.hget(KEYS.inflight, "j:1").split(b"|")[0])  # type: ignore[union-attr]
    assert rest == held - mine.retry_tax > 0 and night.window(T0)[1] == rest
    assert redis_client.zscore(KEYS.started, "j:1") is not None
    swept = sweep(night.runs, round((T0 + 4000) * 1000), 60)  # run 2's worker is gone
    assert [(s.row.attempt, s.row.outcome) for s in swept] == [(1, Outcome.KILLED)]
    assert night.window(T0)[1] == 0
