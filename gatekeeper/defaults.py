"""Every default gatekeeper has, named once, with why it is what it is.

The settings model (:mod:`gatekeeper.settings`), the pure core's keyword defaults and the Redis
adapter's script arguments all read these; nothing else writes the numbers again.
"""

from __future__ import annotations

__all__ = [
    "BREAKER_OPEN_S",
    "BUDGET_UNITS",
    "CANARY_PERCENT",
    "DECISION_RECORD_CAP",
    "FLAG_CACHE_S",
    "FREE_WAIT_ALLOWANCE_S",
    "MAX_QUEUE_AGE_S",
    "MISS_ERROR_BUDGET",
    "MISS_MIN_ADMISSIONS",
    "QUEUE_AGE_HORIZON_S",
    "QUEUE_WAIT_UNIT_PER_SECOND",
    "RECORD_RETENTION_S",
    "REDIS_TIMEOUT_S",
    "REPLAY_BATCH_SIZE",
    "SERVICE_DRIFT_FACTOR",
    "SERVICE_TIME_MIN_SAMPLES",
    "STALE_ATTEMPT_S",
    "WINDOW_RETENTION_S",
    "WINDOW_SECONDS",
    "WORKER_HEARTBEAT_S",
]

MAX_QUEUE_AGE_S = 30.0
"""The queue-age cap of the source's declared workload, in seconds (a veto, not the vote)."""
WINDOW_SECONDS = 900
"""Width of a ledger window; windows are aligned to the Unix epoch."""
QUEUE_WAIT_UNIT_PER_SECOND = 200.0
"""Declared weight that lets a second of queue wait compete with a chunk of tokens."""
FREE_WAIT_ALLOWANCE_S = 10.0
"""How long an attempt admitted to free may wait there before it is moved to reserved (an
``expired`` row), and the wait its admission reserves in the budget (the ceiling, SPEC
section 2: each admission reserves ``tokens_in + allowance * queue_wait_unit_per_second``).

The trade-off: at the default weight 10 s reserves 2,000 units, so with the drill's
1,200-token attempts a 12,000-unit window carries three free attempts in flight at once. A
longer allowance lets fewer run at once (30 s, the age cap, reserves 6,000: one in flight); a
shorter one moves more work to reserved. 10 s is a third of the age cap: a free queue the gate
admitted to because it looked short, that has not started an attempt within 10 s, is the
late-starting slot the source warns of."""
BUDGET_UNITS = 12_000.0
"""Retry-tax budget per window: jobs x input tokens x fail fraction = 40 x 1200 x 0.25, the
source's rule for its declared workload (start from tokens times jobs, cut by the fail
fraction)."""
CANARY_PERCENT = 5.0
"""Share of jobs (a stable hash of the task id) that go through the gate once it is on."""
FLAG_CACHE_S = 5.0
"""How stale a live flag read from Redis may be: a rollback binds new tasks within this."""
MISS_ERROR_BUDGET = 0.01
"""Share of a window's free admissions that may miss slack before the free path freezes."""
MISS_MIN_ADMISSIONS = 20
"""A window needs this many free admissions before its miss rate can freeze the free path:
at the default 1% budget, one miss in fewer than 20 would be a 5%+ rate from noise alone."""
STALE_ATTEMPT_S = 1800.0
"""``gatekeeper sweep`` records a run started longer ago than this, with no row, as killed."""
QUEUE_AGE_HORIZON_S = 300.0
"""A free attempt published longer ago than this no longer holds the queue's age up, so a
purged or lost message defers new work for at most this long (ten times the age cap)."""
WORKER_HEARTBEAT_S = 10.0
"""How often a worker refreshes its heartbeat (TTL three times this): a sweep waits up to
three intervals after a worker died before it records its runs as killed."""
REDIS_TIMEOUT_S = 0.5
"""Connect and read timeout of the gate's Redis: past it a publish fails closed."""
REPLAY_BATCH_SIZE = 100
"""Deferred messages the replayer claims, scores and moves together on a Redis broker, in one
round trip per step (claim, records, decisions, handoffs, move, deadlines): past about a
hundred the round trips are a small share of a message's cost. A batch may take longer than
the lock's TTL (slow steps in process, a slow backend): the lock is checked, and renewed once
a third of its TTL has passed, before each claim, before each step of each message and before
the moves, so only a replayer stalled for a whole TTL loses it."""
BREAKER_OPEN_S = 1.0
"""After the gate's Redis did not answer, how long until the first probe (a ``PING`` from a
thread of its own), and between probes: decisions are made without Redis meanwhile. A second
keeps a hung server's cost to one timeout a second per process, and a server back within a
second or two of the probe."""
WINDOW_RETENTION_S = 8 * 24 * 3600
"""Windows are kept eight days: a week of review (``gatekeeper report``) plus a day's margin."""
RECORD_RETENTION_S = 2 * 24 * 3600
"""An attempt's record (the gate's, then its runs') outlives any sane visibility timeout,
retry delay or deadline. About 620 bytes until the row of its last run, then cut to about 310
(gatekeeper/redis/kept.py): at 10 finished jobs a second, 10 x 2 days x 310 B = 0.54 GB."""
SERVICE_TIME_MIN_SAMPLES = 100
"""Runs a task needs before its observed p95 is used (``service_time=learned`` or ``max``) or
said to drift: the p95 of 100 runs rests on its 5 slowest, so one slow run moves it by at
most a bucket or two; of 20 it would be the second slowest run, whatever the tail."""
SERVICE_DRIFT_FACTOR = 1.5
"""``service_time_drift`` fires when the observed p95 is more than this times the declared
guess: SPEC section 6's default. Below it the bucket error (4.9 %) and an honest guess's
spread are noise; at 1.5 a task's retry tax is also under-counted by a third or more."""
DECISION_RECORD_CAP = 1_000_000
"""Decisions kept for ``gatekeeper tune`` (a stream trimmed to about this many): about 160 MB
at about 160 bytes a decision (measured: docs/decision-records.md). That is a week of a batch
that makes 1.6 decisions a second, 27.8 hours at 10 a second; a week at 10 a second needs
6,048,000 (about 1 GB), at 100 a second 60,480,000 (about 10 GB). 0 keeps none."""
