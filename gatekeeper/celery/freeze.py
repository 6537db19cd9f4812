"""The auto-freeze: slack misses over the error budget turn the free path off in Redis.

The rule is the core's (:func:`gatekeeper.core.health.should_freeze`); this writes the flag
(with its reason, as actor ``gatekeeper:auto-freeze``, counting ``freezes`` in the lifetime
totals in the same transaction) and the alert line.
"""

from __future__ import annotations

from typing import Any

from gatekeeper.core.health import WindowHealth, should_freeze
from gatekeeper.redis.flags import FlagStore

__all__ = ["maybe_freeze"]


def maybe_freeze(
    flags: FlagStore, alerts: Any, window: int, misses: int, admitted: int, now: float
) -> bool:
    """Freeze the free path when a window's misses exceed the error budget; True if frozen."""
    settings = flags.settings
    health = WindowHealth(window_id=window, admitted_free=admitted, slack_misses=misses)
    budget = settings.miss_error_budget
    if not should_freeze(health, budget, settings.miss_min_admissions):
        return False
    if flags.stored().get("free_path_enabled") == "false":
        return False
    reason = (
        f"slack misses {misses}/{admitted} = {misses / admitted:.1%} of free admissions in "
        f"window {window} exceed miss_error_budget {budget:.1%}"
    )
    if flags.close(reason, "gatekeeper:auto-freeze", now) is None:
        return False  # another worker froze it meanwhile: one freeze, one line
    alerts.error(
        "free_path_frozen", window=window, slack_misses=misses, admitted_free=admitted,
        miss_error_budget=budget, reason=reason, on_disk=flags.persisted,
    )  # fmt: skip
    return True
