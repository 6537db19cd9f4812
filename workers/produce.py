"""``python -m workers.produce``: publish the declared demo workload once.

Prints ``published=<n>``; with ``GATEKEEPER_DEMO_IDS_FILE`` set, also writes the task ids
there, one a line (``gatekeeper demo`` uses it to account for every task).
"""

from __future__ import annotations

import os
from pathlib import Path

from workers.run import exit_on_config_error, produce

if __name__ == "__main__":
    ids = exit_on_config_error(produce)
    target = os.environ.get("GATEKEEPER_DEMO_IDS_FILE")
    if target:
        Path(target).write_text("\n".join(ids) + "\n")
    print(f"published={len(ids)}")
