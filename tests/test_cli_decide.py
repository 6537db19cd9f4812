"""``gatekeeper decide``: one decision from the command line."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gatekeeper.ops.cli import main

BASE = ["decide", "--queue-age-s", "12", "--expected-service-s", "8", "--retry-tax-s", "8"]


def test_prints_dwell_slack_decision_and_reason() -> None:
    result = CliRunner().invoke(main, [*BASE, "--deadline-slack-s", "90"])
    assert result.exit_code == 0
    assert result.output == "dwell=28 slack=90 decision=admit_free reason=fits\n"


def test_a_lower_cap_defers() -> None:
    result = CliRunner().invoke(
        main, [*BASE, "--deadline-slack-s", "90", "--max-queue-age-s", "10"]
    )
    assert result.output == "dwell=28 slack=90 decision=defer reason=queue_age_cap\n"


def test_the_cap_comes_from_settings_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEKEEPER_MAX_QUEUE_AGE_S", "11")
    result = CliRunner().invoke(main, [*BASE, "--deadline-slack-s", "90"])
    assert "decision=defer reason=queue_age_cap" in result.output


def test_fractional_values_print_to_the_millisecond() -> None:
    result = CliRunner().invoke(main, [*BASE, "--deadline-slack-s", "28.25"])
    assert result.output == "dwell=28 slack=28.25 decision=admit_free reason=fits\n"


def test_a_guard_names_the_field() -> None:
    args = ["decide", "--queue-age-s", "1", "--expected-service-s", "0", "--deadline-slack-s", "9"]
    result = CliRunner().invoke(main, args)
    assert result.output.endswith(
        "decision=defer reason=bad_service_guess field=expected_service_s\n"
    )


def test_nan_is_a_number_that_fails_closed() -> None:
    result = CliRunner().invoke(main, [*BASE, "--deadline-slack-s", "nan"])
    assert "decision=defer reason=non_finite_input field=deadline_slack_s" in result.output


@pytest.mark.parametrize("option", ["--queue-age-s", "--expected-service-s", "--deadline-slack-s"])
def test_a_value_that_is_not_a_number_exits_2_naming_the_option(option: str) -> None:
    values = {"--queue-age-s": "12", "--expected-service-s": "8", "--deadline-slack-s": "90"}
    values[option] = "soon"
    args = ["decide"] + [part for pair in values.items() for part in pair]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert option in result.output and "soon" in result.output


def test_bad_settings_exit_2_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEKEEPER_MAX_QUEUE_AGE_S", "-3")
    result = CliRunner().invoke(main, [*BASE, "--deadline-slack-s", "90"])
    assert result.exit_code == 2
    assert "GATEKEEPER_MAX_QUEUE_AGE_S" in result.output
