"""``bench/replay.py`` checks itself: it reports ``moved_per_s`` only when every deferred task
ended in free or reserved exactly once; otherwise it fails loudly.

Each test runs the real bench, tiny, as a subprocess (its own embedded Redis).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.benches import run_bench as bench

pytestmark = pytest.mark.redis

N = 30
SMALL = ["-n", str(N), "--rounds", "2"]


def run_bench(cwd: Path, *args: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    return bench("replay.py", cwd, *SMALL, *args, **env_vars)


def test_every_deferred_task_is_moved_to_free_once(tmp_path: Path) -> None:
    result = run_bench(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-2].startswith("moved_per_s="), result.stdout
    assert any(f"each pass to_free={N})" in text for text in lines), result.stdout
    assert "bench:" not in result.stderr


def test_tasks_not_deferred_fail_the_bench_without_a_figure(tmp_path: Path) -> None:
    # The free path off: every publish goes to reserved, nothing to defer or to replay.
    result = run_bench(tmp_path, GATEKEEPER_FREE_PATH_ENABLED="false")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "moved_per_s" not in result.stdout
    problems = result.stderr.splitlines()
    assert f"bench: redis round 1: defer holds 0 messages after {N} deferred publishes" in problems
    assert f"bench: redis round 1: the pass counted {{}}, expected to_free={N}" in problems
