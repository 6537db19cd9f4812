"""Entry points: ``python -m workers.free``, ``workers.reserved``, ``workers.replayer``,
``workers.produce``. Each reads settings from the environment, like the CLI.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from gatekeeper.errors import ConfigError
from gatekeeper.settings import load_settings

T = TypeVar("T")

__all__ = ["exit_on_config_error", "produce", "replayer", "worker"]


def exit_on_config_error(entry: Callable[[], T]) -> T:
    """Run an entry point; a bad setting ends it with its one-line message, no traceback."""
    try:
        return entry()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def worker(role: str, concurrency: int | None = None) -> None:
    """Run a Celery worker on the free or the reserved queue (replaces this process).

    Concurrency: the argument, else ``GATEKEEPER_DEMO_CONCURRENCY``, else 1.
    """
    settings = load_settings()
    if concurrency is None:
        concurrency = int(os.environ.get("GATEKEEPER_DEMO_CONCURRENCY", "1"))
    queue = settings.free_queue if role == "free" else settings.reserved_queue
    os.environ["GATEKEEPER_DEMO_ROLE"] = role
    argv = [
        sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-Q", queue,
        "-P", "prefork", "-c", str(concurrency), "-n", f"{role}@%h", "-l", "INFO",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    os.execv(sys.executable, argv)


def replayer() -> None:
    """Run ``gatekeeper replay`` (replaces this process)."""
    os.execv(sys.executable, [sys.executable, "-m", "gatekeeper", "replay"])


def produce(pace_s: float | None = None) -> list[str]:
    """Publish the declared workload (``[drill] jobs``) at a seeded pace; returns the ids."""
    from workers.app import create_app

    settings = load_settings()
    app = create_app(settings)
    task = app.tasks["workers.embed_chunk"]
    rng = random.Random(settings.drill.seed)
    pace = float(os.environ.get("GATEKEEPER_DEMO_PACE_S", "0.25")) if pace_s is None else pace_s
    ids = []
    for chunk in range(settings.drill.jobs):
        ids.append(task.delay(chunk).id)
        time.sleep(rng.uniform(0, 2 * pace))
    return ids
