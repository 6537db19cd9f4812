"""``bench/publish_steps.py`` checks itself: it prints its steps only when every timed gated
publish was decided ``admit_free/fits`` on the path the run claims, each step it names once a
publish called once, and fails loudly otherwise. The real bench, tiny, as a subprocess."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.test_bench_publish import run_bench, scratch_url  # noqa: F401 (its fixture)

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("scratch_url")]  # flushed after

BENCH = REPO_ROOT / "bench" / "publish_steps.py"
N = 40
OBSERVED = f"""
import runpy, sys
from celery import signals
signals.before_task_publish.connect(lambda **kwargs: None, weak=False)
sys.argv[0] = {str(BENCH)!r}
sys.path.insert(0, {str(BENCH.parent)!r})
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""A receiver of Celery's publish signal: ``auto`` fast publish stands aside."""


def run_steps(
    url: str, cwd: Path, *args: str, code: str | None = None, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    sizes = ("-n", str(N), "--warmup", "20")
    return run_bench(url, cwd, *args, code=code, script=BENCH, sizes=sizes, **env_vars)


def step(stdout: str, name: str) -> str:
    """The gated block's line of a step."""
    gated = stdout.split("plain:")[0]
    found = [text for text in gated.splitlines() if text.endswith(f"({name})")]
    assert len(found) == 1, stdout
    return found[0]


@pytest.mark.parametrize(
    ("mode", "path", "once"),
    [
        ("auto", "fast", ["Installed._fits", "send", "Channel.send", "Owed.settle"]),
        ("off", "ordinary", ["GateStore.score", "Channel.send", "Channel.read", "Channel._put"]),
    ],
)
def test_the_steps_of_the_path_taken_are_printed(
    redis_url: str, tmp_path: Path, mode: str, path: str, once: list[str]
) -> None:
    result = run_steps(redis_url, tmp_path, "--fast-publish", mode)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"gated ({path} path; every publish admit_free/fits" in result.stdout
    for name in ["hook less Celery's", "Celery's sender", "Pipeline.unscripted",
                 "GateStore.gate_call", *once]:  # fmt: skip
        assert " us x1.00  (" in step(result.stdout, name)
    plain = result.stdout.split("plain:")[1]
    assert " x1.00  (Channel._put)" in plain
    assert " x1.00  (AbstractConnection.read_response)" in plain
    assert "gated_minus_plain_us=" in result.stdout
    assert "bench:" not in result.stderr


def test_publishes_not_admitted_print_no_steps(redis_url: str, tmp_path: Path) -> None:
    result = run_steps(redis_url, tmp_path, GATEKEEPER_FREE_PATH_ENABLED="false")
    assert result.returncode == 1, result.stdout + result.stderr
    assert " us " not in result.stdout
    problems = result.stderr.splitlines()
    assert (
        f"bench: {N} routings for {N} gated publishes, not admit_free/fits: "
        f"{{'reserved/free_path_disabled': {N}}}"
    ) in problems, result.stderr
    assert f"bench: 0 of {N} gated publishes had their reply read later (fast)" in problems


def test_a_path_not_taken_prints_no_steps(redis_url: str, tmp_path: Path) -> None:
    # Something observes publishes: admitted, on the ordinary path, not the fast one claimed.
    result = run_steps(redis_url, tmp_path, code=OBSERVED)
    assert result.returncode == 1, result.stdout + result.stderr
    assert " us " not in result.stdout
    problems = result.stderr.splitlines()
    assert f"bench: 0 of {N} gated publishes had their reply read later (fast)" in problems
    assert f"bench: send called 0 times for {N} gated publishes" in problems


def test_without_hiredis_it_refuses(redis_url: str, tmp_path: Path) -> None:
    # The gate's line would go through redis-py, whose timers stand for Celery's publish.
    code = OBSERVED.replace(
        "from celery import signals\nsignals.before_task_publish.connect(lambda **kwargs: None, "
        "weak=False)",
        "from gatekeeper.redis import wire\nwire.RAW = False",
    )
    assert "wire.RAW = False" in code
    result = run_steps(redis_url, tmp_path, code=code)
    assert result.returncode == 2, result.stdout + result.stderr
    assert " us " not in result.stdout
    assert result.stderr.startswith("bench: needs hiredis")


def test_a_step_called_more_than_once_a_publish_prints_no_steps(
    redis_url: str, tmp_path: Path
) -> None:
    # Every publish admitted on the fast path, but one step named x1.00 runs twice a publish
    # (through the class, so the bench's own timer counts both): its figure would be two
    # calls' time shown as one's.
    doubled = """
from gatekeeper.celery.hook import Installed
real, inner = Installed._fits, []
def twice(self, *args, **kwargs):
    if not inner:
        inner.append(1)
        try:
            Installed._fits(self, *args, **kwargs)
        finally:
            inner.clear()
    return real(self, *args, **kwargs)
Installed._fits = twice
"""
    code = OBSERVED.replace(
        "from celery import signals\nsignals.before_task_publish.connect(lambda **kwargs: None, "
        "weak=False)",
        doubled,
    )
    assert "Installed._fits = twice" in code
    result = run_steps(redis_url, tmp_path, code=code)
    assert result.returncode == 1, result.stdout + result.stderr
    assert " us " not in result.stdout
    problems = result.stderr.splitlines()
    assert problems == [f"bench: Installed._fits called {2 * N} times for {N} gated publishes"]
