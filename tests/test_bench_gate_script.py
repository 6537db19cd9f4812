"""``bench/gate_script.py`` checks itself: it prints ``gate_lua_us`` only when every timed call
decided what its path claims, and fails loudly otherwise.

Each test runs the real bench, tiny, as a subprocess on an embedded ``redis-server`` of its own.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.benches import run_bench as bench
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.redis

CALLS, BLOCKS = 20, 2
TIMED = CALLS * BLOCKS
ANSWERS_ADMIT = "return {'admit_free', 'fits', '0', '8.000000', '0', '1'}\n"
"""A script that answers admit_free/fits and writes nothing."""


def run_bench(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return bench("gate_script.py", cwd, "--calls", str(CALLS), "--blocks", str(BLOCKS),
                 "--warmup", "5", *args)  # fmt: skip


def lines_starting(stdout: str, prefix: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(prefix)]


def test_a_checked_run_prints_each_paths_server_time(tmp_path: Path) -> None:
    result = run_bench(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    paths = lines_starting(result.stdout, "path=")
    assert [line.split(" gate_lua_us=")[0] for line in paths] == [
        f"path=admit decided admit_free/fits x{TIMED}",
        f"path=admit_fast decided admit_free/fits x{TIMED}",
        f"path=defer decided defer/queue_age_cap x{TIMED}",
        f"path=reserved decided reserved/dwell_over_slack x{TIMED}",
    ]
    (figures,) = lines_starting(result.stdout, "gate_lua_us ")
    names = [item.split("=")[0] for item in figures.split()[1:]]
    assert names == ["admit", "admit_fast", "defer", "reserved"]
    assert lines_starting(result.stdout, "empty_evalsha_us=")
    assert result.stderr == ""


def test_a_baseline_script_is_timed_in_the_same_blocks(tmp_path: Path) -> None:
    baseline = REPO_ROOT / "gatekeeper" / "lua" / "gate.lua"
    result = run_bench(tmp_path, "--baseline", str(baseline), "--record-cap", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    (figures,) = lines_starting(result.stdout, "gate_lua_us ")
    assert "admit[baseline]=" in figures and "reserved[baseline]=" in figures


def test_calls_not_decided_as_claimed_fail_the_bench_without_a_figure(tmp_path: Path) -> None:
    # No budget: every admission is refused (reserved/retry_tax_budget).
    result = run_bench(tmp_path, "--budget-units", "0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gate_lua_us" not in result.stdout
    problems = result.stderr.splitlines()
    assert (
        f"bench: admit: {TIMED} of {TIMED} timed calls were not admit_free/fits: "
        f"reserved/retry_tax_budget x{TIMED}"
    ) in problems, result.stderr
    assert f"bench: admit_fast: free/defer/reserved lists held [0, 0, {CALLS}], not " in (
        result.stderr
    )


def test_a_script_that_writes_nothing_fails_the_bench(tmp_path: Path) -> None:
    # It answers admit_free/fits whatever the path, pushes nothing and keeps no record.
    script = tmp_path / "answers.lua"
    script.write_text(ANSWERS_ADMIT, encoding="utf-8")
    result = run_bench(tmp_path, "--baseline", str(script))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gate_lua_us" not in result.stdout
    problems = result.stderr.splitlines()
    assert (
        f"bench: defer[baseline]: {TIMED} of {TIMED} timed calls were not "
        f"defer/queue_age_cap: admit_free/fits x{TIMED}"
    ) in problems, result.stderr
    assert f"bench: admit[baseline]: 0 decision records for {CALLS} calls" in problems
    assert not any(line.startswith("bench: admit: ") for line in problems), result.stderr
