"""``bench/worker_ir.py`` checks itself: it prints ``Ir_per_run`` only when callgrind counted
instructions and every counted start and finish did what a gated run's do, and fails loudly
otherwise.

Each test runs the real bench, tiny, as a subprocess on a ``redis-server`` of its own under
valgrind (a missing valgrind skips outside CI and fails under ``CI=true``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.benches import run_bench as bench
from tests.conftest import missing_server

pytestmark = pytest.mark.redis

RUNS = 20


@pytest.fixture(autouse=True)
def _valgrind() -> None:
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        missing_server("valgrind is not installed (Debian: apt-get install valgrind)")


def run_bench(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return bench("worker_ir.py", cwd, "--runs", str(RUNS), "--warmup", "5", *args, timeout=300)


def figures(stdout: str) -> dict[str, int]:
    (line,) = [line for line in stdout.splitlines() if line.startswith("worker_lua_ir ")]
    return {name: int(value) for name, value in (item.split("=") for item in line.split()[1:])}


def test_a_checked_run_prints_instructions_per_run_of_each_script(tmp_path: Path) -> None:
    result = run_bench(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    scripts = [line for line in result.stdout.splitlines() if line.startswith("script=")]
    assert [line.split(" Ir_per_run=")[0] for line in scripts] == [
        f"script=start.lua every start the gate's message, run 1, no dead run x{RUNS}",
        f"script=finish.lua every finish one free/ok row written, the record cut x{RUNS}",
    ]
    counts = figures(result.stdout)
    assert list(counts) == ["start", "finish", "total"]
    # Counted, not made up: each script runs several commands, and the total is their sum.
    assert counts["start"] > 10_000 and counts["finish"] > 10_000
    assert abs(counts["total"] - counts["start"] - counts["finish"]) <= 1


def test_the_same_script_as_a_baseline_counts_the_same(tmp_path: Path) -> None:
    ours = Path(__file__).parents[1] / "gatekeeper" / "lua" / "finish.lua"
    result = run_bench(tmp_path, "--baseline-finish", str(ours))
    assert result.returncode == 0, result.stdout + result.stderr
    counts = figures(result.stdout)
    assert list(counts) == ["start", "finish", "start[baseline]", "finish[baseline]", "total",
                            "total[baseline]"]  # fmt: skip
    assert abs(counts["finish[baseline]"] - counts["finish"]) < counts["finish"] * 0.02


def test_starts_that_are_not_the_gates_runs_fail_the_bench_without_a_figure(
    tmp_path: Path,
) -> None:
    refusing = tmp_path / "start.lua"
    refusing.write_text("return {0, 'forged'}\n", encoding="utf-8")
    result = run_bench(tmp_path, "--baseline-start", str(refusing))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Ir_per_run" not in result.stdout and "worker_lua_ir" not in result.stdout
    lines = result.stderr.splitlines()
    assert any(line.startswith("bench: [baseline]: start of ") and "refused='forged'" in line
               for line in lines), result.stderr  # fmt: skip
