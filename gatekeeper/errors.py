"""Every error gatekeeper raises, rooted at :class:`GatekeeperError`.

The ones a user catches are exported from ``gatekeeper``: :class:`BadDeclaredInput` (a gated
task's declaration, raised by ``@gated`` at import), :class:`ConfigError` (settings, at
start-up), :class:`CeleryShapeError` (``install`` on a Celery whose private API changed) and
:class:`LedgerUnavailable` (the on-call commands with the gate's Redis down). redis-py's
errors are wrapped at the Redis adapter's boundary (``raise LedgerUnavailable(...) from exc``);
the publish path never lets any of these reach the caller's publish: it routes fail-closed.
"""

from __future__ import annotations

__all__ = [
    "BadDeclaredInput",
    "CeleryShapeError",
    "ConfigError",
    "DeadlineAbandoned",
    "EmbeddedRedisError",
    "FreePathLocked",
    "GatekeeperError",
    "LedgerUnavailable",
    "PublishFailed",
]


class GatekeeperError(Exception):
    """Root of gatekeeper's errors."""


class ConfigError(GatekeeperError, ValueError):
    """A setting has a value gatekeeper cannot use; the message names it and what was expected."""


class BadDeclaredInput(GatekeeperError, ValueError):
    """A declared input (decorator, task option or header) is not usable; names the field."""

    def __init__(self, field: str, expected: str, got: object) -> None:
        super().__init__(f"{field}: expected {expected}, got {got!r}")
        self.field = field


class LedgerUnavailable(GatekeeperError):
    """The gate's Redis could not be reached or a script failed (wraps the redis-py error)."""


class GateUnreachable(LedgerUnavailable):
    """The gate's Redis gave no answer at all (refused, timed out, failing over): nothing is
    wrong with what was asked, so the replayer stops its pass and strikes no message."""


class PublishFailed(GatekeeperError):
    """A fast publish's message could not be pushed at all: the broker, the gate's own Redis,
    could not be reached (the hook raises kombu's ``OperationalError`` for it)."""


class CeleryShapeError(GatekeeperError):
    """Celery's or kombu's private API no longer looks the way gatekeeper relies on."""


class FreePathLocked(GatekeeperError):
    """Re-enabling the free path was refused: the last hour of windows is not clean."""


class EmbeddedRedisError(GatekeeperError):
    """No ``redis-server`` binary could be found, or it did not start."""


class DeadlineAbandoned(GatekeeperError):
    """A task's deadline passed before it could run: stored as its result by the replayer,
    so ``AsyncResult.get()`` raises it and a chord with it ends (one message argument, so a
    result backend can rebuild it)."""
