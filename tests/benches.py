"""Running a bench the way a user does, for the tests that hold each bench to its checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

__all__ = ["run_bench"]


def run_bench(
    name: str, cwd: Path, *args: str, timeout: float = 120, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    """``python bench/<name> ARGS`` in a fresh process, in ``cwd``, importing this checkout,
    without the suite's own ``GATEKEEPER_*`` settings (only ``env_vars``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(PYTHONPATH=str(REPO_ROOT), **env_vars)
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / name), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
