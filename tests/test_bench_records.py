"""``bench/records.py`` checks itself before it prints: one record per decision, each parsed
and reproducing its routed decision. Run tiny, as a subprocess (its own embedded Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benches import run_bench

pytestmark = pytest.mark.redis


def test_the_bench_measures_real_records_and_prints_their_size(tmp_path: Path) -> None:
    result = run_bench("records.py", tmp_path, "--decisions", "300")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("mix ") and "admit_free/fits=" in lines[1]
    size = [line for line in lines if line.startswith("bytes_per_decision=")]
    assert size and 100 < float(size[0].split("=")[1].split()[0]) < 400
    assert [line.split()[0] for line in lines if line.startswith("rate=")] == [
        "rate=10/s", "rate=100/s"
    ]  # fmt: skip
    assert "bench:" not in result.stderr
