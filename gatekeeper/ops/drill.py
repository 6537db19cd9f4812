"""``gatekeeper drill``: both sources' local drills, in process, with no server and no network.

1. The dwell-gate table: SPEC section 1's six sample jobs plus the injected stuck attempt,
   printed in the source's form (``job=1 dwell=28 slack=90 decision=admit_free``).
2. The ledger drill: the declared workload (``[drill]`` in ``config/gatekeeper.toml``) run
   one attempt at a time on a simulated clock. Each attempt goes through the same core as
   production: the dwell gate, then the budget. Queue waits and the coin flip that kills a
   share of first free attempts come from one ``random.Random(seed)``, so the same seed gives
   the same rows, byte for byte.

Simulation rules (declared, not measured): a job is published when the previous one is done;
its deadline is its first publish plus ``deadline_slack_s``; an attempt waits its drawn queue
wait, then runs ``service_s`` (a killed one dies half-way through, and its death is noticed
``kill_detect_s`` later, when its row is written); only free attempts die;
a killed attempt retries while it has retries left, gated again, and is abandoned if its
deadline has passed by then; a deferred attempt is parked for one service interval and scored
again. Windows are ``window_seconds`` wide from the drill's clock zero.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Any

from gatekeeper.core.dwell import Decision, GateInputs, decide, retry_tax_s
from gatekeeper.core.ledger import (
    LedgerRow,
    Outcome,
    Path,
    WindowSummary,
    admit,
    make_row,
    summarize,
    window_id,
)
from gatekeeper.settings import DrillSettings

__all__ = [
    "DWELL_SAMPLES",
    "DrillResult",
    "dwell_table_lines",
    "ledger_json",
    "run_ledger_drill",
]

DWELL_SAMPLES: tuple[GateInputs, ...] = (
    GateInputs(12, 8, 8, 90),
    GateInputs(41, 8, 8, 90),
    GateInputs(20, 8, 8, 30),
    GateInputs(20, 8, 0, 30),
    GateInputs(10, 0, 8, 90),  # injected: non-positive service guess
    GateInputs(10, 8, 8, -1),
    GateInputs(50, 8, 8, 40),  # injected: stuck attempt, the age cap fires first
)
"""The source's sample table (jobs 1-6) and its injected stuck attempt (job 7)."""


def dwell_table_lines(samples: Sequence[GateInputs] = DWELL_SAMPLES) -> list[str]:
    """One line per sample, formatted exactly as the source's script prints them."""
    lines = []
    for number, inputs in enumerate(samples, start=1):
        result = decide(inputs)
        lines.append(
            f"job={number} dwell={result.dwell_s:.0f} "
            f"slack={inputs.deadline_slack_s:.0f} decision={result.decision.value}"
        )
    return lines


@dataclass(frozen=True)
class DrillResult:
    """The ledger drill's rows (in the order they were written) and one summary per window."""

    settings: DrillSettings
    rows: tuple[tuple[int, LedgerRow], ...]
    """(window id, row) pairs."""
    summaries: tuple[tuple[int, WindowSummary], ...]


class _Window:
    """The running totals of the window the drill's clock is in."""

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.tax_units = 0.0
        self.exposure = 0.0


def run_ledger_drill(cfg: DrillSettings) -> DrillResult:
    """Run the declared workload; pure apart from the seeded generator it owns."""
    rng = random.Random(cfg.seed)
    unit = cfg.queue_wait_unit_per_second
    now = 0.0
    rows: list[tuple[int, LedgerRow]] = []
    window = _Window(window_id(now, cfg.window_seconds))

    def current_window() -> _Window:
        nonlocal window
        ident = window_id(now, cfg.window_seconds)
        if ident != window.ident:
            window = _Window(ident)
        return window

    def record(row: LedgerRow) -> None:
        win = current_window()
        if row.path is Path.FREE:
            win.tax_units += row.retry_tax
        rows.append((win.ident, row))

    for number in range(1, cfg.jobs + 1):
        job_id = str(number)
        deadline = now + cfg.deadline_slack_s
        attempt = 1
        while True:
            retries_left = cfg.max_retries - (attempt - 1)
            parked = 0.0
            while True:
                wait_s = round(rng.uniform(0, cfg.queue_wait_max_s), 3)
                slack_now = deadline - now
                gate = decide(
                    GateInputs(
                        queue_age_s=wait_s,
                        expected_service_s=cfg.service_s,
                        retry_tax_s=retry_tax_s(retries_left, cfg.service_s),
                        deadline_slack_s=slack_now,
                        max_queue_age_s=cfg.max_queue_age_s,
                    )
                )
                if gate.decision is not Decision.DEFER or slack_now <= 0:
                    break
                parked += cfg.service_s
                now += cfg.service_s
            slack_ms = round(slack_now * 1000)
            if slack_now <= 0:
                record(_row(job_id, attempt, Path.FREE, Outcome.ABANDONED, 0, 0, 0, slack_ms, unit))
                break
            path = Path.RESERVED
            admitted_in: _Window | None = None
            if gate.decision is Decision.ADMIT_FREE:
                win = current_window()
                answer = admit(
                    tax_units=win.tax_units,
                    exposure=win.exposure,
                    queue_age_s=wait_s,
                    tokens_in=cfg.input_tokens_per_job,
                    budget_units=cfg.budget_units,
                    queue_wait_unit_per_second=unit,
                    mode=cfg.budget_mode,
                )
                if answer.admitted:
                    path = Path.FREE
                    admitted_in = win
                    win.exposure += cfg.input_tokens_per_job
                else:
                    record(
                        _row(job_id, attempt, Path.FREE, Outcome.REJECTED, 0, 0, 0, slack_ms, unit)
                    )
            coin = rng.random() if attempt == 1 else 1.0
            killed = path is Path.FREE and coin < cfg.kill_fraction
            wait_ms = round((parked + wait_s) * 1000)
            now += wait_s
            now += cfg.service_s / 2 + cfg.kill_detect_s if killed else cfg.service_s
            if admitted_in is not None:
                admitted_in.exposure -= cfg.input_tokens_per_job
            slack_ms = round((deadline - now) * 1000)
            if killed:
                record(
                    _row(
                        job_id,
                        attempt,
                        path,
                        Outcome.KILLED,
                        wait_ms,
                        cfg.input_tokens_per_job,
                        0,
                        slack_ms,
                        unit,
                    )
                )
                if retries_left > 0:
                    attempt += 1
                    continue
                break
            record(
                _row(
                    job_id,
                    attempt,
                    path,
                    Outcome.OK,
                    wait_ms,
                    cfg.input_tokens_per_job,
                    cfg.output_tokens_per_job,
                    slack_ms,
                    unit,
                )
            )
            break

    summaries = []
    for ident in sorted({ident for ident, _ in rows}):
        window_rows = [row for row_window, row in rows if row_window == ident]
        summaries.append((ident, summarize(window_rows, cfg.budget_units)))
    return DrillResult(settings=cfg, rows=tuple(rows), summaries=tuple(summaries))


def _row(
    job_id: str,
    attempt: int,
    path: Path,
    outcome: Outcome,
    wait_ms: int,
    tokens_in: int,
    tokens_out: int,
    slack_ms: int,
    unit: float,
) -> LedgerRow:
    return make_row(
        job_id=job_id,
        attempt=attempt,
        path=path,
        outcome=outcome,
        queue_wait_ms=wait_ms,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        deadline_slack_ms=slack_ms,
        queue_wait_unit_per_second=unit,
    )


def ledger_json(result: DrillResult) -> str:
    """The ledger file: the declared workload, each window's summary, and every row."""
    document: dict[str, Any] = {
        "source": "gatekeeper drill",
        "workload": result.settings.model_dump(mode="json"),
        "windows": [
            {
                "window_id": ident,
                "summary": summary.line(),
                "tax_units": summary.tax_units,
                "budget_units": summary.budget_units,
                "budget_left": summary.budget_left,
            }
            for ident, summary in result.summaries
        ],
        "rows": [{"window_id": ident, **row.to_json()} for ident, row in result.rows],
    }
    return json.dumps(document, indent=2) + "\n"


def write_ledger(result: DrillResult, out: FilePath) -> FilePath:
    """Write the ledger file, creating its folder; returns the path written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(ledger_json(result), encoding="utf-8")
    return out
