"""``bench/worker.py`` checks itself: it reports a ratio only when every gated task was
decided ``admit_free/fits``, ran once from ``free`` and has its ``free/ok`` row, and every
plain task ran once; otherwise it fails loudly.

Each test runs the real bench, tiny, as a subprocess (its own embedded Redis and worker).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.benches import run_bench as bench

pytestmark = [pytest.mark.redis, pytest.mark.celery]

N = 20
SMALL = ["-n", str(N), "--rounds", "1", "--blocks", "2", "--pools", "solo"]


def run_bench(cwd: Path, *args: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    return bench("worker.py", cwd, *SMALL, *args, **env_vars)


def test_a_solo_worker_runs_every_task_and_the_ratio_comes_last(tmp_path: Path) -> None:
    result = run_bench(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-2].startswith("ratio="), result.stdout
    assert any(text.startswith("solo gated: ") for text in lines), result.stdout
    assert any("the gate's: round_trips=" in text for text in lines), result.stdout
    # The server's CPU per task is read off INFO cpu (a gated run costs Redis more than a
    # plain one: two scripts), and the usec are shown by command, never summed.
    cpu = re.search(r"solo server cpu_us per task gated=(\d+) plain=(\d+)", result.stdout)
    assert cpu is not None, result.stdout
    assert int(cpu[1]) > int(cpu[2]) > 0, result.stdout
    assert "server usec per task gated=" not in result.stdout
    assert "bench:" not in result.stderr


def test_gated_tasks_not_admitted_fail_the_bench_without_a_figure(tmp_path: Path) -> None:
    # The free path off sends every gated publish to reserved, which the worker does not read.
    result = run_bench(tmp_path, GATEKEEPER_FREE_PATH_ENABLED="false")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ratio=" not in result.stdout
    assert "tasks/s" not in result.stdout
    problems = result.stderr.splitlines()
    assert (
        f"bench: solo round 1: gated tasks not all decided admit_free/fits: "
        f"{{'reserved/free_path_disabled': {N}}}"
    ) in problems, result.stderr
    assert f"bench: solo round 1: 0 of {N} gated tasks were in free after publishing" in problems
