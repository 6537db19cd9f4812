"""A publisher process for the state-loss tests: publishes ``tests.embed`` with a tag.

    python -m tests.apps.publisher BROKER_URL GATE_URL TAG STOP_FILE

Publishes one gated task every 20 ms, its argument ``<TAG>-<n>``, until ``STOP_FILE`` exists.
A publish that fails (the broker down) is counted on stderr, and the loop goes on.
"""

from __future__ import annotations

import os
import sys
import time

from tests.apps.gated_app import create_app
from tests.conftest import gate_settings


def main() -> None:
    broker, gate, tag, stop = sys.argv[1:5]
    settings = gate_settings(gate, flag_cache_s=0.5, budget_units=1e9, redis_timeout_s=0.2)
    app = create_app(settings, broker)
    embed = app.tasks["tests.embed"]
    n = 0
    print("ready", flush=True)
    while not os.path.exists(stop):
        try:
            embed.delay(f"{tag}-{n}")
        except Exception as exc:  # counted, and the publisher goes on
            print(f"publish failed: {exc!r}", file=sys.stderr, flush=True)
        n += 1
        time.sleep(0.02)


if __name__ == "__main__":
    main()
