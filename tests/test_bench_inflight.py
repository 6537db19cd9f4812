"""``bench/inflight.py`` checks itself before it prints: every timed call admitted, and the
in-flight state exactly the size plus the decisions made. Run tiny, as a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benches import run_bench

pytestmark = pytest.mark.redis


def test_the_bench_prints_one_line_per_size_and_the_flatness_last(tmp_path: Path) -> None:
    result = run_bench("inflight.py", tmp_path, "--in-flight", "10,2000", "--decisions", "100",
                       "--rounds", "1")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["in_flight=10", "in_flight=2000"]
    assert lines[-1].startswith("flatness=") and "bench:" not in result.stderr
