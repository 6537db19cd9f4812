"""Learned service times: a log-bucketed histogram of observed runs, and which value to use.

SPEC section 6. No Redis, no clock: :mod:`gatekeeper.redis.service_times` counts rows into the
buckets and reads them back; the publish pipeline asks :func:`choose_service` for the value.

The buckets are fixed and log-spaced: bucket ``i`` holds runs of ``[MIN_S * G**i,
MIN_S * G**(i+1))`` seconds, ``G = 1.1``, ``i`` from 0 to ``BUCKETS - 1`` (1 ms to about 52 h;
shorter runs count in the first bucket, longer ones in the last). One row adds one to one
bucket: constant cost, and at most ``BUCKETS`` counters per task whatever the traffic.

The estimate of a quantile is the geometric middle of the bucket that holds the sample's
``ceil(q * n)``-th smallest run, so for runs between 1 ms and 52 h it is within
:data:`RELATIVE_ERROR` (``sqrt(1.1) - 1``, 4.9 %) of that run, above or below.

A run killed by its time limit ran at least as long as it was allowed: it is counted in the
bucket of the time it ran, as a lower bound (``lower_bounds`` says how many). When such runs
sit in the top 5 %, the p95 is itself a lower bound of the tail they cut off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

__all__ = [
    "BUCKETS",
    "GROWTH",
    "MIN_S",
    "RELATIVE_ERROR",
    "ServiceHistogram",
    "ServiceTimeMode",
    "bucket_of",
    "bucket_value",
    "choose_service",
    "drifted",
]

ServiceTimeMode = Literal["declared", "learned", "max"]
MIN_S = 0.001
"""The lower edge of the first bucket: a millisecond, the ledger's own resolution."""
GROWTH = 1.1
"""Each bucket is 10 % wider than the one before."""
BUCKETS = 200
"""``MIN_S * GROWTH**200`` is about 190,000 s (52 h): longer than any deadline worth gating."""
RELATIVE_ERROR = math.sqrt(GROWTH) - 1
"""The most a quantile estimate is off, relative to the sample's run at that rank."""
_LOG_GROWTH = math.log(GROWTH)


def bucket_of(seconds: float) -> int:
    """The bucket a run of ``seconds`` counts in (clamped to the first and the last)."""
    if not seconds > MIN_S:  # also NaN
        return 0
    if math.isinf(seconds):
        return BUCKETS - 1
    return min(BUCKETS - 1, int(math.log(seconds / MIN_S) / _LOG_GROWTH))


def bucket_value(index: int) -> float:
    """The estimate a bucket stands for: its geometric middle."""
    return float(MIN_S * GROWTH ** (index + 0.5))


@dataclass(frozen=True)
class ServiceHistogram:
    """One task's observed runs, by bucket."""

    counts: Mapping[int, int] = field(default_factory=dict)
    lower_bounds: int = 0
    """How many of the runs were killed by their time limit (they ran at least that long)."""

    @cached_property
    def samples(self) -> int:
        """How many runs (computed once: every publish of the task asks, until the next read)."""
        return sum(self.counts.values())

    def quantile(self, q: float) -> float | None:
        """The estimate of the ``q`` quantile (0 < q <= 1); None with no runs."""
        total = self.samples
        if total == 0:
            return None
        rank = max(1, math.ceil(q * total))
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                return bucket_value(index)
        return bucket_value(max(self.counts))  # unreachable: the counts sum to total

    @cached_property
    def p95(self) -> float | None:
        return self.quantile(0.95)

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> ServiceHistogram:
        """Read the hash as stored: ``b<index>`` counts and ``lower_bounds``."""
        counts: dict[int, int] = {}
        for name, value in fields.items():
            if name.startswith("b") and name[1:].isdigit() and int(value) > 0:
                counts[int(name[1:])] = int(value)
        return cls(counts, int(fields.get("lower_bounds", 0)))


def choose_service(
    mode: ServiceTimeMode,
    declared_s: float,
    learned_p95_s: float | None,
    samples: int,
    min_samples: int,
) -> tuple[float, str]:
    """The service time a decision uses, and its source (``declared`` or ``learned``).

    ``declared`` always uses the declared value; ``learned`` the p95 once ``min_samples`` runs
    exist; ``max`` the larger of the two (then). A declared value that is not a positive
    finite number is used as it is, whatever the mode: the gate's guard must see it and fail
    closed, not have it hidden behind a learned one.
    """
    usable = learned_p95_s is not None and samples >= min_samples
    if mode == "declared" or not usable or not 0 < declared_s < math.inf:
        return declared_s, "declared"
    assert learned_p95_s is not None
    if mode == "learned" or learned_p95_s > declared_s:
        return learned_p95_s, "learned"
    return declared_s, "declared"


def drifted(declared_s: float, learned_p95_s: float | None, factor: float) -> bool:
    """Whether the observed p95 exceeds the declared guess by ``factor`` (or more)."""
    return learned_p95_s is not None and learned_p95_s > declared_s * factor
