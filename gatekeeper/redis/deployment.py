"""What the deployment's processes run with: their ``window_seconds`` and ``budget_units``.

The on-call's commands run in a shell whose settings need not be the deployment's (no
``GATEKEEPER_WINDOW_SECONDS`` there, another ``budget_units``). A clean hour judged with a
shell's own values reads other windows than the gate writes (and an empty window is clean),
or holds them to another budget, so ``flags set free_path_enabled true`` could re-open the free
path over an hour that is not clean.

So the processes keep the values they run with in ``gatekeeper:{ns}:deployment``
(:func:`announcer`, ``pair.lua``): a process that decides publishes (a
:class:`gatekeeper.redis.gate.Pipeline`: the app's gate, the replayer, ``dead-letter requeue``)
its pair, field ``<window_seconds>|<budget_units>``; a worker, from its heartbeat, its window
alone, ``<window_seconds>|rows`` (it writes rows in its own windows, and decides nothing
with a budget); each valued ``<last seen>|<host>:<pid>``, the server's time, at a process's
first read of the flags and at most every :data:`ANNOUNCE_EVERY_S` after (so a key deleted or
lost is back within a minute). A process warns ``deployment_settings_differ`` once per other
pair seen within the hour, and forgets pairs unseen for a day (and two windows).

The clean hour (:func:`judge_hour`) reads the windows of every size kept for killed rows, and
holds each window's tax to the lowest budget kept for its size: an extra pair only reads
empty windows or asks for less, so a one-off ``task.delay()`` from a shell, a
``window_seconds`` changed within the hour, or processes of an older version beside newer
ones hide nothing; a budget raised within the day, or a one-off pair's lower budget, refuses
until that pair is forgotten or deleted (the refusal names it, and how). With no pair that
decides, the shell's values judge, and the verdict says so; a size only workers keep is held
to the lowest budget there is. The commands that read or write windows use a deciding pair
seen within the hour, of the workers' size first, then the lowest budget (:func:`latest`,
gatekeeper/ops/oncall.py ``as_deployed``).
"""

from __future__ import annotations

import math
import os
import re
import socket
import time
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
from gatekeeper.redis.scripts import evalsha, load_lua, read_windows
from gatekeeper.settings import GatekeeperSettings

__all__ = ["ANNOUNCE_EVERY_S", "Seen", "announcer", "judge_hour", "latest", "recorded", "shown"]

ANNOUNCE_EVERY_S = 60.0
"""How often a process writes its pair again (at a read of the flags, or a worker's beat)."""
FORGET_AFTER_S = 86_400.0
"""A pair not seen for this long (and for two of its windows) is deleted by the next write."""
HOUR_S = 3600.0
SLACK_S = ANNOUNCE_EVERY_S + 60.0
"""How long after its last write a pair may still be deciding: its next write waits for a
read of the flags, up to ``flag_cache_s`` (at most 60 s) after the period."""
ROWS = "rows"
"""The budget part of a worker's field: its window alone."""
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")


@dataclass(frozen=True)
class Seen:
    """One pair of values a process ran with (``budget_units`` None: a worker's, its window
    alone), and who wrote it last, when (the server's time)."""

    window_seconds: int
    budget_units: float | None
    at: float
    by: str = "?"

    @property
    def field(self) -> str:
        budget = ROWS if self.budget_units is None else repr(self.budget_units)
        return f"{self.window_seconds}|{budget}"

    def values(self) -> str:
        budget = "(a worker's: none)" if self.budget_units is None else repr(self.budget_units)
        return f"window_seconds={self.window_seconds} budget_units={budget}"

    def said(self) -> str:
        """The values and where they come from, for a command's output."""
        try:
            when = datetime.fromtimestamp(self.at, tz=timezone.utc).isoformat(timespec="seconds")
        except (ValueError, OverflowError, OSError):
            when = "an unknown time"
        return f"{self.values()} (field '{self.field}', last seen from {self.by} at {when})"

    def seen_within_hour_of(self, now: float) -> bool:
        first = hour_windows(window_id(now, self.window_seconds), self.window_seconds)[0]
        return self.at + SLACK_S >= first * self.window_seconds

    def forgotten_by(self, now: float) -> bool:
        """Unseen long enough to be forgotten: a day, and never while a window it may have
        written can still be read by a clean hour (two windows, for a window of a day)."""
        return self.at < now - max(FORGET_AFTER_S, 2 * self.window_seconds + 2 * HOUR_S)

    @classmethod
    def mine(cls, settings: GatekeeperSettings, now: float, rows: bool = False) -> Seen:
        return cls(settings.window_seconds, None if rows else settings.budget_units, now,
                   f"{socket.gethostname()}:{os.getpid()}")  # fmt: skip

    @classmethod
    def parse(cls, field: bytes | str, value: bytes | str) -> Seen:
        """One field of the hash; :class:`ConfigError` names what is not usable."""
        name, text = _text(field), _text(value)
        seconds_text, _, budget_text = name.partition("|")
        at_text, _, by = text.partition("|")
        rows = budget_text == ROWS
        seconds, budget, at = 0, math.nan, math.nan
        if seconds_text.isdecimal() and seconds_text.isascii() and _NUMBER.fullmatch(at_text):
            seconds, at = int(seconds_text), float(at_text)
            if rows or _NUMBER.fullmatch(budget_text):
                budget = 0.0 if rows else float(budget_text)
        if not (1 <= seconds <= 86_400 and 0 <= budget < math.inf and math.isfinite(at)):
            raise ConfigError(
                f"deployment field {name!r} = {text!r}: expected '<window_seconds 1..86400>|"
                "<budget_units >= 0, or rows>' = '<last seen>|<host:pid>' (written by the "
                "deployment's processes; HDEL the field and they write theirs again within a "
                "minute)"
            )
        return cls(seconds, None if rows else budget, at, by or "?")


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
    """The deciding pairs seen within the hour ending ``now`` (else the latest deciding pair),
    the one a command uses first: of a window size the workers keep (a one-off process's size
    is nobody's), then with the lowest budget (the one a clean hour holds the window to)."""
    deciding = [s for s in seen if s.budget_units is not None]
    within = [s for s in deciding if s.seen_within_hour_of(now)]
    workers = {s.window_seconds for s in seen if s.budget_units is None
               and s.seen_within_hour_of(now)}  # fmt: skip
    return sorted(within, key=lambda s: (s.window_seconds not in workers, s.budget_units,
                                         -s.at)) or deciding[:1]  # fmt: skip


def shown(settings: GatekeeperSettings, judges: list[Seen]) -> tuple[Seen | None, str]:
    """The pair a command uses (the first of :func:`latest`'s; None: the shell's own), and a
    note when it is not the shell's or when several were seen within the hour ('': none)."""
    mine = Seen.mine(settings, 0.0)
    if not judges:
        return None, ""
    if len(judges) > 1:
        pairs = "; ".join(s.said() for s in judges)
        return judges[0], (f"the deployment decided with {len(judges)} pairs within the hour: "
                           f"{pairs}: the first is used")  # fmt: skip
    if judges[0].field == mine.field:
        return None, ""
    return judges[0], f"this shell's {mine.values()} are not the deployment's {judges[0].said()}"


def announcer(
    client: redis.Redis, keys: Keys, settings: GatekeeperSettings, log: Any,
    breaker: Breaker | None = None, rows: bool = False,
) -> Callable[[], None]:  # fmt: skip
    """A process's hook (a flag read, a worker's beat): at most every :data:`ANNOUNCE_EVERY_S`
    write its pair (``rows``: a worker's window alone) with ``pair.lua`` (one round trip),
    forget pairs unseen long enough, and warn once per other pair seen within the hour. A
    failure is said once a minute; it never raises, since a publish reads the flags."""
    warned: set[str] = set()
    script = client.register_script(load_lua("pair.lua"))
    due = [-math.inf]

    def announce() -> None:
        if time.monotonic() < due[0]:
            return
        due[0] = time.monotonic() + ANNOUNCE_EVERY_S
        try:
            mine = Seen.mine(settings, 0.0, rows)
            if breaker is not None:
                breaker.check("cannot write the deployment's values")
            reply = evalsha(client, script, [keys.deployment], [mine.field, mine.by])
        except Exception as exc:  # never into a publish (a decoding client's bytes included)
            if breaker is not None and isinstance(exc, redis.RedisError):
                breaker.failed(exc)  # (only a server that did not answer opens it)
            log.info("deployment_not_written", key=keys.deployment, error=repr(exc))
            return
        try:
            now, pairs = float(_text(reply[0])), dict(zip(reply[1::2], reply[2::2], strict=True))
            _looked_over(client, keys, Seen(mine.window_seconds, mine.budget_units, now),
                         pairs, warned, log)  # fmt: skip
        except Exception as exc:  # a key not gatekeeper's writing: the judge says so, not this
            log.info("deployment_not_read", key=keys.deployment, error=repr(exc))

    return announce


def _looked_over(
    client: redis.Redis, keys: Keys, mine: Seen, stored: Mapping[Any, Any], warned: set[str],
    log: Any,
) -> None:  # fmt: skip
    stale = []
    for field, value in stored.items():
        try:
            other = Seen.parse(field, value)
        except ConfigError:
            continue  # the clean hour refuses it, naming it
        if other.forgotten_by(mine.at):
            stale.append((field, value))
        elif (other.budget_units is not None and mine.budget_units is not None
              and other.field != mine.field and other.field not in warned
              and other.at >= mine.at - HOUR_S):  # fmt: skip
            warned.add(other.field)
            log.warning("deployment_settings_differ", window_seconds=mine.window_seconds,
                        budget_units=mine.budget_units, other_window_seconds=(
                            other.window_seconds), other_budget_units=other.budget_units,
                        other_by=other.by, other_at=other.at, key=keys.deployment)  # fmt: skip
    if stale:  # each only if no process wrote it meanwhile
        script = client.register_script(load_lua("unpair.lua"))
        evalsha(client, script, [keys.deployment], [part for pair in stale for part in pair])


def judge_hour(
    client: redis.Redis, keys: Keys, settings: GatekeeperSettings, stored: Mapping[str, str],
    state_field: str, now: float,
) -> CleanHour:  # fmt: skip
    """Whether the last hour of ledger windows (ending in the one ``now`` is in) is clean: for
    every window size kept (the shell's when no pair that decides is), no killed rows in its
    windows, and each one's tax within the lowest budget kept for that size. Not clean when
    what is recorded cannot be read.

    Only windows recorded after the state was initialised (``stored[state_field]``, from the
    flags hash) count: a window from before ``gatekeeper init`` may have been lost with the
    state, so an empty one proves nothing (initialising is not a re-open)."""
    try:
        pairs = recorded(client, keys)
    except ConfigError as exc:
        return CleanHour(False, f"the deployment's values cannot be read: {exc}")
    if any(s.budget_units is not None for s in pairs):
        said = (
            f" (judged with the deployment's pairs: {'; '.join(s.said() for s in pairs)}; "
            f"one that no process of it runs with: HDEL {keys.deployment} '<field>')"
        )
    else:
        pairs = [*pairs, Seen.mine(settings, now)]
        said = (f" (judged with this shell's {pairs[-1].values()}: no process that decides "
                "has recorded its own)")  # fmt: skip
    # Each size's lowest deciding budget; a size only workers keep (their tax is real: a row
    # is charged in its writer's window) gets the lowest of all.
    lowest = min(s.budget_units for s in pairs if s.budget_units is not None)
    budgets = {s.window_seconds: lowest for s in pairs}
    for pair in pairs:
        if pair.budget_units is not None and pair.budget_units < budgets[pair.window_seconds]:
            budgets[pair.window_seconds] = pair.budget_units
    clean = []
    for seconds, budget in sorted(budgets.items()):
        verdict = _hour(client, keys, seconds, budget, stored.get(state_field), now)
        if not verdict.clean:
            return CleanHour(False, verdict.reason + said)
        clean.append(f"({seconds} s) {verdict.reason.removeprefix('clean hour: ')}")
    return CleanHour(True, "clean hour: " + "; ".join(clean) + said)


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
