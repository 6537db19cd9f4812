"""SPEC section 2: a row's retry tax, the admission inequality in both modes, the summary."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatekeeper.core.dwell import Reason
from gatekeeper.core.ledger import (
    BudgetMode,
    LedgerRow,
    Outcome,
    Path,
    admit,
    make_row,
    row_retry_tax,
    summarize,
    window_id,
)


def test_worked_vector_killed_first_attempt_costs_1620() -> None:
    row = make_row(
        job_id="3",
        attempt=1,
        path=Path.FREE,
        outcome=Outcome.KILLED,
        queue_wait_ms=2100,
        tokens_in=1200,
        tokens_out=0,
        deadline_slack_ms=5000,
        queue_wait_unit_per_second=200,
    )
    assert row.retry_tax == 1620


# outcome, tokens_in, queue_wait_ms, unit, retry_tax
TAX_VECTORS = [
    (Outcome.KILLED, 1200, 2100, 200, 1620),
    (Outcome.OK, 1200, 2100, 200, 420),
    (Outcome.OK, 1200, 0, 200, 0),
    (Outcome.KILLED, 1200, 0, 200, 1200),
    (Outcome.REJECTED, 1200, 2100, 200, 0),
    (Outcome.ABANDONED, 1200, 2100, 200, 0),
    (Outcome.KILLED, 500, 1500, 0, 500),
]


@pytest.mark.parametrize(("outcome", "tokens", "wait_ms", "unit", "tax"), TAX_VECTORS)
def test_row_tax_follows_the_formula(
    outcome: Outcome, tokens: int, wait_ms: int, unit: float, tax: float
) -> None:
    assert row_retry_tax(outcome, tokens, wait_ms, unit) == tax


@pytest.mark.parametrize("outcome", [Outcome.REJECTED, Outcome.ABANDONED])
def test_rejected_and_abandoned_rows_carry_no_tokens(outcome: Outcome) -> None:
    row = make_row(
        job_id="1",
        attempt=1,
        path=Path.FREE,
        outcome=outcome,
        queue_wait_ms=0,
        tokens_in=1200,
        tokens_out=50,
        deadline_slack_ms=-10,
    )
    assert (row.tokens_in, row.tokens_out, row.retry_tax) == (0, 0, 0)


def test_a_row_refuses_attempt_zero() -> None:
    with pytest.raises(ValueError, match="attempt"):
        make_row(
            job_id="1",
            attempt=0,
            path=Path.FREE,
            outcome=Outcome.OK,
            queue_wait_ms=0,
            tokens_in=1,
            tokens_out=1,
            deadline_slack_ms=1,
        )


def test_row_json_has_every_spec_field_in_order() -> None:
    row = make_row(
        job_id="j",
        attempt=2,
        path=Path.RESERVED,
        outcome=Outcome.OK,
        queue_wait_ms=10,
        tokens_in=5,
        tokens_out=6,
        deadline_slack_ms=7,
    )
    assert list(row.to_json()) == [
        "job_id",
        "attempt",
        "path",
        "queue_wait_ms",
        "tokens_in",
        "tokens_out",
        "outcome",
        "deadline_slack_ms",
        "retry_tax",
    ]
    assert row.to_json()["path"] == "reserved"
    assert list(row.to_json()) == [field.name for field in fields(LedgerRow)]  # none left out
    assert LedgerRow.from_json(row.to_json()) == row


# tax_units, exposure, queue_age_s, tokens, budget, mode, admitted, projected
ADMIT_VECTORS = [
    (0, 0, 0, 1200, 1200, BudgetMode.EXPOSURE, True, 0),
    (0, 0, 0, 1201, 1200, BudgetMode.EXPOSURE, False, 0),
    (5000, 2400, 2, 1200, 9000, BudgetMode.EXPOSURE, True, 7800),
    (5000, 2400, 3, 1200, 9000, BudgetMode.EXPOSURE, False, 8000),
    (5000, 2400, 3, 1200, 9000, BudgetMode.OPTIMISTIC, True, 5600),
    (11000, 0, 0, 1200, 12000, BudgetMode.OPTIMISTIC, False, 11000),
]


@pytest.mark.parametrize(
    ("tax", "exposure", "age", "tokens", "budget", "mode", "admitted", "projected"),
    ADMIT_VECTORS,
)
def test_admission_inequality(
    tax: float,
    exposure: float,
    age: float,
    tokens: int,
    budget: float,
    mode: BudgetMode,
    admitted: bool,
    projected: float,
) -> None:
    answer = admit(
        tax_units=tax,
        exposure=exposure,
        queue_age_s=age,
        tokens_in=tokens,
        budget_units=budget,
        queue_wait_unit_per_second=200,
        mode=mode,
    )
    assert (answer.admitted, answer.projected_tax) == (admitted, projected)
    assert answer.reason is (Reason.FITS if admitted else Reason.RETRY_TAX_BUDGET)


def test_optimistic_mode_ignores_exposure_that_exposure_mode_counts() -> None:
    args = {
        "tax_units": 0,
        "exposure": 11_000,
        "queue_age_s": 0,
        "tokens_in": 1200,
        "budget_units": 12_000,
    }
    assert admit(**args, mode=BudgetMode.OPTIMISTIC).admitted
    assert not admit(**args, mode=BudgetMode.EXPOSURE).admitted


@given(
    st.floats(min_value=0, max_value=1e7),
    st.floats(min_value=0, max_value=1e7),
    st.floats(min_value=0, max_value=1e4),
    st.integers(min_value=0, max_value=100_000),
    st.floats(min_value=0, max_value=1e7),
)
def test_exposure_mode_never_admits_what_optimistic_refuses(
    tax: float, exposure: float, age: float, tokens: int, budget: float
) -> None:
    args = {
        "tax_units": tax,
        "exposure": exposure,
        "queue_age_s": age,
        "tokens_in": tokens,
        "budget_units": budget,
    }
    if admit(**args, mode=BudgetMode.EXPOSURE).admitted:
        assert admit(**args, mode=BudgetMode.OPTIMISTIC).admitted


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_budget_inputs_refuse(bad: float) -> None:
    assert not admit(
        tax_units=bad, exposure=0, queue_age_s=0, tokens_in=1, budget_units=10
    ).admitted
    assert not admit(tax_units=0, exposure=0, queue_age_s=0, tokens_in=1, budget_units=bad).admitted


def _row(outcome: Outcome, path: Path, tokens: int = 1200, wait_ms: int = 1000):  # type: ignore[no-untyped-def]
    return make_row(
        job_id="j",
        attempt=1,
        path=path,
        outcome=outcome,
        queue_wait_ms=wait_ms,
        tokens_in=tokens,
        tokens_out=0,
        deadline_slack_ms=0,
    )


def test_summary_counts_outcomes_and_charges_only_free_rows() -> None:
    rows = [
        _row(Outcome.OK, Path.FREE),  # 200
        _row(Outcome.KILLED, Path.FREE),  # 1400
        _row(Outcome.KILLED, Path.RESERVED),  # recorded, not charged
        _row(Outcome.OK, Path.RESERVED),
        _row(Outcome.REJECTED, Path.FREE),
        _row(Outcome.ABANDONED, Path.FREE),
    ]
    summary = summarize(rows, budget_units=12_000)
    assert summary.tax_units == 1600
    assert summary.line() == "finished=2 killed_rows=2 rejected=1 abandoned=1 budget_left=10400"


def test_budget_left_rounds_down_and_goes_negative() -> None:
    rows = [_row(Outcome.KILLED, Path.FREE, tokens=1000, wait_ms=1)]  # 1000.2
    assert summarize(rows, budget_units=1000).budget_left == -1
    assert summarize(rows, budget_units=1001).budget_left == 0


def test_windows_are_aligned_to_the_epoch() -> None:
    assert window_id(0, 900) == 0
    assert window_id(899.999, 900) == 0
    assert window_id(900, 900) == 1
    assert window_id(1_800_000_123, 900) == 1_800_000_123 // 900


def test_window_width_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_seconds"):
        window_id(10, 0)
