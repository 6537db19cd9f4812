"""Gatekeeper: deadline-aware admission control for Celery.

Every gated task is scored when it is published and sent to the ``free``, ``defer`` or
``reserved`` queue; a retry-tax ledger in Redis prices the work that free slots waste.
Importing this package does nothing: no Redis connection, no Celery hook, no logging set-up,
and no adapter is even imported until one of its names is first used (PEP 562), so the pure
core (``gatekeeper.core``) can be imported without Celery, kombu or redis.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from gatekeeper.core.dwell import Decision, GateInputs, GateResult, Reason, decide, retry_tax_s
from gatekeeper.core.ledger import (
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
from gatekeeper.core.spec import GatedSpec
from gatekeeper.errors import (
    BadDeclaredInput,
    CeleryShapeError,
    ConfigError,
    DeadlineAbandoned,
    GatekeeperError,
    LedgerUnavailable,
)

if TYPE_CHECKING:
    from gatekeeper.celery.gating import gated
    from gatekeeper.celery.hook import Installed, install
    from gatekeeper.celery.metering import meter
    from gatekeeper.settings import DrillSettings, GatekeeperSettings, load_settings

_LAZY = {
    "gated": "gatekeeper.celery.gating",
    "install": "gatekeeper.celery.hook",
    "Installed": "gatekeeper.celery.hook",
    "meter": "gatekeeper.celery.metering",
    "DrillSettings": "gatekeeper.settings",
    "GatekeeperSettings": "gatekeeper.settings",
    "load_settings": "gatekeeper.settings",
}
"""Public names whose modules import Celery, redis or pydantic-settings: loaded on first use."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gatekeeper' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Admission",
    "BadDeclaredInput",
    "BudgetMode",
    "CeleryShapeError",
    "ConfigError",
    "DeadlineAbandoned",
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
