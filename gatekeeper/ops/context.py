"""What every ``gatekeeper`` sub-command shares: the settings of one invocation, numbers shown
the way the source prints them."""

from __future__ import annotations

import math

import click

from gatekeeper.errors import ConfigError
from gatekeeper.settings import GatekeeperSettings, load_settings

__all__ = ["format_number", "settings_of"]


def settings_of(ctx: click.Context) -> GatekeeperSettings:
    """Load settings once per invocation; a bad value is a usage error naming the variable."""
    obj = ctx.ensure_object(dict)
    if "settings" not in obj:
        try:
            obj["settings"] = load_settings(obj.get("config"))
        except ConfigError as exc:
            raise click.UsageError(str(exc), ctx=ctx) from exc
    settings: GatekeeperSettings = obj["settings"]
    return settings


def format_number(value: float) -> str:
    """Whole numbers without a decimal point (``28``), others to the millisecond (``28.5``)."""
    if not math.isfinite(value):
        return str(value)
    if float(value).is_integer():
        return str(int(value))
    return str(round(value, 3))
