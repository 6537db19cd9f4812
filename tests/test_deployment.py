"""The clean hour is judged with the deployment's ``window_seconds`` and ``budget_units``, not
with the settings of the shell an operator runs ``gatekeeper flags`` in: the processes keep the
values they run with in Redis, and the hour must be clean in the windows of every size kept,
each window's tax within the lowest budget kept (gatekeeper/redis/deployment.py)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from click.testing import CliRunner

import gatekeeper
import gatekeeper.redis.deployment
from gatekeeper.core.ledger import window_id
from gatekeeper.ops.cli import main
from gatekeeper.ops.metrics import collector_for
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger
from tests.apps.gated_app import create_app
from tests.conftest import clear_of_a_window_edge, gate_settings, running_worker, wait_until
from tests.scrape import scrape, serving, value
from tests.test_runs import record, start_run

KEYS = Keys()


def deployed(redis_url: str, **overrides: Any) -> Celery:
    """A process that decides with these settings publishes one gated task."""
    app = create_app(gate_settings(redis_url, **overrides), redis_url)
    app.tasks["tests.embed"].delay(1)
    return app


def stored(client: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(KEYS.deployment).items()}


def seen(at: float, by: str) -> str:
    """A pair's value as ``pair.lua`` writes it."""
    return f"{at!r}|{by}"


def killed_row_in(client: redis.Redis, window_seconds: int) -> None:
    client.hset(KEYS.window(window_id(time.time(), window_seconds)), "rows:killed", 1)


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


def test_a_process_that_decides_writes_the_pair_it_decides_with(
    redis_url: str, redis_client: redis.Redis
) -> None:
    deployed(redis_url, window_seconds=600, budget_units=100)
    ((pair, seen),) = stored(redis_client).items()
    at, by = seen.split("|")
    assert pair == "600|100.0" and abs(float(at) - time.time()) < 60  # the server's clock
    assert by.endswith(f":{os.getpid()}")


def test_a_reopen_reads_the_deployments_windows_not_the_shells(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    # The shell has no GATEKEEPER_WINDOW_SECONDS: with its 900 s it would read windows the gate
    # never wrote, each empty and so clean, and re-open over a killed row.
    clear_of_a_window_edge(600, 5)
    deployed(redis_url, window_seconds=600)
    killed_row_in(redis_client, 600)
    code, output = reopen(shell)
    assert code == 1, output
    assert (
        "killed rows" in output
        and "judged with the deployment's pairs: window_seconds=600" in output
    )
    assert redis_client.hget(KEYS.flags, "free_path_enabled") == b"false"
    assert list(stored(redis_client)) == ["600|12000.0"]  # the shell wrote nothing there


def test_a_reopen_holds_the_hour_to_the_deployments_budget(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    clear_of_a_window_edge(900, 5)
    deployed(redis_url, budget_units=100)
    redis_client.hset(KEYS.window(window_id(time.time(), 900)), "tax_units", 150)
    code, output = reopen(shell)  # the shell's budget is the default 12,000
    assert code == 1, output
    assert "tax 150 is over the budget 100" in output and "budget_units=100.0" in output


def test_the_deployments_clean_hour_reopens(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    clear_of_a_window_edge(600, 5)
    deployed(redis_url, window_seconds=600, budget_units=100)
    killed_row_in(redis_client, 900)  # not a window the deployment writes
    code, output = reopen(shell)
    assert code == 0, output
    assert (
        "clean hour" in output
        and "judged with the deployment's pairs: window_seconds=600" in output
    )


@pytest.mark.parametrize(
    ("first", "then", "killed_in"),
    [(600, 900, 600), (900, 600, 900)],
    ids=["a_one_off_process_with_the_shells_settings", "a_window_change_within_the_hour"],
)
def test_another_pair_beside_the_deployments_hides_no_window(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner, first: int, then: int,
    killed_in: int,
) -> None:  # fmt: skip
    """A reviewer: ``task.delay()`` from a shell with the default settings (900 s) wrote its
    values over the deployment's (600 s), and the re-open then passed over the deployment's
    killed row; a deployment restarted with another ``window_seconds`` hid the old windows."""
    clear_of_a_window_edge(killed_in, 5)
    deployed(redis_url, window_seconds=first)
    killed_row_in(redis_client, killed_in)
    deployed(redis_url, window_seconds=then)
    assert set(stored(redis_client)) == {f"{first}|12000.0", f"{then}|12000.0"}
    code, output = reopen(shell)
    assert code == 1 and "killed rows" in output, output


def test_a_pair_last_seen_before_the_hour_still_judges_when_no_other_was(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    clear_of_a_window_edge(600, 5)
    redis_client.hset(KEYS.deployment, "600|12000.0", seen(time.time() - 7200, "old:1"))
    killed_row_in(redis_client, 600)
    code, output = reopen(shell)
    assert code == 1 and "judged with the deployment's pairs: window_seconds=600" in output, output


def test_a_quiet_deployments_pair_still_judges_beside_a_one_off_publish(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    """A second reviewer: the deployment last published 75 minutes ago, its worker then wrote
    a killed row (a worker's row goes in its own current window), and a one-off publish from
    a shell with the default settings was the only pair seen within the hour."""
    clear_of_a_window_edge(600, 5)
    redis_client.hset(KEYS.deployment, "600|12000.0", seen(time.time() - 4500, "quiet:1"))
    killed_row_in(redis_client, 600)
    deployed(redis_url)  # 900 s
    code, output = reopen(shell)
    assert code == 1 and "killed rows" in output, output


def test_a_budget_raised_within_the_day_holds_until_the_old_pair_is_deleted(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    """Each window's tax is held to the lowest budget kept for its size: the old pair (100,
    seen 50 minutes ago) refuses a tax the new budget allows, naming the pair and how to
    forget it; deleted, the new one judges."""
    clear_of_a_window_edge(600, 5)
    redis_client.hset(KEYS.deployment, "600|100.0", seen(time.time() - 3000, "old:1"))
    deployed(redis_url, window_seconds=600, budget_units=1000)
    redis_client.hset(KEYS.window(window_id(time.time(), 600)), "tax_units", 500)
    code, output = reopen(shell)
    assert code == 1 and "is over the budget 100" in output, output
    assert "field '600|100.0', last seen from old:1" in output and "HDEL" in output
    redis_client.hdel(KEYS.deployment, "600|100.0")
    code, output = reopen(shell)
    assert code == 0 and "window_seconds=600 budget_units=1000.0 (" in output, output


def test_processes_of_an_older_version_beside_a_newer_one_hide_no_tax(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    """A fourth reviewer: a pair first seen now (an upgrade's first process) left the tax of
    the windows before it held to no budget."""
    clear_of_a_window_edge(900, 5)
    redis_client.hset(KEYS.window(window_id(time.time(), 900) - 2), "tax_units", 20_000)
    code, output = reopen(shell)
    assert code == 1 and "over the budget 12000" in output, output  # no pair: the shell's
    deployed(redis_url)
    code, output = reopen(shell)
    assert code == 1 and "over the budget 12000" in output, output


def test_a_workers_window_is_read_and_its_budget_ignored(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    """A worker keeps its window alone (it decides nothing with a budget): its killed rows
    are read; a tax the publishers' budget allows is not held to the worker's default."""
    clear_of_a_window_edge(1200, 5)
    deployed(redis_url, budget_units=50_000)
    redis_client.hset(KEYS.deployment, "1200|rows", seen(time.time(), "worker:1"))
    redis_client.hset(KEYS.window(window_id(time.time(), 900)), "tax_units", 20_000)
    code, output = reopen(shell)
    assert code == 0, output
    assert shell.invoke(main, ["flags", "set", "free_path_enabled", "false"]).exit_code == 0
    killed_row_in(redis_client, 1200)
    code, output = reopen(shell)
    assert code == 1 and "killed rows" in output, output


def test_a_sweep_from_a_shell_writes_its_killed_row_in_the_deployments_window(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second reviewer: the sweep wrote a vanished run's killed row in the shell's window,
    one the re-open never read."""
    clear_of_a_window_edge(600, 10)
    monkeypatch.setenv("GATEKEEPER_BROKER_URL", redis_url)
    deployed(redis_url, window_seconds=600)
    now_ms = round(time.time() * 1000)
    runs = RunLedger(redis_client, KEYS, window_seconds=600, queue_wait_unit_per_second=200)
    begun = record(
        path="reserved",
        decision="reserved",
        published_ms=now_ms - 120_000,
        admitted_ms=now_ms - 120_000,
        window=None,
        deadline_ms=now_ms + 900_000,
    )
    start_run(runs, redis_client, "vanished", 1, begun, now_ms - 60_000)
    swept = shell.invoke(main, ["sweep", "--older-than-s", "0"])
    assert swept.exit_code == 0 and "swept=1" in swept.output, swept.output
    assert redis_client.hget(KEYS.window(window_id(time.time(), 600)), "rows:killed") == b"1"
    code, output = reopen(shell)
    assert code == 1 and "killed rows" in output, output


def test_without_a_recorded_deployment_the_shells_values_judge_and_say_so(
    redis_client: redis.Redis, shell: CliRunner
) -> None:
    code, output = reopen(shell)
    assert code == 0, output
    assert "judged with this shell's window_seconds=900 budget_units=12000.0" in output
    assert "no process that decides has recorded its own" in output


@pytest.mark.parametrize(
    ("field", "value"),
    [("0|1.0", "1.0|h:1"), ("x|1", "1.0|h:1"), ("600|-1", "1.0|h:1"), ("600|nan", "1|h:1"),
     ("600|1_0", "1|h:1"), ("600|row", "1|h:1"), ("600|1.0", "soon|h:1"),
     ("600|1.0", "inf|h:1"), (b"\xff", b"\xfe"), ("86401|1.0", "1.0|h:1")],
)  # fmt: skip
def test_an_unreadable_pair_is_no_clean_hour_and_force_still_reopens(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner, field: Any, value: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    app = deployed(redis_url)
    redis_client.hset(KEYS.deployment, field, value)
    code, output = reopen(shell)
    assert code == 1, output
    assert "deployment field" in output and "cannot be read" in output
    code, output = reopen(shell, "--force")
    assert code == 0 and "forced" in output
    capsys.readouterr()
    time.sleep(0.3)  # past flag_cache_s: the re-open is read
    app.tasks["tests.embed"].delay(2)  # the gate decides as before
    assert "reason=fits" in capsys.readouterr().err


def test_a_key_of_another_type_is_no_clean_hour_and_breaks_no_publish(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    redis_client.set(KEYS.deployment, "oops")
    code, output = reopen(shell)
    assert code == 1 and "is not a hash of deployment pairs" in output, output
    code, output = reopen(shell, "--force")
    assert code == 0, output
    status = shell.invoke(main, ["status"])
    assert status.exit_code == 0 and "is not a hash of deployment pairs" in status.output
    capsys.readouterr()
    deployed(redis_url)
    err = capsys.readouterr().err
    assert "reason=fits" in err and "event=deployment_not_written" in err


def test_a_client_that_decodes_replies_meets_bytes_that_are_not_utf8_and_still_decides(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second reviewer: the announce's reply, decoded by the app's own client, raised out
    of the flag read, and every gated publish failed closed (``gate_error``)."""
    redis_client.hset(KEYS.deployment, b"\xff", b"\xfe")
    app = Celery("decoding", broker=redis_url)
    decoding = redis.Redis.from_url(redis_url, decode_responses=True)
    gatekeeper.install(app, gate_settings(redis_url), client=decoding)

    @gatekeeper.gated(expected_service_s=1, tokens_in=100, deadline_s=60)
    @app.task(name="tests.decoding", shared=False)  # type: ignore[untyped-decorator]
    def decoded(x: int) -> int:
        return x

    capsys.readouterr()
    decoded.delay(1)
    err = capsys.readouterr().err
    assert "reason=fits" in err and "event=deployment_not_written" in err


def test_a_process_deciding_with_other_values_than_another_says_so_once(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(gatekeeper.redis.deployment, "ANNOUNCE_EVERY_S", 0.0)
    deployed(redis_url, window_seconds=600)
    deployed(redis_url, window_seconds=600)
    assert "deployment_settings_differ" not in capsys.readouterr().err
    app = deployed(redis_url, window_seconds=1200)
    time.sleep(0.3)  # past flag_cache_s: it writes again, and says nothing again
    app.tasks["tests.embed"].delay(2)
    (line,) = [ln for ln in capsys.readouterr().err.splitlines()
               if "event=deployment_settings_differ" in ln]  # fmt: skip
    assert " window_seconds=1200 " in line and " other_window_seconds=600 " in line


def test_a_lost_key_is_written_again_by_the_processes_that_decide(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reviewer: the key deleted (or lost with the data) while the state marker stayed was
    never written again, and the next re-open was judged with the shell's values."""
    monkeypatch.setattr(gatekeeper.redis.deployment, "ANNOUNCE_EVERY_S", 0.5)
    app = deployed(redis_url, window_seconds=600)
    redis_client.delete(KEYS.deployment)
    time.sleep(0.3)  # past flag_cache_s, not past the announce's period: not yet
    app.tasks["tests.embed"].delay(2)
    assert not redis_client.exists(KEYS.deployment)
    time.sleep(0.3)
    app.tasks["tests.embed"].delay(3)
    assert list(stored(redis_client)) == ["600|12000.0"]


def test_a_window_size_only_workers_keep_is_held_to_the_lowest_budget(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    """A fifth reviewer: new workers (600 s) beside old publishers (no pair): the workers'
    windows were held to no budget, and a re-open passed over a tax four times the budget."""
    clear_of_a_window_edge(600, 5)
    redis_client.hset(KEYS.deployment, "600|rows", seen(time.time(), "worker:1"))
    redis_client.hset(KEYS.window(window_id(time.time(), 600)), "tax_units", 50_000)
    code, output = reopen(shell)  # the shell's 900 s, 12,000
    assert code == 1 and "over the budget 12000" in output, output


def test_the_commands_use_the_workers_window_not_a_one_off_processs(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    """A fifth reviewer: a one-off pair of another size (and a lower budget) took over what
    status, the exporter, the sweep and the requeue read and decided with."""
    clear_of_a_window_edge(600, 5)
    deployed(redis_url, window_seconds=600, budget_units=50_000)
    redis_client.hset(KEYS.deployment, "600|rows", seen(time.time(), "worker:1"))
    deployed(redis_url)  # 900 s, 12,000
    current = window_id(time.time(), 600)
    redis_client.hset(KEYS.window(current), "tax_units", 40)
    status = shell.invoke(main, ["status"])
    assert status.exit_code == 0 and f"window={current} tax_units=40.0" in status.output
    assert "budget_units=50000" in status.output and "2 pairs within the hour" in status.output


def test_a_sweep_refuses_while_the_pairs_cannot_be_read(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    """A fifth reviewer: a sweep in the shell's window while the key was unreadable wrote a
    killed row that nobody read once the bad field was deleted."""
    redis_client.hset(KEYS.deployment, "600|x", "1|h:1")
    swept = shell.invoke(main, ["sweep", "--older-than-s", "0"])
    assert swept.exit_code == 1 and "nothing was done" in swept.output, swept.output


def test_a_one_off_pair_with_a_lower_budget_refuses_and_says_how_to_forget_it(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner
) -> None:
    """A third reviewer: a one-off publish with the shell's budget (12,000) beside the
    deployment's 50,000. The hour is held to the lower one (an extra pair must never let a
    tax through); the refusal names the pair, and where it was last seen from."""
    clear_of_a_window_edge(900, 5)
    deployed(redis_url, budget_units=50_000)
    redis_client.hset(KEYS.window(window_id(time.time(), 900) - 2), "tax_units", 20_000)
    deployed(redis_url)  # 900 s, 12,000
    code, output = reopen(shell)
    assert code == 1 and "over the budget 12000" in output, output
    assert f"field '900|12000.0', last seen from {socket.gethostname()}:" in output
    redis_client.hdel(KEYS.deployment, "900|12000.0")
    code, output = reopen(shell)
    assert code == 0, output


def test_a_host_whose_clock_is_behind_moves_no_pair_back(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A third reviewer: a host minutes behind set a shared pair's last seen back. The
    server's clock writes it."""
    behind = create_app(gate_settings(redis_url, window_seconds=600), redis_url,
                        clock=lambda: time.time() - 600)  # fmt: skip
    behind.tasks["tests.embed"].delay(1)
    ((at, _),) = [v.split("|") for v in stored(redis_client).values()]
    assert abs(float(at) - time.time()) < 60


def test_a_worker_that_never_publishes_keeps_its_pair(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A third reviewer: a worker writes killed rows in its own window, but only publishers
    kept a pair; its heartbeat keeps the worker's window."""
    with running_worker(redis_url, tmp_path / "w.log", GATEKEEPER_WINDOW_SECONDS="1200"):
        assert wait_until(lambda: "1200|rows" in stored(redis_client))


def test_a_day_windows_pair_is_kept_while_its_windows_can_be_read(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.hset(KEYS.deployment, "86400|1.0", seen(time.time() - 90_000, "day:1"))
    deployed(redis_url)
    assert "86400|1.0" in stored(redis_client)


def test_pairs_unseen_for_a_day_are_forgotten(redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.hset(KEYS.deployment, "300|1.0", seen(time.time() - 90_000, "old:1"))
    redis_client.hset(KEYS.deployment, "1800|1.0", seen(time.time() - 80_000, "old:2"))
    deployed(redis_url)
    assert set(stored(redis_client)) == {"1800|1.0", "900|12000.0"}


def test_ledger_and_status_read_the_deployments_window_and_say_so(
    redis_url: str, redis_client: redis.Redis, shell: CliRunner, tmp_path: Path
) -> None:
    clear_of_a_window_edge(600, 5)
    deployed(redis_url, window_seconds=600, budget_units=100)
    current = window_id(time.time(), 600)
    redis_client.hset(KEYS.window(current), "tax_units", 40)
    ledger = shell.invoke(main, ["ledger", "--json", str(tmp_path / "rows.json")])
    assert ledger.exit_code == 0, ledger.output
    assert "note: this shell's window_seconds=900 budget_units=12000.0 are not the " in (
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
    redis_client.hset(KEYS.deployment, b"\xff", b"lots")  # unreadable: its own, said
    with serving(collector_for(gate_settings(redis_url))) as url:
        samples = scrape(url)
    assert value(samples, "gatekeeper_budget_units") == 12000
    assert value(samples, "gatekeeper_redis_up") == 1
