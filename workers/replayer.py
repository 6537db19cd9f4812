"""``python -m workers.replayer``: the defer queue's replayer (``gatekeeper replay``)."""

from __future__ import annotations

from workers.run import replayer

if __name__ == "__main__":
    replayer()
