"""What a worker process holds of the runs it executes: those running (their records), and
the starts each thread sent and has not read yet (gatekeeper/redis/run_start.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from gatekeeper.redis.run_start import StartCall
from gatekeeper.redis.runs import RunRecord

__all__ = ["Running", "Starting", "Starts"]


@dataclass(frozen=True)
class Running:
    """A run this process is executing: verified (the gate's record) or not."""

    attempt: int
    run: int
    record: RunRecord
    verified: bool


@dataclass(frozen=True)
class Starting:
    """A run whose start was sent on this thread's line and whose reply is not read yet."""

    call: StartCall
    task: Any
    attempt: int
    headers: dict[str, Any]
    now: int
    again: bool = False
    """The message was redelivered (a dead earlier run may be owed its row)."""


class Starts(threading.local):
    """The starts this thread sent and not read, by task id (a line's replies: its own)."""

    def __init__(self) -> None:
        self.by_job: dict[str, Starting] = {}
