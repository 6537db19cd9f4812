"""Live flags: settings defaults, overridden in Redis, read at most ``flag_cache_s`` stale.

Precedence (SPEC section 4), so a rollback works whichever way an operator does it:

- ``free_path_enabled`` is false when it is false in the settings **or** in Redis; turning it
  back on needs both.
- ``dwell_gate_enabled`` and ``canary_percent``: a value in Redis overrides the settings until
  it is cleared (``gatekeeper flags unset NAME``).

Every change is appended to the flag log with its reason, actor and time.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import redis

from gatekeeper.core.flagvalues import FLAG_NAMES, Flags, closed_by, in_canary, parse_flag
from gatekeeper.core.health import CleanHour
from gatekeeper.errors import ConfigError, FreePathLocked, LedgerUnavailable
from gatekeeper.forks import renew_in_children
from gatekeeper.redis.breaker import Breaker
from gatekeeper.redis.cluster import home
from gatekeeper.redis.deployment import judge_hour
from gatekeeper.redis.durable import REPLICA_WAIT_S, on_disk, replicated
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import text_of
from gatekeeper.settings import GatekeeperSettings

__all__ = [
    "FLAG_NAMES",
    "STATE_FIELD",
    "FlagChange",
    "FlagStore",
    "Flags",
    "FreePathLocked",
    "in_canary",
    "parse_flag",
]


STATE_FIELD = "initialised_at"
"""The state marker: a field of the flags hash (so one key holds both, and whatever loses the
flags loses the marker with them), written only by ``gatekeeper init``."""
STATE_MISSING = (
    "the gate's state is missing from Redis (lost, flushed, or never initialised): nothing "
    "goes to free until an operator runs `gatekeeper init`"
)
FLAG_LOG_LENGTH = 1000
"""How many flag changes the log keeps."""
UNREAD_RETRY_S = 1.0
"""While the flags have never been read, how soon the next decision tries again."""


@dataclass(frozen=True)
class FlagChange:
    """One entry of the flag log."""

    name: str
    value: str | None
    reason: str
    actor: str
    at: float


def combine(
    settings: GatekeeperSettings, stored: dict[str, str], policy: str | None = None
) -> Flags:
    """Apply SPEC's precedence to the settings and the values stored in Redis; ``policy``,
    the server's ``maxmemory-policy`` (None: not asked), closes the free path unless it is
    ``noeviction``."""
    values: dict[str, Any] = {}
    for name in FLAG_NAMES:
        raw = stored.get(name)
        try:
            values[name] = None if raw is None else parse_flag(name, raw)
        except ConfigError:
            # A corrupt stored value must not open the free path: treat it as "off".
            values[name] = False if name == "free_path_enabled" else None
    gate = values["dwell_gate_enabled"]
    canary = values["canary_percent"]
    missing = STATE_FIELD not in stored
    eviction = None if policy in (None, "noeviction") else policy
    return Flags(
        dwell_gate_enabled=settings.dwell_gate_enabled if gate is None else bool(gate),
        free_path_enabled=settings.free_path_enabled
        and values["free_path_enabled"] is not False
        and not missing
        and eviction is None,
        canary_percent=settings.canary_percent if canary is None else float(canary),
        state_missing=missing,
        eviction=eviction,
    )


class FlagStore:
    """Reads and changes the live flags of one namespace."""

    def __init__(
        self,
        client: redis.Redis,
        settings: GatekeeperSettings,
        keys: Keys | None = None,
        clock: Callable[[], float] = time.monotonic,
        breaker: Breaker | None = None,
    ) -> None:
        self.client = client
        self.breaker = breaker
        self.settings = settings
        self.keys = keys or Keys(settings.key_prefix, settings.namespace)
        self._clock = clock
        self._lock = threading.Lock()
        renew_in_children(self)
        self._cached: Flags | None = None
        self._read_at = -math.inf
        self.disk_wait_s = 0.0
        """How long a write waits for its snapshot (``gatekeeper flags``: 30 s; 0: not at all)."""
        self.persisted = ""
        """How the last write reached the disk (:func:`gatekeeper.redis.durable.on_disk`)."""
        self.replicas = ""
        """``<acknowledged>/<connected>`` replicas of the last write ('': none, or unknown)."""
        self.announce: Callable[[], None] | None = None
        """A deciding process's :func:`gatekeeper.redis.deployment.announcer`, called after
        each read that succeeds (it writes at most once a minute)."""

    def stored(self) -> dict[str, str]:
        """The overrides in Redis, as text; :class:`LedgerUnavailable` at once while the
        breaker is open (:meth:`current` then keeps the flags it has)."""
        if self.breaker is not None:
            self.breaker.check("cannot read flags")
        try:
            raw = self.client.hgetall(self.keys.flags)
        except redis.RedisError as exc:
            if self.breaker is not None:
                self.breaker.failed(exc)
            raise LedgerUnavailable(f"cannot read flags: {exc}") from exc
        return {text_of(k): text_of(v) for k, v in raw.items()}

    def eviction_policy(self) -> str:
        """The server's ``maxmemory-policy`` (from ``INFO``: managed Redis often disables
        ``CONFIG``), ``unknown`` when it does not say; on a Redis Cluster, the policy of the
        primary that serves the namespace's slot (it holds every key of the namespace)."""
        try:
            policy = (
                home(self.client, self.keys.flags, fresh=True)
                .info("memory")
                .get("maxmemory_policy")
            )
        except redis.RedisError as exc:
            if self.breaker is not None:
                self.breaker.failed(exc)
            raise LedgerUnavailable(f"cannot read INFO memory: {exc}") from exc
        return str(policy) if policy else "unknown"

    def current(self) -> Flags:
        """The flags in force, at most ``flag_cache_s`` old.

        When Redis cannot be read the last flags read stay in force (stale beats absent);
        before any read has succeeded the settings are returned with ``unread`` set.
        """
        now = self._clock()
        cached = self._cached  # fresh most of the time: no lock to read it
        if cached is not None and now - self._read_at < self.settings.flag_cache_s:
            return cached
        with self._lock:
            if self._cached is not None and now - self._read_at < self.settings.flag_cache_s:
                return self._cached
            try:
                flags = combine(self.settings, self.stored(), self.eviction_policy())
                if self.announce is not None:
                    self.announce()  # (once a minute: deployment.py)
            except LedgerUnavailable as exc:
                cached, why = self._cached, str(exc)  # (stale: not read now; unread: never)
                flags = replace(cached, stale=why) if cached else replace(
                    combine(self.settings, {STATE_FIELD: "unread"}), unread=why)  # fmt: skip
                # Retry after one cache interval, not on every publish; while never read or
                # stale, within UNREAD_RETRY_S, so that Redis back means the flags back.
            read_at = now
            if flags.unread is not None or flags.stale is not None:
                read_at -= max(0.0, self.settings.flag_cache_s - UNREAD_RETRY_S)
            self._cached, self._read_at = flags, read_at
            return flags

    def _forked(self) -> None:
        """In a forked child: a lock of its own (the parent's may be held mid-read)."""
        self._lock = threading.Lock()

    def invalidate(self) -> None:
        """Forget the cached flags (the next decision reads Redis)."""
        with self._lock:
            self._cached, self._read_at = None, -math.inf

    def set(
        self, name: str, value: str, reason: str, actor: str, now: float, force: bool = False
    ) -> FlagChange:
        """Store an override and log it; re-opening the free path needs a clean hour or force."""
        parsed = parse_flag(name, value)
        text = str(parsed).lower() if isinstance(parsed, bool) else repr(parsed)
        if name == "free_path_enabled" and parsed is True:
            return self._write(name, text, reason, actor, now,
                               lambda: self._reopen_reason(reason, now, force))  # fmt: skip
        return self._write(name, text, reason, actor, now)

    def close(self, reason: str, actor: str, now: float) -> FlagChange | None:
        """The auto-freeze: ``free_path_enabled=false`` in Redis, counted in the totals'
        ``freezes``, unless Redis has it false already (None). Checked under WATCH, so workers
        that freeze at once write, log and count one freeze."""

        def unless_closed() -> str:
            if closed_by(self.stored()):
                raise _Closed
            return reason

        name = "free_path_enabled"
        try:
            for _ in range(2):  # FreePathLocked: the flags changed meanwhile; read them again
                with contextlib.suppress(FreePathLocked):
                    return self._write(name, "false", reason, actor, now, unless_closed, "freezes")
        except _Closed:
            return None
        return self._write(name, "false", reason, actor, now, None, "freezes")

    def unset(
        self, name: str, reason: str, actor: str, now: float, force: bool = False
    ) -> FlagChange:
        """Remove an override: the settings decide again (a clean hour to lift a freeze)."""
        parse_flag(name, "0")  # validates the name
        if name != "free_path_enabled":
            return self._write(name, None, reason, actor, now)

        def checked() -> str:  # lifting a rollback or a freeze is a re-open
            closed = closed_by(self.stored())
            return self._reopen_reason(reason, now, force) if closed else reason

        return self._write(name, None, reason, actor, now, checked)

    def clean_hour(self, now: float) -> CleanHour:
        """Whether the last hour of ledger windows is clean, judged with the deployment's
        ``window_seconds`` and ``budget_units`` (:func:`gatekeeper.redis.deployment.judge_hour`)."""
        return judge_hour(self.client, self.keys, self.settings, self.stored(), STATE_FIELD, now)

    def _reopen_reason(self, reason: str, now: float, force: bool) -> str:
        verdict = self.clean_hour(now)
        if verdict.clean:
            return f"{reason} ({verdict.reason})"
        if not force:
            raise FreePathLocked(
                f"free_path_enabled stays false: {verdict.reason}; wait for a clean ledger hour "
                "or pass --force"
            )
        return f"{reason} (forced: {verdict.reason})"

    def initialise(
        self, reason: str, actor: str, now: float, open_path: bool = False
    ) -> FlagChange | None:
        """Write the state marker (``gatekeeper init``); None when it is there already.

        Not a re-open: the free path is closed first (``free_path_enabled=false`` in Redis),
        so it opens again only through ``flags set free_path_enabled true``, which needs a
        clean hour of windows recorded after this (or ``--force``). ``open_path`` (``init
        --open``: a new deployment, or an upgrade whose state is intact) leaves it open, and
        the flag log says so."""
        if STATE_FIELD in self.stored():
            return None
        if open_path:
            reason = f"{reason} (opened at init: --open)"
        else:  # closed before the marker exists, so no publish sees the path open between
            self._write("free_path_enabled", "false", f"{reason} (closed at init: a re-open "
                        "needs a clean hour of windows recorded after it)", actor, now)  # fmt: skip
        return self._write(STATE_FIELD, repr(now), reason, actor, now)

    def _write(
        self, name: str, value: str | None, reason: str, actor: str, now: float,
        check: Callable[[], str] | None = None, counted: str | None = None,
    ) -> FlagChange:  # fmt: skip
        """Write one flag and its log entry (and count ``counted`` in the ``totals``) in one
        transaction. ``check`` (a re-open, the auto-freeze): run once the flags are watched,
        it gives the reason written or raises, so nothing is written over a flag changed
        meanwhile (a rollback undone by a re-open, two workers' freezes counted twice)."""
        try:
            server = home(self.client, self.keys.flags, fresh=True)  # a cluster's MULTI
            with server.pipeline(transaction=True) as pipe:  # reset (un-WATCHed) on the way out
                if check is not None:
                    pipe.watch(self.keys.flags)  # type: ignore[no-untyped-call]
                    reason = check()  # raises FreePathLocked when it may not re-open
                    pipe.multi()
                change = FlagChange(name=name, value=value, reason=reason, actor=actor, at=now)
                if value is None:
                    pipe.hdel(self.keys.flags, name)
                else:
                    pipe.hset(self.keys.flags, name, value)
                pipe.lpush(self.keys.flags_log, json.dumps(change.__dict__))
                pipe.ltrim(self.keys.flags_log, 0, FLAG_LOG_LENGTH - 1)
                if counted is not None:
                    pipe.hincrby(self.keys.totals, counted, 1)
                pipe.execute()
        except redis.WatchError as exc:
            raise FreePathLocked(
                f"{name} not re-opened: the flags changed while the re-open was checked "
                "(another operator, or an auto-freeze); nothing was written: see `gatekeeper "
                "flags` and run it again"
            ) from exc
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot write flag {name}: {exc}") from exc
        self.invalidate()
        waits = min(self.disk_wait_s, REPLICA_WAIT_S)  # (a worker's: 0, the timeout)
        shared = replicated(server, max(self.settings.redis_timeout_s, waits))
        self.replicas = f"{shared[0]}/{shared[1]}" if shared else ""
        try:  # best effort: never fails a write that was made
            self.persisted = on_disk(server, self.disk_wait_s, wait=self.disk_wait_s > 0)
        except Exception as exc:  # a thread that cannot start, say
            self.persisted = f"unknown: {exc}"
        return change

    def history(self, limit: int = 20) -> list[FlagChange]:
        """The newest flag changes first."""
        try:
            raw = self.client.lrange(self.keys.flags_log, 0, limit - 1)
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot read the flag log: {exc}") from exc
        changes = []
        for item in raw:  # an entry gatekeeper did not write is left out of the history
            with contextlib.suppress(ValueError, TypeError):
                changes.append(FlagChange(**json.loads(text_of(item))))
        return changes


class _Closed(Exception):  # the free path is closed in Redis already: no auto-freeze
    pass
