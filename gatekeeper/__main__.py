"""``python -m gatekeeper``: the same command line as the ``gatekeeper`` script."""

from __future__ import annotations

from gatekeeper.ops.cli import main

main()
