"""``bench/publish.py`` checks itself: it reports a ratio only when every timed gated publish
was decided ``admit_free/fits`` on the path the run claims, and fails loudly otherwise.

Each test runs the real bench, tiny, as a subprocess against the suite's Redis.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.redis

BENCH = REPO_ROOT / "bench" / "publish.py"
N = 30
SMALL = ["-n", str(N), "--rounds", "3"]
OBSERVED = f"""
import runpy, sys
from celery import signals
signals.before_task_publish.connect(lambda **kwargs: None, weak=False)
sys.argv[0] = {str(BENCH)!r}
sys.path.insert(0, {str(BENCH.parent)!r})  # as running the file puts its folder first
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""The bench with a receiver of Celery's publish signal: ``auto`` fast publish stands aside."""

CLOSING = f"""
import runpy, sys
import redis
from celery import signals
spare = redis.Redis.from_url(sys.argv[sys.argv.index("--redis-url") + 1])
spare.ping()
gated = []
def close_once(sender=None, **kwargs):
    if sender == "bench.gated":
        gated.append(sender)
        if len(gated) == 201:  # the first of the counting pass, after the 200 of the warm-up
            spare.connection_pool.disconnect()  # redis-py 5.0's close() keeps it open
signals.before_task_publish.connect(close_once, weak=False)
sys.argv[0] = {str(BENCH)!r}
sys.path.insert(0, {str(BENCH.parent)!r})
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""The bench with another client of its Redis that closes its connection while the gated
publishes are counted (the server counts the close as a read): ``--fast-publish off`` only,
since a receiver of the publish signal makes ``auto`` stand aside anyway."""


@pytest.fixture()
def scratch_url(redis_url: str, redis_client: redis.Redis) -> Iterator[str]:
    """The suite's Redis, empty (the bench deletes lists and leaves ledger hashes behind)."""
    try:
        yield redis_url
    finally:
        redis_client.flushdb()


def run_bench(
    url: str, cwd: Path, *args: str, code: str | None = None, script: Path = BENCH,
    sizes: tuple[str, ...] = tuple(SMALL), **env_vars: str,
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``script`` (this bench, or another with its options) run on ``url``, GATEKEEPER_*
    settings of the suite left out; ``code``: that Python instead (it runs the script)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(PYTHONPATH=str(REPO_ROOT), **env_vars)
    start = [sys.executable, str(script)] if code is None else [sys.executable, "-c", code]
    gc.collect()  # the suite's unreachable clients close now, not while the bench counts
    return subprocess.run(
        [*start, "--redis-url", url, *sizes, *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def line(stdout: str, prefix: str) -> str:
    found = [text for text in stdout.splitlines() if text.startswith(prefix)]
    assert len(found) == 1, stdout
    return found[0]


def test_by_default_every_gated_publish_is_admitted_on_the_fast_path(
    scratch_url: str, tmp_path: Path
) -> None:
    result = run_bench(scratch_url, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert line(result.stdout, "ratio=")
    assert line(result.stdout, "decisions:") == f"decisions: admit_free/fits={N}"
    assert line(result.stdout, "fast_publish=").startswith(
        f"fast_publish=auto path=fast taken for {N}/{N} timed gated publishes"
    )
    assert "bench:" not in result.stderr


def test_with_fast_publish_off_every_gated_publish_is_admitted_on_the_ordinary_path(
    scratch_url: str, tmp_path: Path
) -> None:
    result = run_bench(scratch_url, tmp_path, "--fast-publish", "off")
    assert result.returncode == 0, result.stdout + result.stderr
    assert line(result.stdout, "ratio=")
    assert line(result.stdout, "decisions:") == f"decisions: admit_free/fits={N}"
    assert line(result.stdout, "fast_publish=").startswith(
        f"fast_publish=off path=ordinary taken for {N}/{N} timed gated publishes"
    )
    assert line(result.stdout, "redis_round_trips_per_decision=1.000")


def test_gated_publishes_not_decided_fits_fail_the_bench_without_a_ratio(
    scratch_url: str, tmp_path: Path
) -> None:
    # A setting the bench leaves to the environment: the free path off sends every gated
    # publish to reserved (decided in process, so the fast path is not taken either).
    result = run_bench(scratch_url, tmp_path, GATEKEEPER_FREE_PATH_ENABLED="false")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ratio=" not in result.stdout
    assert "tasks/s" not in result.stdout
    assert line(result.stdout, "decisions:") == f"decisions: reserved/free_path_disabled={N}"
    problems = result.stderr.splitlines()
    assert (
        f"bench: {N} of {N} gated publishes were not admit_free/fits: "
        f"reserved/free_path_disabled x{N}"
    ) in problems, result.stderr
    assert any(
        problem.startswith(f"bench: {N} of {N} gated publishes did not take the fast path")
        for problem in problems
    ), result.stderr


def test_a_path_not_taken_fails_the_bench_without_a_ratio(scratch_url: str, tmp_path: Path) -> None:
    # Something observes publishes, so "auto" takes the ordinary path: admitted, but not
    # on the path the run claims.
    result = run_bench(scratch_url, tmp_path, code=OBSERVED)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ratio=" not in result.stdout
    assert line(result.stdout, "decisions:") == f"decisions: admit_free/fits={N}"
    assert line(result.stdout, "fast_publish=").startswith(
        f"fast_publish=auto path=fast taken for 0/{N} timed gated publishes"
    )
    assert result.stderr.splitlines() == [
        f"bench: {N} of {N} gated publishes did not take the fast path (gate.lua did not push "
        f"the message) though fast_publish=auto claims it: admit_free/fits x{N}"
    ]


def test_a_connection_closed_while_publishes_are_counted_is_not_counted_as_a_round_trip(
    scratch_url: str, tmp_path: Path
) -> None:
    # What once failed CI: a test suite's leftover client, collected while the bench ran,
    # closed its connection, and the ordinary path read 1.067 round trips a decision.
    result = run_bench(scratch_url, tmp_path, "--fast-publish", "off", code=CLOSING)
    assert result.returncode == 0, result.stdout + result.stderr
    found = line(result.stdout, "redis_round_trips_per_decision=")
    # At least the closed pass measured again (a leftover of the suite's may add one).
    assert re.fullmatch(
        r"redis_round_trips_per_decision=1\.000 \(redis_commands_per_decision=13\.000, counting "
        r"those inside gate\.lua; (1 pass|[2-4] passes) measured again \(a connection opened "
        r"or closed\)\)",
        found,
    ), found
