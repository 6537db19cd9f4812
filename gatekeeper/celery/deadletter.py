"""A dead-lettered task ends in the result backend, so that callers, ``link_error`` and
chords see it end instead of waiting forever.

When the replayer abandons a task (its deadline passed in defer) and it knows the Celery app
(``gatekeeper -A proj replay``, ``celery -A proj gatekeeper replay``), it stores a failure for
it: :class:`~gatekeeper.errors.DeadlineAbandoned`, naming the deadline, through the app's
backend with the request the message carries (its group and chord, its errbacks), as a
worker would for a task that raised. ``AsyncResult.get()`` then raises it, a chord's error
callback runs, and ``link_error`` callbacks are called.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime, timezone
from typing import Any

from celery.app.task import Context
from celery.backends.base import DisabledBackend

from gatekeeper.errors import DeadlineAbandoned

__all__ = ["fail_in_backend"]


def fail_in_backend(app: Any, message: dict[str, Any], deadline_at: float) -> str:
    """Store the abandoned task's failure; returns what was done (``failed``, or why not)."""
    headers = message.get("headers") or {}
    if app is None:
        return "no_app"
    if isinstance(app.backend, DisabledBackend):
        return "no_backend"
    try:
        args, kwargs, embed = _body(message)
    except (ValueError, TypeError, KeyError):
        return "body_unreadable"  # not JSON (a pickle or a compressed body): nothing stored
    delivery = message.get("properties", {}).get("delivery_info")
    request = Context({**headers, **(embed or {}), "args": args, "kwargs": kwargs,
                       "delivery_info": delivery})  # fmt: skip
    when = datetime.fromtimestamp(deadline_at, tz=timezone.utc).isoformat(timespec="seconds")
    error = DeadlineAbandoned(
        f"task {headers.get('id')} abandoned: its deadline {when} passed before it could run"
    )
    app.backend.mark_as_failure(headers.get("id"), error, request=request)
    return "failed"


def _body(message: dict[str, Any]) -> tuple[Any, Any, Any]:
    if message.get("content-type") != "application/json":
        raise ValueError("not JSON")
    raw = message["body"]
    if message.get("properties", {}).get("body_encoding") == "base64":
        raw = base64.b64decode(raw)
    args, kwargs, embed = json.loads(raw)
    return args, kwargs, embed
