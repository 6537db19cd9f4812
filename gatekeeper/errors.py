"""Every error gatekeeper raises is a :class:`GatekeeperError`."""

from __future__ import annotations

__all__ = ["ConfigError", "GatekeeperError", "LedgerUnavailable", "PublishFailed"]


class GatekeeperError(Exception):
    """Root of gatekeeper's errors."""


class ConfigError(GatekeeperError, ValueError):
    """A setting has a value gatekeeper cannot use; the message names it and what was expected."""


class LedgerUnavailable(GatekeeperError):
    """The gate's Redis could not be reached or a script failed (wraps the redis-py error)."""


class PublishFailed(GatekeeperError):
    """A fast publish's message could not be pushed at all: the broker, the gate's own Redis,
    could not be reached (the hook raises kombu's ``OperationalError`` for it)."""
