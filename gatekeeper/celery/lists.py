"""Where kombu's Redis transport keeps a queue's messages: one list per priority step.

A message of priority 0 waits in the list named after its queue; one of priority n > 0 in
``<queue>\\x06\\x16<step>`` (kombu's ``PRIORITY_STEPS``). The replayer and ``gatekeeper status``
read the lists directly, since Celery's own monitors do not see the defer queue. The app's
``broker_transport_options`` may name them otherwise (``sep``, ``priority_steps``, as Celery's
documentation suggests for Redis priorities, and ``unacked_key``): :class:`Layout` reads them
as kombu does, so that a deferred task of any priority is found where kombu put it.
"""

from __future__ import annotations

import json
from bisect import bisect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from gatekeeper.core.headers import H_ATTEMPT
from gatekeeper.errors import ConfigError

__all__ = ["PRIORITY_SEP", "PRIORITY_STEPS", "UNACKED", "Layout", "queue_list", "waiting_attempts"]

PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (0, 3, 6, 9)
"""kombu's Redis transport: a message of priority n > 0 waits in ``<queue>\\x06\\x16<step>``."""
UNACKED = "unacked"
"""kombu's hash of messages delivered and not yet acked (a worker's prefetched messages and
those waiting on an ETA): field = delivery tag, value = ``[message, exchange, routing_key]``."""
CHUNK = 1000


@dataclass(frozen=True, slots=True)
class Layout:
    """How kombu's Redis transport names a queue's lists: the transport options ``sep``,
    ``priority_steps`` and ``unacked_key`` (kombu's defaults when absent)."""

    sep: str = PRIORITY_SEP
    steps: tuple[int, ...] = PRIORITY_STEPS
    unacked: str = UNACKED

    @classmethod
    def of(cls, options: Mapping[str, Any] | None) -> Layout:
        """The layout the broker's transport ``options`` give; ConfigError names the option
        whose value kombu could not use either."""
        options = options or {}
        sep, steps = options.get("sep", PRIORITY_SEP), options.get("priority_steps", PRIORITY_STEPS)
        unacked = options.get("unacked_key", UNACKED)
        if not isinstance(sep, str):
            raise ConfigError(f"broker_transport_options: sep: expected text, got {sep!r}")
        if not isinstance(unacked, str) or not unacked:
            raise ConfigError(
                f"broker_transport_options: unacked_key: expected a key name, got {unacked!r}"
            )
        try:
            whole = tuple(steps) if not isinstance(steps, (str, bytes)) else ()
        except TypeError:
            whole = ()
        if (
            not whole
            or any(type(step) is not int or not 0 <= step <= 9 for step in whole)
            or (list(whole) != sorted(set(whole)))
        ):
            raise ConfigError(
                "broker_transport_options: priority_steps: expected increasing whole numbers "
                f"from 0 to 9 (kombu's default [0, 3, 6, 9]), got {steps!r}"
            )
        return cls(sep, whole, unacked)

    def queue_list(self, queue: str, priority: int) -> str:
        """The list of ``queue`` that holds its messages of this priority (kombu's
        ``_q_for_pri``, the priority first bounded to 0-9 as kombu bounds it)."""
        step = self.steps[bisect(self.steps, max(0, min(priority, 9))) - 1]
        return f"{queue}{self.sep}{step}" if step else queue

    def lists(self, queue: str) -> list[str]:
        """Every list of ``queue``, in the order kombu's workers pop them."""
        return [self.queue_list(queue, step) for step in self.steps]


DEFAULT_LAYOUT = Layout()


def queue_list(queue: str, priority: int) -> str:
    """The Redis list kombu keeps a queue's messages of this priority in (default options)."""
    return DEFAULT_LAYOUT.queue_list(queue, priority)


def waiting_attempts(broker: redis.Redis, queue: str, layout: Layout = DEFAULT_LAYOUT) -> set[str]:
    """``<job_id>:<attempt>`` of every gated message still to run from ``queue``: in its lists
    (every priority) or delivered to a worker and not acked (prefetched, or waiting on an
    ETA: they have left the list but still wait). Read in chunks; a message that cannot be
    read is skipped (it names no attempt)."""
    found: set[str] = set()
    for name in layout.lists(queue):
        start = 0
        while True:
            chunk = broker.lrange(name, start, start + CHUNK - 1)
            found.update(_members(chunk))
            if len(chunk) < CHUNK:
                break
            start += CHUNK
    # Delivered from any queue: an attempt a worker holds still waits, wherever it came from.
    unacked = (_delivered(raw) for _, raw in broker.hscan_iter(layout.unacked, count=CHUNK))
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
