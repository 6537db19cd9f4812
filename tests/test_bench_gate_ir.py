"""``bench/gate_ir.py`` checks itself: it prints ``Ir_per_decision`` only when callgrind counted
instructions and every counted call decided what its path claims, and fails loudly otherwise.

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

CALLS = 20


@pytest.fixture(autouse=True)
def _valgrind() -> None:
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        missing_server("valgrind is not installed (Debian: apt-get install valgrind)")


def run_bench(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return bench("gate_ir.py", cwd, "--calls", str(CALLS), "--warmup", "5", *args, timeout=300)


def checked_run(cwd: Path, *args: str, claims: list[str]) -> tuple[list[str], str]:
    """A run that must pass, with nothing on stderr: its ``path=`` lines (each as ``claims``
    says, in order) and its whole output."""
    result = run_bench(cwd, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    paths = [line for line in result.stdout.splitlines() if line.startswith("path=")]
    assert [line.split(" Ir_per_decision=")[0] for line in paths] == claims
    assert result.stderr == ""
    return paths, result.stdout


def last_line(stdout: str, prefix: str) -> str:
    (line,) = [line for line in stdout.splitlines() if line.startswith(prefix)]
    return line


def test_a_checked_run_prints_instructions_per_decision(tmp_path: Path) -> None:
    paths, stdout = checked_run(tmp_path, "--paths", "admit,reserved", claims=[
        f"path=admit decided admit_free/fits x{CALLS}",
        f"path=reserved decided reserved/dwell_over_slack x{CALLS}",
    ])  # fmt: skip
    figures = last_line(stdout, "gate_lua_ir ")
    counts = dict(item.split("=") for item in figures.split()[1:])
    assert list(counts) == ["admit", "reserved"]
    # Counted, not made up: an admission runs more of the script than a reserved decision.
    assert int(counts["admit"]) > int(counts["reserved"]) > 10_000
    assert "call'2=" in paths[0]  # the commands' share, where the binary names its functions


def test_calls_not_decided_as_claimed_fail_the_bench_without_a_figure(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--paths", "admit", "--budget-units", "0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Ir_per_decision" not in result.stdout and "gate_lua_ir" not in result.stdout
    assert (
        f"bench: admit: {CALLS} of {CALLS} timed calls were not admit_free/fits: "
        f"reserved/retry_tax_budget x{CALLS}"
    ) in result.stderr.splitlines(), result.stderr


def test_the_admit_path_is_counted_at_each_size_in_flight(tmp_path: Path) -> None:
    _, stdout = checked_run(tmp_path, "--in-flight", "10,600", claims=[
        f"path=admit@10 decided admit_free/fits x{CALLS}",
        f"path=admit@600 decided admit_free/fits x{CALLS}",
    ])  # fmt: skip
    flatness = last_line(stdout, "flatness_ir=")
    assert 0.5 < float(flatness.split()[0].split("=")[1]) < 1.5


def test_an_unknown_path_is_named(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--paths", "admit,sideways")
    assert result.returncode == 2
    assert "--paths: unknown ['sideways']" in result.stderr
