"""Scraping the exporter in tests: over HTTP, parsed with prometheus_client's own parser."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gatekeeper.ops.metrics import GateCollector, serve
from tests.conftest import REPO_ROOT, unused_port, wait_until
from tests.processes import stop

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""(sample name, sorted labels) -> value."""


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    """Every sample of one scrape of ``url``."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """One sample's value (None when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))))


def by_label(samples: Samples, name: str, *keep: str) -> dict[tuple[str, ...], float]:
    """A metric's samples summed over every label but ``keep``."""
    out: dict[tuple[str, ...], float] = {}
    for (sample, labels), number in samples.items():
        if sample == name:
            key = tuple(dict(labels)[label] for label in keep)
            out[key] = out.get(key, 0.0) + number
    return out


@contextmanager
def serving(collector: GateCollector) -> Iterator[str]:
    """The collector served on a free local port; yields its /metrics URL."""
    port = unused_port()
    server = serve(collector, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def exporter(env: dict[str, str], *args: str, log: Any = subprocess.DEVNULL) -> Iterator[str]:
    """``gatekeeper metrics`` (or ``args``, ``{port}`` standing for a free port: another
    command that serves them, such as ``replay --metrics-port {port}``, or ``celery -A app
    gatekeeper metrics``) as a process of its own; yields its /metrics URL once it answers."""
    port = unused_port()
    command = [
        part.replace("{port}", str(port)) for part in args or ("metrics", "--port", "{port}")
    ]
    program = (
        ["-m", "celery", *command[1:]] if command[0] == "celery" else ["-m", "gatekeeper", *command]
    )
    full_env = {
        **env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    }
    process = subprocess.Popen([sys.executable, *program], env=full_env,
                               stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"

    def answers() -> bool:
        try:
            urllib.request.urlopen(url, timeout=5).close()
        except OSError:
            return process.poll() is not None  # exited: stop waiting, fail below
        return True

    try:
        assert wait_until(answers, timeout_s=60, every_s=0.2)
        assert process.poll() is None, f"the exporter exited with {process.returncode}"
        yield url
    finally:
        stop(process)
