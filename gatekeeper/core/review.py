"""The weekly review (SPEC section 4): which decisions to count, and the three ratios. Pure.

Over a fixed window (a week by default), from the per-window decision counters:

1. ``free_missed``: free admissions that later missed their slack / free admissions.
   High: the service-time guesses are too kind.
2. ``defer_savable``: defers by the age cap whose dwell still fit the slack (reserved capacity
   could have run them at once) / defers. High: work was deferred that a reserved worker
   could have saved. (A guard's defer, such as a bad service guess, is never "savable".)
3. ``reserved_age_shift``: shifts to reserved for dwell over slack where the task's own
   service and retry tax fit the slack (the free queue's age, not the deadline, sent it away)
   / shifts to reserved. High: the age cap is stricter than the deadline.

``gate.lua`` counts the marks for the decisions it makes; :mod:`gatekeeper.redis.gate` counts
the others with :func:`review_marks`. A test holds the two to the same answers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gatekeeper.core.dwell import Decision, Reason

__all__ = ["DEFER_FIT", "RESERVED_AGE_SHIFT", "Review", "review_marks", "summarize_review"]

DEFER_FIT = "review:defer_fit"
RESERVED_AGE_SHIFT = "review:reserved_age_shift"
DECIDED_PREFIX = "decided:"
ADMIT_PREFIX = DECIDED_PREFIX + "admit_free:"
ADMIT_FITS = "admit_free/fits"
"""The one way to be admitted; gate.lua counts it as ``admitted_free``, not ``decided:...``."""


def review_marks(
    decision: str, reason: str, dwell_s: float, slack_s: float, service_s: float, tax_s: float
) -> tuple[bool, bool]:
    """(defer whose dwell fit the slack, reserved shift that the queue's age caused)."""
    finite = all(math.isfinite(v) for v in (dwell_s, slack_s, service_s, tax_s))
    defer_fit = (
        decision == Decision.DEFER.value
        and reason == Reason.QUEUE_AGE_CAP.value
        and finite
        and slack_s > 0
        and dwell_s <= slack_s
    )
    age_shift = (
        decision == Decision.RESERVED.value
        and reason == Reason.DWELL_OVER_SLACK.value
        and finite
        and service_s + tax_s <= slack_s
    )
    return defer_fit, age_shift


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


@dataclass(frozen=True)
class Review:
    """The counts behind the three ratios, and every decision by kind and reason."""

    windows: int
    free_admissions: int
    slack_misses: int
    defers: int
    defers_savable: int
    reserved: int
    reserved_age_shifts: int
    decisions: dict[str, int] = field(default_factory=dict)

    @property
    def free_missed(self) -> float | None:
        return _ratio(self.slack_misses, self.free_admissions)

    @property
    def defer_savable(self) -> float | None:
        return _ratio(self.defers_savable, self.defers)

    @property
    def reserved_age_shift(self) -> float | None:
        return _ratio(self.reserved_age_shifts, self.reserved)

    def lines(self) -> list[str]:
        def show(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.4f}"

        lines = [
            f"free_missed={show(self.free_missed)} "
            f"(slack_misses={self.slack_misses} free_admissions={self.free_admissions})",
            f"defer_savable={show(self.defer_savable)} "
            f"(defers_dwell_fit={self.defers_savable} defers={self.defers})",
            f"reserved_age_shift={show(self.reserved_age_shift)} "
            f"(reserved_dwell_fit_without_age={self.reserved_age_shifts} reserved={self.reserved})",
        ]
        lines += [f"decision {key}={count}" for key, count in sorted(self.decisions.items())]
        return lines


def summarize_review(windows: Iterable[Mapping[str, str]]) -> Review:
    """Add up the counters of the given window hashes."""
    decisions: dict[str, int] = {}
    totals = {"admitted_free": 0, "slack_misses": 0, DEFER_FIT: 0, RESERVED_AGE_SHIFT: 0}
    count = 0
    for fields in windows:
        count += 1
        for key, value in fields.items():
            if key in totals:
                totals[key] += int(float(value))
            elif key.startswith(ADMIT_PREFIX):
                continue  # written before admissions were counted once: admitted_free has them
            elif key.startswith(DECIDED_PREFIX) and key.count(":") == 2:
                name = key[len(DECIDED_PREFIX) :].replace(":", "/")
                decisions[name] = decisions.get(name, 0) + int(value)
    if totals["admitted_free"]:  # gate.lua counts admissions in admitted_free alone
        decisions[ADMIT_FITS] = totals["admitted_free"]
    by_kind = {kind: 0 for kind in ("admit_free", "defer", "reserved")}
    for name, number in decisions.items():
        kind = name.split("/")[0]
        by_kind[kind] = by_kind.get(kind, 0) + number
    return Review(
        windows=count,
        free_admissions=totals["admitted_free"],
        slack_misses=totals["slack_misses"],
        defers=by_kind["defer"],
        defers_savable=totals[DEFER_FIT],
        reserved=by_kind["reserved"],
        reserved_age_shifts=totals[RESERVED_AGE_SHIFT],
        decisions=decisions,
    )
