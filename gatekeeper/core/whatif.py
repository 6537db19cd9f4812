"""What-if on recorded decisions (SPEC section 7): each recorded decision re-decided under one
changed knob with the same pure core, and the two columns compared. Pure.

A :class:`DecisionRecord` holds a decision's inputs exactly as the script that made it saw them
(``gate.lua`` writes them with the decision; ``record.lua`` for a decision made in process):
never the task's arguments. :func:`redecide` takes them through the same order as the publish
path (:mod:`gatekeeper.redis.gate`): what the flags and the pipeline decided before any knob
stands; then :func:`~gatekeeper.core.dwell.decide` with the knob's cap or service time; then,
for an admission, :func:`~gatekeeper.core.ledger.admit` with the knob's budget or wait weight,
against the window's tax and exposure **as the script saw them**. Each decision is re-decided
on its own: an admission the knob adds or removes does not change the exposure later decisions
saw (what that would have cost is :mod:`gatekeeper.ops.simulator`'s question).

:func:`compare` counts both columns by kind and reason, lists what changes, and computes the
review's three ratios (:mod:`gatekeeper.core.review`) for each. Free admissions that later
missed their slack are known only for attempts admitted in both columns (the record keeps the
misses, by job and attempt); one the knob newly admits has no known outcome and is counted as
unknown, never guessed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gatekeeper.core.dwell import Decision, GateInputs, Reason, decide, retry_tax_s
from gatekeeper.core.ledger import BudgetMode, admit
from gatekeeper.core.review import Review, review_marks
from gatekeeper.core.service import ServiceTimeMode, choose_service

__all__ = [
    "KNOBS",
    "Change",
    "Comparison",
    "DecisionRecord",
    "Knob",
    "Redecided",
    "compare",
    "record_fields",
    "redecide",
]

KNOBS = ("max_queue_age_s", "budget_units", "queue_wait_unit_per_second", "service_time")
"""The knobs ``gatekeeper tune`` changes, one at a time."""
SCORED = frozenset(r.value for r in (
    Reason.NON_FINITE_INPUT, Reason.BAD_SERVICE_GUESS, Reason.DEADLINE_PASSED,
    Reason.NEGATIVE_INPUT, Reason.QUEUE_AGE_CAP, Reason.DWELL_OVER_SLACK, Reason.FITS,
    Reason.RETRY_TAX_BUDGET,
))  # fmt: skip
"""Reasons the dwell gate and the budget give: only these can change with a knob. The others
(the flags, a duplicate publish, a bad input, a lost state marker) were decided before."""
GUARDS = frozenset(r.value for r in (
    Reason.NON_FINITE_INPUT, Reason.BAD_SERVICE_GUESS, Reason.DEADLINE_PASSED,
    Reason.NEGATIVE_INPUT,
))  # fmt: skip
FIELDS = ("d", "r", "j", "k", "a", "s", "x", "l", "y", "n", "c", "b", "u", "m", "tu", "e", "p")
"""A record's fields in the stream, in this order (the same names in every entry, so Redis
stores them once per node): decision, reason, ``<job_id>:<attempt>``, task label, queue age,
service used, retry tax, slack, delay, tokens, cap, budget, wait weight, budget mode, the
window's tax and exposure, and ``p`` = ``<declared>|<learned p95>|<samples>|<retries left>|
<wait allowance s>`` (what the publisher knew). Empty: not read (a decision made in process)."""


@dataclass(frozen=True)
class DecisionRecord:
    """One recorded decision and its inputs (seconds, units), as its script saw them."""

    job_id: str
    attempt: int
    task: str
    decision: str
    reason: str
    queue_age_s: float | None
    """None: the free queue was not read (a decision made in process, before the script)."""
    expected_service_s: float
    retry_tax_s: float
    deadline_slack_s: float
    delay_s: float
    tokens_in: int
    max_queue_age_s: float
    budget_units: float
    queue_wait_unit_per_second: float
    budget_mode: str
    tax_units: float | None
    exposure: float | None
    service_declared_s: float
    service_learned_p95_s: float | None
    service_samples: int
    retries_left: int
    wait_allowance_s: float
    at_ms: int = 0
    """When it was recorded (the stream entry's id)."""

    @classmethod
    def from_fields(cls, fields: Mapping[str, str], at_ms: int = 0) -> DecisionRecord:
        """Parse a stream entry; raises ValueError (or KeyError) for one that is not a record."""
        job_id, _, attempt = fields["j"].rpartition(":")
        declared, p95, samples, left, allowance = fields["p"].split("|")
        return cls(
            job_id=job_id, attempt=int(attempt), task=fields["k"], decision=fields["d"],
            reason=fields["r"], queue_age_s=_maybe(fields["a"]),
            expected_service_s=_number(fields["s"]), retry_tax_s=_number(fields["x"]),
            deadline_slack_s=_number(fields["l"]), delay_s=_number(fields["y"]),
            tokens_in=int(fields["n"] or 0), max_queue_age_s=_number(fields["c"]),
            budget_units=_number(fields["b"]), queue_wait_unit_per_second=_number(fields["u"]),
            budget_mode=fields["m"], tax_units=_maybe(fields["tu"]),
            exposure=_maybe(fields["e"]), service_declared_s=_number(declared),
            service_learned_p95_s=_maybe(p95), service_samples=int(samples or 0),
            retries_left=int(left or 0), wait_allowance_s=_number(allowance), at_ms=at_ms,
        )  # fmt: skip


def record_fields(values: Mapping[str, str]) -> list[str]:
    """Field, value pairs in :data:`FIELDS` order (missing ones empty), for ``XADD``."""
    out: list[str] = []
    for name in FIELDS:
        out += [name, values.get(name, "")]
    return out


def _number(text: str) -> float:
    return float(text) if text else math.nan


def _maybe(text: str) -> float | None:
    return float(text) if text else None


@dataclass(frozen=True)
class Knob:
    """One changed setting: a name from :data:`KNOBS` and its value."""

    name: str
    value: float | str


@dataclass(frozen=True)
class Redecided:
    """A record re-decided: ``decision`` None when the record cannot tell (an input the knob
    needs was never read)."""

    decision: str | None
    reason: str | None
    dwell_s: float
    expected_service_s: float
    retry_tax_s: float


def redecide(record: DecisionRecord, knob: Knob | None = None, min_samples: int = 1) -> Redecided:
    """The decision the record's inputs get under ``knob`` (None: as recorded).

    ``min_samples`` is ``service_time_min_samples`` for a ``service_time`` knob."""
    service, tax = record.expected_service_s, record.retry_tax_s
    cap, budget = record.max_queue_age_s, record.budget_units
    unit = record.queue_wait_unit_per_second
    if knob is not None and knob.name == "service_time":
        mode: ServiceTimeMode = knob.value  # type: ignore[assignment]
        service, _ = choose_service(mode, record.service_declared_s,
                                    record.service_learned_p95_s, record.service_samples,
                                    min_samples)  # fmt: skip
        tax = retry_tax_s(record.retries_left, service)
    elif knob is not None:
        value = float(knob.value)
        cap = value if knob.name == "max_queue_age_s" else cap
        budget = value if knob.name == "budget_units" else budget
        unit = value if knob.name == "queue_wait_unit_per_second" else unit
    age = record.queue_age_s
    gate = decide(GateInputs(age or 0.0, service, tax, record.deadline_slack_s, cap,
                             record.delay_s))  # fmt: skip
    if record.reason not in SCORED:  # decided before the gate: no knob changes it
        return Redecided(record.decision, record.reason, gate.dwell_s, service, tax)
    if gate.reason.value in GUARDS:
        return Redecided(gate.decision.value, gate.reason.value, gate.dwell_s, service, tax)
    if age is None:  # past the guards, the queue's age decides, and it was never read
        return Redecided(None, None, gate.dwell_s, service, tax)
    if gate.decision is not Decision.ADMIT_FREE:
        return Redecided(gate.decision.value, gate.reason.value, gate.dwell_s, service, tax)
    if record.tax_units is None or record.exposure is None:
        return Redecided(None, None, gate.dwell_s, service, tax)
    answer = admit(
        tax_units=record.tax_units, exposure=record.exposure, queue_age_s=age,
        tokens_in=record.tokens_in, budget_units=budget, queue_wait_unit_per_second=unit,
        mode=BudgetMode(record.budget_mode), wait_allowance_s=record.wait_allowance_s,
    )  # fmt: skip
    decision = Decision.ADMIT_FREE if answer.admitted else Decision.RESERVED
    return Redecided(decision.value, answer.reason.value, gate.dwell_s, service, tax)


@dataclass(frozen=True)
class Change:
    """One decision that the knob changes (``now`` None: the record cannot tell)."""

    record: DecisionRecord
    was: str
    now: str | None


@dataclass(frozen=True)
class Comparison:
    """Both columns: decisions by ``decision/reason``, the changes, the review for each."""

    records: int
    as_was: dict[str, int]
    would_be: dict[str, int]
    changes: list[Change]
    undecidable: int
    """Records the knob needs an input for that was never read: in no ``would_be`` count."""
    review_was: Review
    review_now: Review
    unknown_outcomes: int
    """Free admissions the knob adds: their outcome (a slack miss or not) is unknown."""
    missed: int = field(default=0)
    """Slack misses in the record that belong to a recorded free admission."""


def _missed_admissions(
    records: list[DecisionRecord], misses: Iterable[tuple[str, int, int]]
) -> set[int]:
    """Indexes of the admissions that later missed their slack: each miss (job id, attempt,
    when) belongs to the job's latest free admission at or before that attempt and moment."""
    admissions: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        if record.decision == Decision.ADMIT_FREE.value:
            admissions.setdefault(record.job_id, []).append(index)
    missed: set[int] = set()
    for job_id, attempt, at_ms in misses:
        owner = None
        for index in admissions.get(job_id, ()):
            record = records[index]
            if record.attempt <= attempt and record.at_ms <= at_ms:
                owner = index
        if owner is not None:
            missed.add(owner)
    return missed


def _review(
    decisions: dict[str, int], admissions: int, misses: int, fit: int, shift: int
) -> Review:
    kinds = Counter[str]()
    for name, number in decisions.items():
        kinds[name.split("/")[0]] += number
    return Review(windows=0, free_admissions=admissions, slack_misses=misses,
                  defers=kinds[Decision.DEFER.value], defers_savable=fit,
                  reserved=kinds[Decision.RESERVED.value], reserved_age_shifts=shift,
                  decisions=dict(decisions))  # fmt: skip


def compare(
    records: Iterable[DecisionRecord],
    misses: Iterable[tuple[str, int, int]] = (),
    knob: Knob | None = None,
    min_samples: int = 1,
) -> Comparison:
    """Re-decide every record under ``knob``; ``misses`` are the recorded slack misses as
    ``(job_id, attempt, at_ms)``."""
    kept = list(records)
    missed = _missed_admissions(kept, misses)
    was: Counter[str] = Counter()
    now: Counter[str] = Counter()
    marks = {"was": [0, 0], "now": [0, 0]}
    changes: list[Change] = []
    undecidable = unknown = known = known_missed = 0
    for index, record in enumerate(kept):
        before = f"{record.decision}/{record.reason}"
        was[before] += 1
        as_recorded = record.queue_age_s or 0.0
        dwell = as_recorded + record.expected_service_s + record.retry_tax_s + record.delay_s
        for i, mark in enumerate(review_marks(record.decision, record.reason, dwell,
                                              record.deadline_slack_s, record.expected_service_s,
                                              record.retry_tax_s)):  # fmt: skip
            marks["was"][i] += mark
        after = redecide(record, knob, min_samples)
        if after.decision is None:
            undecidable += 1
            changes.append(Change(record, before, None))
            continue
        name = f"{after.decision}/{after.reason}"
        now[name] += 1
        for i, mark in enumerate(review_marks(after.decision, after.reason or "", after.dwell_s,
                                              record.deadline_slack_s, after.expected_service_s,
                                              after.retry_tax_s)):  # fmt: skip
            marks["now"][i] += mark
        if after.decision == Decision.ADMIT_FREE.value:
            if record.decision == Decision.ADMIT_FREE.value:
                known += 1
                known_missed += index in missed
            else:
                unknown += 1
        if name != before:
            changes.append(Change(record, before, name))
    admitted_was = was.get(f"{Decision.ADMIT_FREE.value}/{Reason.FITS.value}", 0)
    return Comparison(
        records=len(kept), as_was=dict(was), would_be=dict(now), changes=changes,
        undecidable=undecidable,
        review_was=_review(dict(was), admitted_was, len(missed), *marks["was"]),
        review_now=_review(dict(now), known, known_missed, *marks["now"]),
        unknown_outcomes=unknown, missed=len(missed),
    )  # fmt: skip
