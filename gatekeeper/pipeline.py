"""The decision pipeline for one publish of a gated task, independent of Celery.

SPEC's order: not gated -> untouched (the hook never calls this); ``dwell_gate_enabled`` off
-> untouched; outside the canary slice -> untouched; ``free_path_enabled`` off -> reserved;
the dwell gate's guards (in process); then, in one Redis script, the age cap, dwell against
slack and the budget. Any fault on the way routes to reserved, never to free, and says why.
Every routed decision writes exactly one log line.

Flags never read (the gate's Redis unreachable since the process started): Redis may
override the settings, so the gate cannot tell whether it is on. Where the settings say
"untouched", the task keeps its own route (``flags_unread``) unless that route is the free
queue; then, and where the settings turn the gate on, it goes to reserved
(``gate_unavailable``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import redis

from gatekeeper.dwell import Decision, GateInputs, Reason, decide, guards_pass, retry_tax_s
from gatekeeper.errors import LedgerUnavailable, PublishFailed
from gatekeeper.fastpath import Push
from gatekeeper.flags import FlagStore, in_canary
from gatekeeper.keys import Keys
from gatekeeper.ledger import window_id
from gatekeeper.logs import make_logger
from gatekeeper.review import review_marks
from gatekeeper.settings import GatekeeperSettings
from gatekeeper.spec import (
    H_ATTEMPT,
    H_ATTEMPT_PUBLISHED_AT,
    H_DEADLINE_AT,
    H_DECISION,
    H_DWELL_S,
    H_EXPECTED_SERVICE_S,
    H_FIRST_PUBLISHED_AT,
    H_FREE_ADMITTED,
    H_MAX_RETRIES,
    H_PUBLISHED_AT,
    H_REASON,
    H_TOKENS_IN,
    H_WINDOW,
    BadDeclaredInput,
    GatedSpec,
    resolve_inputs,
)
from gatekeeper.store import GateStore, PendingScore

__all__ = ["FLAGS_UNREAD", "GATE_UNAVAILABLE", "Begun", "Pipeline", "Publish", "Routing"]

GATE_UNAVAILABLE = "gate_unavailable"
GATE_ERROR = "gate_error"
BAD_INPUT = "bad_input"
FREE_PATH_DISABLED = "free_path_disabled"
GATE_DISABLED = "gate_disabled"
OUTSIDE_CANARY = "outside_canary"
FLAGS_UNREAD = "flags_unread"


@dataclass(frozen=True)
class Publish:
    """One publish of a gated task, as the hook saw it."""

    task: str
    job_id: str
    retries: int
    max_retries: int | None
    spec: GatedSpec | None
    headers: Mapping[str, Any]
    """Headers the message carries (retries, replays) and the caller's overrides."""
    spec_error: BadDeclaredInput | None = None
    origin: str = "publish"
    """``publish`` (the hook) or ``replay`` (the replayer re-scoring a deferred task)."""
    delay_s: float | None = None
    """Seconds until a delayed task is due, when known before the message exists; else the
    ``eta`` header says."""

    @property
    def attempt(self) -> int:
        return self.retries + 1


@dataclass(frozen=True)
class Routing:
    """Where the publish goes: ``queue`` None means untouched (its normal route)."""

    queue: str | None
    decision: str
    reason: str
    headers: dict[str, Any] = field(default_factory=dict)
    published: bool = False
    """True when the gate script already pushed the message (fast publish)."""


@dataclass
class Begun:
    """A decision :meth:`Pipeline.begin` started: final already, or awaiting the gate script."""

    publish: Publish
    routing: Routing | None
    """The final routing when no script was needed; None while ``pending``."""
    pending: PendingScore | None = None
    headers: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)
    win: int = 0
    push: Push | None = None
    """The message the script was asked to push too (fast publish)."""


class Pipeline:
    """Scores publishes of gated tasks with the flags, the core and the gate's Redis."""

    def __init__(
        self,
        settings: GatekeeperSettings,
        store: GateStore,
        flags: FlagStore,
        logger: Any,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.store = store
        self.flags = flags
        self.log = logger
        self.clock = clock
        self._queues = {
            Decision.ADMIT_FREE: settings.free_queue,
            Decision.DEFER: settings.defer_queue,
            Decision.RESERVED: settings.reserved_queue,
        }

    @classmethod
    def create(
        cls, settings: GatekeeperSettings, client: redis.Redis, clock: Callable[[], float]
    ) -> Pipeline:
        """A pipeline on one Redis client with gatekeeper's own decision logger."""
        keys = Keys(settings.key_prefix, settings.namespace)
        store = GateStore(client, keys, horizon_s=settings.queue_age_horizon_s)
        flags = FlagStore(client, settings, keys)
        return cls(settings, store, flags, make_logger(settings, "decision"), clock)

    def route(
        self,
        publish: Publish,
        render: Callable[[dict[str, Any]], Push | None] | None = None,
        *,
        off_free: bool = False,
    ) -> Routing:
        """Decide one publish; never raises for a bad input or an unreachable Redis.

        ``render`` (fast publish) turns the headers into a message for the gate script to push
        with its decision; it is called only when the decision needs the script.
        ``off_free``: see :meth:`begin`.
        """
        return self.complete(self.begin(publish, render, off_free=off_free))

    def begin(
        self,
        publish: Publish,
        render: Callable[[dict[str, Any]], Push | None] | None = None,
        *,
        off_free: bool = False,
    ) -> Begun:
        """Start deciding one publish: everything up to sending the gate script.

        Decisions that need no script are final here (and logged); the others wait in the
        returned :class:`Begun` until :meth:`complete` reads the script's reply, so the round
        trip can overlap the caller's own work. Never raises for a bad input or a Redis fault.

        Flags never read, where the settings say untouched: a ``flags_unread`` routing, not
        logged, for the caller to keep the task's own route (:meth:`kept_own_route`) or, when
        that route is the free queue, to ask again with ``off_free`` (reserved, stamped).
        """
        flags = self.flags.current()
        skip = None
        if not flags.dwell_gate_enabled:
            skip = GATE_DISABLED
        elif not in_canary(publish.job_id, flags.canary_percent):
            skip = OUTSIDE_CANARY
        if skip is not None and flags.unread is None:
            self.log.debug("gate_skipped", task=publish.task, job_id=publish.job_id,
                           reason=skip)  # fmt: skip
            return Begun(publish, Routing(None, "untouched", skip))
        if skip is not None and not off_free:
            return Begun(publish, Routing(None, "untouched", FLAGS_UNREAD))

        now = self.clock()
        fields: dict[str, Any] = {
            "task": publish.task,
            "job_id": publish.job_id,
            "attempt": publish.attempt,
            "retries": publish.retries,
        }
        if publish.origin != "publish":
            fields["origin"] = publish.origin
        try:
            if publish.spec_error is not None:
                raise publish.spec_error
            assert publish.spec is not None
            inputs = resolve_inputs(publish.spec, publish.headers, now)
        except BadDeclaredInput as exc:
            # What can be known is stamped, so the attempt still gets its ledger row and a
            # retry cannot start a new deadline; the bad input itself is left as it was.
            carried_first = publish.headers.get(H_FIRST_PUBLISHED_AT)
            stamp: dict[str, Any] = {
                H_FIRST_PUBLISHED_AT: now if carried_first is None else carried_first,
                H_PUBLISHED_AT: now,
                H_ATTEMPT_PUBLISHED_AT: now,
                H_ATTEMPT: publish.attempt,
            }
            if isinstance(publish.headers.get(H_DEADLINE_AT), (int, float)):
                stamp[H_DEADLINE_AT] = publish.headers[H_DEADLINE_AT]
            self._count(window_id(now, self.settings.window_seconds), Decision.RESERVED,
                        BAD_INPUT, fields)  # fmt: skip
            return Begun(
                publish,
                self._finish(
                    Decision.RESERVED, BAD_INPUT, stamp, fields, error=str(exc), field=exc.field
                ),
            )

        delay = publish.delay_s
        if delay is None:
            delay = _delay_s(publish.headers.get("eta"), now)
        left = 0 if publish.max_retries is None else publish.max_retries - publish.retries
        tax_s = retry_tax_s(left, inputs.expected_service_s)
        slack = inputs.deadline_at - now
        win = window_id(now, self.settings.window_seconds)
        if delay:
            fields["delay_s"] = delay
        fields.update(
            expected_service_s=inputs.expected_service_s,
            retry_tax_s=tax_s,
            deadline_slack_s=slack,
            tokens=inputs.tokens_in,
        )
        same_attempt = publish.headers.get(H_ATTEMPT) == publish.attempt
        carried = publish.headers.get(H_ATTEMPT_PUBLISHED_AT) if same_attempt else None
        headers = {
            H_DEADLINE_AT: inputs.deadline_at,
            H_FIRST_PUBLISHED_AT: inputs.first_published_at,
            H_PUBLISHED_AT: now,
            # A replayed (deferred) attempt keeps its first publish: its wait includes parking.
            # A delayed one starts waiting when it is due: the delay asked for is not a wait.
            H_ATTEMPT_PUBLISHED_AT: now + delay if carried is None else carried,
            H_ATTEMPT: publish.attempt,
            H_EXPECTED_SERVICE_S: inputs.expected_service_s,
            H_TOKENS_IN: inputs.tokens_in,
        }
        if publish.max_retries is not None:
            headers[H_MAX_RETRIES] = publish.max_retries
        if publish.headers.get(H_FREE_ADMITTED):
            headers[H_FREE_ADMITTED] = True
        if flags.unread is not None:  # the settings turn the gate on; Redis is unreachable
            routing = self._finish(
                Decision.RESERVED, GATE_UNAVAILABLE, headers, fields, error=flags.unread
            )
            return Begun(publish, routing)
        if not flags.free_path_enabled:
            self._count(win, Decision.RESERVED, FREE_PATH_DISABLED, fields)
            return Begun(
                publish, self._finish(Decision.RESERVED, FREE_PATH_DISABLED, headers, fields)
            )

        # Rule 1 needs no Redis: a guard that fires here never costs a round trip.
        cap = self.settings.max_queue_age_s
        service = inputs.expected_service_s
        if not guards_pass(service, tax_s, slack, cap, delay):  # decide() names the reason
            guard = decide(GateInputs(0.0, service, tax_s, slack, cap, delay))
            if guard.decision is Decision.DEFER:
                fields.update(queue_age_s=0.0, dwell_s=guard.dwell_s, field=guard.field)
                self._count(win, guard.decision, guard.reason.value, fields)
                routing = self._finish(guard.decision, guard.reason.value, headers, fields)
                return Begun(publish, routing)

        push = render(headers) if render is not None else None
        pending = self.store.start_score(
            now_s=now,
            window_id=win,
            job_id=publish.job_id,
            attempt=publish.attempt,
            expected_service_s=inputs.expected_service_s,
            retry_tax_s=tax_s,
            deadline_slack_s=slack,
            max_queue_age_s=cap,
            tokens_in=inputs.tokens_in,
            budget_units=self.settings.budget_units,
            queue_wait_unit_per_second=self.settings.queue_wait_unit_per_second,
            budget_mode=self.settings.budget_mode,
            deadline_slack_ms=round(slack * 1000),
            delay_s=delay,
            push=push,
        )
        return Begun(publish, None, pending, headers, fields, win, push=push)

    def complete(self, begun: Begun) -> Routing:
        """Finish a decision :meth:`begin` started: read the gate script's reply, log, route."""
        if begun.routing is not None:
            return begun.routing
        assert begun.pending is not None
        publish, headers, fields, win = begun.publish, begun.headers, begun.fields, begun.win
        try:
            scored = begun.pending.result()
        except LedgerUnavailable as exc:
            if begun.push is not None:  # fast publish: push the built message here instead
                return self._push_instead(
                    begun.push, publish, GATE_UNAVAILABLE, headers, fields, str(exc)
                )
            return self._finish(
                Decision.RESERVED, GATE_UNAVAILABLE, headers, fields, error=str(exc)
            )
        fields.update(queue_age_s=scored.queue_age_s, dwell_s=scored.dwell_s)
        if scored.decision is Decision.ADMIT_FREE:
            headers[H_FREE_ADMITTED] = True
            headers[H_WINDOW] = win
        if scored.reason is Reason.RETRY_TAX_BUDGET:
            fields.update(
                projected_tax=scored.projected_tax, budget_units=self.settings.budget_units
            )
        routing = self._finish(scored.decision, scored.reason.value, headers, fields)
        if begun.push is not None:
            routing = replace(routing, published=True)
        return routing

    def kept_own_route(self, publish: Publish) -> None:
        """Log a publish that keeps its own route because the flags were never read."""
        with contextlib.suppress(Exception):  # as for decision lines: never change the route
            self.log.warning("gate_skipped", task=publish.task, job_id=publish.job_id,
                             reason=FLAGS_UNREAD, error=self.flags.current().unread)  # fmt: skip

    def _count(self, win: int, decision: Decision, reason: str, fields: dict[str, Any]) -> None:
        """Count a decision made without the gate script (the script counts its own).

        One extra round trip, only on these paths; a failure to count never blocks routing.
        """
        marks = review_marks(
            decision.value,
            reason,
            _number(fields.get("dwell_s")),
            _number(fields.get("deadline_slack_s")),
            _number(fields.get("expected_service_s")),
            _number(fields.get("retry_tax_s")),
        )
        self.store.count_decision(win, decision.value, reason, marks)

    def fail_closed(
        self, publish: Publish, reason: str, error: str, push: Push | None = None
    ) -> Routing:
        """The route for a publish the pipeline could not finish (hook faults); with ``push``
        (fast publish, the message already built), that message is pushed here."""
        fields = {"task": publish.task, "job_id": publish.job_id, "attempt": publish.attempt,
                  "retries": publish.retries}  # fmt: skip
        if push is not None:
            return self._push_instead(push, publish, reason, {}, fields, error)
        return self._finish(Decision.RESERVED, reason, {}, fields, error=error)

    def _push_instead(
        self,
        push: Push,
        publish: Publish,
        reason: str,
        headers: dict[str, Any],
        fields: dict[str, Any],
        error: str,
    ) -> Routing:
        """A fast publish whose script did not push (it failed, or its reply was lost or
        late): ``fallback.lua`` pushes the message Celery already built to reserved, unless
        the script pushed it for this request after all, whose decision is then the one
        logged. Raises :class:`PublishFailed` when Redis cannot be reached for it."""
        reserved = self._queues[Decision.RESERVED]
        try:
            earlier = self.store.push_fallback(
                push, publish.job_id, publish.attempt, Decision.RESERVED.value, reason, reserved
            )
        except LedgerUnavailable as down:
            self._finish(Decision.RESERVED, reason, headers, fields, error=f"{error}; {down}")
            raise PublishFailed(f"cannot publish {publish.job_id}: {down}") from down
        if earlier is None:
            routing = self._finish(Decision.RESERVED, reason, headers, fields, error=error)
        else:
            routing = self._finish(*earlier, headers, fields, recovered=True)
        return replace(routing, published=True)

    def _finish(
        self,
        decision: Decision,
        reason: str,
        headers: dict[str, Any],
        fields: dict[str, Any],
        **extra: Any,
    ) -> Routing:
        queue = self._queues[decision]
        dwell = fields.get("dwell_s")
        tokens = fields.get("tokens")
        pressure = (
            tokens * dwell
            if isinstance(dwell, float) and math.isfinite(dwell) and tokens is not None
            else None
        )
        headers = {**headers, H_DECISION: decision.value, H_REASON: reason}
        if isinstance(dwell, float) and math.isfinite(dwell):
            headers[H_DWELL_S] = dwell
        line = {
            "queue_age_s": None,
            "expected_service_s": None,
            "retry_tax_s": None,
            "dwell_s": None,
            "deadline_slack_s": None,
            "tokens": None,
            **fields,
            "decision": decision.value,
            "reason": reason,
            "token_pressure": pressure,
            "queue": queue,
            **extra,
        }
        level = "warning" if reason in (GATE_UNAVAILABLE, GATE_ERROR, BAD_INPUT) else "info"
        # A closed or full log stream must not change where the task goes.
        with contextlib.suppress(Exception):
            getattr(self.log, level)("gate_decision", **line)
        return Routing(queue, decision.value, reason, headers)


def _delay_s(eta: Any, now: float) -> float:
    """Seconds until a delayed task is due (Celery's ``eta`` header, ISO 8601); 0 if none.

    An ``eta`` that cannot be read counts as no delay (Celery itself writes this header, and
    would not have built the message with a bad one).
    """
    if not eta:
        return 0.0
    try:
        due = datetime.fromisoformat(str(eta))
    except ValueError:
        return 0.0
    if due.tzinfo is None:
        due = due.replace(tzinfo=timezone.utc)
    return max(0.0, due.timestamp() - now)


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan
