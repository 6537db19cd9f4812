"""The clean hour is judged with the deployment's ``window_seconds`` and ``budget_units``, not
with the settings of the shell an operator runs ``gatekeeper flags`` in: every process that
decides publishes writes the values it decides with (gatekeeper/redis/deployment.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.core.ledger import window_id
from gatekeeper.ops.cli import main
from gatekeeper.ops.metrics import collector_for
from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import create_app
from tests.conftest import clear_of_a_window_edge, gate_settings, initialised
from tests.scrape import scrape, serving, value

KEYS = Keys()


def deployed(redis_url: str, **overrides: object) -> None:
    """A process that decides with these settings publishes one gated task."""
    app = create_app(gate_settings(redis_url, **overrides), redis_url)
    app.tasks["tests.embed"].delay(1)


def stored(client: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(KEYS.deployment).items()}


@pytest.fixture()
def shell(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """An operator's shell: the gate's Redis, and otherwise the default settings."""
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    runner = CliRunner()
    assert runner.invoke(main, ["flags", "set", "free_path_enabled", "false"]).exit_code == 0
    return runner


def reopen(shell: CliRunner, *extra: str) -> tuple[int, str]:
    done = shell.invoke(main, ["flags", "set", "free_path_enabled", "true", *extra])
    return done.exit_code, done.output


def test_a_process_that_decides_writes_the_values_it_decides_with(
    redis_url: str, redis_client: redis.Redis
) -> None:
    deployed(redis_url, window_seconds=600, budget_units=100)
    values = stored(redis_client)
    assert (values["window_seconds"], float(values["budget_units"])) == ("600", 100.0)
    assert abs(float(values["at"]) - time.time()) < 60
    assert values["by"].endswith(f":{os.getpid()}")


def test_a_reopen_reads_the_deployments_windows_not_the_shells(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    # The shell has no GATEKEEPER_WINDOW_SECONDS: with its 900 s it would read windows the gate
    # never wrote, each empty and so clean, and re-open over a killed row.
    clear_of_a_window_edge(600, 5)
    deployed(redis_url, window_seconds=600)
    redis_client.hset(KEYS.window(window_id(time.time(), 600)), "rows:killed", 1)
    code, output = reopen(shell)
    assert code == 1, output
    assert "killed rows" in output and "judged with the deployment's window_seconds=600" in output
    assert redis_client.hget(KEYS.flags, "free_path_enabled") == b"false"
    assert stored(redis_client)["window_seconds"] == "600"  # the shell wrote nothing there


def test_a_reopen_holds_the_hour_to_the_deployments_budget(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    clear_of_a_window_edge(900, 5)
    deployed(redis_url, budget_units=100)
    redis_client.hset(KEYS.window(window_id(time.time(), 900)), "tax_units", 150)
    code, output = reopen(shell)  # the shell's budget is the default 12,000
    assert code == 1, output
    assert "tax 150 is over the budget 100" in output and "budget_units=100" in output


def test_the_deployments_clean_hour_reopens(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    clear_of_a_window_edge(600, 5)
    deployed(redis_url, window_seconds=600, budget_units=100)
    redis_client.hset(KEYS.window(window_id(time.time(), 900)), "rows:killed", 1)  # not its
    code, output = reopen(shell)
    assert code == 0, output
    assert "clean hour" in output and "judged with the deployment's window_seconds=600" in output


def test_without_a_recorded_deployment_the_shells_values_judge_and_say_so(
    redis_client: redis.Redis, shell: CliRunner
) -> None:
    code, output = reopen(shell)
    assert code == 0, output
    assert "judged with this shell's window_seconds=900 budget_units=12000" in output
    assert "no deciding process has recorded its own" in output


@pytest.mark.parametrize(
    ("field", "value"), [("window_seconds", "0"), ("window_seconds", "x"), ("budget_units", "-1")]
)
def test_an_unreadable_deployment_is_no_clean_hour_and_force_still_reopens(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner, field: str, value: str
) -> None:
    deployed(redis_url)
    redis_client.hset(KEYS.deployment, field, value)
    code, output = reopen(shell)
    assert code == 1, output
    assert f"deployment field {field}={value!r}" in output and "cannot be read" in output
    code, output = reopen(shell, "--force")
    assert code == 0 and "forced" in output


def test_a_process_deciding_with_other_values_than_the_last_says_so(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    deployed(redis_url, window_seconds=600)
    capsys.readouterr()
    deployed(redis_url, window_seconds=600)
    assert "deployment_settings_differ" not in capsys.readouterr().err
    deployed(redis_url, window_seconds=1200)
    (line,) = [ln for ln in capsys.readouterr().err.splitlines()
               if "event=deployment_settings_differ" in ln]  # fmt: skip
    assert " window_seconds=1200 " in line and " previous_window_seconds=600 " in line
    assert stored(redis_client)["window_seconds"] == "1200"  # the last one's


def test_ledger_and_status_read_the_deployments_window_and_say_so(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner, tmp_path: Path
) -> None:
    clear_of_a_window_edge(600, 5)
    deployed(redis_url, window_seconds=600, budget_units=100)
    current = window_id(time.time(), 600)
    redis_client.hset(KEYS.window(current), "tax_units", 40)
    ledger = shell.invoke(main, ["ledger", "--json", str(tmp_path / "rows.json")])
    assert ledger.exit_code == 0, ledger.output
    assert "this shell's window_seconds=900 budget_units=12000 are not the deployment's" in (
        ledger.output)  # fmt: skip
    document = json.loads((tmp_path / "rows.json").read_text())
    assert (document["window_id"], document["window_seconds"]) == (current, 600)
    assert document["budget_units"] == 100
    status = shell.invoke(main, ["status"])
    assert status.exit_code == 0, status.output
    assert f"window={current} tax_units=40.0" in status.output
    assert "budget_units=100 budget_left=60" in status.output


def test_the_exporter_shows_the_deployments_window_and_budget(
    redis_url: str, redis_client: redis.Redis
) -> None:
    clear_of_a_window_edge(600, 5)
    deployed(redis_url, window_seconds=600, budget_units=100)
    redis_client.hset(KEYS.window(window_id(time.time(), 600)), "tax_units", 40)
    with serving(collector_for(gate_settings(redis_url))) as url:  # its own: 900 s, 12,000
        samples = scrape(url)
    assert value(samples, "gatekeeper_window_seconds") == 600
    assert value(samples, "gatekeeper_budget_units") == 100
    assert value(samples, "gatekeeper_window_tax_units") == 40
    assert value(samples, "gatekeeper_budget_left_units") == 60
    redis_client.hset(KEYS.deployment, "budget_units", "lots")  # unreadable: its own, said
    with serving(collector_for(gate_settings(redis_url))) as url:
        samples = scrape(url)
    assert value(samples, "gatekeeper_budget_units") == 12000
    assert value(samples, "gatekeeper_redis_up") == 1


def test_a_redis_that_lost_its_data_has_the_values_again_before_the_state_is_initialised(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = create_app(gate_settings(redis_url, window_seconds=600), redis_url)
    app.tasks["tests.embed"].delay(1)
    redis_client.flushdb()  # the state marker and the deployment's values gone together
    time.sleep(0.3)  # past flag_cache_s: the next publish reads the flags again
    app.tasks["tests.embed"].delay(2)
    assert stored(redis_client)["window_seconds"] == "600"
    initialised(redis_client)
    time.sleep(0.3)
    redis_client.delete(KEYS.deployment)
    app.tasks["tests.embed"].delay(3)  # the state is back: written once per process, not again
    assert not redis_client.exists(KEYS.deployment)
