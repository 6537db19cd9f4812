"""A publisher process for the budget-ceiling test: ``COUNT`` gated ``tests.taxed`` tasks.

    python -m tests.apps.tax_publisher BROKER_URL GO_FILE COUNT FAIL SLEEP_S

Its settings come from the environment (GATEKEEPER_*), as a deployment's would. It waits for
``GO_FILE`` so that every publisher starts at once, then publishes as fast as it can.
"""

from __future__ import annotations

import os
import sys
import time

from gatekeeper.settings import load_settings
from tests.apps.gated_app import create_app


def main() -> None:
    broker, go, count, fail, sleep_s = sys.argv[1:6]
    app = create_app(load_settings(), broker)
    taxed = app.tasks["tests.taxed"]
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.005)
    for _ in range(int(count)):
        taxed.delay(fail == "1", float(sleep_s))


if __name__ == "__main__":
    main()
