"""``gatekeeper status``: per task, the declared service time and the learned p95."""

from __future__ import annotations

import redis
from click.testing import CliRunner

from gatekeeper.ops.cli import main
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.service_times import ServiceTimes
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings

RUNS_S = [0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5, 1.9, 2.4, 3.0]


def test_status_shows_declared_and_learned_per_task(
    redis_url: str, redis_client: redis.Redis
) -> None:
    times = ServiceTimes(redis_client, Keys())
    for run_s in RUNS_S:
        times.observe("tests.long_tail", run_s)
    env = {"GATEKEEPER_REDIS_URL": redis_url, "GATEKEEPER_SERVICE_TIME": "max",
           "GATEKEEPER_SERVICE_TIME_MIN_SAMPLES": "10"}  # fmt: skip
    result = CliRunner().invoke(main, ["status"], env=env)
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("service ")]
    assert line.startswith("service task=tests.long_tail declared_s=n/a learned_p95_s=3.")
    assert "samples=10 lower_bounds=0 (service_time=max, min_samples=10)" in line


def test_with_the_app_status_shows_each_gated_tasks_declaration_and_what_it_uses(
    redis_url: str, redis_client: redis.Redis
) -> None:
    times = ServiceTimes(redis_client, Keys())
    for run_s in RUNS_S:
        times.observe("tests.long_tail", run_s)
    app = create_app(gate_settings(redis_url), redis_url)
    env = {"GATEKEEPER_REDIS_URL": redis_url, "GATEKEEPER_SERVICE_TIME": "max",
           "GATEKEEPER_SERVICE_TIME_MIN_SAMPLES": "10"}  # fmt: skip
    result = CliRunner().invoke(main, ["status"], env=env, obj={"app": app})
    assert result.exit_code == 0, result.output
    lines = {line.split()[1]: line for line in result.output.splitlines()
             if line.startswith("service ")}  # fmt: skip
    assert "declared_s=0.8 learned_p95_s=3." in lines["task=tests.long_tail"]
    assert "samples=10 lower_bounds=0 uses=learned" in lines["task=tests.long_tail"]
    assert "declared_s=1 learned_p95_s=n/a samples=0" in lines["task=tests.embed"]
    assert "uses=declared" in lines["task=tests.embed"]
    assert "task=tests.plain" not in lines  # not gated
