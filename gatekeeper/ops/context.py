"""What every ``gatekeeper`` sub-command shares: the settings of one invocation, numbers shown
the way the source prints them."""

from __future__ import annotations

import math
import re
from typing import Any

import click

from gatekeeper.errors import ConfigError
from gatekeeper.settings import GatekeeperSettings, load_settings

__all__ = ["app_of", "duration_s", "format_number", "settings_of"]


def app_of(ctx: click.Context) -> Any:
    """The Celery app ``-A/--app`` names (``proj.celery:app``, or one ``celery -A`` runs this
    command under), or None."""
    obj = ctx.ensure_object(dict)
    app = obj.get("app")
    if isinstance(app, str):
        from celery.app.utils import find_app  # only when an app is named

        try:
            app = obj["app"] = find_app(app)
        except Exception as exc:  # an import error, a typo: named, as celery -A does
            raise click.UsageError(f"--app: cannot load {app!r}: {exc}", ctx=ctx) from exc
    return app


def settings_of(ctx: click.Context) -> GatekeeperSettings:
    """Load settings once per invocation (with ``-A/--app``, the Celery app's config too); a
    bad value is a usage error naming the variable."""
    obj = ctx.ensure_object(dict)
    if "settings" not in obj:
        try:
            obj["settings"] = load_settings(obj.get("config"), app=app_of(ctx))
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


def duration_s(value: str) -> float:
    """``--since``: a duration like ``7d``, ``24h``, ``90m`` or ``900s`` (or plain seconds)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw]?)", value.strip())
    if not match:
        raise click.BadParameter(f"expected a duration like 7d, 24h or 900s, got {value!r}",
                                 param_hint="--since")  # fmt: skip
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match.group(2)]
    return float(match.group(1)) * unit
