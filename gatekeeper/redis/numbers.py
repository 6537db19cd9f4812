"""Numbers as the gate's scripts and records hold them: the shortest text that reads back as
the same double.

A decision record keeps its inputs as the text the gate script was sent (no conversion in the
script: gatekeeper/lua/gate.lua), so that text is what a record costs. ``repr`` is already
the shortest text that round-trips; a whole number is shorter still as an integer (``600``
for ``600.0``, ``1000000000000`` for ``1000000000000.0``), which Redis also stores in a
stream entry as an integer of a few bytes. Lua's ``tonumber`` and Python's ``float`` read
both alike.
"""

from __future__ import annotations

import math

__all__ = ["exact"]

_WHOLE = 2.0**53
"""Below this every whole double has an integer text that reads back as itself."""


def exact(value: float) -> str:
    """``value`` (a float) as the shortest text ``float()`` and ``tonumber`` read back as the
    same double; -0.0, infinities and NaN as ``repr`` writes them."""
    number = float(value)
    negative_zero = number == 0 and math.copysign(1.0, number) < 0
    if number.is_integer() and abs(number) < _WHOLE and not negative_zero:
        return str(int(number))
    return repr(number)
