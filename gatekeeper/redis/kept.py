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

While a run goes on, what the worker knows of it itself (``task``, ``retries``,
``max_retries``, ``time_limit_s``, ``tokens_out``, ``worker``: ``own_fields`` in
gatekeeper/celery/message.py) is one field too, ``own``, a JSON object written by its start
(:func:`pack_own`): no script reads those fields, and six more fields of a compact hash cost
``start.lua`` and ``finish.lua`` a walk of the record each to write, look past and drop
(bench/worker_ir.py). A record started by an older worker has them laid out; :func:`unpack`
reads both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

__all__ = ["KEPT", "KEPT_FIELDS", "OWN", "pack_own", "unpack"]

KEPT = "kept"
"""The packed field of a record cut after its row."""

KEPT_FIELDS = ("published_ms", "deadline_ms", "tokens_in", "window")
"""The fields packed in ``kept``, in their order there."""


OWN = "own"
"""The field of a started record that holds the worker's own fields (:func:`pack_own`)."""


def pack_own(own: Mapping[str, str]) -> str:
    """The worker's own fields of a run as ``own``'s value: a JSON object of text."""
    return json.dumps(dict(own), separators=(",", ":"))


def unpack(fields: Mapping[str, str]) -> dict[str, str]:
    """The record's fields with those packed in ``kept`` and ``own`` laid out again (a field
    stored on its own wins); a record with neither comes back as it is. An ``own`` that is
    not a JSON object of text (written by something else) is left out."""
    packed, own = fields.get(KEPT), fields.get(OWN)
    if packed is None and own is None:
        return dict(fields)
    laid_out: dict[str, str] = {}
    if own is not None:
        laid_out.update(_own_of(own))
    if packed is not None:
        values = packed.split("|")
        laid_out.update(
            (name, value) for name, value in zip(KEPT_FIELDS, values, strict=False) if value
        )
    laid_out.update(fields)
    laid_out.pop(OWN, None)
    return laid_out


def _own_of(text: str) -> dict[str, str]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
