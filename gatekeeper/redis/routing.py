"""Where a gated publish goes: what the decision pipeline hands back to the publish hook."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gatekeeper.core.dwell import Decision, Reason

__all__ = ["Routing"]


@dataclass(slots=True)
class Routing:
    """Where the publish goes; ``decision`` None means untouched (its normal route), unless
    the message is ``published`` already: then its decision is the reply the gate script
    sent and the publish did not wait for (:meth:`owed`)."""

    queue: str | None
    decision: Decision | None
    reason: Reason
    headers: dict[str, Any] = field(default_factory=dict)
    published: bool = False
    """True when a script already pushed the message (fast publish)."""
    drop: tuple[str, ...] = ()
    """Headers not to forward (gatekeeper headers that were not numbers: ``bad_input``)."""

    @classmethod
    def owed(cls) -> Routing:
        """A fast publish sent with its reply read later (:mod:`gatekeeper.redis.later`): the
        script pushes the message where it decides, and the decision is logged as its reply
        is read. Its ``reason`` says nothing."""
        return cls(None, None, Reason.FITS, published=True)

    @property
    def is_owed(self) -> bool:
        return self.published and self.decision is None
