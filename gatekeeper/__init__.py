"""Gatekeeper: deadline-aware admission control for Celery.

Every gated task is scored when it is published and sent to the ``free``, ``defer`` or
``reserved`` queue; a retry-tax ledger in Redis prices the work that free slots waste.
Importing this package does nothing: no Redis connection, no Celery hook, no logging set-up.
"""

from __future__ import annotations

from gatekeeper.celery_hook import Installed, install
from gatekeeper.dwell import Decision, GateInputs, GateResult, Reason, decide, retry_tax_s
from gatekeeper.errors import ConfigError, GatekeeperError, LedgerUnavailable
from gatekeeper.ledger import (
    Admission,
    BudgetMode,
    LedgerRow,
    Outcome,
    Path,
    WindowSummary,
    admit,
    make_row,
    row_retry_tax,
    summarize,
    window_id,
)
from gatekeeper.metering import meter
from gatekeeper.settings import DrillSettings, GatekeeperSettings, load_settings
from gatekeeper.spec import GatedSpec, gated

__all__ = [
    "Admission",
    "BudgetMode",
    "ConfigError",
    "Decision",
    "DrillSettings",
    "GateInputs",
    "GateResult",
    "GatedSpec",
    "GatekeeperError",
    "GatekeeperSettings",
    "Installed",
    "LedgerRow",
    "LedgerUnavailable",
    "Outcome",
    "Path",
    "Reason",
    "WindowSummary",
    "admit",
    "decide",
    "gated",
    "install",
    "load_settings",
    "make_row",
    "meter",
    "retry_tax_s",
    "row_retry_tax",
    "summarize",
    "window_id",
]

__version__ = "0.1.0.dev0"
