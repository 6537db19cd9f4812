"""What an attempt's run record keeps after its row, and how it reads back.

Once every run of an attempt has its row, ``finish.lua`` cuts the record (``run:<job_id>:
<attempt>``, keys.py) to what later reads of it need: a finished job's record then takes
about 270 bytes instead of about 620 for the rest of ``RECORD_RETENTION_S`` (measured by
bench/memory.py; about 110 of them are the key itself). What stays, and who reads it:

- ``nonce``, ``decision``, ``reason``: a redelivered message is still the gate's (start.lua,
  take.lua), a spare copy of an expired attempt is still known as run (expire.lua), and a
  re-sent publish request still finds its own decision (gate.lua);
- ``runs``, ``rowed``: one row per run, whatever signal fires twice (finish.lua), and a
  publish of the same attempt after its row is not taken for a duplicate (gate.lua);
- ``free_admitted`` (only when ``1``): the next attempt's decision carries it (gate.lua);
- ``prev_nonce`` (when not empty), ``dup:*``, ``taken:*`` and the replayer's handoff fields,
  untouched: a copy or a replay that comes back after the run finds what it found before;
- ``kept``, ``<published_ms>|<deadline_ms>|<tokens_in>|<window>``: what the row of a
  redelivery after the row needs besides what its own start writes again (``started_ms``,
  ``task``, ``retries``, ``tokens_out``, ...). Its presence also says the reservation is
  closed: a later run of the attempt is charged nothing (as ``reserved`` = ``charged`` said).

Dropped: ``admitted_ms`` and ``dwell_s`` (only the first run's tax and slack-miss line read
them), ``label``, ``reserved``, ``charged``, ``expired_ms`` and every field a start writes.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["KEPT", "KEPT_FIELDS", "unpack"]

KEPT = "kept"
"""The packed field of a record cut after its row."""

KEPT_FIELDS = ("published_ms", "deadline_ms", "tokens_in", "window")
"""The fields packed in ``kept``, in their order there."""


def unpack(fields: Mapping[str, str]) -> dict[str, str]:
    """The record's fields with those packed in ``kept`` laid out again (a field stored on its
    own wins); a record that was never cut comes back as it is."""
    packed = fields.get(KEPT)
    if packed is None:
        return dict(fields)
    values = packed.split("|")
    laid_out = {name: value for name, value in zip(KEPT_FIELDS, values, strict=False) if value}
    return {**laid_out, **fields}
