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
from dataclasses import dataclass

from gatekeeper.core.dwell import DECIDED_BY, Decision, GateInputs, Reason, decide, retry_tax_s
from gatekeeper.core.ledger import BudgetMode, admit
from gatekeeper.core.review import Review, review_marks
from gatekeeper.core.service import ServiceTimeMode, choose_service

__all__ = [
    "KNOBS",
    "NOTHING_KNOWN",
    "Change",
    "Comparison",
    "DecisionRecord",
    "Knob",
    "Redecided",
    "Tally",
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
<wait allowance s>`` (what the publisher knew). Empty: not read (a decision made in process);
but ``d`` empty is the one decision ``gate.lua`` gives its reason (``dwell.DECIDED_BY``) and
``m`` empty is ``exposure`` (so that a record costs less); a whole number may be written as an
integer (``600`` for ``600.0``). Records written before that spell them out, and read alike."""
NOTHING_KNOWN = "||0|0|0"
"""``p`` for a decision whose inputs could not be read (a bad input)."""


@dataclass(frozen=True, slots=True)
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
        declared, p95, samples, left, allowance = (fields["p"] or NOTHING_KNOWN).split("|")
        reason = fields["r"]
        return cls(
            job_id=job_id, attempt=int(attempt), task=fields["k"],
            decision=fields["d"] or DECIDED_BY[reason], reason=reason,
            queue_age_s=_maybe(fields["a"]),
            expected_service_s=_number(fields["s"]), retry_tax_s=_number(fields["x"]),
            deadline_slack_s=_number(fields["l"]), delay_s=_number(fields["y"]),
            tokens_in=int(fields["n"] or 0), max_queue_age_s=_number(fields["c"]),
            budget_units=_number(fields["b"]), queue_wait_unit_per_second=_number(fields["u"]),
            budget_mode=fields["m"] or BudgetMode.EXPOSURE.value, tax_units=_maybe(fields["tu"]),
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
    if record.reason not in SCORED:  # decided before the gate: no knob changes it
        return Redecided(record.decision, record.reason, math.nan, service, tax)
    age = record.queue_age_s
    gate = decide(GateInputs(age or 0.0, service, tax, record.deadline_slack_s, cap,
                             record.delay_s))  # fmt: skip
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
    changed: int
    undecidable: int
    """Records the knob needs an input for that was never read: in no ``would_be`` count."""
    changes: list[Change]
    """The first changes (all of them unless a limit was given), undecidable ones included."""
    superseded: int
    """Replays of an attempt that the knob would have handed on already (a defer that it
    admits or reserves): in no ``would_be`` count, for that attempt was decided once."""
    review_was: Review
    review_now: Review
    unknown_outcomes: int
    """Free admissions the knob adds: their outcome (a slack miss or not) is unknown."""


_HANDED_ON = (Decision.ADMIT_FREE.value, Decision.RESERVED.value)


@dataclass(slots=True)
class _Admission:
    attempt: int
    at_ms: int
    still: bool
    """Admitted in the would-be column too (its outcome is known there)."""


class Tally:
    """:func:`compare`, one record at a time, so that a week of records need not be held:
    what it keeps per record is a counter; per free admission a few numbers (its misses are
    attributed at the end); the changes up to ``show``."""

    def __init__(self, knob: Knob | None = None, min_samples: int = 1,
                 show: int | None = None) -> None:  # fmt: skip
        self.knob, self.min_samples, self.show = knob, min_samples, show
        self.was: Counter[str] = Counter()
        self.now: Counter[str] = Counter()
        self.marks = {"was": [0, 0], "now": [0, 0]}
        self.changes: list[Change] = []
        self.records = self.changed = self.undecidable = self.unknown = self.superseded = 0
        self.admissions: dict[str, list[_Admission]] = {}
        self.settled: set[tuple[str, int]] = set()
        """Attempts deferred as they were that the knob hands on: their replays follow."""

    def add(self, record: DecisionRecord) -> None:
        """Re-decide one record (records in the order they were made)."""
        self.records += 1
        before = f"{record.decision}/{record.reason}"
        self.was[before] += 1
        age = record.queue_age_s or 0.0
        dwell = age + record.expected_service_s + record.retry_tax_s + record.delay_s
        self._mark("was", record.decision, record.reason, dwell, record,
                   record.expected_service_s, record.retry_tax_s)  # fmt: skip
        admitted = record.decision == Decision.ADMIT_FREE.value
        attempt = (record.job_id, record.attempt)
        if attempt in self.settled:  # a replay of what the would-be column handed on
            self.superseded += 1
            if admitted:  # its outcome belongs to an attempt the knob already decided
                self.admissions.setdefault(record.job_id, []).append(
                    _Admission(record.attempt, record.at_ms, False)
                )
            return
        after = redecide(record, self.knob, self.min_samples)
        if record.decision == Decision.DEFER.value and after.decision in _HANDED_ON:
            self.settled.add(attempt)
        if after.decision is None:
            self.undecidable += 1
            self._change(Change(record, before, None))
        else:
            name = f"{after.decision}/{after.reason}"
            self.now[name] += 1
            self._mark("now", after.decision, after.reason or "", after.dwell_s, record,
                       after.expected_service_s, after.retry_tax_s)  # fmt: skip
            if after.decision == Decision.ADMIT_FREE.value and not admitted:
                self.unknown += 1
            if name != before:
                self.changed += 1
                self._change(Change(record, before, name))
        if admitted:
            still = after.decision == Decision.ADMIT_FREE.value
            self.admissions.setdefault(record.job_id, []).append(
                _Admission(record.attempt, record.at_ms, still)
            )

    def _mark(self, column: str, decision: str, reason: str, dwell: float,
              record: DecisionRecord, service: float, tax: float) -> None:  # fmt: skip
        marks = review_marks(decision, reason, dwell, record.deadline_slack_s, service, tax)
        for i, mark in enumerate(marks):
            self.marks[column][i] += mark

    def _change(self, change: Change) -> None:
        if self.show is None or len(self.changes) < self.show:
            self.changes.append(change)

    def result(self, misses: Iterable[tuple[str, int, int]] = ()) -> Comparison:
        """Both columns, with the recorded slack misses ``(job_id, attempt, at_ms)``: each
        belongs to the job's latest free admission at or before that attempt and moment."""
        missed: set[int] = set()
        for job_id, attempt, at_ms in misses:
            owner = None
            for admission in self.admissions.get(job_id, ()):
                if admission.attempt <= attempt and admission.at_ms <= at_ms:
                    owner = admission
            if owner is not None:
                missed.add(id(owner))
        owners = [a for group in self.admissions.values() for a in group]
        known = sum(a.still for a in owners)
        known_missed = sum(a.still and id(a) in missed for a in owners)
        return Comparison(
            records=self.records, as_was=dict(self.was), would_be=dict(self.now),
            changed=self.changed, undecidable=self.undecidable, changes=self.changes,
            superseded=self.superseded,
            review_was=_review(dict(self.was), len(owners), len(missed), *self.marks["was"]),
            review_now=_review(dict(self.now), known, known_missed, *self.marks["now"]),
            unknown_outcomes=self.unknown,
        )  # fmt: skip


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
    """Re-decide every record under ``knob`` (all of them at once: :class:`Tally`)."""
    tally = Tally(knob, min_samples)
    for record in records:
        tally.add(record)
    return tally.result(misses)
