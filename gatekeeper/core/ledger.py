"""The retry-tax ledger's arithmetic: a row's tax, the admission inequality, a window's summary.

SPEC section 2. Pure functions over frozen dataclasses; the Redis store and its Lua script
repeat :func:`admit` for atomicity, and a test holds the two to the same answers.

    row.retry_tax = (tokens_in if outcome == killed else 0)
                  + queue_wait_seconds * queue_wait_unit_per_second

    projected_tax = tax_units + exposure + queue_age_s * queue_wait_unit_per_second
    admit if projected_tax + tokens_in <= budget_units

Tax is in declared units, not money. Only free-path rows charge the window's ``tax_units``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from gatekeeper.core.dwell import Reason
from gatekeeper.defaults import QUEUE_WAIT_UNIT_PER_SECOND, WINDOW_SECONDS

__all__ = [
    "Admission",
    "BudgetMode",
    "LedgerRow",
    "Outcome",
    "Path",
    "WindowSummary",
    "admit",
    "deadline_slack_ms",
    "make_row",
    "reservation",
    "row_retry_tax",
    "summarize",
    "window_id",
]


class Outcome(str, Enum):
    """How an attempt ended, as far as the ledger is concerned."""

    OK = "ok"
    KILLED = "killed"
    """Started but did not finish: exception, time limit, worker lost, revoked while running."""
    REJECTED = "rejected"
    """Refused by the budget at publish (the attempt then runs on the reserved path)."""
    ABANDONED = "abandoned"
    """Dropped because its deadline passed before it could run or retry."""
    EXPIRED = "expired"
    """Admitted to free but still waiting there when its wait allowance ran out: moved to
    reserved before it ran (the same attempt then runs there, with a row of its own). Charged
    the allowance's wait, no tokens."""

    def __str__(self) -> str:
        return self.value


class Path(str, Enum):
    """The kind of capacity an attempt ran on (or was refused from)."""

    FREE = "free"
    RESERVED = "reserved"

    def __str__(self) -> str:
        return self.value


class BudgetMode(str, Enum):
    """Whether admission counts the tokens of free attempts still in flight."""

    EXPOSURE = "exposure"
    """Default: in-flight free attempts could still die, so their tokens count now."""
    OPTIMISTIC = "optimistic"
    """The source's formula as written; sound only when attempts run one at a time."""

    def __str__(self) -> str:
        return self.value


def window_id(timestamp_s: float, window_seconds: int = WINDOW_SECONDS) -> int:
    """The epoch-aligned window a Unix timestamp falls in."""
    if window_seconds <= 0:
        raise ValueError(f"window_seconds: expected a positive integer, got {window_seconds!r}")
    return math.floor(timestamp_s / window_seconds)


def row_retry_tax(
    outcome: Outcome,
    tokens_in: int,
    queue_wait_ms: int,
    queue_wait_unit_per_second: float = QUEUE_WAIT_UNIT_PER_SECOND,
) -> float:
    """This attempt's contribution to its window's tax.

    Rejected and abandoned rows never ran: they carry no token charge and no wait charge; an
    expired row is charged its wait alone. The wait is taken in whole milliseconds so that
    2100 ms at 200 is exactly 420.
    """
    if outcome in (Outcome.REJECTED, Outcome.ABANDONED):
        return 0.0
    token_charge = tokens_in if outcome is Outcome.KILLED else 0
    return token_charge + queue_wait_ms * queue_wait_unit_per_second / 1000


@dataclass(frozen=True)
class LedgerRow:
    """One attempt of one job, with every field SPEC section 2 names."""

    job_id: str
    attempt: int
    path: Path
    queue_wait_ms: int
    tokens_in: int
    tokens_out: int
    outcome: Outcome
    deadline_slack_ms: int
    retry_tax: float

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> LedgerRow:
        """The inverse of :meth:`to_json` (extra keys such as ``window_id`` are ignored)."""
        return cls(
            job_id=str(row["job_id"]),
            attempt=int(row["attempt"]),
            path=Path(row["path"]),
            queue_wait_ms=int(row["queue_wait_ms"]),
            tokens_in=int(row["tokens_in"]),
            tokens_out=int(row["tokens_out"]),
            outcome=Outcome(row["outcome"]),
            deadline_slack_ms=int(row["deadline_slack_ms"]),
            retry_tax=float(row["retry_tax"]),
        )

    def to_json(self) -> dict[str, Any]:
        """A plain dict in field order, enums as their values (the ledger file's row form)."""
        # Spelled out, not dataclasses.asdict (a deep copy): a worker builds one per run.
        return {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "path": self.path.value,
            "queue_wait_ms": self.queue_wait_ms,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "outcome": self.outcome.value,
            "deadline_slack_ms": self.deadline_slack_ms,
            "retry_tax": self.retry_tax,
        }


def deadline_slack_ms(deadline_at: float, now_s: float) -> int:
    """A row's ``deadline_slack_ms``: the deadline's distance from ``now_s`` in whole
    milliseconds, within +-1e15 (a deadline the gate never stamps, on a message put in defer
    by hand, such as -1e306, -inf or an integer of 400 digits, that no double holds)."""
    try:
        ms = (float(deadline_at) - now_s) * 1000
    except OverflowError:  # an integer past a double's range
        ms = -math.inf if deadline_at < 0 else math.inf
    return 0 if math.isnan(ms) else round(max(-1e15, min(1e15, ms)))


def make_row(
    *,
    job_id: str,
    attempt: int,
    path: Path,
    outcome: Outcome,
    queue_wait_ms: int,
    tokens_in: int,
    tokens_out: int,
    deadline_slack_ms: int,
    queue_wait_unit_per_second: float = QUEUE_WAIT_UNIT_PER_SECOND,
    charged_wait_ms: int | None = None,
    charged_tokens_in: int | None = None,
) -> LedgerRow:
    """Build a row and price it; rejected and abandoned rows are stored with no tokens or wait.

    ``charged_wait_ms`` and ``charged_tokens_in`` price the row where what it is charged
    differs from what it records (a free row: the wait since its admission to free, and no
    more tokens than its admission reserved); by default the recorded ones are charged.
    """
    if attempt < 1:
        raise ValueError(f"attempt: expected an integer >= 1, got {attempt!r}")
    if outcome in (Outcome.REJECTED, Outcome.ABANDONED, Outcome.EXPIRED):
        tokens_in = tokens_out = 0
    if tokens_in < 0 or tokens_out < 0 or queue_wait_ms < 0:
        raise ValueError(
            "tokens_in, tokens_out and queue_wait_ms: expected non-negative integers, got "
            f"{tokens_in!r}, {tokens_out!r}, {queue_wait_ms!r}"
        )
    wait = queue_wait_ms if charged_wait_ms is None else max(0, min(charged_wait_ms, queue_wait_ms))
    charged = tokens_in if charged_tokens_in is None else max(0, min(charged_tokens_in, tokens_in))
    tax = row_retry_tax(outcome, charged, wait, queue_wait_unit_per_second)
    return LedgerRow(
        job_id=job_id,
        attempt=attempt,
        path=path,
        queue_wait_ms=queue_wait_ms,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        outcome=outcome,
        deadline_slack_ms=deadline_slack_ms,
        retry_tax=tax,
    )


@dataclass(frozen=True)
class Admission:
    """The budget's answer for one attempt the dwell gate admitted to the free path."""

    admitted: bool
    projected_tax: float
    reason: Reason


def admit(
    *,
    tax_units: float,
    exposure: float,
    queue_age_s: float,
    tokens_in: int,
    budget_units: float,
    queue_wait_unit_per_second: float = QUEUE_WAIT_UNIT_PER_SECOND,
    mode: BudgetMode = BudgetMode.EXPOSURE,
    wait_allowance_s: float = 0.0,
) -> Admission:
    """Whether the window's budget can carry one more free attempt of ``tokens_in`` tokens.

    ``projected_tax`` is what the window would owe before this attempt; the attempt is admitted
    when that plus what it reserves (:func:`reservation`: its tokens, and in ``exposure`` mode
    its wait allowance) stays within ``budget_units``. Non-finite numbers refuse.
    """
    counted_exposure = exposure if mode is BudgetMode.EXPOSURE else 0.0
    projected = tax_units + counted_exposure + queue_age_s * queue_wait_unit_per_second
    allowance = wait_allowance_s if mode is BudgetMode.EXPOSURE else 0.0
    total = projected + reservation(tokens_in, allowance, queue_wait_unit_per_second)
    if not math.isfinite(total) or not math.isfinite(budget_units) or total > budget_units:
        return Admission(False, projected, Reason.RETRY_TAX_BUDGET)
    return Admission(True, projected, Reason.FITS)


def reservation(
    tokens_in: int, wait_allowance_s: float, queue_wait_unit_per_second: float
) -> float:
    """What an admission to free holds in its window's exposure: the most its attempt can
    still be charged (its tokens, if it dies, and its wait up to the allowance). The ceiling
    of SPEC section 2 rests on it: a free attempt is never charged more than it reserved."""
    return tokens_in + wait_allowance_s * queue_wait_unit_per_second


@dataclass(frozen=True)
class WindowSummary:
    """The counts an on-call reads first, and the budget that is left."""

    finished: int
    killed_rows: int
    rejected: int
    abandoned: int
    tax_units: float
    budget_units: float
    expired: int = 0
    """Free attempts moved to reserved when their wait allowance ran out."""

    @property
    def budget_left(self) -> int:
        """Budget minus free-path tax, rounded down: never overstate what is left."""
        # Rounded to a micro-unit first so float summation noise cannot cost a whole unit.
        return math.floor(round(self.budget_units - self.tax_units, 6))

    def line(self) -> str:
        """SPEC's summary line, exactly as the drill and the CLI print it."""
        return (
            f"finished={self.finished} killed_rows={self.killed_rows} "
            f"rejected={self.rejected} abandoned={self.abandoned} "
            f"budget_left={self.budget_left}"
        ) + (f" expired={self.expired}" if self.expired else "")  # new fields follow the five


def summarize(rows: Iterable[LedgerRow], budget_units: float) -> WindowSummary:
    """Count a window's rows by outcome and charge the free-path rows' tax to its budget."""
    counts = dict.fromkeys(Outcome, 0)
    tax = 0.0
    for row in rows:
        counts[row.outcome] += 1
        if row.path is Path.FREE:
            tax += row.retry_tax
    return WindowSummary(
        finished=counts[Outcome.OK],
        killed_rows=counts[Outcome.KILLED],
        rejected=counts[Outcome.REJECTED],
        abandoned=counts[Outcome.ABANDONED],
        tax_units=tax,
        budget_units=budget_units,
        expired=counts[Outcome.EXPIRED],
    )
