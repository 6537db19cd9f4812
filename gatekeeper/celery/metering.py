"""Token metering from inside a task: what an attempt really used, for its ledger row.

    @gatekeeper.gated(expected_service_s=8, tokens_in=1200, deadline_s=90)
    @app.task
    def embed(chunk):
        response = client.embed(chunk)
        gatekeeper.meter(tokens_in=response.usage.input, tokens_out=response.usage.output)

Call it as soon as the numbers are known (before anything that may fail): an attempt killed
afterwards is charged what it metered. Without a call the declared values stand.
"""

from __future__ import annotations

import threading

from gatekeeper.errors import BadDeclaredInput

__all__ = ["meter", "take_metered"]

_metered: dict[str, tuple[int | None, int | None]] = {}
_lock = threading.Lock()


def _count(field: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadDeclaredInput(field, "a non-negative whole number of tokens", value)
    return value


def meter(
    tokens_in: int | None = None, tokens_out: int | None = None, *, task_id: str | None = None
) -> None:
    """Report the tokens the current task's attempt used (a later call replaces an earlier).
    In a task called directly (``embed(chunk)``: no message, no attempt) it checks its values
    and keeps nothing."""
    counts = (_count("tokens_in", tokens_in), _count("tokens_out", tokens_out))
    if task_id is None:
        from celery import current_task  # imported late: importing gatekeeper stays cheap

        task_id = getattr(getattr(current_task, "request", None), "id", None)
        if task_id is None:
            if current_task:  # a task called directly
                return
            raise RuntimeError("gatekeeper.meter() needs a running task (or task_id=)")
    with _lock:
        _metered[task_id] = counts


def take_metered(task_id: str) -> tuple[int | None, int | None]:
    """The counts reported for a task id, forgotten once taken; (None, None) if none."""
    with _lock:
        return _metered.pop(task_id, (None, None))
