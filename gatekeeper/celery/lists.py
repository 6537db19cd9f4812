"""Where kombu's Redis transport keeps a queue's messages: one list per priority step.

A message of priority 0 waits in the list named after its queue; one of priority n > 0 in
``<queue>\\x06\\x16<step>`` (kombu's ``PRIORITY_STEPS``). The replayer and ``gatekeeper status``
read the lists directly, since Celery's own monitors do not see the defer queue.
"""

from __future__ import annotations

import json
from bisect import bisect
from collections.abc import Iterable, Iterator
from typing import Any

import redis

from gatekeeper.core.headers import H_ATTEMPT

__all__ = ["PRIORITY_SEP", "PRIORITY_STEPS", "UNACKED", "queue_list", "waiting_attempts"]

PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (0, 3, 6, 9)
"""kombu's Redis transport: a message of priority n > 0 waits in ``<queue>\\x06\\x16<step>``."""
UNACKED = "unacked"
"""kombu's hash of messages delivered and not yet acked (a worker's prefetched messages and
those waiting on an ETA): field = delivery tag, value = ``[message, exchange, routing_key]``."""
CHUNK = 1000


def queue_list(queue: str, priority: int) -> str:
    """The Redis list kombu keeps a queue's messages of this priority in."""
    step = PRIORITY_STEPS[bisect(PRIORITY_STEPS, max(0, min(priority, 9))) - 1]
    return f"{queue}{PRIORITY_SEP}{step}" if step else queue


def waiting_attempts(broker: redis.Redis, queue: str) -> set[str]:
    """``<job_id>:<attempt>`` of every gated message still to run from ``queue``: in its lists
    (every priority) or delivered to a worker and not acked (prefetched, or waiting on an
    ETA: they have left the list but still wait). Read in chunks; a message that cannot be
    read is skipped (it names no attempt)."""
    found: set[str] = set()
    for name in (queue_list(queue, p) for p in PRIORITY_STEPS):
        start = 0
        while True:
            chunk = broker.lrange(name, start, start + CHUNK - 1)
            found.update(_members(chunk))
            if len(chunk) < CHUNK:
                break
            start += CHUNK
    # Delivered from any queue: an attempt a worker holds still waits, wherever it came from.
    unacked = (_delivered(raw) for _, raw in broker.hscan_iter(UNACKED, count=CHUNK))
    found.update(_members(m for m in unacked if m is not None))
    return found


def _delivered(raw: Any) -> Any:
    """The message of one ``unacked`` entry (``[message, exchange, routing_key]``)."""
    try:
        message = json.loads(raw)[0]
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    return json.dumps(message)


def _members(raw_messages: Iterable[Any]) -> Iterator[str]:
    for raw in raw_messages:
        try:
            headers = json.loads(raw)["headers"]
            attempt = headers[H_ATTEMPT]
        except (ValueError, TypeError, KeyError):
            continue
        if isinstance(attempt, int) and not isinstance(attempt, bool):
            yield f"{headers.get('id')}:{attempt}"
