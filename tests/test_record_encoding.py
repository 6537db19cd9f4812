"""The decision record's shorter encoding (issue 15): ``gate.lua`` leaves the decision and
the default budget mode empty and sends whole numbers as integers; every record, written
so or spelled out by the previous version, reads back as the same inputs and decision."""

from __future__ import annotations

import math
import struct
from dataclasses import replace

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from gatekeeper.core.dwell import DECIDED_BY, Decision, Reason
from gatekeeper.core.ledger import BudgetMode
from gatekeeper.core.whatif import DecisionRecord, redecide
from gatekeeper.redis.decisions import read_records
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.numbers import exact
from gatekeeper.redis.store import GateStore
from tests.calls import gate_call

KEYS = Keys()
NOW = 1_800_000_000.0


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


@given(st.floats(allow_nan=False) | st.integers(-(2**60), 2**60).map(float))
def test_a_number_reads_back_as_the_same_double_and_never_longer(value: float) -> None:
    text = exact(value)
    assert bits(float(text)) == bits(value)  # -0.0 stays -0.0
    assert len(text) <= len(repr(value))


@pytest.mark.parametrize(
    ("value", "text"),
    [(600.0, "600"), (1e12, "1000000000000"), (0.0, "0"), (-0.0, "-0.0"), (0.01, "0.01"),
     (2.0**53, "9007199254740992.0"), (math.inf, "inf"), (-3.0, "-3")],
)  # fmt: skip
def test_whole_numbers_are_written_as_integers(value: float, text: str) -> None:
    assert exact(value) == text


def test_every_reason_the_gate_script_gives_has_one_decision() -> None:
    scripted = {"fits", "non_finite_input", "bad_service_guess", "deadline_passed",
                "negative_input", "queue_age_cap", "dwell_over_slack", "retry_tax_budget",
                "state_missing", "free_path_disabled", "duplicate_publish"}  # fmt: skip
    assert set(DECIDED_BY) == scripted
    assert DECIDED_BY[Reason.FITS.value] == Decision.ADMIT_FREE.value
    assert DECIDED_BY[Reason.QUEUE_AGE_CAP.value] == Decision.DEFER.value


@pytest.mark.parametrize(
    ("slack", "decided"), [(600.0, "admit_free/fits"), (5.0, "reserved/dwell_over_slack")]
)
def test_a_gate_record_leaves_out_what_it_need_not_spell(
    redis_client: redis.Redis, slack: float, decided: str
) -> None:
    call = gate_call(NOW, expected_service_s=8.0, deadline_slack_s=slack, budget_units=1e12,
                     queue_wait_unit_per_second=200.0, max_queue_age_s=30.0,
                     budget_mode=BudgetMode.EXPOSURE)  # fmt: skip
    GateStore(redis_client, KEYS).score(call)
    (_, raw), *_ = redis_client.xrange(KEYS.decisions)
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    assert (fields["d"], fields["m"]) == ("", "")
    assert (fields["s"], fields["l"], fields["c"], fields["b"], fields["u"], fields["y"]) == (
        "8", exact(slack), "30", "1000000000000", "200", "0"
    )  # fmt: skip
    (record,) = read_records(redis_client, KEYS, 0).records
    assert f"{record.decision}/{record.reason}" == decided
    assert record.budget_mode == "exposure" and record.budget_units == 1e12
    again = redecide(record)
    assert f"{again.decision}/{again.reason}" == decided


def test_a_record_spelled_out_by_the_previous_version_reads_as_the_new_one(
    redis_client: redis.Redis,
) -> None:
    old = {"d": "defer", "r": "queue_age_cap", "j": "job:1", "k": "t", "a": "41.0", "s": "8.0",
           "x": "8.0", "l": "90.0", "y": "0.0", "n": "1200", "c": "30.0", "b": "60000.0",
           "u": "200.0", "m": "exposure", "tu": "0", "e": "0", "p": "8.0||0|1|30.0"}  # fmt: skip
    new = {**old, "d": "", "a": "41", "s": "8", "x": "8", "l": "90", "y": "0", "c": "30",
           "b": "60000", "u": "200", "m": "", "p": "8||0|1|30"}  # fmt: skip
    for fields in (old, new):
        redis_client.xadd(KEYS.decisions, fields)  # type: ignore[arg-type]
    first, second = read_records(redis_client, KEYS, 0).records
    assert isinstance(first, DecisionRecord) and first.decision == "defer"
    assert replace(first, at_ms=0) == replace(second, at_ms=0)
