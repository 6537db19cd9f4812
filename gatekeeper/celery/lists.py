"""Where kombu's Redis transport keeps a queue's messages: one list per priority step.

A message of priority 0 waits in the list named after its queue; one of priority n > 0 in
``<queue>\\x06\\x16<step>`` (kombu's ``PRIORITY_STEPS``). The replayer and ``gatekeeper status``
read the lists directly, since Celery's own monitors do not see the defer queue.
"""

from __future__ import annotations

from bisect import bisect

__all__ = ["PRIORITY_SEP", "PRIORITY_STEPS", "queue_list"]

PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (0, 3, 6, 9)
"""kombu's Redis transport: a message of priority n > 0 waits in ``<queue>\\x06\\x16<step>``."""


def queue_list(queue: str, priority: int) -> str:
    """The Redis list kombu keeps a queue's messages of this priority in."""
    step = PRIORITY_STEPS[bisect(PRIORITY_STEPS, max(0, min(priority, 9))) - 1]
    return f"{queue}{PRIORITY_SEP}{step}" if step else queue
