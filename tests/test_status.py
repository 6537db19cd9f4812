"""gatekeeper status: what an on-call reads first."""

from __future__ import annotations

import time

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.core.ledger import window_id
from gatekeeper.ops.cli import main
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.lock import Claims
from tests.apps.gated_app import create_app
from tests.conftest import clear_of_a_window_edge, gate_settings


def test_status_shows_flags_with_who_when_why_queues_age_and_budget(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_of_a_window_edge(900, 10)  # the budget line is the current window's
    app = create_app(gate_settings(redis_url, budget_units=3000), redis_url)
    app.tasks["tests.embed"].delay(1)  # admitted: 100 tokens and 2,000 of wait reserved
    app.tasks["tests.embed"].apply_async((2,), headers={"gatekeeper_expected_service_s": 0})
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    monkeypatch.setenv("GATEKEEPER_BUDGET_UNITS", "3000")
    runner = CliRunner()
    args = ["flags", "set", "canary_percent", "50", "--reason", "widen the canary"]
    assert runner.invoke(main, args).exit_code == 0
    result = runner.invoke(main, ["status"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    canary = next(line for line in lines if line.startswith("flag canary_percent="))
    assert canary.startswith("flag canary_percent=50.0 (redis) changed ")
    assert canary.endswith(": widen the canary") and " by " in canary
    assert "flag free_path_enabled=true (settings)" in lines
    assert any(line.startswith("free_queue_age_s=") and "waiting_free=1" in line for line in lines)
    queues = next(line for line in lines if line.startswith("queues "))
    assert "free=1" in queues and "defer=1" in queues and "reserved=0" in queues
    window = window_id(time.time(), 900)
    budget = next(line for line in lines if line.startswith(f"window={window}"))
    assert (
        "exposure=2100" in budget and "budget_left=3000" in budget and "admitted_free=1" in budget
    )
    assert "reruns_after_row=0 forged_runs=0 unverified_runs=0" in lines
    records = next(line for line in lines if line.startswith("records "))
    assert records.startswith("records entries=2 since=20")  # both decisions, recorded now
    assert records.endswith(" decision_record_cap=1000000 refused=0")


def test_status_counts_every_replayers_claims(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_client.lpush("defer", b"a", b"b", b"c")
    live = Claims(redis_client, "defer", 30.0, "one")
    live.begin()
    live.claim("defer")
    redis_client.rpoplpush("defer", "defer:replaying")  # an older version's processing list
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["status"])
    queues = next(line for line in result.stdout.splitlines() if line.startswith("queues "))
    assert "defer=1" in queues and "defer:replaying=2" in queues
    port = redis_client.connection_pool.connection_kwargs["port"]
    assert queues.endswith(f"(broker 127.0.0.1:{port}/0)")  # which broker it read, named


def test_status_names_every_source_that_closes_the_free_path(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis holds true, the settings say false: the settings close it, and Redis's last
    change (a re-open) is not shown as its cause; both false: both named."""
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    runner = CliRunner()
    opened = ["flags", "set", "free_path_enabled", "true", "--force", "--reason", "reopen"]
    assert runner.invoke(main, opened).exit_code == 0
    monkeypatch.setenv("GATEKEEPER_FREE_PATH_ENABLED", "false")
    lines = runner.invoke(main, ["status"]).stdout.splitlines()
    assert "flag free_path_enabled=false (settings)" in lines
    closed = ["flags", "set", "free_path_enabled", "false", "--reason", "page 4411"]
    assert runner.invoke(main, closed).exit_code == 0
    lines = runner.invoke(main, ["status"]).stdout.splitlines()
    (line,) = [line for line in lines if line.startswith("flag free_path_enabled=")]
    assert line.startswith("flag free_path_enabled=false (settings, redis) changed ")
    assert line.endswith(": page 4411")
    monkeypatch.delenv("GATEKEEPER_FREE_PATH_ENABLED")
    lines = runner.invoke(main, ["status"]).stdout.splitlines()
    (line,) = [line for line in lines if line.startswith("flag free_path_enabled=")]
    assert line.startswith("flag free_path_enabled=false (redis) changed ")


def test_data_gatekeeper_did_not_write_is_a_clear_error_or_left_out_never_a_traceback(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row that is not JSON or not a ledger row, a counter that is not a number, a flag
    log entry that is not a change: ``ledger`` and ``status`` say where (exit 1), a re-open
    is refused (nothing proves the hour clean), the flag history leaves the entry out."""
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    runner = CliRunner()
    keys = Keys()
    window = window_id(time.time(), 900)
    redis_client.lpush(keys.flags_log, "junk")
    assert runner.invoke(main, ["flags"]).exit_code == 0
    assert runner.invoke(main, ["status"]).exit_code == 0
    for row, said in (("not json", "not JSON"), ('{"job_id": "a"}', "not a ledger row")):
        redis_client.delete(keys.window_rows(window))
        redis_client.rpush(keys.window_rows(window), row)
        result = runner.invoke(main, ["ledger"])
        assert result.exit_code == 1 and said in result.output, result.output
        assert not isinstance(result.exception, (ValueError, KeyError))
    redis_client.hset(keys.window(window), "tax_units", "abc")
    result = runner.invoke(main, ["status"])
    assert result.exit_code == 1 and "not a number" in result.output, result.output
    reopen = ["flags", "set", "free_path_enabled", "true", "--reason", "reopen"]
    result = runner.invoke(main, reopen)
    assert result.exit_code == 1 and "not a number" in result.output, result.output
