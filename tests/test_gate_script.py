"""gate.lua repeats the core's rules for atomicity: the script and the core must agree."""

from __future__ import annotations

import math
import time

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper.core.dwell import Decision, GateInputs, decide
from gatekeeper.core.ledger import BudgetMode, Outcome, Path, admit, make_row
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis import wire
from gatekeeper.redis.keys import ATTEMPTS, WAITING_PAD, Keys
from gatekeeper.redis.scripts import load_lua, read_rows
from gatekeeper.redis.store import GateStore
from tests.calls import gate_call
from tests.conftest import initialised, unused_port

NOW_S = 1_800_000_000.0
WINDOW = 2_000_000
KEYS = Keys("gktest", "script")


@pytest.fixture(autouse=True)
def _initialised(redis_client: redis.Redis) -> None:
    initialised(redis_client, KEYS)


def core_answer(
    age_ms: int | None,
    service: float,
    tax_s: float,
    slack: float,
    cap: float,
    tax_units: float,
    exposure: float,
    tokens: int,
    budget: float,
    mode: BudgetMode,
    delay: float = 0.0,
) -> tuple[str, str]:
    age = 0.0 if age_ms is None else age_ms / 1000
    gate = decide(GateInputs(age, service, tax_s, slack, cap, delay))
    if gate.decision is not Decision.ADMIT_FREE:
        return gate.decision.value, gate.reason.value
    answer = admit(
        tax_units=tax_units,
        exposure=exposure,
        queue_age_s=age,
        tokens_in=tokens,
        budget_units=budget,
        queue_wait_unit_per_second=200,
        mode=mode,
    )
    return ("admit_free", "fits") if answer.admitted else ("reserved", "retry_tax_budget")


def script_answer(
    client: redis.Redis,
    age_ms: int | None,
    service: float,
    tax_s: float,
    slack: float,
    cap: float,
    tax_units: float,
    exposure: float,
    tokens: int,
    budget: float,
    mode: BudgetMode,
    delay: float = 0.0,
) -> tuple[str, str]:
    client.delete(
        KEYS.free_waiting, KEYS.window(WINDOW), KEYS.window_rows(WINDOW), KEYS.run("j", 1)
    )
    if age_ms is not None:
        client.zadd(KEYS.free_waiting, {"older:1": NOW_S * 1000 - age_ms})
    client.hset(KEYS.window(WINDOW), mapping={"tax_units": tax_units, "exposure": exposure})
    store = GateStore(client, KEYS, horizon_s=1e9)
    scored = store.score(
        gate_call(
            now_s=NOW_S,
            window_id=WINDOW,
            job_id="j",
            attempt=1,
            expected_service_s=service,
            retry_tax_s=tax_s,
            deadline_slack_s=slack,
            max_queue_age_s=cap,
            tokens_in=tokens,
            budget_units=budget,
            queue_wait_unit_per_second=200,
            budget_mode=mode,
            deadline_slack_ms=0,
            delay_s=delay,
        )
    )
    return scored.decision.value, scored.reason.value


# age_ms, service, tax_s, slack, cap, tax_units, exposure, tokens, budget, mode
CASES = [
    (12_000, 8, 8, 90, 30, 0, 0, 1200, 12_000, BudgetMode.EXPOSURE),
    (41_000, 8, 8, 90, 30, 0, 0, 1200, 12_000, BudgetMode.EXPOSURE),
    (20_000, 8, 8, 30, 30, 0, 0, 1200, 12_000, BudgetMode.EXPOSURE),
    (20_000, 8, 0, 30, 30, 0, 0, 1200, 12_000, BudgetMode.EXPOSURE),
    (10_000, 0, 8, 90, 30, 0, 0, 1200, 12_000, BudgetMode.EXPOSURE),
    (10_000, 8, 8, -1, 30, 0, 0, 1200, 12_000, BudgetMode.EXPOSURE),
    (50_000, 8, 8, 40, 30, 0, 0, 1200, 12_000, BudgetMode.EXPOSURE),
    (None, 8, 8, 90, 30, 0, 0, 1200, 12_000, BudgetMode.EXPOSURE),
    (30_000, 8, 8, 90, 30, 0, 0, 1200, 12_000, BudgetMode.EXPOSURE),
    (2_000, 1, 0, 90, 30, 5000, 2400, 1200, 9000, BudgetMode.EXPOSURE),
    (3_000, 1, 0, 90, 30, 5000, 2400, 1200, 9000, BudgetMode.EXPOSURE),
    (3_000, 1, 0, 90, 30, 5000, 2400, 1200, 9000, BudgetMode.OPTIMISTIC),
    (0, 1, 0, 90, 30, 0, 0, 1200, 1200, BudgetMode.EXPOSURE),
    (0, 1, 0, 90, 30, 0, 0, 1201, 1200, BudgetMode.EXPOSURE),
    (1, 1, -1, 90, 30, 0, 0, 1, 1200, BudgetMode.EXPOSURE),
    (1, math.nan, 0, 90, 30, 0, 0, 1, 1200, BudgetMode.EXPOSURE),
    (1, 1, 0, math.inf, 30, 0, 0, 1, 1200, BudgetMode.EXPOSURE),
]


@pytest.mark.parametrize(
    (
        "age_ms",
        "service",
        "tax_s",
        "slack",
        "cap",
        "tax_units",
        "exposure",
        "tokens",
        "budget",
        "mode",
    ),
    CASES,
)
def test_script_and_core_agree_on_the_table(
    redis_client: redis.Redis,
    age_ms: int | None,
    service: float,
    tax_s: float,
    slack: float,
    cap: float,
    tax_units: float,
    exposure: float,
    tokens: int,
    budget: float,
    mode: BudgetMode,
) -> None:
    args = (age_ms, service, tax_s, slack, cap, tax_units, exposure, tokens, budget, mode)
    assert script_answer(redis_client, *args) == core_answer(*args)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    age_ms=st.one_of(st.none(), st.integers(min_value=0, max_value=120_000)),
    service=st.floats(min_value=-5, max_value=60, allow_nan=False),
    tax_s=st.floats(min_value=0, max_value=60),
    slack=st.floats(min_value=-10, max_value=200),
    cap=st.floats(min_value=0, max_value=60),
    tax_units=st.floats(min_value=0, max_value=20_000),
    exposure=st.floats(min_value=0, max_value=20_000),
    tokens=st.integers(min_value=0, max_value=5000),
    budget=st.floats(min_value=0, max_value=30_000),
    mode=st.sampled_from(BudgetMode),
    delay=st.one_of(st.just(0.0), st.floats(min_value=0, max_value=120)),
)
def test_script_and_core_agree_on_generated_inputs(
    redis_client: redis.Redis,
    age_ms: int | None,
    service: float,
    tax_s: float,
    slack: float,
    cap: float,
    tax_units: float,
    exposure: float,
    tokens: int,
    budget: float,
    mode: BudgetMode,
    delay: float,
) -> None:
    args = (age_ms, service, tax_s, slack, cap, tax_units, exposure, tokens, budget, mode, delay)
    assert script_answer(redis_client, *args) == core_answer(*args)


def test_admission_reserves_exposure_and_marks_the_attempt_waiting(
    redis_client: redis.Redis,
) -> None:
    answer = script_answer(redis_client, None, 1, 0, 90, 30, 0, 0, 700, 12_000, BudgetMode.EXPOSURE)
    assert answer == ("admit_free", "fits")
    assert float(redis_client.hget(KEYS.window(WINDOW), "exposure")) == 700
    assert redis_client.zscore(KEYS.free_waiting, "j:1") == NOW_S * 1000


def test_waiting_entries_past_the_horizon_stop_counting(redis_client: redis.Redis) -> None:
    redis_client.zadd(KEYS.free_waiting, {"stale:1": NOW_S * 1000 - 10_000_000})
    store = GateStore(redis_client, KEYS, horizon_s=60)
    scored = store.score(gate_call(
        now_s=NOW_S, window_id=WINDOW, job_id="j", attempt=1, expected_service_s=1,
        retry_tax_s=0, deadline_slack_s=90, max_queue_age_s=30, tokens_in=1,
        budget_units=100, queue_wait_unit_per_second=0, budget_mode=BudgetMode.EXPOSURE,
        deadline_slack_ms=0,
    ))  # fmt: skip
    assert (scored.decision, scored.queue_age_s) == (Decision.ADMIT_FREE, 0)
    assert redis_client.zscore(KEYS.free_waiting, "stale:1") is None


def test_every_key_the_script_touches_shares_one_hash_tag() -> None:
    names = [KEYS.free_waiting, KEYS.window(1), KEYS.window_rows(1), KEYS.flags, KEYS.flags_log,
             KEYS.totals, KEYS.deferred, KEYS.replayer_last_pass]  # fmt: skip
    assert {name.split("{")[1].split("}")[0] for name in names} == {"script"}


@pytest.mark.parametrize("job_id", ["plain-id", 'quote"and\\backslash', "ünïcode"])
def test_the_scripts_rejected_row_is_the_cores_row(redis_client: redis.Redis, job_id: str) -> None:
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    store.score(gate_call(
        now_s=NOW_S, window_id=WINDOW, job_id=job_id, attempt=3, expected_service_s=1,
        retry_tax_s=0, deadline_slack_s=-1.234, max_queue_age_s=30, tokens_in=500,
        budget_units=100, queue_wait_unit_per_second=0, budget_mode=BudgetMode.EXPOSURE,
    ))  # fmt: skip
    # a passed deadline defers before the budget
    assert read_rows(store.client, store.keys, WINDOW) == []
    redis_client.delete(KEYS.run(job_id, 3))  # a new publish of the attempt, not a duplicate
    store.score(gate_call(
        now_s=NOW_S, window_id=WINDOW, job_id=job_id, attempt=3, expected_service_s=1,
        retry_tax_s=0, deadline_slack_s=1.234, max_queue_age_s=30, tokens_in=500,
        budget_units=100, queue_wait_unit_per_second=0, budget_mode=BudgetMode.EXPOSURE,
    ))  # fmt: skip
    (stored,) = read_rows(store.client, store.keys, WINDOW)
    expected = make_row(
        job_id=job_id, attempt=3, path=Path.FREE, outcome=Outcome.REJECTED, queue_wait_ms=0,
        tokens_in=0, tokens_out=0, deadline_slack_ms=1234,
    )  # fmt: skip
    assert stored == expected.to_json()


def test_a_flushed_script_cache_is_reloaded(redis_client: redis.Redis) -> None:
    redis_client.script_flush()
    assert script_answer(redis_client, None, 1, 0, 90, 30, 0, 0, 1, 100, BudgetMode.EXPOSURE) == (
        "admit_free",
        "fits",
    )


def _inputs(job: str) -> dict[str, object]:
    return dict(
        now_s=NOW_S, window_id=WINDOW, job_id=job, attempt=1, expected_service_s=1,
        retry_tax_s=0, deadline_slack_s=90, max_queue_age_s=30, tokens_in=5,
        budget_units=100, queue_wait_unit_per_second=0, budget_mode=BudgetMode.EXPOSURE,
        deadline_slack_ms=0,
    )  # fmt: skip


def test_the_line_talks_through_the_socket_when_hiredis_is_there(
    redis_client: redis.Redis,
) -> None:
    # gatekeeper/redis/wire.py relies on redis-py's connection keeping its socket in ``_sock``.
    redis_client.delete(KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    assert store.score(gate_call(**_inputs("raw"))).decision is Decision.ADMIT_FREE
    if wire.RAW:
        channel = store._line.channel
        assert channel.sock is not None and channel.sock is channel.conn._sock


def test_the_line_without_hiredis_uses_redis_pys_own_calls(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "RAW", False)
    redis_client.delete(KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    assert store.score(gate_call(**_inputs("plain"))).decision is Decision.ADMIT_FREE
    assert store._line.channel.sock is None
    redis_client.script_flush()
    assert store.score(gate_call(**_inputs("again"))).decision is Decision.ADMIT_FREE


@pytest.mark.parametrize("raw", [True, False], ids=["hiredis", "redis-py"])
def test_a_line_the_server_closed_while_idle_reconnects_before_sending(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, raw: bool
) -> None:
    monkeypatch.setattr(wire, "RAW", raw and wire.RAW)
    redis_client.delete(KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    store.score(gate_call(**_inputs("before")))
    redis_client.client_kill_filter(_type="normal", skipme=True)  # drops the line's connection
    time.sleep(0.05)
    assert store.score(gate_call(**_inputs("after"))).decision is Decision.ADMIT_FREE


def test_a_gate_redis_that_is_gone_raises_ledger_unavailable(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    store = GateStore(redis.Redis(port=unused_port(), socket_connect_timeout=0.5), KEYS)
    with pytest.raises(LedgerUnavailable):
        store.score(gate_call(**_inputs("nowhere")))
    client.close()


def test_an_admission_is_counted_once_and_the_window_gets_its_ttl(
    redis_client: redis.Redis,
) -> None:
    redis_client.delete(KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(redis_client, KEYS, horizon_s=1e9, retention_s=1000)
    store.score(gate_call(**_inputs("one")))
    store.score(gate_call(**_inputs("two")))
    fields = redis_client.hgetall(KEYS.window(WINDOW))
    assert fields[b"admitted_free"] == b"2"
    assert not any(key.startswith(b"decided:") for key in fields)  # read as admit_free/fits
    assert 0 < redis_client.ttl(KEYS.window(WINDOW)) <= 1000


def test_the_in_flight_hash_the_totals_and_the_waiting_set_are_tables_from_the_first_admission(
    redis_client: redis.Redis,
) -> None:
    # A compact (ziplist, listpack) hash is searched field by field: with 300-500 jobs in
    # flight HSETNX took a third of an admission (bench/gate_ir.py). Each value's tail takes
    # the hash past Redis's 64-byte value limit at once; readers take the first fields.
    redis_client.delete(KEYS.inflight, KEYS.totals, KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    assert store.score(gate_call(**_inputs("first"))).decision is Decision.ADMIT_FREE
    assert redis_client.object("encoding", KEYS.inflight) == b"hashtable"
    # The lifetime totals too (one counter per task, decision and reason: hundreds in an app
    # of many tasks); their reader takes the decided:* fields only.
    assert redis_client.object("encoding", KEYS.totals) == b"hashtable"
    assert redis_client.object("encoding", KEYS.window(WINDOW)) == b"hashtable"  # and windows
    reserved, window, admitted_ms = redis_client.hget(KEYS.inflight, "first:1").split(b"|")[:3]
    assert (float(reserved), int(window), float(admitted_ms)) == (5.0, WINDOW, NOW_S * 1000)
    assert float(redis_client.hget(KEYS.window(WINDOW), "exposure")) == 5.0
    # The waiting set a skip list from its first member, by its pad (no attempt, at +inf).
    assert redis_client.object("encoding", KEYS.free_waiting) == b"skiplist"
    assert redis_client.zscore(KEYS.free_waiting, WAITING_PAD) == math.inf
    assert redis_client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 1
    assert store.release("first", 1, WINDOW) == 5  # the whole reservation back, read as before
    assert float(redis_client.hget(KEYS.window(WINDOW), "exposure")) == 0.0
    assert not redis_client.hexists(KEYS.inflight, "first:1")
    # The pad alone is an empty free queue: an age of 0, and the pad is not added twice.
    later = store.score(gate_call(**{**_inputs("later"), "now_s": NOW_S + 50}))
    assert (later.decision, later.queue_age_s) == (Decision.ADMIT_FREE, 0.0)
    assert redis_client.zrange(KEYS.free_waiting, 0, -1) == [b"later:1", WAITING_PAD.encode()]


def test_release_gives_back_to_the_window_its_in_flight_entry_names(
    redis_client: redis.Redis,
) -> None:
    # release.lua's caller names a window; the entry gate.lua wrote names the one that holds
    # the reservation: that one gets it back, whatever the caller says.
    elsewhere = WINDOW + 7
    redis_client.delete(KEYS.inflight, KEYS.window(WINDOW), KEYS.window(elsewhere),
                        KEYS.free_waiting)  # fmt: skip
    store = GateStore(redis_client, KEYS, horizon_s=1e9, retention_s=1000)
    for job in ("a", "b"):
        assert store.score(gate_call(**_inputs(job))).decision is Decision.ADMIT_FREE
    assert float(redis_client.hget(KEYS.window(WINDOW), "exposure")) == 10.0
    assert store.release("a", 1, elsewhere) == 5
    assert store.release("b", 1, elsewhere, unpublished=True) == 5
    window = redis_client.hgetall(KEYS.window(WINDOW))
    assert (float(window[b"exposure"]), window[b"admitted_free"]) == (0.0, b"1")
    assert not redis_client.exists(KEYS.window(elsewhere))  # never made by a release
    # A window gone past its retention is not made again (with no TTL) by a late release.
    assert store.score(gate_call(**_inputs("c"))).decision is Decision.ADMIT_FREE
    redis_client.delete(KEYS.window(WINDOW))
    assert store.release("c", 1, WINDOW) == 5
    assert not redis_client.exists(KEYS.window(WINDOW))
    assert not redis_client.hexists(KEYS.inflight, "c:1")
    # An entry that names no window (an older version's): the caller's window.
    redis_client.hset(KEYS.window(WINDOW), "exposure", "3")
    redis_client.hset(KEYS.inflight, "old:1", "3")
    assert store.release("old", 1, WINDOW) == 3
    assert float(redis_client.hget(KEYS.window(WINDOW), "exposure")) == 0.0


def test_an_undone_admission_gives_back_only_to_a_window_that_still_exists(
    redis_client: redis.Redis,
) -> None:
    # unscore.lua (the replayer's decision undone) gives the exposure back as release.lua
    # does: to the window the entry names, never making one gone past its retention again
    # (with no TTL), nor taking admitted_free from it.
    redis_client.delete(KEYS.inflight, KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(redis_client, KEYS, horizon_s=1e9, retention_s=1000)
    unscore = redis_client.register_script(load_lua("unscore.lua"))
    for job in ("kept", "gone"):
        assert store.score(gate_call(**_inputs(job))).decision is Decision.ADMIT_FREE
    for job in ("kept", "gone"):
        if job == "gone":
            redis_client.delete(KEYS.window(WINDOW))
        nonce = redis_client.hget(KEYS.run(job, 1), "nonce")
        keys = [KEYS.run(job, 1), KEYS.inflight, KEYS.free_waiting, KEYS.window(WINDOW)]
        assert unscore(keys=keys, args=[nonce, "msg", "", f"{job}:1", "1", "0"]) == 1
        assert not redis_client.hexists(KEYS.inflight, f"{job}:1")
        if job == "kept":  # (the other job's admission still held)
            window = redis_client.hgetall(KEYS.window(WINDOW))
            assert (float(window[b"exposure"]), window[b"admitted_free"]) == (5.0, b"1")
    assert not redis_client.exists(KEYS.window(WINDOW))


def test_an_expiry_gives_back_to_the_window_its_in_flight_entry_names(
    redis_client: redis.Redis,
) -> None:
    # A reviewer: a replay scored again in the next window keeps its first entry (HSETNX),
    # which names the window holding the reservation; the record and the message name the
    # second. expire.lua gave the reservation back to the second: it under-counted another
    # admission's there, and the first kept it.
    initialised(redis_client, KEYS)
    redis_client.delete(KEYS.inflight, KEYS.window(WINDOW), KEYS.window(WINDOW + 1),
                        KEYS.free_waiting)  # fmt: skip
    store = GateStore(redis_client, KEYS, horizon_s=1e9, retention_s=100_000)
    first = gate_call(**_inputs("j"))
    assert store.score(first).decision is Decision.ADMIT_FREE
    later = {"now_s": NOW_S + 1, "window_id": WINDOW + 1, "max_queue_age_s": 1e5}
    again = gate_call(**{**_inputs("j"), **later}, prev_nonce=first.nonce)  # the replay
    assert store.score(again).decision is Decision.ADMIT_FREE
    assert store.score(gate_call(**{**_inputs("other"), **later})).decision is Decision.ADMIT_FREE
    expire = redis_client.register_script(load_lua("expire.lua"))
    keys = [KEYS.run("j", 1), KEYS.inflight, KEYS.free_waiting, KEYS.window(WINDOW + 1),
            KEYS.window_rows(WINDOW + 1)]  # fmt: skip
    head = '{"job_id": "j", "attempt": 1, "path": "free", "outcome": "expired"'
    args = ["j:1", again.nonce, str(int((NOW_S + 2000) * 1000)), "100", "0", "100000", head,
            str(WINDOW + 1), ""]  # fmt: skip
    assert expire(keys=keys, args=args) == b"expired"
    exposures = [float(redis_client.hget(KEYS.window(w), "exposure")) for w in (WINDOW, WINDOW + 1)]
    assert exposures == [0.0, 5.0]  # (other's 5 still held in the second)


def test_the_window_keeps_the_oldest_free_queue_age_its_decisions_saw(
    redis_client: redis.Redis,
) -> None:
    redis_client.delete(KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    seen = []
    for job, age_ms in (("empty", None), ("five", 5000), ("twelve", 12_250), ("three", 3000)):
        redis_client.delete(KEYS.free_waiting)
        if age_ms is not None:
            redis_client.zadd(KEYS.free_waiting, {"older:1": NOW_S * 1000 - age_ms})
        store.score(gate_call(**_inputs(job)))
        seen.append(redis_client.hget(KEYS.window(WINDOW), "free_age_max_ms"))
    # An empty queue is kept as 0 (so a window with none of it predates the field).
    assert seen == [b"0", b"5000", b"12250", b"12250"]


def test_a_fractional_exposure_left_by_another_writer_still_takes_an_admission(
    redis_client: redis.Redis,
) -> None:
    redis_client.delete(KEYS.window(WINDOW), KEYS.free_waiting)
    redis_client.hset(KEYS.window(WINDOW), "exposure", "2.5")
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    assert store.score(gate_call(**_inputs("frac"))).decision is Decision.ADMIT_FREE
    assert float(redis_client.hget(KEYS.window(WINDOW), "exposure")) == 7.5


def test_a_line_out_of_step_with_its_replies_fails_closed_once_then_recovers(
    redis_client: redis.Redis,
) -> None:
    if not wire.RAW:
        pytest.skip("the raw line needs hiredis")
    redis_client.delete(KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    store.score(gate_call(**_inputs("first")))
    # Something nobody asked for ahead of the next reply (a push message, a stray reply).
    store._line.channel.reader.feed(b">2\r\n$7\r\nmessage\r\n$4\r\njunk\r\n")
    with pytest.raises(LedgerUnavailable):
        store.score(gate_call(**_inputs("second")))
    over = {**_inputs("third"), "tokens_in": 10_000}  # over the budget: must not read a stale yes
    assert store.score(gate_call(**over)).decision is Decision.RESERVED
    assert store.score(gate_call(**_inputs("fourth"))).decision is Decision.ADMIT_FREE


def test_an_interrupted_send_leaves_the_line_usable(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_client.delete(KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    send = wire.Channel.send

    def interrupted(self: wire.Line, parts: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(wire.Channel, "send", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.score(gate_call(**_inputs("interrupted")))
    monkeypatch.setattr(wire.Channel, "send", send)
    assert not store._line.channel.busy
    assert store.score(gate_call(**_inputs("after"))).decision is Decision.ADMIT_FREE


def test_a_single_connection_client_is_called_directly(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, single_connection_client=True)
    client.delete(KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(client, KEYS, horizon_s=1e9)
    assert store.score(gate_call(**_inputs("single"))).decision is Decision.ADMIT_FREE
    assert store._line.channel is None
    client.close()


@pytest.mark.parametrize("budget", [100.0, 1e9], ids=["rejected", "admitted"])
def test_the_gate_script_sent_twice_decides_once(redis_client: redis.Redis, budget: float) -> None:
    """A request re-sent after a lost reply (its nonce is the record's) changes nothing: no
    second rejected row, no second admission or exposure, the same decision."""
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    call = gate_call(
        now_s=NOW_S,
        window_id=WINDOW,
        job_id="twice",
        tokens_in=500,
        budget_units=budget,
        wait_allowance_s=2,
        queue_wait_unit_per_second=200,
    )
    first, again = store.score(call), store.score(call)  # fmt: skip
    assert (first.decision, first.reason) == (again.decision, again.reason)
    window = {k.decode(): v.decode() for k, v in redis_client.hgetall(KEYS.window(WINDOW)).items()}
    if budget == 100.0:
        assert first.reason.value == "retry_tax_budget"
        assert len(read_rows(store.client, store.keys, WINDOW)) == 1 and window["rejected"] == "1"
    else:
        assert first.decision.value == "admit_free"
        assert window["admitted_free"] == "1" and float(window["exposure"]) == 500 + 2 * 200
        assert redis_client.hget(KEYS.run("twice", 1), "reserved") == b"900"


@pytest.mark.parametrize("unit", [0.1 + 0.2, 1 / 3, 2.5])
def test_a_fractional_reservation_given_back_leaves_no_residue(
    redis_client: redis.Redis, unit: float
) -> None:
    # The in-flight entry keeps the reservation as the exposure grew by it (17 digits where
    # it is not whole): given back, by a release or a run's end, the window's exposure is
    # what it was (a reviewer: 14 digits left about 1e-13 behind).
    redis_client.delete(KEYS.inflight, KEYS.window(WINDOW), KEYS.free_waiting)
    store = GateStore(redis_client, KEYS, horizon_s=1e9, retention_s=1000)
    call = {**_inputs("frac"), "queue_wait_unit_per_second": unit, "wait_allowance_s": 7.0}
    assert store.score(gate_call(**call)).decision is Decision.ADMIT_FREE
    held = float(redis_client.hget(KEYS.inflight, "frac:1").split(b"|")[0])
    assert held == 5 + float(repr(7.0 * unit))  # the reservation, exactly
    assert float(redis_client.hget(KEYS.window(WINDOW), "exposure")) == held
    store.release("frac", 1, WINDOW)
    assert float(redis_client.hget(KEYS.window(WINDOW), "exposure")) == 0.0
