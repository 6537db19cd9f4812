"""SPEC section 7's simulator: tiny nights whose outcomes are worked out by hand.

Every night here has fixed service times and no start delay, so each number below can be
followed on paper (the comments do). Unless a test says otherwise: one job, declared and real
service 8 s, deadline 90 s, 1200 tokens, two retries, the gate's default settings.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from gatekeeper.core.ledger import BudgetMode
from gatekeeper.night import NightSettings
from gatekeeper.ops.simulator import GateKnobs, NightResult, Policy, draw_night, run_night
from gatekeeper.settings import GatekeeperSettings

KNOBS = GateKnobs(
    max_queue_age_s=30.0,
    budget_units=12_000.0,
    queue_wait_unit_per_second=200.0,
    free_wait_allowance_s=10.0,
    budget_mode=BudgetMode.EXPOSURE,
    window_seconds=900,
    replay_poll_s=0.5,
    replay_backoff_s=1.0,
    replay_backoff_max_s=30.0,
    queue_age_horizon_s=300.0,
)
"""The gate's defaults, as the tests below work them out."""


def tiny(**night: Any) -> NightSettings:
    fields: dict[str, Any] = {
        "jobs": 1,
        "service": "fixed",
        "service_median_s": 8.0,
        "start_delay_max_s": 0.0,
        "kill_rate": 0.0,
        "free_slots": 1,
        "reserved_slots": 1,
    }
    return NightSettings(**{**fields, **night})


def run(night: NightSettings, policy: Policy, **knobs: Any) -> NightResult:
    tried = GateKnobs(**{**KNOBS.__dict__, **knobs})
    return run_night(night, draw_night(night, night.seed), policy, tried)


def outcome(result: NightResult) -> tuple[int, int, float, float]:
    return (result.missed, result.wasted_tokens, result.reserved_s, result.free_s)


def test_the_knobs_are_the_settings_defaults() -> None:
    assert GateKnobs.of(GatekeeperSettings()) == KNOBS


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (Policy.ALWAYS_FREE, (0, 0, 0.0, 8.0)),
        (Policy.ALWAYS_RESERVED, (0, 0, 8.0, 0.0)),
        # dwell 0 + 8 + 2 x 8 = 24 <= 90: admit_free; 0 + (1200 + 10 x 200) <= 12000: admitted.
        (Policy.GATE, (0, 0, 0.0, 8.0)),
    ],
)
def test_one_job_nothing_dies(policy: Policy, expected: tuple[int, int, float, float]) -> None:
    result = run(tiny(), policy)
    assert outcome(result) == expected
    assert (result.completed, result.p95_s) == (1, 8.0)


def test_a_job_whose_every_free_attempt_dies_runs_out_of_retries() -> None:
    # Attempt 1 dies at 4 s (half of 8), noticed at 10; attempt 2 runs 10..14, noticed at 20.
    result = run(tiny(kill_rate=1.0, max_retries=1), Policy.ALWAYS_FREE)
    assert outcome(result) == (1, 2400, 0.0, 20.0)
    assert (result.killed, result.retries, result.failed, result.completed) == (2, 1, 1, 0)
    assert math.isnan(result.p95_s)


def test_the_gate_charges_each_killed_free_attempt_its_tokens() -> None:
    # Attempt 1: dwell 16 <= 90, admitted, dies: 1200 tokens + 0 s of wait. Attempt 2 at 10 s:
    # dwell 8 <= 80, 1200 + 3200 <= 12000, admitted, dies: 1200 more. The gate cannot know.
    result = run(tiny(kill_rate=1.0, max_retries=1), Policy.GATE)
    assert outcome(result) == (1, 2400, 0.0, 20.0)
    assert result.window_tax == (2400.0,)


def test_the_retry_tax_sends_a_tight_job_to_reserved_where_free_would_miss() -> None:
    # Deadline 20 s. Free: three attempts die (0..10, 10..20, 20..30): missed, 3600 tokens.
    # The gate: dwell 0 + 8 + 2 x 8 = 24 > 20 -> reserved, done at 8 s.
    night = tiny(kill_rate=1.0, deadline_s=20.0)
    assert outcome(run(night, Policy.ALWAYS_FREE)) == (1, 3600, 0.0, 30.0)
    gate = run(night, Policy.GATE)
    assert outcome(gate) == (0, 0, 8.0, 0.0)
    assert gate.window_tax == ()


def test_a_reserved_pool_of_one_makes_the_second_job_late() -> None:
    # Two jobs at once, deadline 12 s: 0..8 in time, 8..16 late.
    result = run(tiny(jobs=2, deadline_s=12.0), Policy.ALWAYS_RESERVED)
    assert outcome(result) == (1, 0, 16.0, 0.0)
    assert result.p95_s == 16.0


def test_the_budget_rejects_what_it_cannot_reserve() -> None:
    # Budget 3200 is one reservation (1200 + 10 x 200). Job 1 admitted and started at once;
    # job 2: 0 + 3200 exposure + 0 age + 3200 > 3200 -> rejected -> reserved.
    result = run(tiny(jobs=2, free_slots=2), Policy.GATE, budget_units=3200.0)
    assert outcome(result) == (0, 0, 8.0, 8.0)
    assert result.rejected == 1
    assert result.window_tax == (0.0,)


def test_a_free_attempt_past_its_allowance_is_expired_to_reserved() -> None:
    # One free slot, real runs 12 s, no retries. Job 2 is admitted at 0 and still waiting at
    # 12 s (>= the 10 s allowance) when the slot is free: expired, charged 10 x 200 = 2000,
    # and runs on reserved 12..24, in time. Without the gate it runs on free 12..24.
    night = tiny(jobs=2, service_median_s=12.0, max_retries=0)
    gate = run(night, Policy.GATE, budget_units=1e6)
    assert outcome(gate) == (0, 0, 12.0, 12.0)
    assert (gate.expired, gate.window_tax) == (1, (2000.0,))
    assert outcome(run(night, Policy.ALWAYS_FREE)) == (0, 0, 0.0, 24.0)


def age_cap_night(deadline_s: float) -> NightSettings:
    """One free slot; jobs at 0, 35 and 70 s; real runs 100 s against the 8 s declared."""
    return tiny(jobs=3, batch_size=1, batch_interval_s=35.0, service_median_s=100.0,
                max_retries=0, deadline_s=deadline_s)  # fmt: skip


def test_the_age_cap_defers_and_the_replayer_backs_off_until_the_queue_is_young() -> None:
    # Job 1 runs 0..100. Job 2 (35 s) is admitted and waits. Job 3 (70 s) finds the queue 35 s
    # old > 30: deferred; replayed at 70.5, then after 1, 2, 4, 8 and 16 s (71.5, 73.5, 77.5,
    # 85.5, 101.5). At 100 job 2 starts (waited 65 s), so at 101.5 the queue is empty: job 3
    # is admitted, waits for job 2 to end, runs 200..300: first publish to end, 230 s.
    # Wait charges: job 2 65 s, job 3 98.5 s, at 200 a second (allowance 1000 s).
    result = run(age_cap_night(1000.0), Policy.GATE, budget_units=1e9, free_wait_allowance_s=1000.0)
    assert outcome(result) == (0, 0, 0.0, 300.0)
    assert (result.deferred, result.abandoned, result.p95_s) == (1, 0, 230.0)
    assert result.window_tax == (pytest.approx((65 + 98.5) * 200),)


def test_a_deferred_job_whose_deadline_passes_is_abandoned() -> None:
    # Deadline 30 s: job 3's is 100 s; its replay at 85.5 still finds the queue too old, the
    # next, at 101.5, finds the deadline gone. Jobs 1 and 2 finish late (100 and 200).
    result = run(age_cap_night(30.0), Policy.GATE, budget_units=1e9, free_wait_allowance_s=1000.0)
    assert (result.missed, result.abandoned, result.completed) == (3, 1, 2)


def test_optimistic_mode_reserves_tokens_only_and_caps_the_charge_there() -> None:
    # Optimistic: an admission reserves 1200 and no wait, so the expired attempt of the
    # allowance test is charged min(2000, 1200).
    night = tiny(jobs=2, service_median_s=12.0, max_retries=0)
    result = run(night, Policy.GATE, budget_units=1e6, budget_mode=BudgetMode.OPTIMISTIC)
    assert (result.expired, result.window_tax) == (1, (1200.0,))


def test_a_waiting_attempt_past_the_horizon_stops_counting_and_gives_back_its_reserve() -> None:
    # Horizon 20 s, one free slot busy 0..100. Job 2 (35 s) is admitted and waits; job 3
    # (70 s) finds it 35 s old but past the horizon: dropped, the queue's age is 0 and job 3
    # is admitted (not deferred). Job 2 reserved nothing after the drop: charged nothing.
    result = run(age_cap_night(1000.0), Policy.GATE, budget_units=1e9,
                 free_wait_allowance_s=1000.0, queue_age_horizon_s=20.0)  # fmt: skip
    assert result.deferred == 0
    # Job 3 waited from 70 to 200 (job 2 ran 100..200): 130 s x 200; job 2: nothing.
    assert result.window_tax == (pytest.approx(130 * 200),)


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_no_window_is_charged_more_than_its_budget(seed: int) -> None:
    night = NightSettings(seed=seed, jobs=600)
    for budget in (3200.0, 12_000.0, 48_000.0):
        result = run(night, Policy.GATE, budget_units=budget, queue_wait_unit_per_second=400.0)
        assert max(result.window_tax) <= budget


@pytest.mark.parametrize("policy", list(Policy))
def test_every_job_ends_exactly_once(policy: Policy) -> None:
    night = NightSettings(jobs=500, seed=5)
    result = run(night, policy)
    assert result.completed + result.abandoned + result.failed == night.jobs
    assert result.missed >= result.abandoned + result.failed


def test_every_policy_faces_the_same_draws() -> None:
    night = NightSettings(jobs=100)
    assert draw_night(night, 7) == draw_night(night, 7)
    assert draw_night(night, 7) != draw_night(night, 8)
    # Reserved never kills or waits: its seconds are exactly the first attempts' service times.
    draws = draw_night(night, 7)
    reserved = run_night(night, draws, Policy.ALWAYS_RESERVED, KNOBS).reserved_s
    first = sum(draws.service_s[job * night.attempts_per_job] for job in range(night.jobs))
    assert reserved == pytest.approx(first)
