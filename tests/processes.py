"""Starting and stopping what the suite runs: a process (:func:`stop`), a server started in
a session of its own, with its whole process group (:func:`stop_group`), and a server hung
for a while (:func:`stopped`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def stop_group(process: subprocess.Popen[bytes] | None, timeout_s: float = 30.0) -> None:
    """SIGTERM the process's group, then SIGKILL it if it has not ended in ``timeout_s``."""
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def stop(process: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM the process (a warm shutdown for a worker), then SIGKILL it after
    ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_started(
    process: subprocess.Popen[bytes], name: str, log: Path, ready: Callable[[], bool],
    timeout_s: float,
) -> None:  # fmt: skip
    """Wait until ``ready()``; a server that exits or does not get there in ``timeout_s`` is
    stopped (its group) and raises with the tail of its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{log_tail(log)}")
        if ready():
            return
        time.sleep(0.2)
    stop_group(process)
    raise RuntimeError(f"{name} did not start:\n{log_tail(log)}")


def log_tail(log: Path) -> str:
    """The last 3,000 characters of a server's log."""
    return log.read_text(errors="replace")[-3000:]


@contextmanager
def stopped(process: subprocess.Popen[bytes] | None) -> Iterator[None]:
    """The process SIGSTOPped (a server the kernel still accepts connections for, that
    answers nothing), and continued on leaving."""
    assert process is not None
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)
