"""What the deciding processes run with: their ``window_seconds`` and ``budget_units`` in Redis.

The on-call's commands run in a shell whose settings need not be the deployment's (no
``GATEKEEPER_WINDOW_SECONDS`` there, another ``budget_units``). A clean hour judged with a
shell's own values reads other windows than the gate writes (and an empty window is clean),
or holds them to another budget, so ``flags set free_path_enabled true`` could re-open the free
path over an hour that is not clean. So every process that decides publishes writes the two
values it decides with to ``gatekeeper:{ns}:deployment`` (:func:`announcer`) at its first
read of the flags, and again at each read while the state marker is missing (a Redis that
lost its data lost this key too), warning when the process before it wrote others. The clean
hour is judged with the values found there (:func:`judge_hour`), and the commands tell a shell
whose values differ (:func:`differs`).

The key holds the last process's values: two processes that decide with different ones are a
misconfiguration the ledger cannot make coherent (their windows or budgets disagree), which
the warning names. Without the key (no deciding process of this version has read the flags
yet) the shell's values are used, and the verdict says so.
"""

from __future__ import annotations

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
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import read_windows, text_of
from gatekeeper.settings import GatekeeperSettings

__all__ = ["Deployment", "announcer", "differs", "judge_hour", "recorded"]


@dataclass(frozen=True)
class Deployment:
    """The values one deciding process runs with, and who wrote them when."""

    window_seconds: int
    budget_units: float
    at: float
    """When it was written (Unix seconds)."""
    by: str
    """``<host>:<pid>`` of the process that wrote it."""

    @classmethod
    def of(cls, settings: GatekeeperSettings, now: float) -> Deployment:
        return cls(settings.window_seconds, settings.budget_units, now,
                   f"{socket.gethostname()}:{os.getpid()}")  # fmt: skip

    @classmethod
    def from_hash(cls, fields: Mapping[str, str]) -> Deployment:
        """Read the stored hash; :class:`ConfigError` names a field that is not usable."""
        try:
            seconds = int(fields["window_seconds"])
        except (KeyError, ValueError):
            raise ConfigError(
                f"deployment field window_seconds={fields.get('window_seconds')!r}: expected a "
                "whole number of seconds >= 1 (written by a deciding process; delete the key "
                "to let the next one write it again)"
            ) from None
        try:
            budget = float(fields["budget_units"])
        except (KeyError, ValueError):
            budget = -1.0
        if seconds < 1 or not budget >= 0 or budget == float("inf"):
            bad = "window_seconds" if seconds < 1 else "budget_units"
            raise ConfigError(
                f"deployment field {bad}={fields.get(bad)!r}: expected "
                f"{'a whole number >= 1' if seconds < 1 else 'a number >= 0'}"
            )
        try:
            at = float(fields.get("at", "nan"))
        except ValueError:
            at = float("nan")
        return cls(seconds, budget, at, fields.get("by", "?"))

    def fields(self) -> dict[str, str]:
        return {"window_seconds": str(self.window_seconds), "budget_units": repr(self.budget_units),
                "at": repr(self.at), "by": self.by}  # fmt: skip

    def values(self) -> str:
        return f"window_seconds={self.window_seconds} budget_units={self.budget_units:g}"

    def said(self) -> str:
        """The values and where they come from, for a command's output."""
        try:
            when = datetime.fromtimestamp(self.at, tz=timezone.utc).isoformat(timespec="seconds")
        except (ValueError, OverflowError):
            when = "an unknown time"
        return f"{self.values()} (written by {self.by} at {when})"


def recorded(client: redis.Redis, keys: Keys) -> Deployment | None:
    """The values stored for the namespace; None when no deciding process wrote them.
    Raises :class:`LedgerUnavailable`, and :class:`ConfigError` for a value not usable."""
    try:
        raw = client.hgetall(keys.deployment)
    except (redis.RedisError, RedisClusterException) as exc:
        raise LedgerUnavailable(f"cannot read {keys.deployment}: {exc}") from exc
    if not raw:
        return None
    return Deployment.from_hash({text_of(k): text_of(v) for k, v in raw.items()})


def differs(settings: GatekeeperSettings, deployment: Deployment | None) -> str:
    """Why the shell's values are not the deployment's ('' when they are, or none is known)."""
    if deployment is None:
        return ""
    if (settings.window_seconds, settings.budget_units) == (
        deployment.window_seconds, deployment.budget_units):  # fmt: skip
        return ""
    mine = Deployment.of(settings, 0.0).values()
    return f"this shell's {mine} are not the deployment's {deployment.said()}"


def announcer(
    client: redis.Redis, keys: Keys, settings: GatekeeperSettings, log: Any,
    clock: Callable[[], float],
) -> Callable[[], bool]:  # fmt: skip
    """A deciding process's hook on its flag reads (:attr:`FlagStore.announce`): write its
    values (one round trip), and warn ``deployment_settings_differ`` when the process before
    it wrote others. True once written; False when Redis did not answer (the next read of
    the flags tries again)."""

    def announce() -> bool:
        mine = Deployment.of(settings, clock())
        try:
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(keys.deployment)
            pipe.hset(keys.deployment, items=[v for kv in mine.fields().items() for v in kv])
            before = pipe.execute()[0]
        except (redis.RedisError, RedisClusterException) as exc:
            log.info("deployment_not_written", key=keys.deployment, error=str(exc))
            return False
        try:
            previous = Deployment.from_hash({text_of(k): text_of(v) for k, v in before.items()})
        except ConfigError:
            return True  # written over: what was there could not be read anyway
        if before and previous.values() != mine.values():
            log.warning("deployment_settings_differ", window_seconds=mine.window_seconds,
                        budget_units=mine.budget_units, previous_window_seconds=(
                            previous.window_seconds), previous_budget_units=(
                            previous.budget_units), previous_by=previous.by,
                        previous_at=previous.at, key=keys.deployment)  # fmt: skip
        return True

    return announce


def judge_hour(
    client: redis.Redis, keys: Keys, settings: GatekeeperSettings, stored: Mapping[str, str],
    state_field: str, now: float,
) -> CleanHour:  # fmt: skip
    """Whether the last hour of ledger windows (ending in the one ``now`` is in) is clean,
    judged with the deployment's ``window_seconds`` and ``budget_units`` (the shell's when
    none is recorded; not clean when what is recorded cannot be read).

    Only windows recorded after the state was initialised (``stored[state_field]``, from the
    flags hash) count: a window from before ``gatekeeper init`` may have been lost with the
    state, so an empty one proves nothing (initialising is not a re-open)."""
    try:
        deployment = recorded(client, keys)
    except ConfigError as exc:
        return CleanHour(False, f"the deployment's settings in {keys.deployment} cannot be "
                                f"read ({exc})")  # fmt: skip
    seconds, budget = settings.window_seconds, settings.budget_units
    if deployment is None:
        said = (f" (judged with this shell's {Deployment.of(settings, now).values()}: no "
                "deciding process has recorded its own)")  # fmt: skip
    else:
        seconds, budget = deployment.window_seconds, deployment.budget_units
        said = f" (judged with the deployment's {deployment.values()})" if differs(
            settings, deployment) else ""  # fmt: skip
    ids = list(hour_windows(window_id(now, seconds), seconds))
    since = stored.get(state_field)
    try:
        initialised = float(since) if since is not None else None
    except ValueError:
        initialised = float("inf")  # not gatekeeper's writing: as if just initialised
    if initialised is not None and not initialised <= ids[0] * seconds:
        try:
            when = datetime.fromtimestamp(initialised, tz=timezone.utc).isoformat(
                timespec="seconds")  # fmt: skip
        except (ValueError, OverflowError):
            when = repr(since)
        return CleanHour(False, f"the state was initialised at {when}: the hour of windows "
                                f"before now was not all recorded after it{said}")  # fmt: skip
    found = read_windows(client, keys, ids)
    try:
        windows = [WindowHealth.from_hash(ident, fields)
                   for ident, fields in zip(ids, found, strict=True)]  # fmt: skip
    except (ValueError, OverflowError) as exc:  # not gatekeeper's writing: not clean
        return CleanHour(False, f"a window of the hour holds a field that is not a number "
                                f"({exc})")  # fmt: skip
    verdict = clean_hour(windows, budget)
    return CleanHour(verdict.clean, verdict.reason + said)
