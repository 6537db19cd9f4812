"""When the free path freezes and when it may open again (SPEC section 4). Pure rules.

- **Freeze**: slack misses of a window's free admissions over ``miss_error_budget`` (after at
  least ``miss_min_admissions`` admissions, so that one early miss out of three cannot freeze
  a batch) set ``free_path_enabled`` false in Redis.
- **Clean ledger hour**: the current window and the ``ceil(3600 / window_seconds)`` complete
  windows before it (so at least a full hour, however far into the current window we are)
  have zero killed rows and every window's tax within its budget. Re-enabling the free path
  needs one, or an explicit force.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gatekeeper.defaults import MISS_MIN_ADMISSIONS

__all__ = [
    "CleanHour",
    "WindowHealth",
    "clean_hour",
    "hour_windows",
    "should_freeze",
]


@dataclass(frozen=True)
class WindowHealth:
    """What the freeze and clean-hour rules read from one window."""

    window_id: int
    killed_rows: int = 0
    tax_units: float = 0.0
    admitted_free: int = 0
    slack_misses: int = 0

    @classmethod
    def from_hash(cls, window_id: int, fields: Mapping[str, str]) -> WindowHealth:
        """Read a window hash as stored in Redis (missing fields are zero)."""
        return cls(
            window_id=window_id,
            killed_rows=int(fields.get("rows:killed", 0)),
            tax_units=float(fields.get("tax_units", 0)),
            admitted_free=int(fields.get("admitted_free", 0)),
            slack_misses=int(fields.get("slack_misses", 0)),
        )


def should_freeze(
    health: WindowHealth,
    miss_error_budget: float,
    min_admissions: int = MISS_MIN_ADMISSIONS,
) -> bool:
    """Whether a window's slack misses exceed the error budget of its free admissions."""
    if health.admitted_free < max(min_admissions, 1):
        return False
    return health.slack_misses / health.admitted_free > miss_error_budget


def hour_windows(current_window: int, window_seconds: int) -> range:
    """The window ids that cover the last full hour, oldest first, the current one included."""
    count = math.ceil(3600 / window_seconds)
    return range(current_window - count, current_window + 1)


@dataclass(frozen=True)
class CleanHour:
    """The verdict, and why not when it is not clean."""

    clean: bool
    reason: str


def clean_hour(windows: list[WindowHealth], budget_units: float) -> CleanHour:
    """Zero killed rows and every window's tax within budget, over the windows given."""
    for window in windows:
        if window.killed_rows:
            return CleanHour(
                False, f"window {window.window_id} has {window.killed_rows} killed rows"
            )
        if window.tax_units > budget_units:
            return CleanHour(
                False,
                f"window {window.window_id} tax {window.tax_units:.0f} is over the budget "
                f"{budget_units:.0f}",
            )
    ids = [w.window_id for w in windows]
    span = f"windows {ids[0]}..{ids[-1]}" if ids else "no windows"
    return CleanHour(True, f"clean hour: {span} have no killed rows and tax within budget")
