"""Every error gatekeeper raises is a :class:`GatekeeperError`."""

from __future__ import annotations

__all__ = ["ConfigError", "GatekeeperError", "LedgerUnavailable"]


class GatekeeperError(Exception):
    """Root of gatekeeper's errors."""


class ConfigError(GatekeeperError, ValueError):
    """A setting has a value gatekeeper cannot use; the message names it and what was expected."""


class LedgerUnavailable(GatekeeperError):
    """The gate's Redis could not be reached or a script failed (wraps the redis-py error)."""
