"""``bench/publish_ir.py`` checks itself: it prints instructions per publish only when every
counted gated publish was decided ``admit_free/fits`` on the claimed path (and no plain one was
decided), and fails loudly, with no figure, otherwise.

Each test runs the real bench, tiny, in processes under valgrind (a missing valgrind skips
outside CI and fails under ``CI=true``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.benches import run_bench
from tests.conftest import REPO_ROOT, missing_server

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _valgrind() -> None:
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        missing_server("valgrind is not installed (Debian: apt-get install valgrind)")


def test_a_checked_run_prints_instructions_per_publish_of_each_kind(tmp_path: Path) -> None:
    result = run_bench("publish_ir.py", tmp_path, "--short", "3", "--long", "9", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "decisions: admit_free/fits=9" in lines
    assert f"gatekeeper measured: {REPO_ROOT / 'gatekeeper'}" in lines  # the checkout's own
    assert any(line.startswith("fast_publish=auto path=fast taken for 9/9") for line in lines)
    figures = {line.split(":")[0]: line for line in lines if ": instructions_per_publish=" in line}
    assert set(figures) == {"plain", "gated"}
    plain, gated = (
        float(figures[kind].split("=")[1].replace(",", "")) for kind in ("plain", "gated")
    )
    (gate,) = [line for line in lines if line.startswith("gate_instructions_per_publish=")]
    shown = float(gate.split("=")[1].split()[0].replace(",", ""))
    assert abs(shown - (gated - plain)) <= 1  # (each figure rounded on its own)
    assert 0 < plain < gated, result.stdout  # the gate adds work to a publish, never none
    assert lines[-1].startswith("ratio_ir=")
    assert result.stderr == ""


def test_publishes_not_decided_as_claimed_fail_the_bench_without_a_figure(tmp_path: Path) -> None:
    result = run_bench("publish_ir.py", tmp_path, "--short", "2", "--long", "4", timeout=600,
                       GATEKEEPER_FREE_PATH_ENABLED="false")  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "instructions_per_publish" not in result.stdout
    assert "ratio_ir" not in result.stdout
    for count in (2, 4):  # each counted process is checked, the short one's too
        assert (
            f"bench: gated x{count}: {count} of {count} gated publishes were not "
            f"admit_free/fits: reserved/free_path_disabled x{count}"
        ) in result.stderr
