"""The night simulator: one declared night under one policy, in process, seeded (SPEC section 7).

A discrete-event simulation on a clock that starts at 0, with no server, no Redis and no
sleeping. Its rules (declared, not measured; :mod:`gatekeeper.night` holds the numbers):

- Jobs are published in batches of ``batch_size`` every ``batch_interval_s``; a job's deadline
  is its first publish plus ``deadline_s``, never extended.
- Every attempt's service time, start delay and kill coin are drawn up front from one
  ``random.Random(seed)``, job by job and attempt by attempt (:func:`draw_night`), so every
  policy faces the same night and only the routing differs.
- Each pool serves first come, first served. A free slot waits its start delay (the attempt
  still waiting), then runs it; one whose coin says killed dies ``kill_at_fraction`` through
  its service time, noticed ``kill_detect_s`` later: the slot is free again and the retry, if
  the task has one left, is published. Reserved slots never wait to start and never die.
- A job is **missed** when it has not finished by its deadline: finished late, abandoned, or
  its last attempt killed. ``wasted_tokens`` is the tokens of killed attempts; ``reserved_s``
  and ``free_s`` the slot-seconds each pool was held (start delays and dying runs included).

The policies: ``always_free`` (every attempt to free, the task's retries on a kill, no
deadline check), ``always_reserved`` (every job to reserved), and ``gate``, which decides
every attempt with the pure core the publish path uses, as ``gate.lua`` feeds it:
:func:`~gatekeeper.core.dwell.decide` on the free queue's age (its oldest admitted attempt
not yet started, within ``queue_age_horizon_s``; older ones are dropped, giving back what they
reserved), the retry tax of the retries left and the remaining slack; then
:func:`~gatekeeper.core.ledger.admit` against the admitting window's tax and exposure, an
admission holding :func:`~gatekeeper.core.ledger.reservation` until its row. Deferred
attempts are re-scored as the replayer does (the first time one poll later, then after a
doubling backoff; abandoned once the deadline has passed). A free attempt is charged its wait
since admission up to the allowance (plus its tokens when killed), never more than it
reserved, to the window that admitted it; one still waiting when a slot takes it after its
allowance is expired and runs on reserved. The gate is simulated on, for every job (canary
100 %); flags, the auto-freeze and Celery's own retry countdown are not simulated.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

from gatekeeper.core.dwell import Decision, GateInputs, decide, retry_tax_s
from gatekeeper.core.ledger import BudgetMode, admit, reservation, window_id
from gatekeeper.night import Draws, NightSettings, draw_night
from gatekeeper.settings import GatekeeperSettings

__all__ = ["Draws", "GateKnobs", "NightResult", "Policy", "draw_night", "run_night"]


class Policy(str, Enum):
    """How a simulated night routes its attempts."""

    ALWAYS_FREE = "always_free"
    ALWAYS_RESERVED = "always_reserved"
    GATE = "gate"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GateKnobs:
    """The settings the simulated gate and replayer decide with."""

    max_queue_age_s: float
    budget_units: float
    queue_wait_unit_per_second: float
    free_wait_allowance_s: float
    budget_mode: BudgetMode
    window_seconds: int
    replay_poll_s: float
    replay_backoff_s: float
    replay_backoff_max_s: float
    queue_age_horizon_s: float

    @classmethod
    def of(cls, settings: GatekeeperSettings) -> GateKnobs:
        """The knobs as the settings have them (what the publish path would use)."""
        return cls(**{name: getattr(settings, name) for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class NightResult:
    """What one policy did with one night."""

    policy: Policy
    jobs: int
    missed: int
    wasted_tokens: int
    reserved_s: float
    free_s: float
    killed: int
    retries: int
    """Retry attempts published (attempt 2 and later)."""
    deferred: int
    """Attempts deferred at least once."""
    rejected: int
    expired: int
    abandoned: int
    failed: int
    """Jobs whose last attempt was killed with no retry left."""
    completed: int
    """Jobs that finished (in time or late): with ``abandoned`` and ``failed``, every job."""
    p95_s: float
    """95th percentile (nearest rank) of first publish to finish, over the jobs that finished
    (late ones included); NaN when none did."""
    window_tax: tuple[float, ...] = ()
    """The tax charged to each window that admitted to free, in window order (gate only)."""


class _Attempt:
    __slots__ = ("admitted", "deferred", "draw", "job", "number", "replays", "reserve", "started",
                 "window")  # fmt: skip

    def __init__(self, job: int, number: int, draw: int) -> None:
        self.job, self.number, self.draw = job, number, draw
        self.admitted = self.started = math.inf  # admitted to free / started (or left) free
        self.reserve, self.window, self.replays, self.deferred = 0.0, 0, 0, False


_REPLAY, _FREE_END, _FREE_DEATH, _RESERVED_END = range(4)
_COUNTS = ("missed", "wasted_tokens", "killed", "retries", "deferred", "rejected", "expired",
           "abandoned", "failed")  # fmt: skip
"""The counters of :class:`NightResult` that a run keeps as attributes of the same name."""


class _Night:
    """The state of one simulation: two pools, their queues, the gate's windows, the counts."""

    def __init__(self, night: NightSettings, draws: Draws, policy: Policy, knobs: GateKnobs):
        self.night, self.draws, self.policy, self.knobs = night, draws, policy, knobs
        self.gated = policy is Policy.GATE
        routes = {Policy.ALWAYS_FREE: self.to_free, Policy.ALWAYS_RESERVED: self.to_reserved}
        self.publish = routes.get(policy, self.score)
        """Where a published attempt goes: a pool, or the gate's decision."""
        self.events: list[tuple[float, int, int, _Attempt]] = []
        self.seq = 0
        self.free_idle, self.reserved_idle = night.free_slots, night.reserved_slots
        self.free_queue: deque[_Attempt] = deque()
        self.reserved_queue: deque[_Attempt] = deque()
        self.waiting: deque[_Attempt] = deque()  # admitted to free, in admission order
        self.windows: dict[int, list[float]] = {}  # id -> [tax_units, exposure]
        self.deadlines = [arrival + night.deadline_s for arrival in draws.arrivals]
        self.finished: list[float] = []
        self.missed = self.wasted_tokens = self.killed = self.retries = self.deferred = 0
        self.rejected = self.expired = self.abandoned = self.failed = 0
        self.reserved_s = self.free_s = 0.0
        # The core is pure: an input seen before in this run gets the answer it got then
        # (a night repeats its inputs: an empty free queue, a batch's shared slack).
        self.decisions: dict[tuple[float, int, float], Decision] = {}
        self.admissions: dict[tuple[float, float, float], bool] = {}
        exposure = knobs.budget_mode is BudgetMode.EXPOSURE
        self.allowance = knobs.free_wait_allowance_s if exposure else 0.0
        """The wait an admission reserves (none in optimistic mode, as ``gate.lua``)."""
        self.reserve = reservation(
            night.tokens_in, self.allowance, knobs.queue_wait_unit_per_second
        )

    def at(self, when: float, kind: int, attempt: _Attempt) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, attempt))

    def run(self) -> NightResult:
        handlers = (self.replay, self.free_end, self.free_death, self.reserved_end)
        events, arrivals, per_job = self.events, self.draws.arrivals, self.night.attempts_per_job
        job, jobs = 0, len(arrivals)
        while job < jobs or events:
            # Arrivals are in time order already: merged in, not heaped, and published
            # before any other event of the same instant.
            if job < jobs and (not events or arrivals[job] <= events[0][0]):
                self.publish(_Attempt(job, 1, job * per_job), arrivals[job])
                job += 1
                continue
            now, _, kind, attempt = heapq.heappop(events)
            handlers[kind](attempt, now)
        return self.result()

    # Routing

    def score(self, attempt: _Attempt, now: float) -> None:
        night, knobs = self.night, self.knobs
        age = self.queue_age(now)
        slack = self.deadlines[attempt.job] - now
        decision = self.decisions.get((age, attempt.number, slack))
        if decision is None:
            retries_left = night.max_retries - (attempt.number - 1)
            tax = retry_tax_s(retries_left, night.expected_service_s)
            inputs = GateInputs(age, night.expected_service_s, tax, slack, knobs.max_queue_age_s)
            decision = self.decisions[age, attempt.number, slack] = decide(inputs).decision
        if decision is Decision.DEFER:
            if not attempt.deferred:
                attempt.deferred = True
                self.deferred += 1
            wait = knobs.replay_poll_s  # due at once: the replayer's next poll takes it
            if attempt.replays:
                backoff = knobs.replay_backoff_s * 2 ** (attempt.replays - 1)
                wait = min(backoff, knobs.replay_backoff_max_s)
            self.at(now + wait, _REPLAY, attempt)
            return
        if decision is Decision.ADMIT_FREE:
            ident = window_id(now, knobs.window_seconds)
            window = self.windows.setdefault(ident, [0.0, 0.0])
            budget = (window[0], window[1], age)
            admitted = self.admissions.get(budget)
            if admitted is None:
                admitted = self.admissions[budget] = admit(
                    tax_units=window[0],
                    exposure=window[1],
                    queue_age_s=age,
                    tokens_in=night.tokens_in,
                    budget_units=knobs.budget_units,
                    queue_wait_unit_per_second=knobs.queue_wait_unit_per_second,
                    mode=knobs.budget_mode,
                    wait_allowance_s=self.allowance,
                ).admitted
            if admitted:
                reserve = self.reserve
                window[1] += reserve
                attempt.reserve, attempt.window, attempt.admitted = reserve, ident, now
                self.waiting.append(attempt)
                self.to_free(attempt, now)
                return
            self.rejected += 1
        self.to_reserved(attempt, now)

    def replay(self, attempt: _Attempt, now: float) -> None:
        if self.deadlines[attempt.job] <= now:
            self.abandoned += 1
            self.missed += 1
            return
        attempt.replays += 1
        self.score(attempt, now)

    def queue_age(self, now: float) -> float:
        """The free queue's age as ``gate.lua`` reads it."""
        waiting, horizon = self.waiting, now - self.knobs.queue_age_horizon_s
        while waiting:
            oldest = waiting[0]
            if oldest.started <= now:
                waiting.popleft()
            elif oldest.admitted < horizon:  # gate.lua drops it and gives back its reserve
                waiting.popleft()
                self.windows[oldest.window][1] -= oldest.reserve
                oldest.reserve = 0.0
            else:
                return now - oldest.admitted
        return 0.0

    # The pools

    def to_free(self, attempt: _Attempt, now: float) -> None:
        self.free_queue.append(attempt)
        self.take_free(now)

    def take_free(self, now: float) -> None:
        draws, night = self.draws, self.night
        while self.free_idle and self.free_queue:
            attempt = self.free_queue.popleft()
            if self.gated and now - attempt.admitted >= self.knobs.free_wait_allowance_s:
                self.expire(attempt, now)
                continue
            self.free_idle -= 1
            delay, service = draws.start_delay_s[attempt.draw], draws.service_s[attempt.draw]
            attempt.started = now + delay
            if draws.killed[attempt.draw]:
                held = delay + service * night.kill_at_fraction + night.kill_detect_s
                self.at(now + held, _FREE_DEATH, attempt)
            else:
                held = delay + service
                self.at(now + held, _FREE_END, attempt)
            self.free_s += held

    def expire(self, attempt: _Attempt, now: float) -> None:
        """Past its allowance before it started: an ``expired`` row, then reserved."""
        self.expired += 1
        attempt.started = now  # it leaves the free queue's wait
        allowance_units = self.knobs.free_wait_allowance_s * self.knobs.queue_wait_unit_per_second
        self.charge(attempt, allowance_units)
        self.to_reserved(attempt, now)

    def charge(self, attempt: _Attempt, tax: float) -> None:
        """A free row's tax, capped at what the admission reserved, to the admitting window;
        the row closes the reservation."""
        if not self.gated:
            return
        window = self.windows[attempt.window]
        window[0] += min(tax, attempt.reserve)
        window[1] -= attempt.reserve
        attempt.reserve = 0.0

    def waited_units(self, attempt: _Attempt) -> float:
        waited = min(self.knobs.free_wait_allowance_s, attempt.started - attempt.admitted)
        return max(0.0, waited) * self.knobs.queue_wait_unit_per_second

    def free_end(self, attempt: _Attempt, now: float) -> None:
        self.free_idle += 1
        if self.gated:
            self.charge(attempt, self.waited_units(attempt))
        self.done(attempt.job, now)
        self.take_free(now)

    def free_death(self, attempt: _Attempt, now: float) -> None:
        night = self.night
        self.free_idle += 1
        self.killed += 1
        self.wasted_tokens += night.tokens_in
        if self.gated:
            self.charge(attempt, night.tokens_in + self.waited_units(attempt))
        if attempt.number <= night.max_retries:
            self.retries += 1
            self.publish(_Attempt(attempt.job, attempt.number + 1, attempt.draw + 1), now)
        else:
            self.failed += 1
            self.missed += 1
        self.take_free(now)

    def to_reserved(self, attempt: _Attempt, now: float) -> None:
        self.reserved_queue.append(attempt)
        self.take_reserved(now)

    def take_reserved(self, now: float) -> None:
        while self.reserved_idle and self.reserved_queue:
            taken = self.reserved_queue.popleft()
            self.reserved_idle -= 1
            service = self.draws.service_s[taken.draw]
            self.reserved_s += service
            self.at(now + service, _RESERVED_END, taken)

    def reserved_end(self, attempt: _Attempt, now: float) -> None:
        self.reserved_idle += 1
        self.done(attempt.job, now)
        self.take_reserved(now)

    def done(self, job: int, now: float) -> None:
        if now > self.deadlines[job]:
            self.missed += 1
        self.finished.append(now - self.draws.arrivals[job])

    def result(self) -> NightResult:
        finished = sorted(self.finished)
        p95 = finished[math.ceil(0.95 * len(finished)) - 1] if finished else math.nan
        return NightResult(
            policy=self.policy,
            jobs=self.night.jobs,
            reserved_s=self.reserved_s,
            free_s=self.free_s,
            completed=len(finished),
            p95_s=p95,
            window_tax=tuple(self.windows[ident][0] for ident in sorted(self.windows)),
            **{name: getattr(self, name) for name in _COUNTS},
        )


def run_night(night: NightSettings, draws: Draws, policy: Policy, knobs: GateKnobs) -> NightResult:
    """Simulate one night under one policy; pure (the draws carry all the randomness)."""
    if len(draws.arrivals) != night.jobs:
        raise ValueError(f"draws: expected {night.jobs} jobs' draws, got {len(draws.arrivals)}")
    return _Night(night, draws, policy, knobs).run()
