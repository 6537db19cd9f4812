"""How a run ended that ``task_postrun`` finds still open: no other signal ended it.

Celery ends most runs with a signal of their own, sent before ``task_postrun`` in the process
that ran them (``task_success``, ``task_failure``, ``task_retry``). A run still held when its
postrun fires got none, and ends there, so every run that reaches postrun gets one row:

==========================================  =========  ===================================
how the run ended                           state      outcome (reason)
==========================================  =========  ===================================
the body raised ``Ignore`` (``replace``)    IGNORED    ``ok`` (``ignored``)
the body raised ``Reject``                  REJECTED   ``killed`` (``reject``)
the body returned, ``on_success`` raised    SUCCESS    ``killed`` (``reject``)
``Reject``, requeued or not
anything else raised out of the trace       any        ``killed`` (the exception's type)
==========================================  =========  ===================================

A ``Reject`` from ``on_success`` comes after the body returned and its result was stored,
but the message is rejected all the same, and Celery (5.6.3 on) sends no end signal in the
process that ran it: the run is a rejected one. A requeued copy runs the body again (spending
its tokens again: the first run's were waste, as a killed row prices them, and the copy is a
new run of the attempt, counted in ``reruns_after_row``); one not requeued is recorded by
Celery 5.7 as a failure (its main process sends ``task_failure`` after this row: still one
row). Before 5.6.3 Celery sent ``task_failure`` for it, in the child after postrun; the row
is the same, and says ``reject`` on every version.

Anything else raised out of the trace after the body (an ordinary exception from
``on_success`` before Celery 5.7: 5.7 logs it and sends ``task_success``; a result backend
that fails after the callbacks were sent) is followed by ``task_failure`` in the same process,
after postrun: the row written here has the reason that signal would have given, and the
signal finds the run ended.

The exception is read with ``sys.exc_info()``: Celery sends postrun from a ``finally`` the
exception is passing through. Were that to change, such a run still gets its one row here,
killed, with the reason ``no_end_signal``.
"""

from __future__ import annotations

import sys

from celery.exceptions import Reject, TimeLimitExceeded
from celery.states import IGNORED, REJECTED

from gatekeeper.core.ledger import Outcome

__all__ = ["ENDED_AT_POSTRUN", "ended_at_postrun", "rejected_for_good", "requeued_on_timeout"]

ENDED_AT_POSTRUN = {IGNORED: (Outcome.OK, "ignored"), REJECTED: (Outcome.KILLED, "reject")}
"""The states of a run whose body ended it with no signal but ``task_postrun``."""


def ended_at_postrun(state: object) -> tuple[Outcome, str]:
    """The outcome and reason of a run still open when its ``task_postrun`` fires (called
    from that signal's receiver, while Celery's exception, if any, is on its way out)."""
    ended = ENDED_AT_POSTRUN.get(state)
    if ended is not None:
        return ended
    raised = sys.exc_info()[1]
    if isinstance(raised, Reject):
        return Outcome.KILLED, "reject"
    return Outcome.KILLED, type(raised).__name__ if raised is not None else "no_end_signal"


def rejected_for_good(retval: object) -> bool:
    """Whether a run ended at postrun dropped its message (``Reject(requeue=False)``, as
    ``task_postrun``'s ``retval`` or on its way out): no copy is left, its job ends."""
    rejected = retval if isinstance(retval, Reject) else sys.exc_info()[1]
    return isinstance(rejected, Reject) and not rejected.requeue


def requeued_on_timeout(task: object, exception: object) -> bool:
    """Whether a ``task_failure`` is followed by a copy of the run: a hard time limit of an
    ``acks_late`` task that does not ack on timeout. Celery 5.7 sends ``task_failure`` for it
    and then requeues the message (``Request.on_timeout``); 5.5 and 5.6 send none then. Every
    other ``task_failure`` is the job's end: the main process sends it only when the message
    is not requeued, and a retry sends ``task_retry`` instead."""
    if not isinstance(exception, TimeLimitExceeded) or not getattr(task, "acks_late", False):
        return False
    acks = getattr(task, "acks_on_timeout", None)  # 5.7; before it, the one setting for both
    if acks is None:
        acks = getattr(task, "acks_on_failure_or_timeout", True)
    return not acks
