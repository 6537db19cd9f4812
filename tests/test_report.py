"""gatekeeper report on a scripted history, against ratios computed by hand."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.core.ledger import BudgetMode, Outcome, window_id
from gatekeeper.core.review import (
    DEFER_FIT,
    FREE_AGE_MAX,
    RESERVED_AGE_SHIFT,
    review_marks,
    summarize_review,
    window_figures,
)
from gatekeeper.ops.cli import main
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger, RunRecord
from gatekeeper.redis.store import GateStore
from tests.calls import gate_call
from tests.conftest import initialised

KEYS = Keys()


def score(store: GateStore, client: redis.Redis, job: str, *, age_s: float = 0.0,
          service: float = 1.0, tax: float = 0.0, slack: float = 60.0) -> str:  # fmt: skip
    """One decision by the gate script, with the free queue made ``age_s`` old."""
    now = time.time()
    client.delete(KEYS.free_waiting)
    if age_s:
        client.zadd(KEYS.free_waiting, {"old:1": (now - age_s) * 1000})
    scored = store.score(gate_call(
        now_s=now, window_id=window_id(now, 900), job_id=job, attempt=1,
        expected_service_s=service, retry_tax_s=tax, deadline_slack_s=slack,
        max_queue_age_s=30, tokens_in=10, budget_units=1e9, queue_wait_unit_per_second=0,
        budget_mode=BudgetMode.EXPOSURE, deadline_slack_ms=round(slack * 1000),
    ))  # fmt: skip
    return f"{scored.decision.value}/{scored.reason.value}"


def test_report_gives_the_hand_computed_ratios(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    # Four free admissions; one of them finishes after its deadline: free_missed = 1/4.
    for n in range(4):
        assert score(store, redis_client, f"a{n}") == "admit_free/fits"
    runs = RunLedger(redis_client, KEYS, window_seconds=900, queue_wait_unit_per_second=0)
    now_ms = round(time.time() * 1000)
    late = RunRecord(task="t", path="free", decision="admit_free", published_ms=now_ms - 9000,
                     admitted_ms=now_ms - 9000, window=window_id(now_ms / 1000 - 9, 900),
                     deadline_ms=now_ms - 1000, tokens_in=10,
                     tokens_out=0, dwell_s=2.0, retries=0, started_ms=now_ms - 5000)  # fmt: skip
    row = runs.row_for("a0", 1, late, Outcome.OK, now_ms)
    assert runs.finish(row, 1, late, now_ms, slack_miss=True).written
    # Three defers: two by the age cap, of which one still fit its slack; one bad guess.
    assert score(store, redis_client, "d0", age_s=40, slack=60) == "defer/queue_age_cap"  # fits
    assert score(store, redis_client, "d1", age_s=40, slack=30) == "defer/queue_age_cap"
    marks = review_marks("defer", "bad_service_guess", 0.0, 60, 0, 0)
    store.record_decision(window_id(time.time(), 900), "b0", 1, Decision.DEFER,
                          Reason.BAD_SERVICE_GUESS, marks, {})  # fmt: skip
    # Three shifts to reserved: two for dwell over slack, one only because of the queue's age.
    assert score(store, redis_client, "r0", age_s=20, service=5, slack=10) == (
        "reserved/dwell_over_slack"  # 5 s of service fit 10 s: the age sent it away
    )
    assert score(store, redis_client, "r1", service=12, slack=10) == "reserved/dwell_over_slack"
    store.record_decision(window_id(time.time(), 900), "f0", 1, Decision.RESERVED,
                          Reason.FREE_PATH_DISABLED, (False, False), {})  # fmt: skip

    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["report", "--since", "1h"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1] == "free_missed=0.2500 (slack_misses=1 free_admissions=4)"
    assert lines[2] == "defer_savable=0.3333 (defers_dwell_fit=1 defers=3)"
    assert lines[3] == ("reserved_age_shift=0.3333 (reserved_dwell_fit_without_age=1 reserved=3)")
    assert lines[4:] == [
        "decision admit_free/fits=4",
        "decision defer/bad_service_guess=1",
        "decision defer/queue_age_cap=2",
        "decision reserved/dwell_over_slack=2",
        "decision reserved/free_path_disabled=1",
    ]


def test_report_names_a_bad_duration(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["report", "--since", "a week"])
    assert result.exit_code == 2 and "7d" in result.output


def test_report_past_the_windows_retention_says_so(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    within, past = (CliRunner().invoke(main, ["report", "--since", s]) for s in ("8d", "30d"))
    assert within.exit_code == past.exit_code == 0, past.output
    assert "kept 8 days" not in within.output and "kept 8 days" in past.output
    assert "windows=769 " in past.output  # 8 days of 15-minute windows, no more
    # A typo of centuries reads the same 8 days, not a window per 15 minutes since 1970.
    ages = CliRunner().invoke(main, ["report", "--since", "1000000000w"])
    assert ages.exit_code == 0 and "windows=769 " in ages.output, ages.output


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    age_s=st.floats(min_value=0, max_value=60),
    service=st.floats(min_value=0.001, max_value=40),
    tax=st.floats(min_value=0, max_value=40),
    slack=st.floats(min_value=0.001, max_value=120),
)
def test_the_scripts_review_marks_are_the_cores(
    redis_client: redis.Redis, age_s: float, service: float, tax: float, slack: float
) -> None:
    redis_client.flushdb()
    initialised(redis_client)
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    now = time.time()
    redis_client.zadd(KEYS.free_waiting, {"old:1": round((now - age_s) * 1000)})
    scored = store.score(gate_call(
        now_s=now, window_id=1, job_id="j", attempt=1, expected_service_s=service,
        retry_tax_s=tax, deadline_slack_s=slack, max_queue_age_s=30, tokens_in=1,
        budget_units=1e9, queue_wait_unit_per_second=0, budget_mode=BudgetMode.EXPOSURE,
        deadline_slack_ms=0,
    ))  # fmt: skip
    expected = review_marks(
        scored.decision.value, scored.reason.value, scored.dwell_s, slack, service, tax
    )
    window = redis_client.hgetall(KEYS.window(1))
    marks = (DEFER_FIT.encode() in window, RESERVED_AGE_SHIFT.encode() in window)
    assert marks == expected


def test_windows_written_before_admissions_were_counted_once_are_not_counted_twice() -> None:
    # Older gate.lua wrote decided:admit_free:fits and admitted_free for each admission.
    old = {"admitted_free": "3", "decided:admit_free:fits": "3", "decided:defer:queue_age_cap": "2"}
    new = {"admitted_free": "4", "decided:reserved:dwell_over_slack": "1"}
    review = summarize_review([old, new])
    assert review.decisions == {
        "admit_free/fits": 7,
        "defer/queue_age_cap": 2,
        "reserved/dwell_over_slack": 1,
    }
    assert (review.free_admissions, review.defers, review.reserved) == (7, 2, 1)


def test_a_windows_figures_for_the_charts_and_a_window_older_than_the_age_field() -> None:
    fields = {
        "admitted_free": "3", "decided:defer:queue_age_cap": "2", "decided:reserved:x": "1",
        "tax_units": "1620.5", "slack_misses": "1", "killed_free": "1", FREE_AGE_MAX: "41250",
    }  # fmt: skip
    figures = window_figures(7, fields)
    assert figures.decisions == {"admit_free": 3, "defer": 2, "reserved": 1}
    assert (figures.tax_units, figures.slack_misses, figures.killed_free) == (1620.5, 1, 1)
    assert figures.free_age_max_s == 41.25
    older = window_figures(8, {"admitted_free": "2"})  # written before the age was kept
    assert older.free_age_max_s is None and older.decisions["admit_free"] == 2


def test_report_html_to_a_path_it_cannot_write_names_the_option(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = CliRunner().invoke(main, ["report", "--html", str(blocker / "review.html")])
    assert result.exit_code == 2 and "--html" in result.output


def test_a_window_field_gatekeeper_did_not_write_is_a_clear_error(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    redis_client.hset(Keys().window(window_id(time.time(), 900)), "free_age_max_ms", "x")
    page = ["report", "--since", "1h", "--html", str(tmp_path / "r.html")]
    result = CliRunner().invoke(main, page)
    assert result.exit_code == 1 and "not a number" in result.output, result.output
    assert CliRunner().invoke(main, ["report", "--since", "1h"]).exit_code == 0  # unread there
    for bad in ("x", "inf"):  # int(float("inf")) is an OverflowError, not a ValueError
        redis_client.hset(Keys().window(window_id(time.time(), 900)), "admitted_free", bad)
        result = CliRunner().invoke(main, ["report", "--since", "1h"])
        assert result.exit_code == 1 and "not a number" in result.output, result.output
    for args in (["report", "--since", "1h"], ["report", "--since", "1h", "--html",
                                              str(tmp_path / "r.html")]):  # fmt: skip
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and "not a number" in result.output, result.output
