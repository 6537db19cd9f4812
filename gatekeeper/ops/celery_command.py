"""``celery -A proj gatekeeper ...``: gatekeeper's commands under the celery CLI.

Celery loads sub-commands from the ``celery.commands`` entry point group (as Flower's ``celery
flower``); this group carries every ``gatekeeper`` command and reads the settings of the app
``celery -A`` loaded (its ``gatekeeper_*`` keys and ``broker_url``), under the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gatekeeper.ops.cli import CONFIG_OPTION, main

__all__ = ["gatekeeper"]


@click.group(name="gatekeeper", commands=main.commands)
@CONFIG_OPTION
@click.pass_context
def gatekeeper(ctx: click.Context, config: Path | None) -> None:
    """Deadline-aware admission control: status, flags, replay, report, ledger, sweep, metrics."""
    parent: Any = ctx.obj  # celery's CLIContext: the app -A loaded
    ctx.obj = {"config": config, "app": getattr(parent, "app", None)}
