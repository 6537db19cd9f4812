"""``gatekeeper tune``: recorded decisions re-decided under one knob (SPEC section 7).

A scripted history goes through the real publish pipeline and ``gate.lua`` on a real Redis,
with a scripted clock; the changed-knob columns below are worked out by hand from it.

The history (cap 30 s, budget 20,000, wait weight 200, allowance 10 s, 1,000 tokens: an
admission reserves 1,000 + 10 x 200 = 3,000; service 8 s, one retry left: tax 8 s; the free
queue's age is the time since ``a1`` was admitted, for nobody starts it)::

    job  t     slack  age   dwell  decision                      budget check
    a1   0     90     0     16     admit_free/fits               0 + 3000 = 3000
    h1   1     -10    -     -      defer/deadline_passed         (in process: no age read)
    z1   2     -      -     -      reserved/bad_input            (its service time is text)
    a2   12    90     12    28     admit_free/fits               3000 + 2400 + 3000 = 8400
    b1   25    30     25    41     reserved/dwell_over_slack     (service + tax 16 <= 30)
    d1   28    200    28    44     admit_free/fits               6000 + 5600 + 3000 = 14600
    e1   29    200    29    45     admit_free/fits               9000 + 5800 + 3000 = 17800
    f1   29.5  200    29.5  45.5   reserved/retry_tax_budget     12000 + 5900 + 3000 = 20900
    c1   35    90     35    51     defer/queue_age_cap           (dwell fits: savable)
    c2   36    40     36    52     defer/queue_age_cap           (dwell 52 > 40)

and ``a2`` then finishes after its deadline: one slack miss among four admissions.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper.core.headers import H_NONCE
from gatekeeper.core.ledger import BudgetMode, LedgerRow, Outcome, Path
from gatekeeper.core.spec import GatedSpec
from gatekeeper.core.whatif import DecisionRecord, Knob, compare, redecide
from gatekeeper.errors import BadDeclaredInput
from gatekeeper.ops.cli import main
from gatekeeper.redis.attempt import Publish
from gatekeeper.redis.decisions import read_records
from gatekeeper.redis.gate import Pipeline
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.service_times import ServiceTimes
from gatekeeper.redis.store import GateStore
from tests.apps.gated_app import create_app
from tests.calls import gate_call
from tests.conftest import gate_settings

T0 = 1_800_000_000.0  # a window's first second (900 s windows)
TASK = "tests.embed"
HISTORY: list[tuple[str, float, float]] = [  # job, t, slack
    ("a1", 0, 90), ("h1", 1, -10), ("z1", 2, 90), ("a2", 12, 90), ("b1", 25, 30), ("d1", 28, 200),
    ("e1", 29, 200), ("f1", 29.5, 200), ("c1", 35, 90), ("c2", 36, 40),
]  # fmt: skip
AS_WAS = {
    "admit_free/fits": 4, "defer/deadline_passed": 1, "defer/queue_age_cap": 2,
    "reserved/bad_input": 1, "reserved/dwell_over_slack": 1, "reserved/retry_tax_budget": 1,
}  # fmt: skip


def history_settings(redis_url: str, **overrides: Any) -> Any:
    return gate_settings(redis_url, max_queue_age_s=30, budget_units=20_000,
                         queue_wait_unit_per_second=200, free_wait_allowance_s=10,
                         **overrides)  # fmt: skip


def play_history(redis_url: str, client: redis.Redis) -> dict[str, str]:
    """Publish the history at its scripted times; then ``a2`` finishes late. Returns each
    job's decision as routed."""
    clock = {"t": 0.0}
    pipeline = Pipeline.create(history_settings(redis_url), client, lambda: T0 + clock["t"])
    routed: dict[str, str] = {}
    nonces: dict[str, str] = {}
    for job, t, slack in HISTORY:
        clock["t"] = t
        spec = GatedSpec(expected_service_s=8, tokens_in=1000, deadline_at=T0 + t + slack)
        publish = Publish(TASK, job, 0, 1, spec, {})
        if job == "z1":  # as the hook passes a declared input that is not a number
            publish = Publish(TASK, job, 0, 1, None, {}, spec_error=BadDeclaredInput(
                "expected_service_s", "a number", "eight"))  # fmt: skip
        routing = pipeline.route(publish)
        assert routing.decision is not None
        routed[job] = f"{routing.decision.value}/{routing.reason.value}"
        nonces[job] = routing.headers.get(H_NONCE, "")
    runs = RunLedger(client, Keys(), window_seconds=900, queue_wait_unit_per_second=200)
    own = {"task": TASK, "retries": "0", "max_retries": "1", "time_limit_s": "0", "tokens_out": "0"}
    started = runs.start("a2", 1, nonces["a2"], own, int((T0 + 40) * 1000))
    assert started.run == 1
    run, record = runs.record("a2", 1) or (0, None)
    assert record is not None
    row = runs.row_for("a2", 1, record, Outcome.OK, int((T0 + 200) * 1000))  # deadline T0+102
    assert runs.finish(row, run, record, int((T0 + 200) * 1000), slack_miss=True).written
    return routed


@pytest.fixture
def history(redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> dict:
    routed = play_history(redis_url, redis_client)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    return routed


def tune(*args: str) -> list[str]:
    result = CliRunner().invoke(main, ["tune", "--since", "1h", *args])
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def columns(lines: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """The as_was and would_be columns of the decision/reason rows."""
    was, now = {}, {}
    for line in lines[2:]:
        if line.startswith("kind ") or line.startswith("changed="):
            break
        name, before, after, _ = line.split()
        was[name], now[name] = int(before), int(after)
    return {k: v for k, v in was.items() if v}, {k: v for k, v in now.items() if v}


def fields_of(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def review(lines: list[str], name: str) -> dict[str, str]:
    (line,) = [line for line in lines if line.startswith(f"review {name} ")]
    return fields_of(line)


def changes(lines: list[str]) -> dict[str, str]:
    return {fields_of(line)["job_id"]: fields_of(line)["would_be"]
            for line in lines if line.startswith("change ")}  # fmt: skip


def test_with_no_knob_the_recorded_decisions_are_reproduced_exactly(history: dict) -> None:
    lines = tune()
    assert fields_of(lines[0])["records"] == "10" and fields_of(lines[0])["misses"] == "1"
    was, now = columns(lines)
    assert was == now == AS_WAS
    routed = {name: list(history.values()).count(name) for name in set(history.values())}
    assert was == routed  # the record holds every decision as it was routed
    assert "changed=0 undecidable=0 superseded=0" in lines and changes(lines) == {}
    assert review(lines, "free_missed") == {
        "as_was": "0.2500", "would_be": "0.2500", "slack_misses": "1/1",
        "free_admissions": "4/4", "unknown_outcome": "0",
    }  # fmt: skip


def test_a_lower_age_cap_defers_what_waited_past_it(history: dict) -> None:
    lines = tune("--max-queue-age-s", "20")
    assert fields_of(lines[0])["knob"] == "max_queue_age_s"
    assert fields_of(lines[0])["value"] == "20" and fields_of(lines[0])["recorded"] == "30"
    was, now = columns(lines)
    assert was == AS_WAS
    # b1 (age 25), d1 (28), e1 (29), f1 (29.5) are past 20 s; a1 (0), a2 (12) are not.
    assert now == {"admit_free/fits": 2, "defer/deadline_passed": 1, "defer/queue_age_cap": 6,
                   "reserved/bad_input": 1}  # fmt: skip
    assert changes(lines) == dict.fromkeys(["b1", "d1", "e1", "f1"], "defer/queue_age_cap")
    assert "changed=4 undecidable=0 superseded=0" in lines
    assert review(lines, "free_missed") == {  # a1 and a2 admitted in both: a2 missed
        "as_was": "0.2500", "would_be": "0.5000", "slack_misses": "1/1",
        "free_admissions": "4/2", "unknown_outcome": "0",
    }  # fmt: skip
    # Defers whose dwell fit: c1 as was; then d1 (44 <= 200), e1, f1 and c1 of 7 defers.
    assert review(lines, "defer_savable") == {
        "as_was": "0.3333", "would_be": "0.5714", "defers_dwell_fit": "1/4", "defers": "3/7",
    }  # fmt: skip
    assert review(lines, "reserved_age_shift") == {  # b1 of b1, f1, z1; then z1 alone
        "as_was": "0.3333", "would_be": "0.0000", "reserved_dwell_fit_without_age": "1/0",
        "reserved": "3/1",
    }  # fmt: skip


def test_a_bigger_budget_admits_what_it_refused_with_an_unknown_outcome(history: dict) -> None:
    lines = tune("--budget-units", "30000")  # f1: 20,900 <= 30,000
    _, now = columns(lines)
    assert now == {"admit_free/fits": 5, "defer/deadline_passed": 1, "defer/queue_age_cap": 2,
                   "reserved/bad_input": 1, "reserved/dwell_over_slack": 1}  # fmt: skip
    assert changes(lines) == {"f1": "admit_free/fits"}
    assert review(lines, "free_missed") == {
        "as_was": "0.2500", "would_be": "0.2500", "slack_misses": "1/1",
        "free_admissions": "4/4", "unknown_outcome": "1",
    }  # fmt: skip


def test_a_smaller_budget_refuses_what_would_pass_it(history: dict) -> None:
    lines = tune("--budget-units", "15000")  # e1: 17,800 > 15,000; d1: 14,600 fits
    _, now = columns(lines)
    assert now["admit_free/fits"] == 3 and now["reserved/retry_tax_budget"] == 2
    assert changes(lines) == {"e1": "reserved/retry_tax_budget"}
    assert review(lines, "free_missed")["would_be"] == "0.3333"  # a2's miss of a1, a2, d1


def test_a_cheaper_wait_admits_what_its_price_refused(history: dict) -> None:
    # At 100 a second an admission reserves 1,000 + 10 x 100 = 2,000, and f1 is priced
    # 12,000 + 29.5 x 100 + 2,000 = 16,950 <= 20,000 (the exposure as the script saw it).
    lines = tune("--queue-wait-unit-per-second", "100")
    assert changes(lines) == {"f1": "admit_free/fits"}
    assert "changed=1 undecidable=0 superseded=0" in lines


def test_a_dearer_wait_refuses_what_its_price_admitted(history: dict) -> None:
    # At 300: 1,000 + 3,000 reserved; e1 is priced 9,000 + 29 x 300 + 4,000 = 21,700.
    lines = tune("--queue-wait-unit-per-second", "300")
    assert changes(lines) == {"e1": "reserved/retry_tax_budget"}


def test_the_learned_p95_sends_long_tasks_away_from_the_free_path(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    times = ServiceTimes(redis_client, Keys())
    for _ in range(5):
        times.observe(TASK, 40.0)
    p95 = times.read(TASK).p95
    assert p95 is not None and 38 < p95 < 42
    play_history(redis_url, redis_client)  # decided with service_time=declared (8 s)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    monkeypatch.setenv("GATEKEEPER_SERVICE_TIME_MIN_SAMPLES", "5")
    lines = tune("--service-time", "max")
    # Service P and tax P (one retry left): dwell = age + 2P, about age + 80. a1 (0 + 2P <= 90)
    # stays; a2 (12 + 2P > 90) goes to reserved; d1, e1 (28, 29 + 2P <= 200) stay; f1 is
    # still refused by the budget; the defers stay (the age cap first).
    assert 2 * p95 <= 90 < 12 + 2 * p95
    assert changes(lines) == {"a2": "reserved/dwell_over_slack"}
    assert review(lines, "free_missed")["would_be"] == "0.0000"  # a2 was the miss
    monkeypatch.setenv("GATEKEEPER_SERVICE_TIME_MIN_SAMPLES", "6")  # not enough runs yet
    assert "changed=0 undecidable=0 superseded=0" in tune("--service-time", "max")


def test_one_knob_at_a_time(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["tune", "--max-queue-age-s", "20", "--budget-units", "9"])
    assert result.exit_code == 2 and "one knob at a time" in result.output
    bad = CliRunner().invoke(main, ["tune", "--budget-units", "-1"])
    assert bad.exit_code == 2 and "--budget-units" in bad.output and ">= 0" in bad.output


def test_records_stay_near_their_cap(redis_url: str, redis_client: redis.Redis) -> None:
    settings = history_settings(redis_url, decision_record_cap=300)
    pipeline = Pipeline.create(settings, redis_client, lambda: T0)
    spec = GatedSpec(expected_service_s=8, tokens_in=1, deadline_s=90)
    for i in range(2000):
        pipeline.route(Publish(TASK, f"j{i}", 0, 1, spec, {}))
    # MAXLEN ~ trims whole stream nodes (100 entries each by default): never far past it.
    assert 300 <= redis_client.xlen(Keys().decisions) <= 400


def test_a_cap_of_zero_records_nothing(redis_url: str, redis_client: redis.Redis) -> None:
    pipeline = Pipeline.create(history_settings(redis_url, decision_record_cap=0),
                               redis_client, lambda: T0)  # fmt: skip
    spec = GatedSpec(expected_service_s=8, tokens_in=1, deadline_s=90)
    pipeline.route(Publish(TASK, "j", 0, 1, spec, {}))
    pipeline.route(Publish(TASK, "late", 0, 1, GatedSpec(8, deadline_at=T0 - 1), {}))
    assert not redis_client.exists(Keys().decisions)


def test_a_record_never_holds_the_tasks_arguments(redis_url: str, redis_client: redis.Redis):
    # Only the fields the re-decision needs; a job id and a task name are the caller's own.
    play_history(redis_url, redis_client)
    for _, fields in redis_client.xrange(Keys().decisions):
        assert set(fields) in ({b"miss"}, {f.encode() for f in (
            "d", "r", "j", "k", "a", "s", "x", "l", "y", "n", "c", "b", "u", "m", "tu", "e", "p",
        )})  # fmt: skip


# The strongest form of "reproduces exactly": whatever gate.lua decided from whatever state,
# its record re-decided by the Python core gives the same decision and reason.
NUMBERS = st.floats(min_value=0, max_value=500, allow_nan=False)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    age_ms=st.one_of(st.none(), st.integers(0, 200_000)),
    service=st.one_of(NUMBERS, st.sampled_from([0.0, -1.0, math.inf])),
    tax=NUMBERS, slack=st.floats(-50, 400, allow_nan=False), cap=NUMBERS,
    tax_units=st.floats(0, 30_000), exposure=st.floats(0, 30_000), tokens=st.integers(0, 9000),
    budget=st.floats(0, 40_000), unit=st.floats(0, 400), delay=st.sampled_from([0.0, 3.5]),
    mode=st.sampled_from(list(BudgetMode)),
)  # fmt: skip
def test_every_decision_of_the_script_is_reproduced_by_the_core(
    redis_client: redis.Redis, age_ms: int | None, service: float, tax: float, slack: float,
    cap: float, tax_units: float, exposure: float, tokens: int, budget: float, unit: float,
    delay: float, mode: BudgetMode,
) -> None:  # fmt: skip
    keys = Keys()
    now = T0 + 100
    redis_client.delete(keys.free_waiting, keys.window(7), keys.run("j", 1), keys.decisions)
    if age_ms is not None:
        redis_client.zadd(keys.free_waiting, {"older:1": now * 1000 - age_ms})
    redis_client.hset(keys.window(7), mapping={"tax_units": tax_units, "exposure": exposure})
    store = GateStore(redis_client, keys, horizon_s=1e9)
    call = gate_call(now, window_id=7, job_id="j", expected_service_s=service, retry_tax_s=tax,
                     deadline_slack_s=slack, max_queue_age_s=cap, tokens_in=tokens,
                     budget_units=budget, queue_wait_unit_per_second=unit, budget_mode=mode,
                     delay_s=delay, wait_allowance_s=10.0,
                     publisher=f"{service!r}||0|1|10.0")  # fmt: skip
    scored = store.score(call)
    (record,) = read_records(redis_client, keys, 0).records
    again = redecide(record)
    assert (again.decision, again.reason) == (scored.decision.value, scored.reason.value)


def test_a_decision_made_in_process_that_a_knob_pushes_past_its_guards_is_undecidable() -> None:
    # A guard's defer read no queue age: were the guard to pass, the record cannot tell.
    record = DecisionRecord(
        job_id="j", attempt=1, task=TASK, decision="defer", reason="bad_service_guess",
        queue_age_s=None, expected_service_s=0.0, retry_tax_s=0.0, deadline_slack_s=60.0,
        delay_s=0.0, tokens_in=1, max_queue_age_s=30.0, budget_units=1e4,
        queue_wait_unit_per_second=200.0, budget_mode="exposure", tax_units=None,
        exposure=None, service_declared_s=0.0, service_learned_p95_s=None, service_samples=0,
        retries_left=0, wait_allowance_s=10.0,
    )  # fmt: skip
    assert redecide(record, Knob("max_queue_age_s", 10.0)).reason == "bad_service_guess"
    fixed = dataclasses.replace(record, expected_service_s=5.0, reason="queue_age_cap")
    assert redecide(fixed).decision is None
    result = compare([record, fixed])
    assert result.undecidable == 1 and result.would_be == {"defer/bad_service_guess": 1}


@pytest.mark.parametrize("fast_publish", ["on", "off"])
def test_a_celery_apps_publishes_are_recorded_and_reproduced(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], fast_publish: str,
) -> None:  # fmt: skip
    app = create_app(gate_settings(redis_url, fast_publish=fast_publish, max_queue_age_s=0.05),
                     redis_url)  # fmt: skip
    embed = app.tasks["tests.embed"]
    embed.delay("a prompt")  # admitted: the free queue was empty
    time.sleep(0.1)  # nobody runs it: the queue is now older than the 0.05 s cap
    embed.delay("a prompt")  # deferred by the age cap
    embed.apply_async(("a prompt",), headers={"gatekeeper_deadline_at": time.time() - 1})
    lines = [fields_of(line) for line in capsys.readouterr().err.splitlines()
             if "event=gate_decision" in line]  # fmt: skip
    routed = [f"{line['decision']}/{line['reason']}" for line in lines]
    assert routed == ["admit_free/fits", "defer/queue_age_cap", "defer/deadline_passed"]
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    out = tune()
    was, now = columns(out)
    assert was == now == {"admit_free/fits": 1, "defer/queue_age_cap": 1,
                          "defer/deadline_passed": 1}  # fmt: skip
    assert "changed=0 undecidable=0 superseded=0" in out
    for _, fields in redis_client.xrange(Keys().decisions):  # the task's arguments: nowhere
        assert b"a prompt" not in b"".join(fields.values())
    assert changes(tune("--max-queue-age-s", "60")) == {
        line["job_id"]: "admit_free/fits" for line in lines[1:2]
    }


def test_an_abandoned_free_admission_is_a_recorded_miss(
    redis_url: str, redis_client: redis.Redis
) -> None:
    play_history(redis_url, redis_client)
    runs = RunLedger(redis_client, Keys(), window_seconds=900, queue_wait_unit_per_second=200)
    row = LedgerRow("d1", 2, Path.RESERVED, 0, 0, 0, Outcome.ABANDONED, -5, 0.0)
    assert runs.abandon(row, int((T0 + 300) * 1000), slack_miss=True).written
    recorded = read_records(redis_client, Keys(), 0)
    assert [(job, attempt) for job, attempt, _ in recorded.misses] == [("a2", 1), ("d1", 2)]
    # d1's miss (its second attempt, abandoned) belongs to its free admission, attempt 1.
    assert compare(recorded.records, recorded.misses).review_was.slack_misses == 2


def test_with_a_cap_of_zero_a_miss_adds_nothing_to_an_old_stream(
    redis_url: str, redis_client: redis.Redis
) -> None:
    play_history(redis_url, redis_client)  # records kept, then the cap is set to 0
    length = redis_client.xlen(Keys().decisions)
    runs = RunLedger(redis_client, Keys(), window_seconds=900, queue_wait_unit_per_second=200,
                     decision_record_cap=0)  # fmt: skip
    for i in range(3):
        row = LedgerRow(f"x{i}", 1, Path.RESERVED, 0, 0, 0, Outcome.ABANDONED, -5, 0.0)
        assert runs.abandon(row, int(T0 * 1000), slack_miss=True).written
    assert redis_client.xlen(Keys().decisions) == length


def test_replays_the_knob_would_have_handed_on_are_superseded(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a1 admitted at 0 (nobody starts it); x deferred by the 30 s cap at 35, and its replays
    # at 45 and 55 deferred again. Under a cap of 100, x is admitted at 35: once.
    clock = {"t": 0.0}
    pipeline = Pipeline.create(history_settings(redis_url), redis_client,
                               lambda: T0 + clock["t"])  # fmt: skip
    spec = GatedSpec(expected_service_s=8, tokens_in=1000, deadline_at=T0 + 500)
    pipeline.route(Publish(TASK, "a1", 0, 1, spec, {}))
    headers: dict[str, Any] = {}
    for t in (35, 45, 55):
        clock["t"] = t
        origin = "replay" if headers else "publish"
        routing = pipeline.route(Publish(TASK, "x", 0, 1, spec, headers, origin=origin))
        assert routing.reason.value == "queue_age_cap"
        headers = dict(routing.headers)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    lines = tune("--max-queue-age-s", "100")
    was, now = columns(lines)
    assert was == {"admit_free/fits": 1, "defer/queue_age_cap": 3}
    assert now == {"admit_free/fits": 2}  # 35 + 8 + 8 <= 465; 3000 + 7000 + 3000 <= 20000
    assert "changed=1 undecidable=0 superseded=2" in lines
    assert review(lines, "free_missed")["unknown_outcome"] == "1"


def test_a_record_the_server_refuses_leaves_the_decision_whole(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A stream key of another type (or an ACL from before records: no XADD) refuses the
    # record; the decision, its record of the attempt and its exposure stand as decided.
    redis_client.set(Keys().decisions, "not a stream")
    pipeline = Pipeline.create(history_settings(redis_url), redis_client, lambda: T0)
    spec = GatedSpec(expected_service_s=8, tokens_in=1000, deadline_s=90)
    admitted = pipeline.route(Publish(TASK, "a", 0, 1, spec, {}))
    late = pipeline.route(Publish(TASK, "late", 0, 1, GatedSpec(8, deadline_at=T0 - 1), {}))
    assert (admitted.reason.value, late.reason.value) == ("fits", "deadline_passed")
    assert redis_client.hget(Keys().run("a", 1), "decision") == b"admit_free"
    assert redis_client.hget(Keys().totals, "records_refused") == b"2"


def test_a_refused_record_is_said_by_tune(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_client.hset(Keys().totals, "records_refused", 3)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["tune", "--since", "1h"])
    assert result.exit_code == 0 and "3 decisions could not be recorded" in result.stderr


def test_a_since_before_the_epoch_starts_at_the_epoch(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    assert tune_since("99999999999w")[0].startswith("tune since=99999999999w from=1970-01-01")


def tune_since(since: str) -> list[str]:
    result = CliRunner().invoke(main, ["tune", "--since", since])
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def test_tune_says_when_the_record_begins_after_since_and_why(
    history: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The history was recorded just now: asked about the last two hours, tune says its record
    # begins later, and why (nothing recorded before; or, near the cap, trimmed).
    shown = CliRunner().invoke(main, ["tune", "--since", "2h"])
    assert shown.exit_code == 0, shown.output
    assert "note: the record begins at " in shown.output
    assert "after --since: none were recorded before" in shown.output
    monkeypatch.setenv("GATEKEEPER_DECISION_RECORD_CAP", "10")  # the stream holds about that
    trimmed = CliRunner().invoke(main, ["tune", "--since", "2h"])
    assert "after --since: older ones were trimmed at decision_record_cap=10" in trimmed.output
    recent = CliRunner().invoke(main, ["tune", "--since", "1m"])
    assert "the record begins at" not in recent.output
