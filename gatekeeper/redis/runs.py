"""The ledger's worker side in Redis: runs that start, the one row each run gets, the sweep.

An attempt (``job_id``, ``attempt``) normally runs once. A message redelivered after its
worker died (``acks_late``, a visibility timeout) is another *run* of the same attempt: it keeps
the attempt number Celery gave it (``retries + 1``, unchanged by a redelivery) and gets its own
row, after the dead run's ``killed`` row. Rows are built from the Python core
(:func:`gatekeeper.core.ledger.make_row`) and applied by ``finish.lua``, once per run.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import redis
from redis.commands.core import Script

from gatekeeper.core.ledger import LedgerRow, Outcome, Path, make_row, window_id
from gatekeeper.core.service import bucket_of
from gatekeeper.defaults import DECISION_RECORD_CAP, FREE_WAIT_ALLOWANCE_S, WINDOW_RETENTION_S
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.kept import pack_own, too_long, unpack
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.owner import owner_of
from gatekeeper.redis.queued import send_all
from gatekeeper.redis.run_start import StartCall, Started
from gatekeeper.redis.scripts import evalsha, load_lua, text_of
from gatekeeper.redis.sent import call_script
from gatekeeper.redis.wire import Line, has_lines
from gatekeeper.settings import GatekeeperSettings

__all__ = ["Finished", "RunLedger", "RunRecord", "Started"]


@dataclass(frozen=True)
class RunRecord:
    """What a run's row needs: the gate's record of the attempt (written when it was decided,
    read back when the run starts) and what the worker adds of its own."""

    task: str
    path: str
    decision: str
    published_ms: int
    """This attempt's first publish (defer parking included in its wait)."""
    admitted_ms: int
    """When the gate admitted (or routed) this attempt, plus any delay it asked for: a free
    row is charged the wait from here, not the time the gate parked it in defer."""
    window: int
    """The ledger window that holds the attempt's exposure (its admission's window)."""
    deadline_ms: int
    tokens_in: int
    tokens_out: int
    dwell_s: float
    retries: int
    free_admitted: bool = False
    """An attempt of this job (this one or an earlier one) was admitted to the free path."""
    max_retries: int = -1
    """The task's max_retries (-1: unknown or unlimited)."""
    time_limit_s: float = 0.0
    """The task's hard time limit (0: none); the sweep waits at least this long."""
    started_ms: int = 0
    nonce: str = ""
    """The gate record's nonce: a message that carries another one is not this attempt's."""
    worker: str = ""
    """The hostname of the worker the run started on (its heartbeat proves it alive)."""
    reserved: float = 0.0
    """What the admission reserved (its tokens and wait allowance): the most its rows can be
    charged, over all its runs."""

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> RunRecord:
        """Read a record as stored (missing fields take their defaults)."""
        fields = unpack(fields)  # a record cut after its row (gatekeeper/redis/kept.py)
        decision = fields.get("decision", "")
        path = Path.FREE if decision == "admit_free" else Path.RESERVED
        return cls(
            task=fields.get("task", ""),
            path=fields.get("path", path.value),
            decision=decision,
            published_ms=int(float(fields.get("published_ms", 0))),
            admitted_ms=int(float(fields.get("admitted_ms", 0))),
            window=int(fields.get("window") or 0),
            deadline_ms=int(float(fields.get("deadline_ms", 0))),
            tokens_in=int(fields.get("tokens_in", 0)),
            tokens_out=int(fields.get("tokens_out", 0)),
            dwell_s=float(fields.get("dwell_s", "nan")),
            retries=int(fields.get("retries", 0)),
            free_admitted=fields.get("free_admitted") in ("1", "True"),
            max_retries=int(fields.get("max_retries", -1)),
            time_limit_s=float(fields.get("time_limit_s", 0)),
            started_ms=int(float(fields.get("started_ms", 0))),
            nonce=fields.get("nonce", ""),
            reserved=float(fields.get("reserved") or 0),
            worker=fields.get("worker", ""),
        )


@dataclass(frozen=True)
class Finished:
    """Whether the row was written (False: a duplicate), and the admission window's misses."""

    written: bool
    slack_misses: int
    admitted_free: int
    retry_tax: float = 0.0
    """The row's tax as written (``finish.lua`` caps a free row's by its reservation)."""
    slack_miss: bool = False
    """The row counted a slack miss (not a rerun's after the attempt's ``ok`` row)."""
    window: int = 0
    """The window whose counts these are (``slack_misses``, ``admitted_free``): the one that
    admitted the attempt, or for a miss its job's latest admission's (owner.py)."""


class RunLedger:
    """Runs of gated attempts and their rows, in one namespace."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        window_seconds: int,
        queue_wait_unit_per_second: float,
        retention_s: int = WINDOW_RETENTION_S,
        wait_allowance_s: float = FREE_WAIT_ALLOWANCE_S,
        decision_record_cap: int = DECISION_RECORD_CAP,
    ) -> None:
        self.client = client
        self.keys = keys
        self.window_seconds = window_seconds
        self.unit = queue_wait_unit_per_second
        self.allowance_ms = round(wait_allowance_s * 1000)
        self.retention_s = retention_s
        self.record_cap = str(decision_record_cap)
        self._start = client.register_script(load_lua("start.lua"))
        self._finish = client.register_script(load_lua("finish.lua"))
        self._abandon = client.register_script(load_lua("abandon.lua"))
        self.line = Line() if has_lines(client) else None  # start and finish, per thread

    @classmethod
    def from_settings(cls, client: redis.Redis, settings: GatekeeperSettings) -> RunLedger:
        """A run ledger for the settings' namespace, window width and wait weight."""
        return cls(client, Keys(settings.key_prefix, settings.namespace),
                   window_seconds=settings.window_seconds,
                   queue_wait_unit_per_second=settings.queue_wait_unit_per_second,
                   wait_allowance_s=settings.free_wait_allowance_s,
                   decision_record_cap=settings.decision_record_cap)  # fmt: skip

    def start(self, job_id: str, attempt: int, nonce: str, own: dict[str, str], now_ms: int,
              token: str | None = None) -> Started:  # fmt: skip
        """Record that a run began, if the message is the gate's (its ``nonce`` is the gate
        record's); ``own`` are the fields the worker knows itself (task, retries, ...).

        ``token`` (random unless given) makes ``start.lua`` safe to send twice: the same
        token again gets the same reply and counts no second run. So after a connection
        error or a timeout it is sent once more (``StartCall``; the client itself does not
        retry)."""
        return self.send_start(job_id, attempt, nonce, own, now_ms, token).started()

    def send_start(self, job_id: str, attempt: int, nonce: str, own: dict[str, str],
                   now_ms: int, token: str | None = None) -> StartCall:  # fmt: skip
        """:meth:`start`, sent now and read by ``started()`` on the call it returns, so the
        run does not wait for it (gatekeeper/redis/run_start.py)."""
        member = f"{job_id}:{attempt}"
        args: list[str] = [member, str(now_ms), nonce, token or secrets.token_hex(8)]
        for name, value in pack_own(own).items():  # four numbers as one (kept.py: OWN)
            args += [name, value]
        keys = [self.keys.run(job_id, attempt), self.keys.started, self.keys.free_waiting,
                self.keys.stats]  # fmt: skip
        # start.lua sends back the gate's fields of the record alone: these are the caller's
        mine = {**own, "started_ms": str(now_ms), "nonce": nonce}
        return StartCall.send(member, self.line, self.client, self._start, keys, args,
                              self.call, partial(_started_of, mine=mine))  # fmt: skip

    def call(self, script: Script, keys: list[str], args: list[str]) -> Any:
        """A run's script through this thread's line (redis-py's way where there is none)."""
        if self.line is None:
            return evalsha(self.client, script, keys, args)
        return call_script(self.line, self.client, script, keys, args)

    def send_all(self, commands: Sequence[Sequence[str]]) -> list[Any]:
        """The commands in one round trip, on this thread's line where there is one: each
        reply or its error (:func:`gatekeeper.redis.wire.send_all`)."""
        return send_all(self.line, self.client, commands)

    def fields(self, job_id: str, attempt: int) -> dict[str, str]:
        """The attempt's record as stored (empty when there is none)."""
        try:
            raw = self.client.hgetall(self.keys.run(job_id, attempt))
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot read run {job_id}:{attempt}: {exc}") from exc
        return unpack({text_of(k): text_of(v) for k, v in raw.items()})

    def record(self, job_id: str, attempt: int) -> tuple[int, RunRecord] | None:
        """The attempt's latest run number and record, or None when it never started."""
        fields = self.fields(job_id, attempt)
        if "runs" not in fields:
            return None
        return int(fields["runs"]), RunRecord.from_fields(fields)

    def row_for(
        self,
        job_id: str,
        attempt: int,
        record: RunRecord,
        outcome: Outcome,
        now_ms: int,
        tokens_in: int | None = None,
        tokens_out: int | None = None,
    ) -> LedgerRow:
        """The core's row for a run that ended now (metered tokens win over declared ones).

        A free row is charged the wait since its admission to free, up to the wait allowance,
        and at most the tokens its admission reserved; a meter that reports more is
        recorded, uncharged (``finish.lua`` caps the attempt's rows at its reservation).
        """
        default_out = 0 if outcome is Outcome.KILLED else record.tokens_out
        used = record.tokens_in if tokens_in is None else tokens_in
        free = record.path == Path.FREE.value
        return make_row(
            job_id=job_id,
            attempt=attempt,
            path=Path(record.path),
            outcome=outcome,
            queue_wait_ms=max(0, record.started_ms - record.published_ms),
            tokens_in=used,
            tokens_out=default_out if tokens_out is None else tokens_out,
            # A deadline that could not be read (a bad-input route) is written as slack 0.
            deadline_slack_ms=record.deadline_ms - now_ms if record.deadline_ms else 0,
            queue_wait_unit_per_second=self.unit,
            charged_wait_ms=min(self.allowance_ms, max(0, record.started_ms - record.admitted_ms))
            if free
            else None,
            charged_tokens_in=min(used, record.tokens_in) if free else None,
        )

    def finish(
        self, row: LedgerRow, run: int, record: RunRecord, now_ms: int, *,
        slack_miss: bool = False, ends: bool = False, went_on: bool = False,
        current: bool = True, service_s: float | None = None, lower_bound: bool = False,
        token: str | None = None,
    ) -> Finished:  # fmt: skip
        """Apply one run's row atomically; a second call for the same run writes nothing.

        ``ends``: the attempt's job ends with this row (``ok``, or failed for good), so a
        later run of it is a rerun whose late finish is no slack miss (finish.lua).
        ``went_on``: the job goes on in its next attempt (a retry), which judges it: a later
        run of this attempt (a copy of its message) is no slack miss either.

        ``service_s``: the run's time, counted in its task's learned service time (SPEC
        section 6) in the same step, only if the row is written (``lower_bound``: it was
        cut off by its time limit). None: the run does not count. ``token`` (random unless
        given): the call that wrote the row, sent again, gets its reply again (finish.lua)."""
        member, mine = f"{row.job_id}:{row.attempt}", self.keys.run(row.job_id, row.attempt)
        row_window = window_id(now_ms / 1000, self.window_seconds)
        looks = slack_miss and record.path != "free"  # (an admitted attempt's miss is its own)
        owner = owner_of(self.client, self.keys, row.job_id, row.attempt) if looks else None
        admission_window = record.window or (owner and owner.window) or row_window
        keys = [  # finish.lua's KEYS, in order
            mine, self.keys.window(row_window),
            self.keys.window_rows(row_window), self.keys.inflight, self.keys.started,
            self.keys.window(admission_window), self.keys.window_rows(admission_window),
            self.keys.totals, self.keys.decisions, self.keys.service(record.task),
            self.keys.service_tasks, owner.record if owner else mine,
        ]  # fmt: skip
        text = json.dumps(row.to_json())  # retry_tax is its last field (LedgerRow's order)
        args = [
            member,
            str(run),
            text,
            row.outcome.value,
            row.path.value,
            repr(row.retry_tax),
            "1" if slack_miss else ("e" if ends else ("r" if went_on else "0")),
            str(self.retention_s),
            "1" if current else "0",
            text[: text.rindex(', "retry_tax": ')],  # the head finish.lua re-prices a capped row
            self.record_cap,
            "" if service_s is None else f"b{bucket_of(service_s)}",
            "1" if lower_bound else "0",
            record.task,
            # A later run may have started on another worker than the first (a redelivery):
            # which names the record has held is not known here, so it is written again.
            "1" if run > 1 or too_long(record.task) or too_long(record.worker) else "0",
            token or secrets.token_hex(4),  # kept with the row's run: short (bench/memory.py)
            record.nonce,  # a record of another publish of the task id is not this run's
        ]
        try:
            try:
                reply = self.call(self._finish, keys, args)
            except (redis.ConnectionError, redis.TimeoutError):  # no answer: it may have run
                reply = self.call(self._finish, keys, args)  # then its reply again (token)
            written, misses, admitted, tax, *missed = reply
            return Finished(bool(written), int(misses), int(admitted), float(text_of(tax)),
                            missed == [1], admission_window)  # fmt: skip
        except (redis.RedisError, ValueError) as exc:  # ValueError: not finish.lua's reply
            raise LedgerUnavailable(f"cannot write the row of {member}: {exc}") from exc

    def abandon(
        self, row: LedgerRow, now_ms: int, slack_miss: bool, nonce: str | None = None
    ) -> Finished:
        """Write an attempt's ``abandoned`` row once (a replayer crash cannot write two), and
        with ``nonce`` (the message's) only while the gate's record holds it, marking the
        record ended (``abandoned``): a publish of the task id after it starts it again."""
        job_id, attempt = row.job_id, row.attempt
        window, mine = window_id(now_ms / 1000, self.window_seconds), self.keys.run(job_id, attempt)
        owner = owner_of(self.client, self.keys, job_id, attempt) if slack_miss else None
        counted = (owner and owner.window) or window  # the miss's window (owner.py)
        keys = [
            self.keys.abandoned(job_id, attempt), self.keys.window(window),
            self.keys.window_rows(window), self.keys.totals, self.keys.decisions, mine,
            self.keys.abandoned(job_id, attempt, nonce or ""), owner.record if owner else mine,
            self.keys.window(counted),
        ]  # fmt: skip
        args = [json.dumps(row.to_json()), str(self.retention_s), "1" if slack_miss else "0",
                f"{row.job_id}:{row.attempt}", self.record_cap]  # fmt: skip
        if nonce is not None:
            args.append(nonce)
        try:
            written, misses, admitted, *missed = evalsha(self.client, self._abandon, keys, args)
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot write the abandoned row: {exc}") from exc
        return Finished(bool(written), int(misses), int(admitted), 0.0, missed == [1], counted)

    def abandoned_before(self, job_id: str, attempt: int, nonce: str) -> bool:
        """Whether the message carrying ``nonce`` has its ``abandoned`` row (abandon.lua): a
        copy of it found after the attempt went on (published again, requeued) is not
        rowed again as a stranger's."""
        if not nonce:
            return False
        try:
            return bool(self.client.exists(self.keys.abandoned(job_id, attempt, nonce)))
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot read the abandonment of {job_id}: {exc}") from exc

    def stale(self, now_ms: int, older_than_s: float) -> list[tuple[str, int]]:
        """Attempts started more than ``older_than_s`` ago that still have no row."""
        before = now_ms - older_than_s * 1000
        try:
            members = self.client.zrangebyscore(self.keys.started, "-inf", before)
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot read started runs: {exc}") from exc
        split = (text_of(member).rpartition(":") for member in members)  # type: ignore[arg-type]
        return [(job_id, int(attempt)) for job_id, _, attempt in split]


def _started_of(reply: Any, mine: dict[str, str]) -> Started:
    """``start.lua``'s reply as a :class:`Started`, the gate's fields of the record in it
    completed by ``mine``, those the start sent (the worker's own, its time and nonce)."""
    if not int(reply[0]):
        return Started(run=0, dead_run=0, dead=None, record=None, refused=text_of(reply[1]))
    run, dead_run, dead_started = int(reply[1]), int(reply[2]), int(float(reply[3]))
    flat = [text_of(part) for part in reply[4:]]
    record = RunRecord.from_fields({**dict(zip(flat[::2], flat[1::2], strict=True)), **mine})
    dead = replace(record, started_ms=dead_started) if dead_run else None
    return Started(run=run, dead_run=dead_run, dead=dead, record=record)
