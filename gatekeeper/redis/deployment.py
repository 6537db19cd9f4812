"""What the deciding processes run with: their ``window_seconds`` and ``budget_units`` in Redis.

The on-call's commands run in a shell whose settings need not be the deployment's (no
``GATEKEEPER_WINDOW_SECONDS`` there, another ``budget_units``). A clean hour judged with a
shell's own values reads other windows than the gate writes (and an empty window is clean),
or holds them to another budget, so ``flags set free_path_enabled true`` could re-open the free
path over an hour that is not clean.

So every process that publishes through the app's gate keeps the pair it decides with in
``gatekeeper:{ns}:deployment`` (:func:`announcer`): field ``<window_seconds>|<budget_units>``,
value ``<last seen, Unix s>|<host>:<pid>``, written at its first read of the flags and again at
most every :data:`ANNOUNCE_EVERY_S` (so a key deleted or lost is back within a minute of the
next publish), warning ``deployment_settings_differ`` once per other pair seen within the hour.
The clean hour is judged under every pair seen within it (:func:`judge_hour`): a one-off
process with a shell's settings, or a ``window_seconds`` changed within the hour, adds a pair
and hides none. With no pair seen within the hour the latest one judges, and with none at all
the shell's values (an upgrade from a version that wrote none), each verdict saying which.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from gatekeeper.core.health import CleanHour, WindowHealth, clean_hour, hour_windows
from gatekeeper.core.ledger import window_id
from gatekeeper.errors import ConfigError, LedgerUnavailable
from gatekeeper.redis.breaker import Breaker
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import read_windows
from gatekeeper.settings import GatekeeperSettings

__all__ = ["ANNOUNCE_EVERY_S", "Seen", "announcer", "differs", "judge_hour", "latest", "recorded"]

ANNOUNCE_EVERY_S = 60.0
"""How often a deciding process writes its pair again (at a read of the flags)."""
FORGET_AFTER_S = 86_400.0
"""A pair not seen for this long is deleted by the next process that writes its own."""
HOUR_S = 3600.0


@dataclass(frozen=True)
class Seen:
    """One pair of values a deciding process ran with, and who wrote it last, when."""

    window_seconds: int
    budget_units: float
    at: float
    by: str = "?"

    @property
    def field(self) -> str:
        return f"{self.window_seconds}|{self.budget_units!r}"

    @property
    def value(self) -> str:
        return f"{self.at!r}|{self.by}"

    def values(self) -> str:
        return f"window_seconds={self.window_seconds} budget_units={self.budget_units!r}"

    def said(self) -> str:
        """The values and where they come from, for a command's output."""
        try:
            when = datetime.fromtimestamp(self.at, tz=timezone.utc).isoformat(timespec="seconds")
        except (ValueError, OverflowError, OSError):
            when = "an unknown time"
        return f"{self.values()} (last written by {self.by} at {when})"

    def seen_within_hour_of(self, now: float) -> bool:
        """Its windows reach into the hour a clean hour reads (with a write's period of slack)."""
        first = hour_windows(window_id(now, self.window_seconds), self.window_seconds)[0]
        return self.at >= first * self.window_seconds - ANNOUNCE_EVERY_S

    @classmethod
    def mine(cls, settings: GatekeeperSettings, now: float) -> Seen:
        return cls(settings.window_seconds, settings.budget_units, now,
                   f"{socket.gethostname()}:{os.getpid()}")  # fmt: skip

    @classmethod
    def parse(cls, field: bytes | str, value: bytes | str) -> Seen:
        """One field of the hash; :class:`ConfigError` names what is not usable."""
        name, text = _text(field), _text(value)
        seconds_text, _, budget_text = name.partition("|")
        at_text, _, by = text.partition("|")
        try:
            seconds, budget, at = int(seconds_text), float(budget_text), float(at_text)
        except ValueError:
            seconds, budget, at = 0, math.nan, math.nan
        if not (1 <= seconds <= 86_400 and 0 <= budget < math.inf and math.isfinite(at)):
            raise ConfigError(
                f"deployment field {name!r} = {text!r}: expected '<window_seconds 1..86400>|"
                "<budget_units >= 0>' = '<unix seconds>|<host:pid>' (written by a deciding "
                "process; HDEL the field and the processes write theirs again within a minute)"
            )
        return cls(seconds, budget, at, by or "?")


def recorded(client: redis.Redis, keys: Keys) -> list[Seen]:
    """Every pair stored for the namespace, the latest first ([] when none). Raises
    :class:`LedgerUnavailable` when Redis does not answer, and :class:`ConfigError` for a
    key or field that is not usable."""
    try:
        raw = client.hgetall(keys.deployment)
    except redis.ResponseError as exc:  # WRONGTYPE: not gatekeeper's writing
        raise ConfigError(f"{keys.deployment} is not a hash of deployment pairs ({exc})") from exc
    except (redis.RedisError, RedisClusterException) as exc:
        raise LedgerUnavailable(f"cannot read the gate's Redis ({keys.deployment}): {exc}") from exc
    return sorted((Seen.parse(k, v) for k, v in raw.items()), key=lambda s: -s.at)


def latest(seen: list[Seen], now: float) -> list[Seen]:
    """The pairs that judge the hour ending ``now``: those seen within it, else the latest."""
    within = [s for s in seen if s.seen_within_hour_of(now)]
    return within or seen[:1]


def differs(settings: GatekeeperSettings, judges: list[Seen]) -> str:
    """Why the shell's values are not the deployment's ('' when they are, or none is known)."""
    mine = Seen.mine(settings, 0.0)
    if not judges or all(s.field == mine.field for s in judges):
        return ""
    return (f"this shell's {mine.values()} are not the deployment's "
            + " and ".join(s.said() for s in judges))  # fmt: skip


def announcer(
    client: redis.Redis, keys: Keys, settings: GatekeeperSettings, log: Any,
    clock: Callable[[], float], breaker: Breaker | None = None,
) -> Callable[[], bool]:  # fmt: skip
    """A deciding process's hook on its flag reads (:attr:`FlagStore.announce`): write its
    pair (one round trip), forget pairs unseen for a day, and warn once per other pair seen
    within the hour. True once written; False when it was not (never raises: a publish reads
    the flags)."""
    warned: set[str] = set()

    def announce() -> bool:
        try:
            mine = Seen.mine(settings, clock())
            if breaker is not None:
                breaker.check("cannot write the deployment's values")
            pipe = client.pipeline(transaction=False)
            pipe.hset(keys.deployment, mine.field, mine.value)
            pipe.hgetall(keys.deployment)
            stored = pipe.execute()[1]
        except (redis.RedisError, RedisClusterException, LedgerUnavailable) as exc:
            if breaker is not None:
                breaker.failed(exc)  # (only a server that did not answer opens it)
            log.info("deployment_not_written", key=keys.deployment, error=str(exc))
            return False
        try:
            _looked_over(client, keys, mine, stored, warned, log)
        except Exception as exc:  # a key not gatekeeper's writing: the judge says so, not this
            log.info("deployment_not_read", key=keys.deployment, error=repr(exc))
        return True

    return announce


def _looked_over(
    client: redis.Redis, keys: Keys, mine: Seen, stored: Mapping[bytes, bytes],
    warned: set[str], log: Any,
) -> None:  # fmt: skip
    stale = []
    for field, value in stored.items():
        try:
            other = Seen.parse(field, value)
        except ConfigError:
            continue  # the clean hour refuses it, naming it
        if other.at < mine.at - FORGET_AFTER_S:
            stale.append(field)
        elif other.field != mine.field and other.field not in warned and (
                other.at >= mine.at - HOUR_S):  # fmt: skip
            warned.add(other.field)
            log.warning("deployment_settings_differ", window_seconds=mine.window_seconds,
                        budget_units=mine.budget_units, other_window_seconds=(
                            other.window_seconds), other_budget_units=other.budget_units,
                        other_by=other.by, other_at=other.at, key=keys.deployment)  # fmt: skip
    if stale:
        client.hdel(keys.deployment, *stale)


def judge_hour(
    client: redis.Redis, keys: Keys, settings: GatekeeperSettings, stored: Mapping[str, str],
    state_field: str, now: float,
) -> CleanHour:  # fmt: skip
    """Whether the last hour of ledger windows (ending in the one ``now`` is in) is clean under
    every pair the deployment decided with within it (:func:`latest`; the shell's values when
    none is recorded); not clean when what is recorded cannot be read.

    Only windows recorded after the state was initialised (``stored[state_field]``, from the
    flags hash) count: a window from before ``gatekeeper init`` may have been lost with the
    state, so an empty one proves nothing (initialising is not a re-open)."""
    try:
        judges = latest(recorded(client, keys), now)
    except ConfigError as exc:
        return CleanHour(False, f"the deployment's values cannot be read: {exc}")
    if judges:
        said = f" (judged with the deployment's {' and '.join(s.values() for s in judges)})"
        pairs = [(s.window_seconds, s.budget_units) for s in judges]
    else:
        said = (f" (judged with this shell's {Seen.mine(settings, now).values()}: no deciding "
                "process has recorded its own)")  # fmt: skip
        pairs = [(settings.window_seconds, settings.budget_units)]
    verdict = CleanHour(True, "")
    for seconds, budget in pairs:
        verdict = _hour(client, keys, seconds, budget, stored.get(state_field), now)
        if not verdict.clean:
            break
    return CleanHour(verdict.clean, verdict.reason + said)


def _hour(
    client: redis.Redis, keys: Keys, seconds: int, budget: float, since: str | None, now: float
) -> CleanHour:
    ids = list(hour_windows(window_id(now, seconds), seconds))
    try:
        initialised = float(since) if since is not None else None
    except ValueError:
        initialised = math.inf  # not gatekeeper's writing: as if just initialised
    if initialised is not None and not initialised <= ids[0] * seconds:
        try:
            when = datetime.fromtimestamp(initialised, tz=timezone.utc).isoformat(
                timespec="seconds")  # fmt: skip
        except (ValueError, OverflowError, OSError):
            when = repr(since)
        return CleanHour(False, f"the state was initialised at {when}: the hour of windows "
                                "before now was not all recorded after it")  # fmt: skip
    found = read_windows(client, keys, ids)
    try:
        windows = [WindowHealth.from_hash(ident, fields)
                   for ident, fields in zip(ids, found, strict=True)]  # fmt: skip
    except (ValueError, OverflowError) as exc:  # not gatekeeper's writing: not clean
        return CleanHour(False, f"a window of the hour holds a field that is not a number "
                                f"({exc})")  # fmt: skip
    return clean_hour(windows, budget)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
