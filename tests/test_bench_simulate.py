"""``bench/simulate.py`` checks what it measured: the jobs it ran and each policy's line.

Tiny runs (100 jobs, one round) as subprocesses; the figure itself is not tested.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType

from tests.conftest import REPO_ROOT

BENCH = REPO_ROOT / "bench" / "simulate.py"


def bench_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_simulate", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), "--jobs", "100", "--rounds", "1", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_checked_run_prints_the_lines_and_the_figure() -> None:
    done = run_bench()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].startswith("night seed=7 jobs=100 ")
    assert [line.split()[0] for line in lines[2:6]] == [
        "policy=always_free",
        "policy=always_reserved",
        "policy=gate",
        "policy=gate_tuned",
    ]
    assert lines[6].startswith("simulate jobs=100 rounds=1 policies=4 wall_s min=")


def test_a_round_over_the_limit_fails_after_the_figure() -> None:
    done = run_bench("--limit-s", "0")
    assert done.returncode == 1
    assert "simulate jobs=100 " in done.stdout
    assert "bench: the slowest round took" in done.stderr


def test_output_missing_a_policy_or_with_other_jobs_is_refused() -> None:
    check = bench_module().check_output
    night = "night seed=7 jobs=100 deadline_s=90 free_slots=8 reserved_slots=6"
    line = "policy={} missed=0 wasted_tokens=0 reserved_s=8 free_s=0"
    tuned = line.format("gate_tuned") + " knob=none value=none tuned_on_seed=1"
    good = [night, *(line.format(p) for p in ("always_free", "always_reserved", "gate")), tuned]
    assert check("\n".join(good), 100) == []
    assert check("\n".join(good), 10_000) != []
    assert check("\n".join(good[:3] + good[4:]), 100) != []  # no gate line
    assert check("\n".join([*good, good[1]]), 100) != []  # a policy twice
    assert check("\n".join([*good[:4], line.format("gate_tuned")]), 100) != []  # no knob
