"""SPEC section 1: the dwell gate's vectors and the properties that must always hold."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatekeeper.core.dwell import Decision, GateInputs, Reason, decide, guards_pass, retry_tax_s

# queue_age_s, expected_service_s, retry_tax_s, deadline_slack_s, dwell_s, decision, reason
SPEC_VECTORS = [
    (12, 8, 8, 90, 28, Decision.ADMIT_FREE, Reason.FITS),
    (41, 8, 8, 90, 57, Decision.DEFER, Reason.QUEUE_AGE_CAP),
    (20, 8, 8, 30, 36, Decision.RESERVED, Reason.DWELL_OVER_SLACK),
    (20, 8, 0, 30, 28, Decision.ADMIT_FREE, Reason.FITS),
    (10, 0, 8, 90, 18, Decision.DEFER, Reason.BAD_SERVICE_GUESS),
    (10, 8, 8, -1, 26, Decision.DEFER, Reason.DEADLINE_PASSED),
    (50, 8, 8, 40, 66, Decision.DEFER, Reason.QUEUE_AGE_CAP),
]


@pytest.mark.parametrize(
    ("age", "service", "tax", "slack", "dwell", "decision", "reason"), SPEC_VECTORS
)
def test_spec_vectors_hold_exactly(
    age: float,
    service: float,
    tax: float,
    slack: float,
    dwell: float,
    decision: Decision,
    reason: Reason,
) -> None:
    result = decide(GateInputs(age, service, tax, slack, max_queue_age_s=30))
    assert (result.dwell_s, result.decision, result.reason) == (dwell, decision, reason)


def test_age_cap_fires_before_slack() -> None:
    # The injected stuck attempt: dwell 66 is over slack 40, but the cap speaks first.
    assert decide(GateInputs(50, 8, 8, 40)).reason is Reason.QUEUE_AGE_CAP


def test_age_at_the_cap_is_not_over_it() -> None:
    assert decide(GateInputs(30, 1, 0, 90, max_queue_age_s=30)).decision is Decision.ADMIT_FREE


def test_dwell_equal_to_slack_fits() -> None:
    assert decide(GateInputs(10, 10, 10, 30)).decision is Decision.ADMIT_FREE


def test_negative_service_guess_defers() -> None:
    result = decide(GateInputs(0, -1, 0, 90))
    assert (result.decision, result.reason, result.field) == (
        Decision.DEFER,
        Reason.BAD_SERVICE_GUESS,
        "expected_service_s",
    )


def test_zero_slack_means_the_deadline_is_gone() -> None:
    assert decide(GateInputs(0, 1, 0, 0)).reason is Reason.DEADLINE_PASSED


@pytest.mark.parametrize(
    "field",
    ["queue_age_s", "expected_service_s", "retry_tax_s", "deadline_slack_s", "max_queue_age_s"],
)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_defers_and_names_the_field(field: str, bad: float) -> None:
    values = {
        "queue_age_s": 1.0,
        "expected_service_s": 1.0,
        "retry_tax_s": 0.0,
        "deadline_slack_s": 90.0,
        "max_queue_age_s": 30.0,
    }
    values[field] = bad
    result = decide(GateInputs(**values))
    assert (result.decision, result.reason, result.field) == (
        Decision.DEFER,
        Reason.NON_FINITE_INPUT,
        field,
    )


def test_a_value_that_is_not_a_number_defers() -> None:
    result = decide(GateInputs("12", 8, 8, 90))  # type: ignore[arg-type]
    assert (result.decision, result.field) == (Decision.DEFER, "queue_age_s")


@pytest.mark.parametrize("field", ["queue_age_s", "retry_tax_s", "max_queue_age_s"])
def test_negative_age_tax_or_cap_fails_closed(field: str) -> None:
    values = {"queue_age_s": 1.0, "retry_tax_s": 0.0, "max_queue_age_s": 30.0}
    values[field] = -0.5
    result = decide(GateInputs(expected_service_s=1.0, deadline_slack_s=90.0, **values))
    assert (result.decision, result.reason, result.field) == (
        Decision.DEFER,
        Reason.NEGATIVE_INPUT,
        field,
    )


def test_retry_tax_is_one_service_interval_per_unused_retry() -> None:
    assert retry_tax_s(retries_left=2, expected_service_s=8) == 16
    assert retry_tax_s(retries_left=0, expected_service_s=8) == 0
    assert retry_tax_s(retries_left=-1, expected_service_s=8) == 0


# Properties. Any float, including NaN, infinities and negatives, for the guards; the valid
# domain (finite, age and tax non-negative) for monotonicity, since a negative age or tax is
# itself refused by a guard.
any_float = st.floats(allow_nan=True, allow_infinity=True)
non_negative = st.floats(min_value=0, max_value=1e6)
positive = st.floats(min_value=1e-3, max_value=1e6)
slack = st.floats(min_value=-1e6, max_value=1e6)
bump = st.floats(min_value=0, max_value=1e6)


@given(any_float, any_float, any_float, any_float, any_float)
def test_never_admits_when_a_guard_fails(
    age: float, service: float, tax: float, slack_s: float, cap: float
) -> None:
    result = decide(GateInputs(age, service, tax, slack_s, cap))
    values = (age, service, tax, slack_s, cap)
    guard_fails = (
        not all(math.isfinite(v) for v in values)
        or service <= 0
        or slack_s <= 0
        or age < 0
        or tax < 0
        or cap < 0
    )
    if guard_fails:
        assert result.decision is Decision.DEFER
    if result.decision is Decision.ADMIT_FREE:
        assert result.dwell_s <= slack_s and age <= cap


@given(non_negative, positive, non_negative, slack, non_negative)
def test_dwell_is_the_sum_of_its_parts(
    age: float, service: float, tax: float, slack_s: float, cap: float
) -> None:
    assert decide(GateInputs(age, service, tax, slack_s, cap)).dwell_s == age + service + tax


def _not_admitted(inputs: GateInputs) -> bool:
    return decide(inputs).decision is not Decision.ADMIT_FREE


@given(non_negative, positive, non_negative, slack, non_negative, bump)
def test_raising_queue_age_never_admits_what_was_refused(
    age: float, service: float, tax: float, slack_s: float, cap: float, more: float
) -> None:
    if _not_admitted(GateInputs(age, service, tax, slack_s, cap)):
        assert _not_admitted(GateInputs(age + more, service, tax, slack_s, cap))


@given(non_negative, positive, non_negative, slack, non_negative, bump)
def test_raising_retry_tax_never_admits_what_was_refused(
    age: float, service: float, tax: float, slack_s: float, cap: float, more: float
) -> None:
    if _not_admitted(GateInputs(age, service, tax, slack_s, cap)):
        assert _not_admitted(GateInputs(age, service, tax + more, slack_s, cap))


@given(non_negative, positive, non_negative, slack, non_negative, bump)
def test_raising_a_positive_service_time_never_admits_what_was_refused(
    age: float, service: float, tax: float, slack_s: float, cap: float, more: float
) -> None:
    if _not_admitted(GateInputs(age, service, tax, slack_s, cap)):
        assert _not_admitted(GateInputs(age, service + more, tax, slack_s, cap))


@given(non_negative, positive, non_negative, slack, non_negative, bump)
def test_lowering_the_slack_never_admits_what_was_refused(
    age: float, service: float, tax: float, slack_s: float, cap: float, less: float
) -> None:
    if _not_admitted(GateInputs(age, service, tax, slack_s, cap)):
        assert _not_admitted(GateInputs(age, service, tax, slack_s - less, cap))


@given(any_float, any_float, any_float, any_float, any_float)
def test_the_cheap_guard_check_agrees_with_decide(
    service: float, tax: float, slack: float, cap: float, delay: float
) -> None:
    # The publish path skips decide() when guards_pass says no guard can fire.
    deferred = decide(GateInputs(0.0, service, tax, slack, cap, delay)).decision is Decision.DEFER
    assert guards_pass(service, tax, slack, cap, delay) is not deferred


@pytest.mark.parametrize("bad", [True, None, "3"])
def test_the_cheap_guard_check_leaves_non_numbers_to_decide(bad: object) -> None:
    assert not guards_pass(1.0, 0.0, 10.0, 30.0, bad)  # type: ignore[arg-type]
