"""The declared night of ``gatekeeper simulate`` (SPEC section 7): the TOML's ``[simulate]`` table.

A night is declared, not measured: the jobs and their deadline, the task as it is gated (its
declared service time, tokens and retries), the service times it really takes (a long tail),
a free pool (its slots, its start delays, its kill rate) and a reserved pool of fixed size.
The gate's own knobs are not here: the simulated gate uses the top-level settings, as the
publish path does. ``[simulate.tune]`` lists the values ``gate_tuned`` tries, one knob at a
time. The defaults below are the ones ``config/gatekeeper.toml`` declares, with where each
number comes from written next to it there.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TUNABLE_KNOBS", "Draws", "NightSettings", "TuneSettings", "draw_night"]

_Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
_Candidates = Annotated[
    list[Annotated[float, Field(ge=0, allow_inf_nan=False)]], Field(max_length=32)
]

TUNABLE_KNOBS = (
    "max_queue_age_s",
    "budget_units",
    "queue_wait_unit_per_second",
    "free_wait_allowance_s",
)
"""The gate's settings ``gate_tuned`` may change, one at a time, in this order."""


class TuneSettings(BaseModel):
    """The values ``gate_tuned`` tries for each knob (``[simulate.tune]``); an empty list
    leaves that knob alone. The current setting is always a candidate too."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_queue_age_s: _Candidates = [10.0, 20.0, 45.0, 60.0]
    budget_units: _Candidates = [24_000.0, 48_000.0, 96_000.0, 192_000.0]
    queue_wait_unit_per_second: _Candidates = [50.0, 100.0, 400.0]
    free_wait_allowance_s: _Candidates = [5.0, 20.0, 30.0]
    max_missed_share: float = Field(0.01, ge=0, le=1, allow_inf_nan=False)
    """The share of the night's jobs a tuned gate may miss: of the candidates within it, the
    one with the least reserved time wins (:mod:`gatekeeper.ops.simulate` states the rule)."""

    @model_validator(mode="after")
    def _positive_allowances(self) -> TuneSettings:
        if any(value <= 0 for value in self.free_wait_allowance_s):
            raise ValueError(
                "simulate.tune.free_wait_allowance_s: expected positive seconds, "
                f"got {self.free_wait_allowance_s!r}"
            )
        return self


class NightSettings(BaseModel):
    """One declared night; every time is in seconds from the night's start."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 7
    """Seeds every draw (service times, start delays, kills): same seed, same output."""
    tune_seed: int = 1
    """The seed ``gate_tuned`` is tuned on; it must differ from ``seed``, which it is
    reported on (a knob picked on the night it is scored on is fitted, not tested)."""
    jobs: int = Field(2000, ge=1, le=1_000_000)
    batch_size: int = Field(40, ge=1)
    """Jobs published at once; a batch every ``batch_interval_s``."""
    batch_interval_s: _Seconds = 90.0
    deadline_s: _PositiveSeconds = 90.0
    """Each job's deadline, after its first publish."""

    expected_service_s: _PositiveSeconds = 8.0
    """The task's declared service time (what the gate scores with)."""
    tokens_in: int = Field(1200, ge=0)
    max_retries: int = Field(2, ge=0, le=100)

    service: Literal["fixed", "lognormal"] = "lognormal"
    """``fixed``: every attempt takes ``service_median_s``; ``lognormal``: a long tail with
    that median and ``service_p95_s`` as its 95th percentile, cut at ``service_max_s``."""
    service_median_s: _PositiveSeconds = 8.0
    service_p95_s: _PositiveSeconds = 20.0
    service_max_s: _PositiveSeconds = 30.0

    free_slots: int = Field(8, ge=1, le=100_000)
    start_delay_max_s: _Seconds = 4.0
    """A free slot takes a start delay drawn uniformly from [0, this] before it runs an
    attempt (it is held meanwhile, and the attempt is still waiting)."""
    kill_rate: float = Field(0.25, ge=0, le=1, allow_inf_nan=False)
    """Share of attempts that die when they run on a free slot (reserved ones never do)."""
    kill_at_fraction: float = Field(0.5, ge=0, le=1, allow_inf_nan=False)
    """How far through its service time a killed attempt dies."""
    kill_detect_s: _Seconds = 6.0
    """A death is noticed this long after it: the slot is held until then, and the retry
    (when the task has one left) is published then."""
    reserved_slots: int = Field(6, ge=1, le=100_000)

    tune: TuneSettings = TuneSettings()

    @model_validator(mode="after")
    def _consistent(self) -> NightSettings:
        if self.tune_seed == self.seed:
            raise ValueError(
                f"simulate.tune_seed: expected a seed other than simulate.seed ({self.seed}): "
                "a knob tuned on the seed it is reported on is fitted, not tested"
            )
        if self.service != "lognormal":
            return self  # fixed: the median alone is used
        if self.service_p95_s <= self.service_median_s:
            raise ValueError(
                "simulate.service_p95_s: expected more than service_median_s "
                f"({self.service_median_s}) for a long tail, got {self.service_p95_s}"
            )
        if self.service_max_s < self.service_median_s:
            raise ValueError(
                "simulate.service_max_s: expected at least service_median_s "
                f"({self.service_median_s}), got {self.service_max_s}"
            )
        return self

    @property
    def lognormal_sigma(self) -> float:
        """The log-space spread that puts ``service_p95_s`` at the 95th percentile."""
        return math.log(self.service_p95_s / self.service_median_s) / _Z95

    @property
    def attempts_per_job(self) -> int:
        """The most attempts one job can take: the first and its retries."""
        return self.max_retries + 1


_Z95 = 1.6448536269514722
"""The standard normal's 95th percentile."""


@dataclass(frozen=True)
class Draws:
    """What the seed decided about a night: arrivals, and per attempt (``job * attempts_per_job
    + attempt - 1``) its service time, its start delay on a free slot and its kill coin."""

    arrivals: tuple[float, ...]
    service_s: tuple[float, ...]
    start_delay_s: tuple[float, ...]
    killed: tuple[bool, ...]


def draw_night(night: NightSettings, seed: int) -> Draws:
    """Every random number the night uses, drawn in a fixed order from ``random.Random(seed)``
    (rounded to the millisecond, as ledger rows are)."""
    rng = random.Random(seed)
    mu, sigma = math.log(night.service_median_s), night.lognormal_sigma
    service, delays, killed = [], [], []
    for _ in range(night.jobs * night.attempts_per_job):
        if night.service == "lognormal":
            drawn = min(rng.lognormvariate(mu, sigma), night.service_max_s)
            service.append(max(0.001, round(drawn, 3)))
        else:
            service.append(night.service_median_s)
        delays.append(round(rng.random() * night.start_delay_max_s, 3))
        killed.append(rng.random() < night.kill_rate)
    arrivals = tuple(
        (index // night.batch_size) * night.batch_interval_s for index in range(night.jobs)
    )
    return Draws(arrivals, tuple(service), tuple(delays), tuple(killed))
