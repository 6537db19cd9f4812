"""Whether a decision's cost stays flat in the number of jobs in flight (issue 15: 10 to
100,000), measured side by side on one embedded redis-server.

Run on demand (this is not a test)::

    python bench/inflight.py [--in-flight 10,1000,100000] [--decisions 5000] [--rounds 3]

For each size it fills the gate's in-flight state the way admitted work that nobody has
started leaves it (``free:waiting`` members and ``inflight`` fields, with the window's
exposure to match, all within the queue-age horizon), then times ``--decisions`` admissions
through :class:`gatekeeper.redis.store.GateStore` (``gate.lua``, the ordinary path) and reads
``INFO commandstats`` for the script's server time. Sizes take turns round by round, so each
sees the same moment of a noisy machine; between rounds each size's state is built again.

It checks what it measured before printing a figure: every timed call decided
``admit_free/fits``, and after each round the waiting set and the in-flight hash hold exactly
the size plus the decisions made (nothing dropped, nothing left over from another size).
Otherwise ``bench: ...`` lines on stderr, no figure, exit 1.

Prints one line per size (``in_flight=N gate_lua_us=... client_us=...``, medians of the
rounds) and last ``flatness=<largest size's gate_lua_us / smallest's>``.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time

import redis

from gatekeeper.core.ledger import BudgetMode
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis.call import GateCall
from gatekeeper.redis.keys import ATTEMPTS, WAITING_PAD, Keys
from gatekeeper.redis.store import GateStore

T0 = 1_800_000_000.0
WINDOW = int(T0 // 900)
TOKENS = 1000


def fill(client: redis.Redis, keys: Keys, size: int) -> None:
    """``size`` admitted attempts not yet started, admitted in the last minute (and the
    waiting set's pad, which the first admission into an empty set adds: keys.py)."""
    client.delete(keys.free_waiting, keys.inflight, keys.window(WINDOW), keys.decisions)
    pipe = client.pipeline(transaction=False)
    pipe.zadd(keys.free_waiting, {WAITING_PAD: math.inf})  # as gate.lua's first admission
    for start in range(0, size, 10_000):
        chunk = range(start, min(size, start + 10_000))
        pipe.zadd(keys.free_waiting, {f"held{i}:1": (T0 - 60 + i * 1e-6) * 1000 for i in chunk})
        pipe.hset(keys.inflight, mapping={f"held{i}:1": f"{TOKENS}|{WINDOW}|0" for i in chunk})
    pipe.hset(keys.window(WINDOW), "exposure", size * TOKENS)
    pipe.execute()


def calls(size: int, count: int, tag: str) -> list[GateCall]:
    def call(i: int) -> GateCall:
        return GateCall(
            now_s=T0 + i * 0.001, window_id=WINDOW, job_id=f"{tag}-{size}-{i}", attempt=1,
            expected_service_s=8.0, retry_tax_s=8.0, deadline_slack_s=600.0,
            max_queue_age_s=1e6, tokens_in=TOKENS, budget_units=1e15,
            queue_wait_unit_per_second=200.0, budget_mode=BudgetMode.EXPOSURE,
            nonce=f"n{i}", published_s=T0 + i * 0.001, deadline_s=T0 + 600,
            wait_allowance_s=10.0, task="reports.embed_batch", publisher="8.0||0|1|10.0",
        )  # fmt: skip

    return [call(i) for i in range(count)]


def one(client: redis.Redis, store: GateStore, keys: Keys, size: int, count: int,
        tag: str) -> tuple[float, float, list[str]]:  # fmt: skip
    """Fill, time ``count`` admissions; (server us per call, client us per call, problems)."""
    fill(client, keys, size)
    batch = calls(size, count, tag)
    client.config_resetstat()
    began = time.perf_counter()
    answers = [store.score(call) for call in batch]
    elapsed = time.perf_counter() - began
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    problems = []
    wrong = [a for a in answers if (a.decision.value, a.reason.value) != ("admit_free", "fits")]
    if wrong:
        problems.append(f"in_flight={size}: {len(wrong)} calls not admit_free/fits: {wrong[0]}")
    held = (
        int(client.zcount(keys.free_waiting, "-inf", ATTEMPTS)),
        int(client.hlen(keys.inflight)),
    )
    if held != (size + count, size + count):
        problems.append(f"in_flight={size}: waiting, inflight = {held}, "
                        f"expected {size + count} each")  # fmt: skip
    return float(stats.get("usec_per_call", "nan")), elapsed / count * 1e6, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-flight", default="10,1000,100000")
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(text) for text in args.in_flight.split(",")]
    figures: dict[int, list[tuple[float, float]]] = {size: [] for size in sizes}
    problems: list[str] = []
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        keys = Keys()
        client.hset(keys.flags, "initialised_at", "-inf")
        store = GateStore(client, keys)
        version = client.info("server")["redis_version"]
        for warm in range(2):  # load the script, warm the allocator
            one(client, store, keys, sizes[0], 200, f"warm{warm}")
        for round_ in range(args.rounds):
            order = sizes if round_ % 2 == 0 else list(reversed(sizes))
            for size in order:
                server_us, client_us, wrong = one(client, store, keys, size, args.decisions,
                                                  f"r{round_}")  # fmt: skip
                problems += wrong
                figures[size].append((server_us, client_us))
    if problems:
        for problem in problems:
            print(f"bench: {problem}", file=sys.stderr)
        return 1
    print(f"redis={version} python={platform.python_version()} decisions={args.decisions} "
          f"rounds={args.rounds} date={time.strftime('%Y-%m-%d')}")  # fmt: skip
    medians = {}
    for size in sizes:
        server_us = statistics.median(f[0] for f in figures[size])
        client_us = statistics.median(f[1] for f in figures[size])
        medians[size] = server_us
        print(f"in_flight={size} gate_lua_us={server_us:.1f} client_us={client_us:.1f} "
              f"(rounds: {' '.join(f'{f[0]:.1f}' for f in figures[size])})")  # fmt: skip
    print(f"flatness={medians[sizes[-1]] / medians[sizes[0]]:.2f} (gate_lua_us at "
          f"in_flight={sizes[-1]} / at in_flight={sizes[0]}; 1.00 = flat)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
