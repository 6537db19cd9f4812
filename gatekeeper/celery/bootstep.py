"""The replayer inside a worker: ``celery -A proj worker -Q reserved --gatekeeper-replay``.

For deployments that want no separate process (as ``worker --beat`` runs the scheduler in a
worker): a worker bootstep that runs :class:`~gatekeeper.celery.replay.Replayer` (and so
its sweep, every minute) in a thread of the worker's main process, started after the pool
and stopped with the worker. The namespace's lock keeps it to one replayer whatever the
number of workers started with the option. The broker it reads is the app's (Redis or
RabbitMQ, as for ``gatekeeper replay``).
"""

from __future__ import annotations

import threading
from typing import Any

import click
from celery import Celery, bootsteps

from gatekeeper.celery.broker import broker_for
from gatekeeper.celery.replay import Replayer
from gatekeeper.errors import ConfigError
from gatekeeper.logs import make_logger

__all__ = ["OPTION", "ReplayStep", "SettingsStep", "add_to_worker"]

OPTION = "gatekeeper_replay"


def add_to_worker(app: Celery, installed: Any) -> None:
    """Offer ``--gatekeeper-replay`` on this app's worker command, and the step it turns on."""
    app.user_options["worker"].add(click.Option(
        ["--gatekeeper-replay"], is_flag=True, default=False,
        help="Run gatekeeper's replayer (and its sweep) in this worker's main process.",
    ))  # fmt: skip
    step = type("GatekeeperReplay", (ReplayStep,), {"installed": installed})
    app.steps["worker"].add(step)
    app.steps["worker"].add(type("GatekeeperSettings", (SettingsStep,), {"installed": installed}))


class SettingsStep(bootsteps.Step):  # type: ignore[misc]
    """Reads gatekeeper's settings as the worker is made, before it takes any task: a bad
    value stops it there, the :class:`~gatekeeper.errors.ConfigError` naming the key. Read
    later, at the first task's signal, it left a worker running whose every signal logged a
    traceback and whose retries raised, a retried task rejected and lost."""

    installed: Any = None

    def __init__(self, parent: Any, **options: Any) -> None:
        try:
            self.installed.parts()  # settings, clients (not connected): ConfigError when bad
        except ConfigError as exc:  # `celery worker` says "Error: ..." and exits 1
            raise click.ClickException(f"gatekeeper: {exc}") from exc
        super().__init__(parent, **options)


class ReplayStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Starts the replayer thread when the worker was given ``--gatekeeper-replay``."""

    requires = ("celery.worker.components:Pool",)
    installed: Any = None

    def __init__(self, parent: Any, **options: Any) -> None:
        self.enabled = bool(options.get(OPTION))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__(parent, **options)

    def start(self, parent: Any) -> None:
        settings = self.installed.settings
        log = make_logger(settings, "replay")
        try:
            broker = broker_for(settings, self.installed.app)
        except ConfigError as exc:
            log.error("replay_not_started", reason=str(exc))
            return
        replayer = Replayer(settings, broker, self.installed.client, app=self.installed.app)
        log.info("replay_started", queue=settings.defer_queue, replayer=replayer.ident,
                 where="worker", broker=broker.shown)  # fmt: skip
        self._thread = threading.Thread(target=replayer.run, args=(self._stop,),
                                        name="gatekeeper-replayer", daemon=True)  # fmt: skip
        self._thread.start()

    def stop(self, parent: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)  # it gives its lock back as it ends
