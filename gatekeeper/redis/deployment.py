"""What the deciding processes run with: their ``window_seconds`` and ``budget_units`` in Redis.

The on-call's commands run in a shell whose settings need not be the deployment's (no
``GATEKEEPER_WINDOW_SECONDS`` there, another ``budget_units``). A clean hour judged with a
shell's own values reads other windows than the gate writes (and an empty window is clean),
or holds them to another budget, so ``flags set free_path_enabled true`` could re-open the free
path over an hour that is not clean.

So every process that decides publishes (:meth:`gatekeeper.redis.gate.Pipeline.create`: the
app's gate, the replayer, ``dead-letter requeue``) keeps the pair it decides with in
``gatekeeper:{ns}:deployment`` (:func:`announcer`): field ``<window_seconds>|<budget_units>``,
value ``<last seen, Unix s>|<host>:<pid>``, written at its first read of the flags and again at
most every :data:`ANNOUNCE_EVERY_S` (so a key deleted or lost is back within a minute of the
next publish), warning ``deployment_settings_differ`` once per other pair seen within the hour.
The clean hour is judged under every pair kept (:func:`judge_hour`): a one-off process with a
shell's settings, or a ``window_seconds`` changed within the hour, adds a pair and hides none.
With none at all (an upgrade from a version that wrote none) the shell's values judge, and the
verdict says so. The commands that read or write windows use the pair seen last
(gatekeeper/ops/oncall.py ``as_deployed``).
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from gatekeeper.core.health import CleanHour, WindowHealth, clean_hour, hour_windows
from gatekeeper.core.ledger import window_id
from gatekeeper.errors import ConfigError, LedgerUnavailable
from gatekeeper.redis.breaker import Breaker
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import evalsha, load_lua, read_windows
from gatekeeper.settings import GatekeeperSettings

__all__ = ["ANNOUNCE_EVERY_S", "Seen", "announcer", "judge_hour", "latest", "recorded", "shown"]

ANNOUNCE_EVERY_S = 60.0
"""How often a deciding process writes its pair again (at a read of the flags)."""
SLACK_S = ANNOUNCE_EVERY_S + 60.0
"""How long after its last write a pair may still have decided: its next write waits for a
read of the flags, up to ``flag_cache_s`` (at most 60 s) after the period."""
FORGET_AFTER_S = 86_400.0
"""A pair not seen for this long is deleted by the next process that writes its own."""
HOUR_S = 3600.0


@dataclass(frozen=True)
class Seen:
    """One pair of values a deciding process ran with, and who wrote it last, when."""

    window_seconds: int
    budget_units: float
    at: float
    """Last seen (Unix seconds)."""
    by: str = "?"
    first: float = -math.inf
    """First seen: the windows it may have decided in lie between ``first`` and ``at``."""

    @property
    def field(self) -> str:
        return f"{self.window_seconds}|{self.budget_units!r}"

    def values(self) -> str:
        return f"window_seconds={self.window_seconds} budget_units={self.budget_units!r}"

    def said(self) -> str:
        """The values and where they come from, for a command's output."""
        try:
            when = datetime.fromtimestamp(self.at, tz=timezone.utc).isoformat(timespec="seconds")
        except (ValueError, OverflowError, OSError):
            when = "an unknown time"
        return f"{self.values()} (last seen from {self.by} at {when})"

    def seen_within_hour_of(self, now: float) -> bool:
        """It may have decided within the hour a clean hour reads (:data:`SLACK_S` after)."""
        first = hour_windows(window_id(now, self.window_seconds), self.window_seconds)[0]
        return self.at + SLACK_S >= first * self.window_seconds

    @classmethod
    def mine(cls, settings: GatekeeperSettings, now: float) -> Seen:
        return cls(settings.window_seconds, settings.budget_units, now,
                   f"{socket.gethostname()}:{os.getpid()}")  # fmt: skip

    @classmethod
    def parse(cls, field: bytes | str, value: bytes | str) -> Seen:
        """One field of the hash; :class:`ConfigError` names what is not usable."""
        name, text = _text(field), _text(value)
        seconds_text, _, budget_text = name.partition("|")
        first_text, _, rest = text.partition("|")
        at_text, _, by = rest.partition("|")
        try:
            seconds, budget = int(seconds_text), float(budget_text)
            first, at = float(first_text), float(at_text)
        except ValueError:
            seconds, budget, first, at = 0, math.nan, math.nan, math.nan
        if not (1 <= seconds <= 86_400 and 0 <= budget < math.inf and math.isfinite(at)
                and math.isfinite(first) and first <= at):  # fmt: skip
            raise ConfigError(
                f"deployment field {name!r} = {text!r}: expected '<window_seconds 1..86400>|"
                "<budget_units >= 0>' = '<first seen>|<last seen>|<host:pid>' (written by a "
                "deciding process; HDEL the field and the processes write theirs again within "
                "a minute)"
            )
        return cls(seconds, budget, at, by or "?", first)

    def forgotten_by(self, now: float) -> bool:
        """Unseen long enough to be forgotten: a day, and never while a window it may have
        decided in can still be read by a clean hour (two windows of up to a day)."""
        return self.at < now - max(FORGET_AFTER_S, 2 * self.window_seconds + HOUR_S + SLACK_S)

    def decided_in(self, window_start: float) -> bool:
        """Whether a window starting then may hold its decisions (:data:`SLACK_S` each side)."""
        return self.first - SLACK_S < window_start + self.window_seconds and (
            window_start <= self.at + SLACK_S)  # fmt: skip


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
    """The pairs seen within the hour ending ``now``, the longest seen first; else the latest."""
    within = sorted((s for s in seen if s.seen_within_hour_of(now)), key=lambda s: s.first)
    return within or seen[:1]


def shown(settings: GatekeeperSettings, judges: list[Seen]) -> tuple[Seen | None, str]:
    """The pair a command shows (the first of :func:`latest`'s: the longest seen, so that a
    one-off process's does not displace the deployment's; None: the shell's own), and a note
    when it is not the shell's or when several were seen within the hour ('': none)."""
    mine = Seen.mine(settings, 0.0)
    if not judges:
        return None, ""
    if len(judges) > 1:
        pairs = "; ".join(s.said() for s in judges)
        return judges[0], (f"the deployment decided with {len(judges)} pairs within the hour: "
                           f"{pairs}: the first, seen longest, is shown")  # fmt: skip
    if judges[0].field == mine.field:
        return None, ""
    return judges[0], f"this shell's {mine.values()} are not the deployment's {judges[0].said()}"


def announcer(
    client: redis.Redis, keys: Keys, settings: GatekeeperSettings, log: Any,
    clock: Callable[[], float], breaker: Breaker | None = None,
) -> Callable[[], bool]:  # fmt: skip
    """A deciding process's hook on its flag reads (:attr:`FlagStore.announce`): write its
    pair (one round trip), forget pairs unseen for a day, and warn once per other pair seen
    within the hour. True once written; False when it was not (never raises: a publish reads
    the flags)."""
    warned: set[str] = set()
    script = client.register_script(load_lua("pair.lua"))

    def announce() -> bool:
        try:
            mine = Seen.mine(settings, clock())
            if breaker is not None:
                breaker.check("cannot write the deployment's values")
            stored = evalsha(client, script, [keys.deployment], [mine.field, repr(mine.at),
                                                                  mine.by])  # fmt: skip
        except Exception as exc:  # never into a publish (a decoding client's bytes included)
            if breaker is not None and isinstance(exc, redis.RedisError):
                breaker.failed(exc)  # (only a server that did not answer opens it)
            log.info("deployment_not_written", key=keys.deployment, error=repr(exc))
            return False
        try:
            pairs = dict(zip(stored[::2], stored[1::2], strict=True))
            _looked_over(client, keys, mine, pairs, warned, log)
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
        if other.forgotten_by(mine.at):
            stale.append(field)
        elif other.field != mine.field and other.field not in warned and (
                other.at >= mine.at - HOUR_S):  # fmt: skip
            warned.add(other.field)
            log.warning("deployment_settings_differ", window_seconds=mine.window_seconds,
                        budget_units=mine.budget_units, other_window_seconds=(
                            other.window_seconds), other_budget_units=other.budget_units,
                        other_by=other.by, other_at=other.at, key=keys.deployment)  # fmt: skip
    if stale:  # each only if no process wrote it meanwhile
        forget_unchanged(client, keys.deployment, [(f, stored[f]) for f in stale])


def forget_unchanged(
    client: redis.Redis, key: str, pairs: list[tuple[bytes | str, bytes | str]]
) -> None:
    """Delete each field whose value is still the one given (``unpair.lua``)."""
    script = client.register_script(load_lua("unpair.lua"))
    evalsha(client, script, [key], [part for pair in pairs for part in pair])


def judge_hour(
    client: redis.Redis, keys: Keys, settings: GatekeeperSettings, stored: Mapping[str, str],
    state_field: str, now: float,
) -> CleanHour:  # fmt: skip
    """Whether the last hour of ledger windows (ending in the one ``now`` is in) is clean under
    every pair recorded (the shell's values when none is): no killed rows in its windows, and
    within its budget the tax of its windows that began before it was last seen (+
    :data:`SLACK_S`: it decided none after). An extra pair costs a read of empty windows, so
    none is left out: a worker writes a killed row into its own window whenever it ends, and a
    one-off publish from a shell must not hide the deployment's pair. Not clean when what is
    recorded cannot be read.

    Only windows recorded after the state was initialised (``stored[state_field]``, from the
    flags hash) count: a window from before ``gatekeeper init`` may have been lost with the
    state, so an empty one proves nothing (initialising is not a re-open)."""
    try:
        pairs = recorded(client, keys)
    except ConfigError as exc:
        return CleanHour(False, f"the deployment's values cannot be read: {exc}")
    if pairs:
        said = (f" (judged with the deployment's pairs: {'; '.join(s.said() for s in pairs)}; "
                f"one no process of it runs with: HDEL {keys.deployment} '<window_seconds>|"
                "<budget_units>')")  # fmt: skip
    else:
        pairs = [Seen.mine(settings, math.inf)]
        said = (f" (judged with this shell's {pairs[0].values()}: no deciding process has "
                "recorded its own)")  # fmt: skip
    verdict = CleanHour(True, "")
    for pair in pairs:
        verdict = _hour(client, keys, pair, stored.get(state_field), now)
        if not verdict.clean:
            break
    return CleanHour(verdict.clean, verdict.reason + said)


def _hour(client: redis.Redis, keys: Keys, pair: Seen, since: str | None, now: float) -> CleanHour:
    seconds = pair.window_seconds
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
    decided = [w if pair.decided_in(w.window_id * seconds) else replace(w, tax_units=0.0)
               for w in windows]  # fmt: skip
    return clean_hour(decided, pair.budget_units)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
