"""A message for ``gate.lua`` to push with its decision (fast publish), as the script takes it.

Celery builds and serializes the message once, with a placeholder where each value the decision
decides goes (the queue in ``delivery_info`` and five ``gatekeeper_*`` headers). Every
placeholder carries this publish's nonce, a random value no caller can know in advance, so
text a caller controls (header keys or values, arguments) cannot look like one: the template
is cut at exactly these strings, each of which must occur exactly once, and the script fills
in only the cuts. :func:`values_for` is the one definition of what goes into each cut, used
for the fallback here and mirrored by ``gate.lua`` (a test holds the two together).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

__all__ = ["FILLED", "Push", "dwell_text", "new_nonce", "placeholders", "values_for"]

FILLED = ("decision", "reason", "dwell", "free", "window", "queue")
"""What the decision fills in, in the order ``gate.lua`` documents."""
SORTED_FILLED = sorted(FILLED)


def new_nonce() -> str:
    """A random value for one publish request (``secrets``: unaffected by a forked child's
    copied ``random`` state, and not guessable by a caller)."""
    return secrets.token_hex(12)


def placeholders(nonce: str) -> dict[str, str]:
    """The placeholder text of each filled value for this publish (a JSON string's content)."""
    return {name: f"__gk_{nonce}_{name}__" for name in FILLED}


def dwell_text(dwell_s: float | None) -> str:
    """A dwell as both paths write it into the message: six decimals, ``null`` when unknown
    (``gate.lua`` writes ``string.format('%.6f')``: the same text)."""
    if dwell_s is None or dwell_s != dwell_s or dwell_s in (float("inf"), float("-inf")):
        return "null"
    return f"{dwell_s:.6f}"


def values_for(
    decision: str, reason: str, dwell_s: float | None, free: bool, window: int | None, queue: str
) -> dict[str, str]:
    """The JSON text of each filled value."""
    return {
        "decision": json.dumps(decision),
        "reason": json.dumps(reason),
        "dwell": dwell_text(dwell_s),
        "free": "true" if free else "false",
        "window": "null" if window is None else str(int(window)),
        "queue": json.dumps(queue),
    }


@dataclass(frozen=True)
class Push:
    """A serialized message cut at its placeholders, and where each decision would push it."""

    pieces: tuple[str, ...]
    """text, name, text, name, ..., text: the names are :data:`FILLED`, each exactly once."""
    lists: tuple[str, str, str]
    """Broker lists for admit_free, defer, reserved (priority sub-lists where needed)."""
    queues: tuple[str, str, str]
    nonce: str

    @classmethod
    def cut(
        cls, text: str, nonce: str, lists: tuple[str, str, str], queues: tuple[str, str, str]
    ) -> Push | None:
        """``text`` cut at this nonce's quoted placeholders; None unless each occurs once."""
        head, *rest = text.split(f'"__gk_{nonce}_')
        if len(rest) != len(FILLED):
            return None
        pieces = [head]
        for part in rest:
            name, closed, after = part.partition('__"')
            if not closed:
                return None
            pieces += [name, after]
        if sorted(pieces[1::2]) != SORTED_FILLED:
            return None
        return cls(tuple(pieces), lists, queues, nonce)

    def filled(self, values: dict[str, str]) -> str:
        """The message with these values (for ``fallback.lua``; ``gate.lua`` fills its own)."""
        return "".join(
            values[piece] if index % 2 else piece for index, piece in enumerate(self.pieces)
        )
