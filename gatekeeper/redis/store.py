"""The gate's side of Redis: the decision script, its fallback, and what the publish path
writes besides (in-process decisions' records, released admissions).

Every redis-py error is wrapped at this boundary in :class:`~gatekeeper.errors.LedgerUnavailable`,
which the publish hook turns into a fail-closed route to reserved. With a
:class:`~gatekeeper.redis.breaker.Breaker`, a call that got no answer opens it, and the publish
path's calls then fail at once, without a socket, until its probe finds Redis back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.core.whatif import FIELDS, NOTHING_KNOWN
from gatekeeper.defaults import (
    DECISION_RECORD_CAP,
    QUEUE_AGE_HORIZON_S,
    RECORD_RETENTION_S,
    WINDOW_RETENTION_S,
)
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.breaker import Breaker
from gatekeeper.redis.call import DECISIONS, REASONS, GateCall, ScoredAttempt
from gatekeeper.redis.cluster import is_cluster
from gatekeeper.redis.keys import DEFERRED_CAP, OTHER_TASK, Keys
from gatekeeper.redis.numbers import exact
from gatekeeper.redis.push import Push
from gatekeeper.redis.scripts import evalsha, load_lua, text_of
from gatekeeper.redis.wire import Line

__all__ = ["GateCall", "GateStore", "ScoredAttempt"]

RERUN = 22
"""Index of gate.lua's ARGV[23], the request-may-have-run flag, in the argument list."""
NO_ANSWER = (redis.ConnectionError, redis.TimeoutError)
"""What a request that may have run raises (sent, and its reply never read)."""


class GateStore:
    """Gatekeeper's state in one Redis, as the publish path uses it."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        horizon_s: float = QUEUE_AGE_HORIZON_S,
        retention_s: int = WINDOW_RETENTION_S,
        record_ttl_s: int = RECORD_RETENTION_S,
        breaker: Breaker | None = None,
        decision_record_cap: int = DECISION_RECORD_CAP,
    ) -> None:
        self.client = client
        self.breaker = breaker
        self.keys = keys
        self.horizon_s = horizon_s
        self.retention_s = retention_s
        self.record_ttl_s = record_ttl_s
        self.record_cap = str(decision_record_cap)
        self._gate: Script = client.register_script(load_lua("gate.lua"))
        self._record: Script = client.register_script(load_lua("record.lua"))
        self._release: Script = client.register_script(load_lua("release.lua"))
        self._fallback: Script = client.register_script(load_lua("fallback.lua"))
        self._line = Line()
        # No line of its own (a socket to one server) on a cluster, nor for a client of one
        # connection (redis-py's single_connection_client) or with no pool.
        self._direct = is_cluster(client) or getattr(client, "connection", None) is not None
        self._direct |= getattr(client, "connection_pool", None) is None
        self._fixed_args: tuple[tuple[Any, ...], tuple[str, ...]] | None = None

    def _records(self, job_id: str, attempt: int) -> list[str]:
        """This attempt's record key and the previous attempt's (the same key for attempt 1)."""
        mine = self.keys.run(job_id, attempt)
        return [mine, self.keys.run(job_id, attempt - 1) if attempt > 1 else mine]

    def gate_call(self, call: GateCall) -> tuple[list[str], list[str]]:
        """The gate script's keys and arguments (documented at the top of gate.lua)."""
        keys = [self.keys.free_waiting, self.keys.window(call.window_id),
                self.keys.window_rows(call.window_id), self.keys.inflight, self.keys.flags,
                *self._records(call.job_id, call.attempt), self.keys.totals,
                self.keys.deferred, self.keys.decisions]  # fmt: skip
        cap, budget, unit, mode, horizon, retention, ttl, allowance, most = self._fixed(call)
        args = [
            repr(call.now_s * 1000),
            f"{call.job_id}:{call.attempt}",
            exact(call.expected_service_s),
            exact(call.retry_tax_s),
            exact(call.deadline_slack_s),
            cap,
            str(call.tokens_in),
            budget,
            unit,
            mode,
            horizon,
            retention,
            call.job_id,
            str(call.attempt),
            str(_ms(call.deadline_slack_s)),
            exact(call.delay_s),
            str(call.window_id),
            call.nonce,
            str(_ms(call.published_s)),
            ttl,
            str(_ms(call.deadline_s)),
            str(_ms(call.now_s + call.delay_s)),
            "0",  # rerun: set where the request may have run already (_reply_now, Scoring)
            call.prev_nonce,
            allowance,
            call.task,
            most,
            call.publisher,
            self.record_cap,
        ]
        if call.push is not None:  # fast publish: the script pushes the decided message too
            keys += call.push.lists
            args += [*call.push.queues, *call.push.pieces]
        return keys, args

    def _fixed(self, call: GateCall) -> tuple[str, ...]:
        """The arguments that come from settings, as text: formatted once per value."""
        key = (call.max_queue_age_s, call.budget_units, call.queue_wait_unit_per_second,
               call.budget_mode, call.wait_allowance_s)  # fmt: skip
        if self._fixed_args is None or self._fixed_args[0] != key:
            self._fixed_args = (key, (
                exact(call.max_queue_age_s), exact(call.budget_units),
                exact(call.queue_wait_unit_per_second), call.budget_mode.value,
                repr(self.horizon_s * 1000), str(self.retention_s), str(self.record_ttl_s),
                repr(float(call.wait_allowance_s * call.queue_wait_unit_per_second)),
                str(DEFERRED_CAP),
            ))  # fmt: skip
        return self._fixed_args[1]

    def score(self, call: GateCall) -> ScoredAttempt:
        """Run the gate script: age cap, dwell against slack, then the budget, atomically.

        It goes through this thread's own connection (:mod:`gatekeeper.redis.wire`); cluster
        and single-connection clients, and a call made while that connection awaits a reply
        (a signal handler publishing mid-decision), go through redis-py. Raises
        :class:`LedgerUnavailable` when Redis or the script fails, or the breaker is open.
        """
        if self.breaker is not None:
            self.breaker.check("gate script")
        keys, args = self.gate_call(call)
        if self._direct:
            return self._gate_reply(self._reply_now(keys, args))
        channel = self._line.take(self.client.connection_pool)
        if channel is None:
            return self._gate_reply(self._reply_now(keys, args))
        try:
            channel.send(["EVALSHA", self._gate.sha, str(len(keys)), *keys, *args])
            reply = channel.read()
            if not (isinstance(reply, list) and len(reply) == 6):
                # Not gate.lua's answer: this channel is out of step with its replies.
                raise redis.ResponseError(f"unexpected reply {reply!r}")
            if channel.known is not None:  # answered here: a later call may be read later
                channel.known.add(self._gate.sha)
        except NoScriptError:  # a restarted or flushed Redis: load it and call again
            reply = self._reply_now(keys, args, load=True)
        except redis.RedisError as exc:
            channel.close()
            reply = exc
        except BaseException:
            channel.close()  # the reply may still be on its way: never reuse the socket
            raise
        finally:
            channel.release()
        return self._gate_reply(reply)

    def _answer(self, keys: list[str], args: list[str], reply: Any) -> Any:
        if isinstance(reply, NoScriptError):  # a restarted or flushed Redis
            reply = self._reply_now(keys, args, load=True)
        try:
            return self._gate_reply(reply)
        except LedgerUnavailable as exc:
            return exc

    def _reply_now(self, keys: list[str], args: list[str], load: bool = False) -> Any:
        """The gate script's reply through redis-py, or the Redis error instead of raising it.

        ``load``: the server just said it does not have the script, so load it first.
        """
        args = [*args[:RERUN], "1", *args[RERUN + 1 :]]
        try:
            if load:
                self.client.script_load(self._gate.script)
            return evalsha(self.client, self._gate, keys, args)
        except redis.RedisError as exc:
            return exc

    def _gate_reply(self, reply: Any) -> ScoredAttempt:
        if isinstance(reply, redis.RedisError):
            if self.breaker is not None:
                self.breaker.failed(reply)
            raise LedgerUnavailable(f"gate script failed: {reply}") from reply
        try:
            decision, reason, age, dwell, projected, free = reply
            return ScoredAttempt(
                decision=DECISIONS[decision],
                reason=REASONS[reason],
                queue_age_s=float(age),
                dwell_s=float(dwell),
                projected_tax=float(projected),
                free_admitted=text_of(free) == "1",
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise LedgerUnavailable(f"gate script replied {reply!r}") from exc

    def record_decision(
        self,
        window_id: int,
        job_id: str,
        attempt: int,
        decision: Decision,
        reason: Reason,
        marks: tuple[bool, bool],
        record: dict[str, str],
        prev_nonce: str = "",
        task: str = OTHER_TASK,
        inputs: Mapping[str, str] | None = None,
    ) -> bool | None:
        """Count a decision made in process, keep its decision record (``inputs``: the
        fields of :data:`~gatekeeper.core.whatif.FIELDS` it knows) and write the gate's
        record of the attempt (``record.lua``); returns the record's ``free_admitted``, None
        when it was not recorded (Redis failed or the breaker is open, a bad input, or
        another publish of the attempt holds a live record): the decision stands, and its
        row will be unverified."""
        if self.breaker is not None and self.breaker.is_open:
            return None
        self._line.settle()  # a gate call of this thread's still unanswered runs first
        keys = [self.keys.window(window_id), *self._records(job_id, attempt), self.keys.totals,
                self.keys.deferred, self.keys.decisions]  # fmt: skip
        member = f"{job_id}:{attempt}"
        args = [decision.value, reason.value, "1" if marks[0] else "0", "1" if marks[1] else "0",
                str(self.retention_s), str(self.record_ttl_s), prev_nonce, task,
                str(DEFERRED_CAP), member, self.record_cap]  # fmt: skip
        values = {"p": NOTHING_KNOWN, **(inputs or {}), "d": decision.value, "r": reason.value,
                  "j": member, "k": task}  # fmt: skip
        args += [values.get(name, "") for name in FIELDS]
        for name, value in record.items():
            args += [name, value]
        try:
            free = text_of(evalsha(self.client, self._record, keys, args))
        except redis.RedisError as exc:
            if self.breaker is not None:
                self.breaker.failed(exc)
            return None
        return None if free == "unrecorded" else free == "1"

    def push_fallback(
        self, push: Push, job_id: str, attempt: int, decision: Decision, reason: Reason,
        text: str, record: dict[str, str], prev_nonce: str = "", task: str = OTHER_TASK,
        force: bool = False,
    ) -> tuple[Decision, Reason] | None:  # fmt: skip
        """Push a fast publish's message that gate.lua did not push, as ``text``; None when
        pushed now, else (decision, reason) of the push this request already made.

        ``fallback.lua`` checks and pushes in one step, keyed by the request's nonce, so it
        is sent again after a connection error or a timeout (once here, besides the client's
        own retry policy), and a stalled gate.lua that runs later pushes nothing. Raises
        :class:`LedgerUnavailable` when it failed, and at once while the breaker is open,
        unless this request's own gate script opened it (it finishes its push, as before),
        or ``force`` (a held message's last tries at exit).
        """
        breaker = self.breaker
        if breaker is not None and not breaker.opened_here() and not force:
            breaker.check(f"cannot push {job_id}")
        index = {Decision.ADMIT_FREE: 0, Decision.DEFER: 1, Decision.RESERVED: 2}[decision]
        keys = [self.keys.run(job_id, attempt), push.lists[index], self.keys.totals]
        args = [push.nonce, decision.value, reason.value, text, str(self.record_ttl_s),
                prev_nonce, task]  # fmt: skip
        for name, value in record.items():
            args += [name, value]
        try:
            try:
                reply = evalsha(self.client, self._fallback, keys, args)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if breaker is not None:
                    breaker.failed(exc)
                reply = evalsha(self.client, self._fallback, keys, args)  # safe: the nonce
        except redis.RedisError as exc:
            if breaker is not None:
                breaker.failed(exc)
                breaker.opened_here()  # asked: this thread's next push is refused, not tried
            raise LedgerUnavailable(f"cannot push {job_id}: {exc}") from exc
        if breaker is not None:
            breaker.answered()
            breaker.opened_here()  # asked: a mark its retry left is not the next push's
        if not reply:
            return None
        return DECISIONS.get(reply[0], Decision.RESERVED), REASONS.get(
            reply[1], Reason.GATE_UNAVAILABLE
        )

    def release(
        self, job_id: str, attempt: int, window_id: int, *, unpublished: bool = False
    ) -> int:
        """Give back an admitted attempt's exposure (it will not run); returns the tokens.

        To the window its in-flight entry names (``window_id`` only for an entry that names
        none, an older version's); a window gone past its retention is not written again.
        ``unpublished``: the message never reached the broker, so the admission is taken back
        from the window's ``admitted_free`` too. Raises :class:`LedgerUnavailable` when it
        failed, and at once while the breaker is open.
        """
        member = f"{job_id}:{attempt}"
        if self.breaker is not None:
            self.breaker.check(f"cannot release {member}")
        self._line.settle()  # a gate call of this thread's still unanswered runs first
        keys = [self.keys.inflight, self.keys.free_waiting, self.keys.window(window_id),
                self.keys.run(job_id, attempt)]  # fmt: skip
        args = [member, "1" if unpublished else "0"]
        try:
            return int(float(evalsha(self.client, self._release, keys, args)))
        except redis.RedisError as exc:
            if self.breaker is not None:
                self.breaker.failed(exc)
            raise LedgerUnavailable(f"cannot release {member}: {exc}") from exc


def _ms(seconds: float) -> int:
    """Seconds as whole milliseconds; 0 for a value that is not finite (the script fails
    such a decision closed before it uses the number)."""
    return round(seconds * 1000) if math.isfinite(seconds) else 0
