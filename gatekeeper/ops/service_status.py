"""``gatekeeper status``'s service-time lines: per task, declared and learned, side by side.

One line per task that has observed runs (and, with ``-A``, per gated task of the app)::

    service task=tasks.embed declared_s=8 learned_p95_s=28.6 samples=412 lower_bounds=3 \
uses=learned (service_time=max, min_samples=100)

``declared_s`` is the task's declaration (``n/a`` without ``-A``: only the app knows it; a
per-call override is not shown); ``uses`` is what a publish with that declaration decides with.
"""

from __future__ import annotations

from typing import Any

from gatekeeper.celery.gating import spec_of
from gatekeeper.core.service import ServiceHistogram, choose_service
from gatekeeper.errors import GatekeeperError
from gatekeeper.redis.service_times import ServiceTimes
from gatekeeper.settings import GatekeeperSettings

__all__ = ["declared_of", "service_lines"]


def declared_of(app: Any) -> dict[str, float]:
    """The declared service time of each gated task of ``app`` (none without an app)."""
    declared: dict[str, float] = {}
    for name, task in sorted(getattr(app, "tasks", {}).items()) if app is not None else ():
        try:
            spec = spec_of(task)
        except GatekeeperError:  # a malformed declaration: its publishes fail closed anyway
            continue
        if spec is not None:
            declared[name] = float(spec.expected_service_s)
    return declared


def service_lines(times: ServiceTimes, settings: GatekeeperSettings, app: Any) -> list[str]:
    """The lines, sorted by task; raises :class:`LedgerUnavailable` when Redis cannot be read."""
    declared = declared_of(app)
    lines = []
    for task in sorted(set(times.names()) | set(declared)):
        histogram: ServiceHistogram = times.read(task)
        p95 = histogram.p95
        guess = declared.get(task)
        line = (
            f"service task={task} declared_s={'n/a' if guess is None else f'{guess:g}'} "
            f"learned_p95_s={'n/a' if p95 is None else f'{p95:.3f}'} "
            f"samples={histogram.samples} lower_bounds={histogram.lower_bounds}"
        )
        if guess is not None:
            _, source = choose_service(settings.service_time, guess, p95, histogram.samples,
                                       settings.service_time_min_samples)  # fmt: skip
            line += f" uses={source}"
        lines.append(
            f"{line} (service_time={settings.service_time}, "
            f"min_samples={settings.service_time_min_samples})"
        )
    return lines
