"""``bench/records.py`` checks itself before it prints: one record per decision, each parsed
and reproducing its routed decision. Run tiny, as a subprocess (its own embedded Redis)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.redis

BENCH = REPO_ROOT / "bench" / "records.py"


def test_the_bench_measures_real_records_and_prints_their_size(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    result = subprocess.run(
        [sys.executable, str(BENCH), "--decisions", "300"], cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("mix ") and "admit_free/fits=" in lines[1]
    size = [line for line in lines if line.startswith("bytes_per_decision=")]
    assert size and 100 < float(size[0].split("=")[1].split()[0]) < 400
    assert [line.split()[0] for line in lines if line.startswith("rate=")] == [
        "rate=10/s", "rate=100/s"
    ]  # fmt: skip
    assert "bench:" not in result.stderr
