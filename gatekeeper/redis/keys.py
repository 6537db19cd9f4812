"""Every Redis key gatekeeper uses, built in one place.

All keys share one prefix and one hash tag, ``{prefix}:{{{namespace}}}:``, so that in Redis
Cluster they live in one slot and a Lua script may touch any of them (neither part may hold a
brace: the settings allow none). With the defaults an operator finds them all with
``redis-cli --scan --pattern 'gatekeeper:*'`` (on a cluster, on the primary that serves the
namespace's slot):

``gatekeeper:{default}:flags`` - hash, no TTL
    Live flag overrides (``dwell_gate_enabled``, ``free_path_enabled``, ``canary_percent``):
    a field present overrides the settings (``free_path_enabled`` can only turn the path off).
    And the state marker ``initialised_at`` (Unix seconds), written by ``gatekeeper init``:
    without it (a Redis that lost its data, or a namespace never initialised) nothing goes to
    free. In the same key as the flags, so whatever loses one loses both.
``gatekeeper:{default}:flags:log`` - list, no TTL, newest first, capped at 1000 entries
    One JSON object per flag change: ``name``, ``value``, ``reason``, ``actor``, ``at``.
``gatekeeper:{default}:deployment`` - hash, no TTL (a pair unseen for a day and two windows
is deleted)
    One field per pair of values the processes run with: ``<window_seconds>|<budget_units>``
    (a process that decides publishes) or ``<window_seconds>|rows`` (a worker's window) ->
    ``<last seen, the server's Unix s>|<host>:<pid>`` (``pair.lua``), written at a process's
    first read of the flags (or beat) and at most once a minute after; the flag commands
    judge a clean hour under every pair kept (gatekeeper/redis/deployment.py).
``gatekeeper:{default}:free:waiting`` - sorted set, no TTL (members expire by score; the pad
    below stays)
    Gated attempts published to the free queue and not yet started: member
    ``<job_id>:<attempt>``, score = when it is due in ms (its publish, or its ETA). The
    oldest score gives the free queue's age. Members older than ``queue_age_horizon_s`` stop
    counting at once, and ``gate.lua`` drops up to 16 of them per decision with what they
    reserved (so without any sweep it and ``inflight`` stay bounded); ``gatekeeper sweep``
    (and the replayer, every minute) drops at once the members whose message is no longer in
    the broker (``celery purge -Q free``), keeping those a worker holds (kombu's ``unacked``).
    And one member that is no attempt, :data:`WAITING_PAD` at score ``+inf``, which
    ``gate.lua`` adds to a set with no member: past 64 bytes it makes the set a skip list
    (a compact one is searched member by member). Read the attempts as the scores below
    ``+inf`` (:data:`ATTEMPTS`).
``gatekeeper:{default}:inflight`` - hash, no TTL (fields removed when the attempt ends)
    Free attempts admitted and not yet finished: field ``<job_id>:<attempt>``, value
    ``<reserved>|<window id>|<admitted ms>|<65 zeros>``: the exposure it holds (its tokens and
    its wait allowance, as text that reads back as the double the window's exposure grew by),
    and where (the window ``release.lua`` gives it back to) and since when. The zeros
    (``gate.lua``'s ``WIDE``) keep the hash a hash table: past 64 bytes a value leaves Redis's
    compact encoding, which is searched field by field (readers take the first three fields).
``gatekeeper:{default}:started`` - sorted set, no TTL (members removed when the run ends)
    Runs of gated attempts that started and have no row yet: member ``<job_id>:<attempt>``,
    score = start time in ms. ``gatekeeper sweep`` records the stale ones as killed.
``gatekeeper:{default}:run:<job_id>:<attempt>`` - hash, TTL = 2 days
    The gate's record of one attempt, the only source a ledger row is priced from. Written by
    the script that decided it (``gate.lua``; ``record.lua`` for a decision made in process;
    ``fallback.lua`` for a fast publish whose script failed): ``nonce`` (random per publish;
    the message carries it as ``gatekeeper_nonce``, and a worker trusts a message only when
    they match), ``decision``, ``reason``, ``window`` (the admission's window, empty unless
    admitted), ``tokens_in``, ``admitted_ms``, ``published_ms``, ``deadline_ms``, ``dwell_s``,
    ``free_admitted`` (``1`` once an attempt of the job was admitted to free), ``reserved``
    (what an admission reserved: the most its rows may be charged), ``label`` (the task's
    name as the metrics count it: a registered gated task's, else ``other``; a replay of
    the attempt is counted under it again) and ``charged`` (what they
    were charged so far); ``expired_ms`` when its wait allowance ran out on free (its decision
    is then ``reserved``, reason ``free_wait_expired``, and ``free_window`` the window that
    admitted it); ``missed`` (the member whose end counted this admission's slack miss: one
    per admission, gatekeeper/redis/owner.py; dropped when the attempt starts again). Then the
    worker's runs: ``runs`` (how many times a worker started it: more than one after a
    redelivery), ``rowed`` (the last run that has its row), ``rowed_by`` (what the finish that
    wrote that row replied, for that call sent again; ``owed`` for runs a later run's row
    passed over, which get theirs late), ``started_ms`` and what the worker
    knows itself: ``task``, ``worker`` (the hostname of the worker it started on) and ``own``
    = ``<retries>|<max_retries>|<time_limit_s>|<tokens_out>``, read back laid out
    (gatekeeper/redis/kept.py; an older worker, or values too long to pack, wrote them as
    fields).
    Once every run it has had has its row, ``finish.lua`` cuts it to ``nonce``, ``decision``,
    ``reason``, ``runs``, ``rowed``, ``rowed_by``, ``free_admitted`` (when ``1``),
    ``missed`` and ``free_window`` (when written), the replayer's fields
    (``handoff_nonce``; an older replayer's ``handoff_from`` and ``handoff``, which kept the
    handoff in the record), the four numbers of a start that wrote them laid out
    and ``kept`` = ``<published_ms>|<deadline_ms>|<tokens_in>|<window>`` (what a redelivery's
    row needs; its presence closes the reservation; ``|ok`` or ``|end`` after it when that row
    ended the job, ``ok`` or failed for good, ``|on<run>`` when that run asked for a retry: a
    rerun's late finish is then no slack miss),
    about 310 bytes instead of about 620,
    for the rest of its TTL (gatekeeper/redis/kept.py).
    ``abandoned`` = ``1`` when the replayer rowed the attempt ``abandoned`` (``abandon.lua``):
    like a run's row, it ends the attempt, so a publish of it after that starts it again.
    A decision made without Redis, or a bad input, writes none: its row is unverified.
``gatekeeper:{default}:window:<id>`` - hash, TTL = window retention
    One ledger window (``id`` = epoch seconds // ``window_seconds``): ``tax_units``
    (the retry tax of the free rows it admitted, wherever they finished), ``exposure`` (what
    free attempts admitted and not finished reserved),
    ``admitted_free``, ``rejected``, ``rows:<outcome>`` (rows by outcome, both paths),
    ``killed_free``, ``slack_misses``, ``unverified:<outcome>`` (unverified rows, counted apart:
    never toward a freeze or against a clean hour), ``decided:<decision>:<reason>`` counters
    (admissions are counted in ``admitted_free`` only) and ``free_age_max_ms``, the oldest
    free-queue age a decision of ``gate.lua`` saw in the window (for ``report --html``). The
    TTL is set by the write that creates a counter, so a window lives about its retention from
    its first decisions. ``gate.lua`` and ``record.lua`` write ``hash_table`` (65 zeros, not a
    counter) with it, as in ``totals`` below: ``read_windows`` leaves it out.
``gatekeeper:{default}:window:<id>:rows`` - list, TTL = window retention
    The window's ledger rows, one JSON object each, oldest first.
``gatekeeper:{default}:handoff:<job_id>:<attempt>`` - string, TTL = 2 days
    How the replayer (or ``dead-letter requeue``) handed a deferred message on (JSON: the
    queue and the header changes, gatekeeper/redis/handoff.py), kept outside the record so
    that its length leaves the record a compact hash. The record's ``handoff_nonce`` names
    the message it belongs to; its TTL is the record's, set when the handoff is kept
    (``keep.lua``, only while the record holds the decision that made the handoff).
``gatekeeper:{default}:unverified:<job_id>:<attempt>`` - hash, TTL = 2 days
    The runs of an attempt whose message has no nonce (its rows are unverified):
    ``runs``, ``rowed`` (the last run with its row) and ``rowed_by`` (the token of the call
    that wrote it), ``started_ms`` of the latest run, ``start_token``/``start_reply`` (a start
    re-sent after a lost reply), and what a row needs as the worker read it from the message
    (``task``, ``worker``, ``decision``, times, tokens, ``retries``, ``time_limit_s``).
    Written only for such runs (``unverified.lua``), so that a run killed with its pool child,
    found dead by its redelivered copy or swept gets its row, and a signal that fires twice
    writes one.
``gatekeeper:{default}:unverified:started`` - sorted set, no TTL
    ``<job_id>:<attempt>`` -> start time (ms) of an unverified attempt whose latest run has no
    row yet; the sweep rows those whose worker is gone, as it does ``started``.
``gatekeeper:{default}:abandoned:<job_id>:<attempt>:<nonce>`` - string, TTL = window retention
    The ``abandoned`` row of the message carrying that nonce (one decision of the attempt) is
    written: the replayer writes it once, and a copy of that message (a twin, one a killed
    replayer left in defer) is not rowed again, also once the attempt went on (its task id
    published again, a dead-letter requeue: each of those, abandoned, is rowed).
    ``abandoned:<job_id>:<attempt>`` without the nonce: written by an earlier version, once
    per attempt; no longer read (it would refuse later lives' rows for its eight days), so
    a copy of a message that version rowed, abandoned after the upgrade, is rowed again.
``gatekeeper:{default}:stats`` - hash, no TTL
    Counters an operator should see in ``gatekeeper status``: ``reruns_after_row``, runs of
    an attempt that already had its row (a message the broker delivered again after it
    finished, e.g. an ack lost with ``acks_late``, or requeued by a task that raised
    ``Reject(requeue=True)``): Celery can run such a task twice, and gatekeeper counts it
    rather than hide it; ``forged_runs``, runs of messages whose ``gatekeeper_nonce`` is not
    their existing record's, or that claim the gate's decision with an attempt it never
    writes (run as ordinary tasks, priced nothing);
    ``unverified_runs``, runs of messages with gatekeeper headers and no nonce (an older
    publisher, or a decision made without Redis), or with a nonce and no record at all (a
    failover lost it): unpriced rows.
``gatekeeper:{default}:totals`` - hash, no TTL (lifetime counters, never reset)
    What ``gatekeeper metrics`` exports as Prometheus counters, each incremented by the script
    (or transaction) that records its event: ``decided:<decision>:<reason>:<task>`` (every
    decision the gate recorded: ``gate.lua``, ``record.lua``, ``fallback.lua``; replays
    included; ``<task>`` is the run record's ``label``, so the field count stays bounded by
    the gated tasks an app registers), ``slack_misses`` (``finish.lua``, ``abandon.lua``),
    ``killed_rows`` (``finish.lua``, for the worker and the sweep; unverified rows too),
    ``abandoned`` (``abandon.lua``; unverified rows too) and ``freezes`` (the auto-freeze's
    flag write). Windows expire and their sums would look like resets; these do not. And
    ``hash_table``, not a counter: 65 zeros, written with each new ``decided:`` field by
    ``gate.lua``, ``record.lua`` and ``fallback.lua``, past Redis's 64-byte compact-hash
    limit, so the hash stays a hash table (a compact one is searched field by field: 36% more
    instructions a decision at 300 fields).
``gatekeeper:{default}:deferred`` - sorted set, no TTL, at most ``DEFERRED_CAP`` members
    Attempts the gate deferred (``gate.lua``, ``record.lua``): member ``<job_id>:<attempt>``,
    score = its deadline in ms (``gatekeeper_defer_next_deadline_seconds``). The replayer
    removes a member when it hands the message on or dead-letters it, and after each
    completed pass those whose deadline passed more than ``replay_backoff_max_s`` before it
    began (a purged or lost message: any still in defer would have been abandoned); the
    scripts keep only the ``DEFERRED_CAP`` nearest deadlines.
``gatekeeper:{default}:decisions`` - stream, no TTL, about ``decision_record_cap`` entries
    The decision records ``gatekeeper tune`` re-decides (:mod:`gatekeeper.core.whatif`): one
    entry per decision the gate recorded (``gate.lua``, ``record.lua``), with its inputs as
    the script saw them, never the task's arguments (fields: ``FIELDS`` there); trimmed by
    ``XADD MAXLEN ~`` with every decision, so the oldest go first. And one entry ``miss`` =
    ``<job_id>:<attempt>`` per slack miss (``finish.lua``, ``abandon.lua``, only while the
    stream exists), so that ``tune`` knows which admissions later missed their deadline.
    docs/decision-records.md gives its size.
``gatekeeper:{default}:replayer:last_pass`` - string, no TTL
    Unix seconds at which a replayer last completed a pass over defer (with the lock held).
    Kept without a TTL so that a replayer gone for good shows as an old time, not as nothing.
``gatekeeper:{default}:service:times:<task>`` - hash, no TTL
    The observed service times of one gated task (:mod:`gatekeeper.core.service`): fields
    ``b<index>``, how many ``ok`` runs (and runs killed by their time limit, counted as lower
    bounds, also in ``lower_bounds``) fell in each log-spaced bucket. At most 200 buckets,
    so bounded whatever the traffic; written only for tasks registered as gated on a worker.
``gatekeeper:{default}:service:names`` - set, no TTL
    The task names that have a ``service:times:<task>`` hash (for ``gatekeeper status``).
``gatekeeper:{default}:service:drift:<window id>:<task>`` - string, TTL = ``window_seconds``
    Set (``SET NX``) by the first publisher to see the task's p95 over
    ``service_drift_factor`` times its declared value in that window: one
    ``service_time_drift`` line per window per task, whatever the number of processes.
``gatekeeper:{default}:worker:<hostname>#<process id>`` - string, TTL = 3 x ``worker_heartbeat_s``
    A live worker process of a gated app (its main process refreshes it; the id is drawn at
    ``worker_init`` and inherited by its pool children): the sweep writes ``killed`` for a
    stale run only once the heartbeat of the worker process it started in is gone. Each
    worker also refreshes ``worker:<hostname>``, which runs recorded by an earlier build name.
``gatekeeper:{default}:dead_letter:lock`` - string, TTL 30 s
    One ``gatekeeper dead-letter requeue`` at a time (redis-py's ``Lock``): two requeues of
    one task would each take the other's decision for one cut short. Given back when the
    command ends; a killed command's expires.
``gatekeeper:{default}:replayer:lock`` - string, TTL ``replay_lock_ttl_s`` (30 s)
    Only one replayer works a namespace at a time: redis-py's ``Lock`` (value: the holder's
    random token). The holder checks it before every claim, between a batch's steps and before
    its moves, and renews it once a third of the TTL has passed; a dead one's lock simply
    expires.

On the broker's Redis (kombu's names, not prefixed): the queue lists ``free``, ``defer``,
``reserved``, ``dead_letter`` (and their priority sub-lists ``<queue>\x06\x16<n>``), and the
replayer's, named after the defer queue (``<tenure>`` is ``<host>:<pid>:<random>:<n>``, the
n-th take of the lock by one replayer process):

``defer:replaying:<tenure>`` - list, no TTL (gone once empty)
    One lock tenure's processing list: a message claimed from ``defer`` (RPOPLPUSH, a batch
    in one transaction) sits there until it is moved on atomically (``move.lua``, a batch in
    one call, and only while the tenure's heartbeat lives). What it leaves is put back in
    ``defer`` by the lock's holder once the tenure's heartbeat has expired (and by the tenure
    itself at the start of each pass, when nothing of its own is in flight).
``defer:replayer:<tenure>`` - string ``1``, TTL ``replay_lock_ttl_s``
    The tenure's heartbeat: set with every claim and after every renewal of the lock, so it
    outlives the lock; deleted when the tenure ends (lock lost or given back). While it lives
    nobody takes the tenure's claims back; once it is gone ``move.lua`` moves none of them.
``defer:replayers`` - set, no TTL (members removed when taken back)
    The tenures whose processing lists may hold claims (added with each claim, in the same
    transaction; removed by the holder that took back an expired tenure's list, while empty).
``defer:replaying`` - list, no TTL
    The single processing list of older versions: the holder puts back whatever is in it at
    the start of every pass (kept for upgrades).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ATTEMPTS", "DEFERRED_CAP", "OTHER_TASK", "WAITING_PAD", "Keys"]

ATTEMPTS = "(+inf"
"""The top of ``free:waiting``'s attempts as a score range's end: every score below ``+inf``,
so without :data:`WAITING_PAD` (``ZRANGEBYSCORE key -inf (+inf LIMIT 0 1``; the README's ACL
has no ``ZCOUNT``: the count is ``ZCARD`` less the members at ``+inf``)."""
WAITING_PAD = "pad" + "0" * 65
"""``free:waiting``'s member that is no attempt (``gate.lua``: ``'pad' .. WIDE``)."""
DEFERRED_CAP = 10_000
"""The most members ``deferred`` keeps (the nearest deadlines): bounded without a replayer."""
OTHER_TASK = "other"
"""The task label of a decision whose task is not known to be a registered gated task."""


@dataclass(frozen=True)
class Keys:
    """Key names for one prefix and namespace."""

    prefix: str = "gatekeeper"
    namespace: str = "default"

    @property
    def base(self) -> str:
        """``prefix:{namespace}``: the hash tag keeps every key in one cluster slot."""
        return f"{self.prefix}:{{{self.namespace}}}"

    @property
    def flags(self) -> str:
        return f"{self.base}:flags"

    @property
    def flags_log(self) -> str:
        return f"{self.base}:flags:log"

    @property
    def deployment(self) -> str:
        return f"{self.base}:deployment"

    @property
    def free_waiting(self) -> str:
        return f"{self.base}:free:waiting"

    @property
    def inflight(self) -> str:
        return f"{self.base}:inflight"

    @property
    def stats(self) -> str:
        return f"{self.base}:stats"

    @property
    def totals(self) -> str:
        return f"{self.base}:totals"

    @property
    def deferred(self) -> str:
        return f"{self.base}:deferred"

    @property
    def decisions(self) -> str:
        return f"{self.base}:decisions"

    @property
    def replayer_last_pass(self) -> str:
        return f"{self.base}:replayer:last_pass"

    @property
    def started(self) -> str:
        return f"{self.base}:started"

    def run(self, job_id: str, attempt: int) -> str:
        return f"{self.base}:run:{job_id}:{attempt}"

    def handoff(self, job_id: str, attempt: int) -> str:
        return f"{self.base}:handoff:{job_id}:{attempt}"

    @property
    def unverified_started(self) -> str:
        return f"{self.base}:unverified:started"

    def unverified(self, job_id: str, attempt: int) -> str:
        return f"{self.base}:unverified:{job_id}:{attempt}"

    def abandoned(self, job_id: str, attempt: int, nonce: str = "") -> str:
        """The marker of an attempt's abandonment; with ``nonce``, of one message's."""
        if nonce:
            return f"{self.base}:abandoned:{job_id}:{attempt}:{nonce}"
        return f"{self.base}:abandoned:{job_id}:{attempt}"

    def worker(self, hostname: str) -> str:
        return f"{self.base}:worker:{hostname}"

    @property
    def replayer_lock(self) -> str:
        return f"{self.base}:replayer:lock"

    @property
    def requeue_lock(self) -> str:
        return f"{self.base}:dead_letter:lock"

    def window(self, window_id: int) -> str:
        return f"{self.base}:window:{window_id}"

    def window_rows(self, window_id: int) -> str:
        return f"{self.base}:window:{window_id}:rows"

    def window_froze(self, window_id: int) -> str:
        """String: the window's misses passed the error budget and froze (or found closed)
        the free path once; a row without a miss of its own checks it no more
        (gatekeeper/celery/freeze.py)."""
        return f"{self.base}:window:{window_id}:froze"

    def service(self, task: str) -> str:
        return f"{self.base}:service:times:{task}"

    @property
    def service_tasks(self) -> str:
        return f"{self.base}:service:names"

    def service_drift(self, task: str, window_id: int) -> str:
        return f"{self.base}:service:drift:{window_id}:{task}"
