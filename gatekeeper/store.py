"""The Redis adapter: gatekeeper's scripts, registered once per client, and what they return.

Every redis-py error is wrapped at this boundary in :class:`~gatekeeper.errors.LedgerUnavailable`,
which the publish hook turns into a fail-closed route to reserved.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from gatekeeper.dwell import Decision, Reason
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.fastpath import Push
from gatekeeper.keys import DEFAULT_WINDOW_RETENTION_S, Keys
from gatekeeper.ledger import BudgetMode
from gatekeeper.review import DEFER_FIT, RESERVED_AGE_SHIFT
from gatekeeper.wire import Borrowed, Line

__all__ = [
    "DEFAULT_QUEUE_AGE_HORIZON_S",
    "GateStore",
    "PendingScore",
    "ScoredAttempt",
    "evalsha",
    "load_lua",
    "read_windows",
    "text_of",
]

DEFAULT_QUEUE_AGE_HORIZON_S = 300.0
"""A waiting entry older than this no longer counts toward the free queue's age (purged queues)."""

FAST_KEY_TTL_S = 300
"""How long ``fast:<job_id>:<attempt>`` is kept (gate.lua writes the same number): both of
its uses, a re-sent request and the look-up after a lost reply, happen within the publish."""


@cache
def load_lua(name: str) -> str:
    """The text of ``gatekeeper/lua/<name>``."""
    return resources.files("gatekeeper").joinpath("lua").joinpath(name).read_text(encoding="utf-8")


def evalsha(
    client: redis.Redis, script: Script, keys: list[str], args: Sequence[str | bytes]
) -> Any:
    """EVALSHA without redis-py's per-call Script wrapper; loads the script when missing."""
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        client.script_load(script.script)
        return client.evalsha(script.sha, len(keys), *keys, *args)


@dataclass(frozen=True)
class ScoredAttempt:
    """What the gate script decided for one attempt."""

    decision: Decision
    reason: Reason
    queue_age_s: float
    dwell_s: float
    projected_tax: float


_DECISIONS: dict[bytes | str, Decision] = {
    **{d.value: d for d in Decision},
    **{d.value.encode(): d for d in Decision},
}
_REASONS: dict[bytes | str, Reason] = {
    **{r.value: r for r in Reason},
    **{r.value.encode(): r for r in Reason},
}
"""The script's replies (bytes, or text from a decoding client) to the core's enums."""


class PendingScore:
    """A gate-script call on its way: :meth:`result` reads the reply (once).

    Holds its channel (:mod:`gatekeeper.wire`) from the send to the read, so no other call
    can take the reply; :meth:`result` hands it back whatever happens.
    """

    def __init__(self, store: GateStore, channel: Line | Borrowed | None, sent: Any) -> None:
        self._store = store
        self._channel = channel
        self._sent = sent
        """(keys, args) while the reply is unread; else the reply or the error."""

    def result(self) -> ScoredAttempt:
        """The decision; raises :class:`LedgerUnavailable` as :meth:`GateStore.score` does."""
        channel = self._channel
        if channel is not None:
            keys, args = self._sent
            self._channel = None
            try:
                self._sent = channel.read()
                if not (isinstance(self._sent, list) and len(self._sent) == 5):
                    # Not gate.lua's answer: this channel is out of step with its replies.
                    raise redis.ResponseError(f"unexpected reply {self._sent!r}")
            except NoScriptError:  # a restarted or flushed Redis: load it and call again
                self._sent = None
            except redis.RedisError as exc:
                channel.close()
                self._sent = exc
            except BaseException:
                channel.close()  # the reply may still be on its way: never reuse the socket
                raise
            finally:
                channel.release()
            if self._sent is None:
                self._sent = self._store._reply_now(keys, args, load=True)
        return self._store._gate_reply(self._sent)


class GateStore:
    """Gatekeeper's state in one Redis: the free queue's waiting set and the ledger windows."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        horizon_s: float = DEFAULT_QUEUE_AGE_HORIZON_S,
        retention_s: int = DEFAULT_WINDOW_RETENTION_S,
    ) -> None:
        self.client = client
        self.keys = keys
        self.horizon_s = horizon_s
        self.retention_s = retention_s
        self._gate: Script = client.register_script(load_lua("gate.lua"))
        self._release: Script = client.register_script(load_lua("release.lua"))
        self._fallback: Script = client.register_script(load_lua("fallback.lua"))
        self._line = Line()

    def score(self, **inputs: Any) -> ScoredAttempt:
        """Run the gate script: age cap, dwell against slack, then the budget, atomically.

        ``inputs`` are :meth:`_gate_call`'s keyword arguments.
        """
        return self.start_score(**inputs).result()

    def _gate_call(
        self,
        *,
        now_s: float,
        window_id: int,
        job_id: str,
        attempt: int,
        expected_service_s: float,
        retry_tax_s: float,
        deadline_slack_s: float,
        max_queue_age_s: float,
        tokens_in: int,
        budget_units: float,
        queue_wait_unit_per_second: float,
        budget_mode: BudgetMode,
        deadline_slack_ms: int,
        delay_s: float = 0.0,
        push: Push | None = None,
    ) -> tuple[list[str], list[str]]:
        """The gate script's keys and arguments (documented at the top of gate.lua)."""
        keys = [
            self.keys.free_waiting,
            self.keys.window(window_id),
            self.keys.window_rows(window_id),
            self.keys.inflight,
            self.keys.flags,
        ]
        args = [
            repr(now_s * 1000),
            f"{job_id}:{attempt}",
            repr(float(expected_service_s)),
            repr(float(retry_tax_s)),
            repr(float(deadline_slack_s)),
            repr(float(max_queue_age_s)),
            str(tokens_in),
            repr(float(budget_units)),
            repr(float(queue_wait_unit_per_second)),
            budget_mode.value,
            repr(self.horizon_s * 1000),
            str(self.retention_s),
            job_id,
            str(attempt),
            str(deadline_slack_ms),
            repr(float(delay_s)),
            str(window_id),
        ]
        if push is not None:  # fast publish: the script pushes the decided message too
            keys += [*push.lists, self.keys.fast(job_id, attempt)]
            args += [push.nonce, *push.queues, *push.pieces]
        return keys, args

    def start_score(self, **inputs: Any) -> PendingScore:
        """Send the gate script with :meth:`score`'s inputs and return before its reply.

        The caller does other work while Redis runs the script, then calls
        :meth:`PendingScore.result`: the round trip overlaps that work instead of adding to it.
        Still one ``EVALSHA`` per decision. Clients that cannot lend a connection (a
        single-connection client) get the synchronous call, already finished.
        """
        keys, args = self._gate_call(**inputs)
        pool = getattr(self.client, "connection_pool", None)
        if pool is None or getattr(self.client, "connection", None) is not None:
            # A cluster client (no single pool) or a single-connection client: its own call.
            return PendingScore(self, None, self._reply_now(keys, args))
        channel: Line | Borrowed | None = None
        try:
            channel = self._line.take(pool)
            if channel is None:
                channel = Borrowed(pool)
            channel.send(["EVALSHA", self._gate.sha, str(len(keys)), *keys, *args])
        except BaseException as exc:
            if channel is not None:  # half a request may be on the socket
                channel.close()
                channel.release()
            if isinstance(exc, redis.RedisError):
                return PendingScore(self, None, exc)
            raise
        return PendingScore(self, channel, (keys, args))

    def _reply_now(self, keys: list[str], args: list[str], load: bool = False) -> Any:
        """The gate script's reply, or the Redis error instead of raising it.

        ``load``: the server just said it does not have the script, so load it first.
        """
        try:
            if load:
                self.client.script_load(self._gate.script)
            return evalsha(self.client, self._gate, keys, args)
        except redis.RedisError as exc:
            return exc

    def _gate_reply(self, reply: Any) -> ScoredAttempt:
        if isinstance(reply, redis.RedisError):
            raise LedgerUnavailable(f"gate script failed: {reply}") from reply
        try:
            decision, reason, age, dwell, projected = reply
            return ScoredAttempt(
                decision=_DECISIONS[decision],
                reason=_REASONS[reason],
                queue_age_s=float(age),
                dwell_s=float(dwell),
                projected_tax=float(projected),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise LedgerUnavailable(f"gate script replied {reply!r}") from exc

    def count_decision(
        self, window_id: int, decision: str, reason: str, marks: tuple[bool, bool]
    ) -> None:
        """Count a decision made in process (the gate script counts the ones it makes)."""
        key = self.keys.window(window_id)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hincrby(key, f"decided:{decision}:{reason}", 1)
            if marks[0]:
                pipe.hincrby(key, DEFER_FIT, 1)
            if marks[1]:
                pipe.hincrby(key, RESERVED_AGE_SHIFT, 1)
            pipe.expire(key, self.retention_s)
            pipe.execute()
        except redis.RedisError:
            pass  # the decision stands; only the review loses one count

    def push_fallback(
        self, push: Push, job_id: str, attempt: int, decision: str, reason: str, queue: str
    ) -> tuple[Decision, str] | None:
        """Push a fast publish's message that gate.lua did not push, decided here; None when
        pushed now, else (decision, reason) of the push this request already made.

        ``fallback.lua`` checks and pushes in one step, keyed by the request's nonce, so it
        is sent again after a connection error or a timeout (once here, besides the client's
        own retry policy), and a stalled gate.lua that runs later pushes nothing. Raises
        :class:`LedgerUnavailable` when it failed.
        """
        target = push.lists[push.queues.index(queue)]
        keys = [self.keys.fast(job_id, attempt), target]
        args = [push.nonce, decision, reason, push.filled(decision, reason, queue)]
        args.append(str(FAST_KEY_TTL_S))
        try:
            try:
                reply = evalsha(self.client, self._fallback, keys, args)
            except (redis.ConnectionError, redis.TimeoutError):
                reply = evalsha(self.client, self._fallback, keys, args)  # safe: the nonce
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot push {job_id}: {exc}") from exc
        return _pushed_by(reply, push.nonce)

    def release(
        self, job_id: str, attempt: int, window_id: int, *, unpublished: bool = False
    ) -> int:
        """Give back an admitted attempt's exposure (it will not run); returns the tokens.

        ``unpublished``: the message never reached the broker, so the admission is taken back
        from the window's ``admitted_free`` too.
        """
        member = f"{job_id}:{attempt}"
        keys = [self.keys.inflight, self.keys.free_waiting, self.keys.window(window_id)]
        args = [member, "1" if unpublished else "0"]
        try:
            return int(float(evalsha(self.client, self._release, keys, args)))
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot release {member}: {exc}") from exc

    def attempt_started(self, job_id: str, attempt: int) -> None:
        """A free attempt has started: it no longer holds the free queue's age up."""
        try:
            self.client.zrem(self.keys.free_waiting, f"{job_id}:{attempt}")
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot update the free queue's waiting set: {exc}") from exc

    def window_rows(self, window_id: int) -> list[dict[str, Any]]:
        """The rows stored for one window, oldest first."""
        try:
            raw = self.client.lrange(self.keys.window_rows(window_id), 0, -1)
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot read window {window_id}: {exc}") from exc
        return [json.loads(text_of(item)) for item in raw]

    def windows(self, ids: Iterable[int]) -> list[dict[str, str]]:
        """The window hashes as text (``tax_units``, ``exposure``, counters), one round trip."""
        return read_windows(self.client, self.keys, ids)


def read_windows(client: redis.Redis, keys: Keys, ids: Iterable[int]) -> list[dict[str, str]]:
    """Window hashes as text, in the order of ``ids``, in one pipelined round trip."""
    try:
        pipe = client.pipeline(transaction=False)
        for ident in ids:
            pipe.hgetall(keys.window(ident))
        raw = pipe.execute()
    except redis.RedisError as exc:
        raise LedgerUnavailable(f"cannot read the ledger windows: {exc}") from exc
    return [{text_of(k): text_of(v) for k, v in fields.items()} for fields in raw]


def text_of(value: bytes | str | int | float) -> str:
    """A Redis reply as text (replies are bytes unless the client decodes them)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _pushed_by(raw: Any, nonce: str) -> tuple[Decision, str] | None:
    """(decision, reason) from ``fast:<job_id>:<attempt>`` when ``nonce``'s request wrote it
    (a value it cannot read counts as reserved: the message was pushed all the same)."""
    if raw is None:
        return None
    owner, _, rest = text_of(raw).partition("|")
    if owner != nonce:
        return None  # another publish of the same task id and attempt
    decision, _, reason = rest.partition("|")
    return _DECISIONS.get(decision, Decision.RESERVED), reason
