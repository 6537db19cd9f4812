"""What a worker process holds of the runs it executes: those running (their records), and
the starts each thread sent and has not read yet (gatekeeper/redis/run_start.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from gatekeeper.celery.message import nonce_of, request_headers
from gatekeeper.core.ledger import Outcome
from gatekeeper.redis.run_start import StartCall
from gatekeeper.redis.runs import RunRecord

__all__ = [
    "REPLACED",
    "TIME_LIMIT_REASONS",
    "Running",
    "Starting",
    "Starts",
    "another_run",
    "learns_from",
]

TIME_LIMIT_REASONS = frozenset({"TimeLimitExceeded", "SoftTimeLimitExceeded"})
"""The failures that mean a run was cut off by its time limit: it ran at least that long."""
REPLACED = "replaced"
"""The reason of an ``ok`` row whose run ``Task.replace`` ended (its slack judged there, as
any ``ok`` row's: the replacement is a publish of its own, with its own deadline)."""


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


def learns_from(app: Any, record: RunRecord, outcome: Outcome, reason: str) -> bool:
    """Whether a run's time counts toward its task's learned service time: a run that
    started, ``ok`` or killed by its time limit (a lower bound), of a task ``app`` registers
    (so the tasks tracked are bounded by the app's own gated tasks)."""
    if not record.started_ms or (outcome is not Outcome.OK and reason not in TIME_LIMIT_REASONS):
        return False
    return record.task in app.tasks


def another_run(running: Running | None, request: Any) -> bool:
    """Whether ``running``, the run a process holds for a task id, is not the run of
    ``request`` that is ending: another message's with the same id (its nonce another), run
    beside it by a threads pool (``Task.replace``'s replacement, a duplicate publish)."""
    if running is None or not running.verified:
        return False
    return running.record.nonce != nonce_of(request_headers(request))
