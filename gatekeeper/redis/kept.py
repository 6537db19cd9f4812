"""What an attempt's run record keeps after its row, and how it reads back.

Once every run of an attempt has its row, ``finish.lua`` cuts the record (``run:<job_id>:
<attempt>``, keys.py) to what later reads of it need: a finished job's record then takes
about 310 bytes instead of about 620 for the rest of ``RECORD_RETENTION_S`` (measured by
bench/memory.py; about 110 of them are the key itself). What stays, and who reads it:

- ``nonce``, ``decision``, ``reason``: a redelivered message is still the gate's (start.lua,
  take.lua), a spare copy of an expired attempt is still known as run (expire.lua), and a
  re-sent publish request still finds its own decision (gate.lua);
- ``runs``, ``rowed``: one row per run, whatever signal fires twice (finish.lua), and a
  publish of the same attempt after its row is not taken for a duplicate (gate.lua);
- ``rowed_by``, ``<token>|<missed>`` (``|<tax>`` after it when the row's tax was capped): the
  reply of the finish that wrote the last row, for that call sent again after its reply was
  lost, so its worker still logs the row and its slack miss (finish.lua). It costs a record
  32 bytes on Redis 7.0 (an allocator size class: any field would; 22 on 6.2);
- ``owed`` (only when a row passed over earlier runs still without theirs: ``,<run>,``
  each, ``,<run>=<reply>,`` once it came late): each of those runs still gets its one row,
  once, and that call sent again its reply (finish.lua);
- ``free_admitted`` (only when ``1``): the next attempt's decision carries it (gate.lua);
- ``missed`` and ``free_window`` (when written): an admission's slack miss counted once, in
  its window, whichever later attempt of the job ends late (gatekeeper/redis/owner.py);
- ``prev_nonce`` (when not empty), ``dup:*``, ``taken:*`` and the replayer's handoff fields,
  untouched: a copy or a replay that comes back after the run finds what it found before;
- ``kept``, ``<published_ms>|<deadline_ms>|<tokens_in>|<window>``: what the row of a
  redelivery after the row needs besides what its own start writes again (``started_ms``,
  ``task``, ``retries``, ``tokens_out``, ...). Its presence also says the reservation is
  closed: a later run of the attempt is charged nothing (as ``reserved`` = ``charged`` said).
  A fifth part, ``ok`` when the row that cut it was ``ok``, ``end`` when it failed for good:
  the job finished then, so a rerun's late finish is no slack miss of it (finish.lua; older
  readers ignore the part); ``on<run>`` when that run asked for a retry: the job went on in
  its next attempt, which judges it, so no run of this one started after it is a slack miss
  either.

Dropped: ``admitted_ms`` and ``dwell_s`` (only the first run's tax and slack-miss line read
them), ``label``, ``reserved``, ``charged``, ``expired_ms`` and every field a start writes,
but for the four numbers below when a start wrote them laid out (an older worker, or values
too long to pack): those stay, as harmless leftovers.

While a run goes on, four of the numbers the worker knows of it itself (``retries``,
``max_retries``, ``time_limit_s``, ``tokens_out``: ``own_fields`` in
gatekeeper/celery/message.py) are one field too, ``own`` = ``<retries>|<max_retries>|
<time_limit_s>|<tokens_out>`` (:func:`pack_own`): no script reads them, and each field of a
compact hash costs ``start.lua`` and ``finish.lua`` a walk of the record to write, look past
and drop (bench/worker_ir.py). ``task`` and ``worker`` stay fields of their own, and the four
are laid out when their text would pass :data:`COMPACT_VALUE` bytes: one value longer than
that turns the record into a hash table, about four times the memory after the cut
(bench/memory.py; a JSON object of all six did, with the bench's own names), and ``HDEL``
never turns it back. A task name or worker that long does the same while the run goes on:
the worker says so to ``finish.lua``, whose cut then writes the record again, compact
(unless what stays is that long itself: an older replayer's handoff). The worker knows only
its own run's names, so the cut of any run but an attempt's first is written again too (a
redelivery may have started on a worker with a longer name; such cuts are rare, and a
rewrite costs one a third more instructions). A record started by an older worker has them
all laid out; :func:`unpack` reads both.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["COMPACT_VALUE", "KEPT", "KEPT_FIELDS", "OWN", "OWN_FIELDS", "pack_own", "too_long",
           "unpack"]  # fmt: skip

KEPT = "kept"
"""The packed field of a record cut after its row."""

KEPT_FIELDS = ("published_ms", "deadline_ms", "tokens_in", "window")
"""The fields packed in ``kept``, in their order there."""


OWN = "own"
"""The field of a started record that holds :data:`OWN_FIELDS` (:func:`pack_own`)."""

OWN_FIELDS = ("retries", "max_retries", "time_limit_s", "tokens_out")
"""The worker's own fields packed in ``own``, in their order there: numbers, never a ``|``."""

COMPACT_VALUE = 64
"""The longest value a compact hash holds (``hash-max-ziplist-value``/``-listpack-value``,
Redis' default): a longer ``own`` is not packed."""


def too_long(value: str) -> bool:
    """Longer than a compact hash holds: a record with such a value is a hash table."""
    return len(value.encode()) > COMPACT_VALUE


def pack_own(own: Mapping[str, str]) -> dict[str, str]:
    """The fields a start writes for the worker's own ``own``: :data:`OWN_FIELDS` as one
    ``own`` when all are there and their text is short enough, the rest as they are."""
    if not all(name in own for name in OWN_FIELDS):
        return dict(own)
    packed = "|".join(own[name] for name in OWN_FIELDS)
    if too_long(packed) or packed.count("|") != len(OWN_FIELDS) - 1:
        return dict(own)  # too long for a compact hash, or a value that would not split back
    rest = {name: value for name, value in own.items() if name not in OWN_FIELDS}
    return {OWN: packed, **rest}


def unpack(fields: Mapping[str, str]) -> dict[str, str]:
    """The record's fields with those packed in ``kept`` and ``own`` laid out again (a field
    stored on its own wins); a record with neither comes back as it is. An ``own`` without
    its four parts (written by something else) is left out."""
    packed, own = fields.get(KEPT), fields.get(OWN)
    if packed is None and own is None:
        return dict(fields)
    laid_out: dict[str, str] = {}
    if own is not None:
        parts = own.split("|")
        if len(parts) == len(OWN_FIELDS):
            laid_out.update(zip(OWN_FIELDS, parts, strict=True))
    if packed is not None:
        values = packed.split("|")
        laid_out.update(
            (name, value) for name, value in zip(KEPT_FIELDS, values, strict=False) if value
        )
    laid_out.update(fields)
    laid_out.pop(OWN, None)
    return laid_out
