"""SPEC section 5: the drill's seven table lines and the seeded ledger drill."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from gatekeeper.core.ledger import Outcome, row_retry_tax
from gatekeeper.ops.cli import main
from gatekeeper.ops.drill import dwell_table_lines, ledger_json, run_ledger_drill
from gatekeeper.settings import DrillSettings

EXPECTED_TABLE = [
    "job=1 dwell=28 slack=90 decision=admit_free",
    "job=2 dwell=57 slack=90 decision=defer",
    "job=3 dwell=36 slack=30 decision=reserved",
    "job=4 dwell=28 slack=30 decision=admit_free",
    "job=5 dwell=18 slack=90 decision=defer",
    "job=6 dwell=26 slack=-1 decision=defer",
    "job=7 dwell=66 slack=40 decision=defer",
]


def test_table_prints_the_sources_lines() -> None:
    assert dwell_table_lines() == EXPECTED_TABLE


def test_same_seed_gives_identical_json() -> None:
    first = ledger_json(run_ledger_drill(DrillSettings(seed=7)))
    second = ledger_json(run_ledger_drill(DrillSettings(seed=7)))
    assert first == second


def test_another_seed_gives_other_rows() -> None:
    assert ledger_json(run_ledger_drill(DrillSettings(seed=7))) != ledger_json(
        run_ledger_drill(DrillSettings(seed=8))
    )


def test_every_row_is_priced_by_the_formula() -> None:
    cfg = DrillSettings()
    for _, row in run_ledger_drill(cfg).rows:
        expected = row_retry_tax(
            row.outcome, row.tokens_in, row.queue_wait_ms, cfg.queue_wait_unit_per_second
        )
        assert row.retry_tax == expected


def test_budget_left_is_budget_minus_free_tax() -> None:
    cfg = DrillSettings()
    result = run_ledger_drill(cfg)
    ((_window, summary),) = result.summaries
    free_tax = sum(row.retry_tax for _, row in result.rows if row.path.value == "free")
    assert summary.tax_units == pytest.approx(free_tax)
    assert summary.budget_left == math.floor(round(cfg.budget_units - free_tax, 6))


def test_default_budget_rejects_some_jobs_but_not_all() -> None:
    cfg = DrillSettings()
    ((_, summary),) = run_ledger_drill(cfg).summaries
    assert 0 < summary.rejected < cfg.jobs


def test_every_job_ends_in_ok_or_a_final_killed_or_abandoned_row() -> None:
    result = run_ledger_drill(DrillSettings(kill_fraction=0.5, seed=3))
    last: dict[str, Outcome] = {}
    for _, row in result.rows:
        last[row.job_id] = row.outcome
    assert len(last) == 40
    assert set(last.values()) <= {Outcome.OK, Outcome.KILLED, Outcome.ABANDONED}


def test_killed_attempt_is_retried_as_attempt_two() -> None:
    result = run_ledger_drill(DrillSettings(kill_fraction=1.0, budget_units=1e9))
    attempts = [(row.job_id, row.attempt, row.outcome) for _, row in result.rows[:2]]
    assert attempts == [("1", 1, Outcome.KILLED), ("1", 2, Outcome.OK)]


def test_a_retry_past_its_deadline_is_abandoned() -> None:
    # Slack 10 s; a first attempt waits up to 4 s, dies at 0.75 s and is noticed 9 s later:
    # every retry finds its deadline gone.
    cfg = DrillSettings(kill_fraction=1.0, kill_detect_s=9, budget_units=1e9)
    rows = [row for _, row in run_ledger_drill(cfg).rows]
    assert [(r.attempt, r.outcome) for r in rows[:2]] == [
        (1, Outcome.KILLED),
        (2, Outcome.ABANDONED),
    ]
    assert rows[1].deadline_slack_ms < 0 and rows[1].retry_tax == 0


def test_drill_command_prints_table_summary_and_path(tmp_path: Path) -> None:
    out = tmp_path / "ledger.json"
    result = CliRunner().invoke(main, ["drill", "--out", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[:7] == EXPECTED_TABLE
    assert lines[7].startswith("finished=") and "budget_left=" in lines[7]
    assert lines[8] == f"wrote {out}"
    document = json.loads(out.read_text())
    assert document["windows"][0]["summary"] == lines[7]
    assert {
        "job_id",
        "attempt",
        "path",
        "queue_wait_ms",
        "tokens_in",
        "tokens_out",
        "outcome",
        "deadline_slack_ms",
        "retry_tax",
    } <= set(document["rows"][0])


def test_drill_command_seed_changes_the_file(tmp_path: Path) -> None:
    runner = CliRunner()
    files = []
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        out = tmp_path / f"{name}.json"
        assert runner.invoke(main, ["drill", "--seed", seed, "--out", str(out)]).exit_code == 0
        files.append(out.read_bytes())
    assert files[0] == files[1]
    assert files[0] != files[2]


def test_drill_reads_the_workload_from_the_toml_file(tmp_path: Path) -> None:
    config = tmp_path / "g.toml"
    config.write_text("[drill]\njobs = 3\nkill_fraction = 0.0\n")
    out = tmp_path / "l.json"
    result = CliRunner().invoke(main, ["--config", str(config), "drill", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[7].startswith("finished=3 killed_rows=0")


def test_the_readme_shows_what_the_default_drill_prints() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ((_, summary),) = run_ledger_drill(DrillSettings()).summaries
    assert summary.line() in readme
