"""Stopping a server the suite started in a session of its own (its whole process group)."""

from __future__ import annotations

import os
import signal
import subprocess


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
