"""``bench/memory.py`` checks itself before it prints: every job admitted, run once, one
free/ok row, nothing left waiting, one decision record each. Run tiny, as a subprocess (its
own embedded Redis and a real worker)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.benches import run_bench as bench

pytestmark = [pytest.mark.redis, pytest.mark.celery]


def run_bench(cwd: Path, **env_vars: str) -> subprocess.CompletedProcess[str]:
    return bench("memory.py", cwd, "-n", "30", timeout=180, **env_vars)


def test_the_bench_prints_bytes_per_finished_job_last(tmp_path: Path) -> None:
    result = run_bench(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("beyond_row_bytes_per_job=")
    assert any(line.startswith("run_records: bytes_per_job=") for line in lines)
    assert lines[-2].startswith("used_memory_growth_per_job="), result.stdout


def test_jobs_that_did_not_run_on_free_fail_the_bench(tmp_path: Path) -> None:
    result = run_bench(tmp_path, GATEKEEPER_FREE_PATH_ENABLED="false")
    assert result.returncode != 0 and "bytes_per_job" not in result.stdout


def test_with_records_off_the_bench_expects_none_and_counts_none(tmp_path: Path) -> None:
    result = run_bench(tmp_path, GATEKEEPER_DECISION_RECORD_CAP="0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decision_record_cap=0" in result.stdout.splitlines()[0]
    assert "decision_records: bytes_per_job=0.0 keys=0" in result.stdout.splitlines()


def test_a_worker_name_past_a_compact_hash_leaves_compact_records(tmp_path: Path) -> None:
    """A real worker named past 64 bytes: its running records are hash tables, and the cut
    writes each one again compact (the encodings line would say ``hashtable=`` otherwise)."""
    name = "celery@worker-embeddings-7d9f8c6b5-x2x9k.batch-nightly.svc.cluster.local"
    result = bench("memory.py", tmp_path, "-n", "30", "--hostname", name, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert f"hostname_bytes={len(name)}" in lines[0]
    (kinds,) = [line for line in lines if line.startswith("run_record_encodings:")]
    assert "hashtable" not in kinds and ("ziplist=" in kinds or "listpack=" in kinds), kinds


def test_replayed_jobs_leave_compact_records_and_their_handoffs_beside_them(
    tmp_path: Path,
) -> None:
    """Every job deferred, replayed to free by the real replayer, then run: each record stays
    compact, its handoff kept beside it (one key a job)."""
    result = bench("memory.py", tmp_path, "-n", "30", "--replayed", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "replayed=every job" in lines[0]
    (kinds,) = [line for line in lines if line.startswith("run_record_encodings:")]
    assert "hashtable" not in kinds and ("ziplist=" in kinds or "listpack=" in kinds), kinds
    (handoffs,) = [line for line in lines if line.startswith("handoffs:")]
    assert handoffs.endswith(" keys=80"), handoffs  # -n 30 and the bench's 50 to warm up


def test_replayed_jobs_the_replayer_did_not_move_fail_the_bench(tmp_path: Path) -> None:
    # With the free path off, the replayer sends each to reserved, not free: no figure.
    result = bench("memory.py", tmp_path, "-n", "30", "--replayed", timeout=180,
                   GATEKEEPER_FREE_PATH_ENABLED="false")  # fmt: skip
    assert result.returncode != 0 and "bytes_per_job" not in result.stdout
    assert "not every task was deferred, then replayed to free" in result.stderr, result.stderr
