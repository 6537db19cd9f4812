"""Ops: the ``gatekeeper`` command line and what it runs (the drill, the demo, the on-call and
flag commands, the embedded Redis). The top layer: it imports the adapters, nothing imports it."""
