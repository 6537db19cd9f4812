"""One slack miss per free admission, counted in its window (gatekeeper/redis/owner.py), with
the real scripts: gate.lua decides and writes the records, start.lua and finish.lua run
them, abandon.lua and expire.lua as the replayer and the expiry call them. A reviewer found
two misses counted for one admitted job, and misses counted in the row's window."""

from __future__ import annotations

import json

import redis

from gatekeeper.core.ledger import BudgetMode, Outcome, Path, make_row, window_id
from gatekeeper.redis.call import GateCall
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import Finished, RunLedger
from gatekeeper.redis.scripts import load_lua
from gatekeeper.redis.store import GateStore
from tests.conftest import initialised

KEYS = Keys()
T0 = 1_800_000_000.0
W = 900
ADMITTED_IN = window_id(T0, W)


def gate(client: redis.Redis, attempt: int, now: float, nonce: str, deadline: float,
         prev: str = "") -> str:  # fmt: skip
    """gate.lua's decision for attempt ``attempt`` of "job" (roomy budget and queue cap)."""
    call = GateCall(
        now_s=now, window_id=window_id(now, W), job_id="job", attempt=attempt,
        expected_service_s=1.0, retry_tax_s=1.0, deadline_slack_s=deadline - now,
        max_queue_age_s=60.0, tokens_in=100, budget_units=1e9,
        queue_wait_unit_per_second=200.0, budget_mode=BudgetMode.EXPOSURE, nonce=nonce,
        published_s=now, deadline_s=deadline, prev_nonce=prev, wait_allowance_s=10.0,
    )  # fmt: skip
    return GateStore(client, KEYS).score(call).decision.value


def run(runs: RunLedger, attempt: int, nonce: str, start_s: float, end_s: float,
        outcome: Outcome = Outcome.OK, went_on: bool = False) -> Finished:  # fmt: skip
    """One run of the attempt, judged as the worker judges it (WorkerSide._end)."""
    started = runs.start("job", attempt, nonce, {"task": "t"}, round(start_s * 1000))
    record = started.record
    assert record is not None
    end_ms = round(end_s * 1000)
    ends = outcome is Outcome.OK
    miss = ends and (record.free_admitted or record.path == "free") and end_ms > record.deadline_ms
    row = runs.row_for("job", attempt, record, outcome, end_ms)
    return runs.finish(row, started.run, record, end_ms, slack_miss=miss, ends=ends,
                       went_on=went_on)  # fmt: skip


def expire(client: redis.Redis, nonce: str, now: float) -> bytes:
    """expire.lua on attempt 1 of "job", admitted in ``now``'s window, past its allowance."""
    row = make_row(job_id="job", attempt=1, path=Path.FREE, outcome=Outcome.EXPIRED,
                   queue_wait_ms=20_000, tokens_in=0, tokens_out=0,
                   deadline_slack_ms=70_000).to_json()  # fmt: skip
    row.pop("retry_tax")
    window = window_id(now, W)
    script = client.register_script(load_lua("expire.lua"))
    return bytes(script(keys=[KEYS.run("job", 1), KEYS.inflight, KEYS.free_waiting,
                              KEYS.window(window), KEYS.window_rows(window)],
                        args=["job:1", nonce, str(round(now * 1000)), "10000", "200", "691200",
                              json.dumps(row)[:-1], str(window), ""]))  # fmt: skip


def misses(client: redis.Redis) -> tuple[bytes | None, bytes | None]:
    """The lifetime total and the admission window's count."""
    return (client.hget(KEYS.totals, "slack_misses"),
            client.hget(KEYS.window(ADMITTED_IN), "slack_misses"))  # fmt: skip


def ledger(client: redis.Redis) -> RunLedger:
    initialised(client)
    return RunLedger(client, KEYS, window_seconds=W, queue_wait_unit_per_second=200)


def test_a_job_ended_ok_late_beside_the_retry_it_published_counts_one_miss(
    redis_client: redis.Redis,
) -> None:
    """``retry(throw=False)``: attempt 1 publishes attempt 2 and returns ok, late; attempt 2
    (sent to reserved: the path closed meanwhile) ends late too. One admission, one miss, in
    whichever order the two rows come."""
    for first in (1, 2):
        redis_client.flushdb()
        runs = ledger(redis_client)
        deadline = T0 + 90
        assert gate(redis_client, 1, T0, "n1", deadline) == "admit_free"
        redis_client.hset(KEYS.flags, "free_path_enabled", "false")
        assert gate(redis_client, 2, T0 + 1, "n2", deadline) == "reserved"
        ends = {1: (T0 + 2, T0 + 100), 2: (T0 + 3, T0 + 110)}
        done = [run(runs, a, f"n{a}", *ends[a]) for a in (first, 3 - first)]
        assert [d.written for d in done] == [True, True]
        assert [d.slack_miss for d in done] == [True, False], first
        assert misses(redis_client) == (b"1", b"1")
        assert done[0].window == ADMITTED_IN


def test_an_abandoned_job_requeued_from_the_dead_letter_and_late_again_counts_one_miss(
    redis_client: redis.Redis,
) -> None:
    """Attempt 1 admitted, retried; attempt 2 deferred past the deadline and abandoned (the
    miss of attempt 1's admission); requeued with a new deadline, decided reserved, late
    again: no second miss of the same admission (the reviewer's 2 misses of 1 admission)."""
    runs = ledger(redis_client)
    deadline = T0 + 90
    assert gate(redis_client, 1, T0, "n1", deadline) == "admit_free"
    assert run(runs, 1, "n1", T0 + 0.1, T0 + 0.2, Outcome.KILLED, went_on=True).written
    assert gate(redis_client, 2, T0 + 100, "n2", deadline) == "defer"
    row = make_row(job_id="job", attempt=2, path=Path.FREE, outcome=Outcome.ABANDONED,
                   queue_wait_ms=0, tokens_in=0, tokens_out=0,
                   deadline_slack_ms=-20_000)  # fmt: skip
    abandoned = runs.abandon(row, round((T0 + 3700) * 1000), True, "n2")  # a later window
    assert abandoned.written and abandoned.slack_miss and abandoned.window == ADMITTED_IN
    assert misses(redis_client) == (b"1", b"1")
    redis_client.hset(KEYS.flags, "free_path_enabled", "false")
    assert gate(redis_client, 2, T0 + 3800, "n3", T0 + 3830, prev="n2") == "reserved"
    again = run(runs, 2, "n3", T0 + 3840, T0 + 3850)
    assert again.written and not again.slack_miss
    assert misses(redis_client) == (b"1", b"1")


def test_an_expired_admissions_late_end_on_reserved_is_a_miss_of_its_admission_window(
    redis_client: redis.Redis,
) -> None:
    """expire.lua moves a free attempt that waited past its allowance to reserved, blanking
    its record's window: it keeps it as ``free_window``, where the late end's miss counts."""
    runs = ledger(redis_client)
    assert gate(redis_client, 1, T0, "n1", T0 + 90) == "admit_free"
    assert expire(redis_client, "n1", T0 + 20) == b"expired"
    done = run(runs, 1, "n1", T0 + 3600, T0 + 3601)  # an hour later, in another window
    assert done.slack_miss and done.window == ADMITTED_IN
    assert misses(redis_client) == (b"1", b"1")


def test_a_task_id_published_again_after_its_late_end_can_miss_again(
    redis_client: redis.Redis,
) -> None:
    """A new life of the attempt (its id published again after its row) is a new admission:
    gate.lua drops the record's ``missed`` with its runs, and its own late end counts."""
    runs = ledger(redis_client)
    assert gate(redis_client, 1, T0, "n1", T0 + 90) == "admit_free"
    assert run(runs, 1, "n1", T0 + 1, T0 + 100).slack_miss
    assert gate(redis_client, 1, T0 + 200, "n2", T0 + 290) == "admit_free"
    assert redis_client.hget(KEYS.run("job", 1), "missed") is None
    assert run(runs, 1, "n2", T0 + 201, T0 + 300).slack_miss
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"2"


def test_a_reused_task_id_expired_from_free_counts_its_miss_in_its_own_admissions_window(
    redis_client: redis.Redis,
) -> None:
    """A reviewer: the id's first life ended in time (its record cut, ``kept`` naming its
    window); published again two hours later, admitted, expired to reserved and late, its
    miss was counted in the first life's window. The record's reason says which is this
    life's: an expiry's ``free_window``."""
    runs = ledger(redis_client)
    assert gate(redis_client, 1, T0, "n1", T0 + 90) == "admit_free"
    assert not run(runs, 1, "n1", T0 + 1, T0 + 2).slack_miss  # in time: cut, kept
    later = T0 + 7200
    assert gate(redis_client, 1, later, "n2", later + 90) == "admit_free"
    assert expire(redis_client, "n2", later + 20) == b"expired"
    done = run(runs, 1, "n2", later + 30, later + 200)
    assert done.slack_miss and done.window == window_id(later, W)
    assert redis_client.hget(KEYS.window(ADMITTED_IN), "slack_misses") is None
