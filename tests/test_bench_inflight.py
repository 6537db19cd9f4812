"""``bench/inflight.py`` checks itself before it prints: every timed call admitted, and the
in-flight state exactly the size plus the decisions made. Run tiny, as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.redis

BENCH = REPO_ROOT / "bench" / "inflight.py"


def test_the_bench_prints_one_line_per_size_and_the_flatness_last(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    result = subprocess.run(
        [sys.executable, str(BENCH), "--in-flight", "10,2000", "--decisions", "100",
         "--rounds", "1"], cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["in_flight=10", "in_flight=2000"]
    assert lines[-1].startswith("flatness=") and "bench:" not in result.stderr
