"""The decision for one publish of a gated task: the flags, the core and the gate script.

:meth:`Pipeline.route` takes the steps in SPEC's order, the first that decides wins:

1. :meth:`~Pipeline._skipped`: ``dwell_gate_enabled`` off, or the job outside the canary ->
   untouched (its normal route). Flags never read (the gate's Redis unreachable since the
   process started): Redis may override the settings, so where they say "untouched" the task
   keeps its own route (``flags_unread``). Either way, when that route is the free queue and
   the free path is closed (or the flags unread, or stale), the hook asks again with
   ``off_free``: the task is then decided as if the gate were on, so ``free_path_enabled=
   false`` binds every gated task (SPEC section 4);
2. :meth:`~Pipeline._resolved`: a declared input that cannot be scored -> reserved
   (``bad_input``, unverified: the gate writes no record for it; ``retries`` that make no
   attempt are counted under attempt 0, which none has);
3. :meth:`~Pipeline._in_process`: the settings turn the gate on but the flags are unread, or
   a task ``off_free`` has only stale flags (the last read failed) -> reserved
   (``gate_unavailable``); ``free_path_enabled`` off -> reserved; the dwell gate's
   guards (:func:`gatekeeper.core.dwell.decide`, no round trip) -> defer;
4. :meth:`~Pipeline.gate_call`: in one Redis script (``gate.lua``), the age cap, dwell against
   slack and the budget, with the attempt's exposure reserved atomically (a batch's scripts
   in one round trip: :mod:`gatekeeper.redis.gate_batch`).

Every decision made with Redis writes the gate's record of the attempt (keyed by job id and
attempt, with a random nonce that the message carries); every routed decision writes exactly
one log line; any fault routes to reserved, never to free, and says why.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import redis

from gatekeeper.core.dwell import Decision, GateInputs, Reason, decide, guards_pass
from gatekeeper.core.headers import (
    H_DECISION,
    H_DWELL_S,
    H_FREE_ADMITTED,
    H_REASON,
    H_WINDOW,
)
from gatekeeper.core.ledger import window_id
from gatekeeper.core.review import review_marks
from gatekeeper.errors import BadDeclaredInput, LedgerUnavailable, PublishFailed
from gatekeeper.logs import LineWriter, make_logger
from gatekeeper.redis.attempt import (
    Attempt,
    Publish,
    bad_headers,
    bad_input_stamp,
    identity,
    label_of,
    no_attempt,
    resolve,
    unrecorded,
)
from gatekeeper.redis.breaker import Breaker
from gatekeeper.redis.cluster import probe_of
from gatekeeper.redis.decisions import in_process_inputs
from gatekeeper.redis.deployment import announcer
from gatekeeper.redis.flags import Flags, FlagStore, in_canary
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.later import Later
from gatekeeper.redis.push import Push, new_nonce, values_for
from gatekeeper.redis.routing import Routing
from gatekeeper.redis.service_times import LearnedService, ServiceTimes
from gatekeeper.redis.store import GateCall, GateStore, ScoredAttempt
from gatekeeper.settings import GatekeeperSettings

__all__ = ["Pipeline", "Publish", "Render", "Routing"]

Render = Callable[[dict[str, Any], str], Push | None]
"""Fast publish: the message for these headers, cut at this nonce's placeholders."""
_WARN = {Reason.GATE_UNAVAILABLE, Reason.GATE_ERROR, Reason.BAD_INPUT, Reason.STATE_MISSING,
         Reason.EVICTION_POLICY}  # fmt: skip
_VALUES: dict[Decision | Reason, str] = {**{d: d.value for d in Decision},
                                         **{r: r.value for r in Reason}}  # fmt: skip
"""The enums' values, looked up once (an enum's ``.value`` is a descriptor call)."""
_LINE_DEFAULTS: dict[str, Any] = dict.fromkeys(
    ("queue_age_s", "expected_service_s", "retry_tax_s", "dwell_s", "deadline_slack_s", "tokens")
)
"""Fields every decision line carries, empty when the decision did not get that far."""


class Pipeline:
    """Scores publishes of gated tasks with the flags, the core and the gate's Redis."""

    def __init__(self, settings: GatekeeperSettings, store: GateStore, flags: FlagStore,
                 logger: Any, clock: Callable[[], float]) -> None:  # fmt: skip
        self.settings = settings
        self.store = store
        self.flags = flags
        self.log = logger
        self.lines = LineWriter(logger)
        self.clock = clock
        times = ServiceTimes(store.client, store.keys, store.breaker)
        self.learned = LearnedService(times, settings, logger, wall=clock)
        self.later = Later(self, 2 * settings.redis_timeout_s) if (
            settings.publish_replies == "later") else None  # fmt: skip
        self._queues = {
            Decision.ADMIT_FREE: settings.free_queue,
            Decision.DEFER: settings.defer_queue,
            Decision.RESERVED: settings.reserved_queue,
        }

    @classmethod
    def create(
        cls, settings: GatekeeperSettings, client: redis.Redis, clock: Callable[[], float]
    ) -> Pipeline:
        """A pipeline on one Redis client with its own decision logger, one breaker (none when
        ``breaker_open_s`` is 0), and its pair kept in Redis (gatekeeper/redis/deployment.py)."""
        keys = Keys(settings.key_prefix, settings.namespace)
        log = make_logger(settings, "decision")
        breaker = (Breaker(client, settings.breaker_open_s, log, probe_of(client, keys.flags))
                   if settings.breaker_open_s else None)  # fmt: skip
        store = GateStore(client, keys, horizon_s=settings.queue_age_horizon_s, breaker=breaker,
                          decision_record_cap=settings.decision_record_cap)  # fmt: skip
        flags = FlagStore(client, settings, keys, breaker=breaker)
        flags.announce = announcer(client, keys, settings, log, breaker)
        return cls(settings, store, flags, log, clock)

    def route(
        self, publish: Publish, render: Render | None = None, *, off_free: bool = False,
        later: bool = False,
    ) -> Routing:  # fmt: skip
        """Decide one publish; never raises for a bad input or an unreachable Redis.

        ``render`` (fast publish) builds the message for the gate script to push with its
        decision; it is called only when the decision needs the script. ``off_free``: the
        task's own route is the free queue and the free path is closed (or the flags are
        unread), so it is decided as if the gate were on (reserved, its headers stamped).
        ``later``: fast publish may return before the script's reply (:mod:`.later`).
        """
        attempt = self.unscripted(publish, off_free)
        if isinstance(attempt, Routing):
            return attempt
        push = render(attempt.headers, attempt.nonce) if render is not None else None
        if push is not None and later and self.later is not None:
            routing = self.later.route(attempt, push)  # None: asked the ordinary way
            if routing is not None:
                return routing
        try:
            scored = self.store.score(self.gate_call(attempt, push))
        except LedgerUnavailable as exc:
            return self.unscored(attempt, exc, push)
        return self.scored(attempt, scored, published=push is not None)

    def unscripted(self, publish: Publish, off_free: bool = False) -> Routing | Attempt:
        """Steps 1 to 3: the routing when one of them decides, else the attempt to score."""
        flags = self.flags.current()
        skipped = self._skipped(publish, flags, off_free)
        if skipped is not None:
            return skipped
        attempt = self._resolved(publish)
        if isinstance(attempt, Routing):
            return attempt
        return self._in_process(attempt, flags, off_free) or attempt

    # -- the steps -----------------------------------------------------------------------

    def _skipped(self, publish: Publish, flags: Flags, off_free: bool) -> Routing | None:
        """Step 1: untouched by the flags (``gate_disabled``, ``outside_canary``)."""
        if not flags.dwell_gate_enabled:
            skip = Reason.GATE_DISABLED
        elif not in_canary(publish.job_id, flags.canary_percent):
            skip = Reason.OUTSIDE_CANARY
        else:
            return None
        if off_free:
            return None  # its own route is the free queue: decided as if the gate were on
        if flags.unread is None:
            self.log.debug("gate_skipped", task=publish.task, job_id=publish.job_id,
                           reason=skip.value)  # fmt: skip
            return Routing(None, None, skip)
        return Routing(None, None, Reason.FLAGS_UNREAD)

    def _resolved(self, publish: Publish) -> Attempt | Routing:
        """Step 2: the attempt's inputs, or reserved for a declared input that is bad."""
        now = self.clock()
        try:
            return resolve(publish, now, self.settings.window_seconds, new_nonce(),
                           self.learned.choose, self.settings.free_wait_allowance_s)  # fmt: skip
        except BadDeclaredInput as exc:
            fields = identity(publish)
            marks = review_marks(Decision.RESERVED.value, Reason.BAD_INPUT.value, *[math.nan] * 4)
            win = window_id(now, self.settings.window_seconds)
            self.store.record_decision(win, publish.job_id, 0 if no_attempt(publish) else
                                       publish.attempt, Decision.RESERVED, Reason.BAD_INPUT,
                                       marks, {}, task=label_of(publish))  # fmt: skip
            stamp = bad_input_stamp(publish, now)
            routing = self._finish(Decision.RESERVED, Reason.BAD_INPUT, stamp, fields,
                                   error=str(exc), field=exc.field)  # fmt: skip
            routing.drop = tuple(bad_headers(publish.headers))
            return routing

    def _in_process(self, attempt: Attempt, flags: Flags, off_free: bool) -> Routing | None:
        """Step 3: decisions made without the gate script."""
        # The settings turn the gate on and Redis is unreachable; or a task the gate would
        # leave alone on its route to free, whose flags could not be read again (a reviewer:
        # scored while they were stale, it counted as an admission of the gate's).
        why = flags.unread or (flags.stale if off_free else None)
        if why is not None:
            return self._finish(Decision.RESERVED, Reason.GATE_UNAVAILABLE,
                                unrecorded(attempt.headers), attempt.fields,
                                error=why)  # fmt: skip
        if flags.state_missing:
            return self._recorded(attempt, Decision.RESERVED, Reason.STATE_MISSING)
        if flags.eviction is not None:
            attempt.fields["maxmemory_policy"] = flags.eviction
            return self._recorded(attempt, Decision.RESERVED, Reason.EVICTION_POLICY)
        if not flags.free_path_enabled:
            return self._recorded(attempt, Decision.RESERVED, Reason.FREE_PATH_DISABLED)
        cap = self.settings.max_queue_age_s
        service, tax_s, slack, delay = (attempt.service_s, attempt.tax_s,
                                        attempt.slack_s, attempt.delay_s)  # fmt: skip
        if guards_pass(service, tax_s, slack, cap, delay):
            return None
        guard = decide(GateInputs(0.0, service, tax_s, slack, cap, delay))  # names the reason
        if guard.decision is not Decision.DEFER:
            return None
        attempt.fields.update(queue_age_s=0.0, dwell_s=guard.dwell_s, field=guard.field)
        return self._recorded(attempt, guard.decision, guard.reason)

    def _recorded(self, attempt: Attempt, decision: Decision, reason: Reason) -> Routing:
        """A decision made in process: counted, recorded (the message carries the nonce
        when the record was written), routed."""
        fields = attempt.fields
        marks = review_marks(decision.value, reason.value, *(
            _number(fields.get(name))
            for name in ("dwell_s", "deadline_slack_s", "expected_service_s", "retry_tax_s")
        ))  # fmt: skip
        free = self.store.record_decision(
            attempt.window, attempt.publish.job_id, attempt.publish.attempt, decision, reason,
            marks, attempt.record(_number(fields.get("dwell_s"))), attempt.prev_nonce,
            label_of(attempt.publish), in_process_inputs(attempt, self.settings),
        )  # fmt: skip
        headers = attempt.headers if free is not None else unrecorded(attempt.headers)
        return self._finish(decision, reason, headers, fields, free=bool(free))

    def gate_call(self, attempt: Attempt, push: Push | None = None) -> GateCall:
        """Step 4, in one Redis script: the request that decides the rest atomically (and
        pushes ``push``, fast publish's message)."""
        publish, inputs = attempt.publish, attempt.inputs
        return GateCall(
            now_s=attempt.now, window_id=attempt.window, job_id=publish.job_id,
            attempt=publish.attempt, expected_service_s=attempt.service_s,
            retry_tax_s=attempt.tax_s, deadline_slack_s=attempt.slack_s,
            max_queue_age_s=self.settings.max_queue_age_s, tokens_in=inputs.tokens_in,
            budget_units=self.settings.budget_units,
            queue_wait_unit_per_second=self.settings.queue_wait_unit_per_second,
            budget_mode=self.settings.budget_mode, nonce=attempt.nonce,
            published_s=attempt.published_s, deadline_s=attempt.inputs.deadline_at,
            delay_s=attempt.delay_s, push=push, prev_nonce=attempt.prev_nonce,
            wait_allowance_s=self.settings.free_wait_allowance_s, task=label_of(publish),
            publisher=attempt.publisher,
        )  # fmt: skip

    def unscored(self, attempt: Attempt, exc: LedgerUnavailable, push: Push | None) -> Routing:
        """Step 4 when the gate script failed: reserved, unrecorded (fast publish: pushed)."""
        headers = unrecorded(attempt.headers)
        if push is not None:  # fast publish: push the built message here instead
            return self._push_instead(push, attempt.publish, Reason.GATE_UNAVAILABLE, headers,
                                      attempt.fields, str(exc), attempt.record(math.nan),
                                      attempt.prev_nonce)  # fmt: skip
        return self._finish(Decision.RESERVED, Reason.GATE_UNAVAILABLE, headers, attempt.fields,
                            error=str(exc))  # fmt: skip

    def scored(self, attempt: Attempt, scored: ScoredAttempt, published: bool = False) -> Routing:
        """Step 4's routing: what the gate script decided."""
        fields = attempt.fields
        fields.update(queue_age_s=scored.queue_age_s, dwell_s=scored.dwell_s)
        if scored.reason is Reason.RETRY_TAX_BUDGET:
            fields.update(projected_tax=scored.projected_tax,
                          budget_units=self.settings.budget_units)  # fmt: skip
        window = attempt.window if scored.decision is Decision.ADMIT_FREE else None
        return self._finish(scored.decision, scored.reason, attempt.headers, fields,
                            free=scored.free_admitted, window=window,
                            published=published)  # fmt: skip

    # -- faults and the one line per decision ----------------------------------------------

    def kept_own_route(self, publish: Publish) -> None:
        """Log a publish that keeps its own route because the flags were never read."""
        with contextlib.suppress(Exception):  # as for decision lines: never change the route
            self.log.warning("gate_skipped", task=publish.task, job_id=publish.job_id,
                             reason=Reason.FLAGS_UNREAD.value,
                             error=self.flags.current().unread)  # fmt: skip

    def fail_closed(
        self, publish: Publish, reason: Reason, error: str, push: Push | None = None
    ) -> Routing:
        """The route for a publish the pipeline could not finish (hook faults); with ``push``
        (fast publish, the message already built), that message is pushed here."""
        fields = identity(publish)
        if push is not None:
            return self._push_instead(push, publish, reason, {}, fields, error, {})
        return self._finish(Decision.RESERVED, reason, {}, fields, error=error)

    def _push_instead(
        self, push: Push, publish: Publish, reason: Reason, headers: dict[str, Any],
        fields: dict[str, Any], error: str, record: dict[str, str], prev_nonce: str = "",
    ) -> Routing:  # fmt: skip
        """A fast publish whose script did not push (it failed, or its reply was lost or
        late): ``fallback.lua`` pushes the message Celery already built to reserved, unless
        the script pushed it for this request after all, whose decision is then the one
        logged. Raises :class:`PublishFailed` when Redis cannot be reached for it."""
        try:
            earlier = self.push_reserved(push, publish, reason, record, prev_nonce)
        except LedgerUnavailable as down:
            self._finish(Decision.RESERVED, reason, headers, fields, error=f"{error}; {down}")
            raise PublishFailed(f"cannot publish {publish.job_id}: {down}") from down
        if earlier is None:
            return self._finish(Decision.RESERVED, reason, headers, fields, published=True,
                                error=error)  # fmt: skip
        return self._finish(*earlier, headers, fields, published=True, recovered=True)

    def push_reserved(
        self, push: Push, publish: Publish, reason: Reason, record: dict[str, str],
        prev_nonce: str = "", force: bool = False,
    ) -> tuple[Decision, Reason] | None:  # fmt: skip
        """``fallback.lua`` with fast publish's message filled in for reserved: None when it
        pushed it, else the decision of this request's push that landed first. Raises
        :class:`LedgerUnavailable` (``force``: asked through an open breaker)."""
        text = push.filled(values_for(Decision.RESERVED.value, reason.value, None, False, None,
                                      self._queues[Decision.RESERVED]))  # fmt: skip
        return self.store.push_fallback(push, publish.job_id, publish.attempt, Decision.RESERVED,
                                        reason, text, record, prev_nonce, label_of(publish),
                                        force)  # fmt: skip

    def _finish(
        self, decision: Decision, reason: Reason, headers: Mapping[str, Any],
        fields: dict[str, Any], *, free: bool = False, window: int | None = None,
        published: bool = False, **extra: Any,
    ) -> Routing:  # fmt: skip
        """Stamp the decided headers (the same values fast publish's script writes) and write
        the decision's one log line."""
        queue = self._queues[decision]
        decided, why = _VALUES[decision], _VALUES[reason]
        dwell = fields.get("dwell_s")
        finite = isinstance(dwell, float) and math.isfinite(dwell)
        # round(x, 6) is the double '%.6f' reads back as: the text gate.lua writes.
        shown = round(dwell, 6) if isinstance(dwell, float) and finite else None
        headers = {**headers, H_DECISION: decided, H_REASON: why, H_DWELL_S: shown,
                   H_FREE_ADMITTED: free, H_WINDOW: window}  # fmt: skip
        line = {**_LINE_DEFAULTS, **fields}
        tokens = fields.get("tokens")
        line["decision"], line["reason"], line["queue"] = decided, why, queue
        line["token_pressure"] = tokens * dwell if finite and tokens is not None else None
        if extra:
            line.update(extra)
        with contextlib.suppress(Exception):  # a closed or full log stream: the route holds
            self.lines.write("warning" if reason in _WARN else "info", "gate_decision", line)
        return Routing(queue, decision, reason, headers, published)


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan
