"""``gatekeeper demo`` end to end: the README's first command, from a clean directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.celery


def test_the_demo_runs_the_workload_to_its_summary_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    out = tmp_path / "ledger.json"
    result = subprocess.run(
        [sys.executable, "-m", "gatekeeper", "demo", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    summary = next(line for line in lines if line.startswith("finished="))
    counts = dict(part.split("=") for part in summary.split())
    # Only first attempts die (max_retries=1): every job ends ok or dead-lettered.
    assert int(counts["finished"]) + int(counts["abandoned"]) == 40
    assert any(line.startswith("free_missed=") for line in lines)
    assert any(line.startswith("defer_savable=") for line in lines)
    assert any(line.startswith("reserved_age_shift=") for line in lines)
    assert lines[-1] == f"wrote {out}"
    document = json.loads(out.read_text())
    assert document["summary"] == summary
    jobs = {row["job_id"] for row in document["rows"]}
    assert len(jobs) == 40
    run = document["run"]
    leftovers = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert run not in leftovers and str(REPO_ROOT) not in run


def test_a_job_is_accounted_for_only_by_a_final_row() -> None:
    from gatekeeper.ops.demo import _finished

    rows = [
        {"job_id": "ok", "attempt": 1, "outcome": "ok"},
        {"job_id": "retried", "attempt": 1, "outcome": "killed"},  # will retry: not final
        {"job_id": "rejected", "attempt": 1, "outcome": "rejected"},  # then runs reserved
        {"job_id": "dead", "attempt": 1, "outcome": "abandoned"},
        {"job_id": "failed", "attempt": 2, "outcome": "killed"},  # no retry left (max 1)
    ]
    assert _finished(rows, max_retries=1) == {"ok", "dead", "failed"}
