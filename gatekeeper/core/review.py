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

:func:`window_figures` reads one window's hash for the report's charts (decisions by kind, the
tax, slack misses, and the free queue's oldest age that ``gate.lua`` saw in it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from gatekeeper.core.dwell import Decision, Reason

__all__ = [
    "DEFER_FIT",
    "FREE_AGE_MAX",
    "KINDS",
    "RATIO_MEANINGS",
    "RESERVED_AGE_SHIFT",
    "Review",
    "WindowFigures",
    "review_marks",
    "summarize_review",
    "window_figures",
]

KINDS = ("admit_free", "defer", "reserved")
"""The decision kinds, in the order the review shows them."""
FREE_AGE_MAX = "free_age_max_ms"
"""Window field: the oldest free-queue age (ms) a decision of ``gate.lua`` saw in the window
(absent in windows written before it was kept, and while the free queue stayed empty)."""
RATIO_MEANINGS = {
    "free_missed": "free admissions that ended after their deadline "
    "(high: the service-time guesses are too kind)",
    "defer_savable": "age-cap defers whose dwell still fit the deadline "
    "(high: reserved capacity could have run them at once)",
    "reserved_age_shift": "shifts to reserved that only the free queue's age caused "
    "(high: the age cap is stricter than the deadlines)",
}
"""Each review ratio in a few words, for the demo and the HTML report."""
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
    def by_kind(self) -> dict[str, int]:
        """Decisions by kind (admit_free, defer, reserved), every reason added up."""
        kinds = dict.fromkeys(KINDS, 0)
        for name, number in self.decisions.items():
            kind = name.split("/")[0]
            kinds[kind] = kinds.get(kind, 0) + number
        return kinds

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
    review = Review(
        windows=count,
        free_admissions=totals["admitted_free"],
        slack_misses=totals["slack_misses"],
        defers=0,
        defers_savable=totals[DEFER_FIT],
        reserved=0,
        reserved_age_shifts=totals[RESERVED_AGE_SHIFT],
        decisions=decisions,
    )
    kinds = review.by_kind
    return replace(review, defers=kinds["defer"], reserved=kinds["reserved"])


@dataclass(frozen=True)
class WindowFigures:
    """What the report draws for one window."""

    window_id: int
    decisions: dict[str, int]
    """By kind (:data:`KINDS`); replays included: every scoring of a deferred task counts."""
    tax_units: float
    admitted_free: int
    slack_misses: int
    killed_free: int
    free_age_max_s: float | None
    """None where the window does not keep it (written before it was kept, or empty)."""


def window_figures(window_id: int, fields: Mapping[str, str]) -> WindowFigures:
    """One window's figures from its hash as stored (missing fields are zero)."""
    age = fields.get(FREE_AGE_MAX)
    return WindowFigures(
        window_id=window_id,
        decisions=summarize_review([fields]).by_kind,
        tax_units=float(fields.get("tax_units", 0)),
        admitted_free=int(fields.get("admitted_free", 0)),
        slack_misses=int(fields.get("slack_misses", 0)),
        killed_free=int(fields.get("killed_free", 0)),
        free_age_max_s=None if age is None else float(age) / 1000,
    )
