"""Learned service times end to end: a real prefork worker, real Redis (SPEC section 6).

The acceptance case, scaled down tenfold for speed with its ratios kept: a task declared at
8 s whose real runs take 6 to 30 s becomes ``tests.long_tail``, declared at 0.8 s, run for
0.6 to 3.0 s.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from gatekeeper.core.service import RELATIVE_ERROR
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.service_times import ServiceTimes
from tests.apps.gated_app import create_app
from tests.conftest import clear_of_a_window_edge, gate_settings, running_worker, wait_until

pytestmark = pytest.mark.celery

RUNS_S = [0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5, 1.9, 2.4, 3.0]
"""Ten runs of 0.6 to 3.0 s: the sample's p95 (its 10th smallest) is the 3.0 s run."""


def decision_lines(err: str) -> list[dict[str, str]]:
    return [
        dict(part.split("=", 1) for part in line.split() if "=" in part)
        for line in err.splitlines()
        if "event=gate_decision" in line
    ]


def test_after_the_minimum_samples_max_decides_with_the_observed_p95_and_drift_fires_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    settings = gate_settings(redis_url, service_time="max", service_time_min_samples=len(RUNS_S),
                             budget_units=1e6)  # every run admitted to free at once  # fmt: skip
    task = create_app(settings, redis_url).tasks["tests.long_tail"]
    times = ServiceTimes(redis_client, Keys())
    with running_worker(redis_url, tmp_path / "worker.log", concurrency=4):
        for run_s in RUNS_S:
            task.delay(run_s)
        assert wait_until(lambda: times.read("tests.long_tail").samples == len(RUNS_S), 30)
    before = decision_lines(capsys.readouterr().err)
    assert len(before) == len(RUNS_S)
    for line in before:  # before the minimum samples: the declared value
        assert (line["decision"], line["service_source"]) == ("admit_free", "declared")
        assert line["expected_service_s"] == "0.8"
    clear_of_a_window_edge(900, 15)  # the drift line is once a window: the rest in one
    time.sleep(settings.flag_cache_s + 0.05)  # the publisher's cached read goes stale
    for _ in range(3):
        task.delay(0)
        time.sleep(settings.flag_cache_s + 0.05)  # each publish reads Redis again
    err = capsys.readouterr().err
    after = decision_lines(err)
    assert len(after) == 3
    for line in after:
        assert line["service_source"] == "learned" and line["service_declared_s"] == "0.8"
        assert float(line["expected_service_s"]) == pytest.approx(3.0, rel=RELATIVE_ERROR)
        assert line["service_learned_p95_s"] == line["expected_service_s"]
        assert line["service_samples"] == str(len(RUNS_S))
    drift = [line for line in err.splitlines() if "event=service_time_drift" in line]
    assert len(drift) == 1, drift  # once a window, though three publishes saw it
    assert "task=tests.long_tail" in drift[0] and "service_declared_s=0.8" in drift[0]
    # Another process (a second publisher app) in the same window says nothing more.
    create_app(settings, redis_url).tasks["tests.long_tail"].delay(0)
    assert "service_time_drift" not in capsys.readouterr().err


def test_a_run_killed_by_its_time_limit_counts_as_a_lower_bound(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = create_app(gate_settings(redis_url), redis_url)
    times = ServiceTimes(redis_client, Keys())
    with running_worker(redis_url, tmp_path / "worker.log"):
        app.tasks["tests.hard"].delay()  # time_limit=1: SIGKILLed at 1 s
        app.tasks["tests.boom"].delay()  # raises at once: killed, not a time limit
        assert wait_until(lambda: times.read("tests.hard").samples == 1, 30)
        assert wait_until(lambda: redis_client.llen("test:runs") == 2)
        time.sleep(0.5)
    hard = times.read("tests.hard")
    assert hard.lower_bounds == 1
    assert hard.p95 is not None and hard.p95 >= 1.0 * (1 - RELATIVE_ERROR)
    assert times.read("tests.boom").samples == 0
    assert times.names() == ["tests.hard"]


def test_a_run_ended_by_its_soft_time_limit_counts_as_a_lower_bound(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # README: SoftTimeLimitExceeded counts as a lower bound too (an audit found the hard
    # limit alone tested).
    app = create_app(gate_settings(redis_url), redis_url)
    times = ServiceTimes(redis_client, Keys())
    with running_worker(redis_url, tmp_path / "worker.log"):
        app.tasks["tests.soft"].delay()  # soft_time_limit=0.5: raised in the task at 0.5 s
        assert wait_until(lambda: times.read("tests.soft").samples == 1, 30)
    soft = times.read("tests.soft")
    assert soft.lower_bounds == 1
    assert soft.p95 is not None and soft.p95 >= 0.5 * (1 - RELATIVE_ERROR)
