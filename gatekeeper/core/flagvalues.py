"""The flags' names and values as text, the flags in force for one decision, and the
canary's slice: pure, no Redis (gatekeeper/redis/flags.py stores them)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from gatekeeper.errors import ConfigError

__all__ = ["FALSE", "FLAG_NAMES", "TRUE", "Flags", "closed_by", "in_canary", "parse_flag"]

FLAG_NAMES = ("dwell_gate_enabled", "free_path_enabled", "canary_percent")

TRUE = {"true", "1", "yes", "on"}
FALSE = {"false", "0", "no", "off"}
"""How a flag's value, or any on/off option gatekeeper reads as text, says yes and no."""


def parse_flag(name: str, value: str) -> bool | float:
    """Validate a flag value given as text; raises ConfigError naming the flag."""
    if name not in FLAG_NAMES:
        raise ConfigError(f"flag name: expected one of {', '.join(FLAG_NAMES)}, got {name!r}")
    text = value.strip().lower()
    if name == "canary_percent":
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and 0 <= number <= 100):
            raise ConfigError(f"canary_percent: expected a number from 0 to 100, got {value!r}")
        return number
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ConfigError(f"{name}: expected true or false, got {value!r}")


def closed_by(stored: Mapping[str, str]) -> bool:
    """Whether the overrides stored in Redis close the free path: its value there and not one
    that reads as true (a corrupt one closes it, as ``combine`` reads it; ``gate.lua`` too).
    The commands write ``false``; a hand's ``HSET`` may write ``0`` or ``off``."""
    text = stored.get("free_path_enabled")
    return text is not None and text.strip().lower() not in TRUE


def in_canary(job_id: str, percent: float) -> bool:
    """Whether a job is in the canary slice: a stable hash of its id, not a coin flip."""
    if percent >= 100:
        return True
    if percent <= 0:
        return False
    digest = hashlib.blake2b(job_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 10_000 < percent * 100


@dataclass(frozen=True)
class Flags:
    """The flags in force for one decision."""

    dwell_gate_enabled: bool
    free_path_enabled: bool
    canary_percent: float
    unread: str | None = None
    """Why Redis could not be read, when no read has succeeded yet: these are the settings
    alone, and a value in Redis may override them (the gate cannot tell whether it is on)."""
    stale: str | None = None
    """Why the last read failed, when these are an earlier read's flags: they stay in force
    (stale beats absent), but not to send a task to free (the path may have closed since)."""
    state_missing: bool = False
    """The state marker is missing: the free path is closed until ``gatekeeper init``."""
    eviction: str | None = None
    """The gate Redis's ``maxmemory-policy`` when it is not ``noeviction`` (or ``unknown``):
    the free path is closed while it is."""

    @property
    def free_open(self) -> bool:
        """Whether a task may go to free on its own route (gate off, outside the canary, not
        gated): the path open, as read from Redis just now (not unread, not stale)."""
        return self.free_path_enabled and self.unread is None and self.stale is None
