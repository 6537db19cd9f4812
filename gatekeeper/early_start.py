"""Starting a gated task's decision in ``app.send_task``, before Celery builds its message.

The gate's one round trip would otherwise come after all of Celery's work on a publish. Here
the wrapped ``send_task`` fixes the task id (Celery would draw the same kind of uuid itself a
moment later), starts the decision (:meth:`Pipeline.begin` sends ``gate.lua``) and lets
Celery route and build the message; the wrapped sender then takes the started decision
(:meth:`EarlyStart.take`) and reads the reply, which has been on its way meanwhile.

It stands aside, and the sender decides from start to end as before, when the publish does
not come through ``send_task``, passes the task id by position, uses fast publish (which
needs the built message), or when a route could still add headers: a router function or
class, or a mapping route with ``headers``. A decision whose message is never sent, or whose
gatekeeper headers changed all the same, is finished and its admission given back.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from celery import Celery
from celery.app.routes import MapRoute
from kombu.utils.uuid import uuid

from gatekeeper.pipeline import Begun, Pipeline, Publish
from gatekeeper.spec import BadDeclaredInput, GatedSpec

__all__ = ["EarlyStart", "GatedTask", "own_headers"]


class GatedTask(Protocol):
    """What the hook knows of a gated task by name."""

    @property
    def spec(self) -> GatedSpec | None: ...
    @property
    def error(self) -> BadDeclaredInput | None: ...
    @property
    def max_retries(self) -> int | None: ...


def own_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The headers a decision reads: gatekeeper's own."""
    return {key: value for key, value in headers.items() if key.startswith("gatekeeper_")}


class EarlyStart:
    """The wrapped ``app.send_task`` and the decisions it started, per thread, by task id."""

    def __init__(
        self,
        app: Celery,
        pipeline: Pipeline,
        original: Callable[..., Any],
        lookup: Callable[[str], GatedTask | None],
        enabled: Callable[[], bool] = lambda: True,
    ) -> None:
        self.app = app
        self.pipeline = pipeline
        self.original = original
        self.lookup = lookup
        self.enabled = enabled
        self._started = threading.local()
        self._router_verdict: tuple[Any, bool] | None = None

    def started(self) -> dict[str, tuple[Begun, dict[str, Any]]]:
        """This thread's started decisions, with the gatekeeper headers each one saw."""
        by_id: dict[str, tuple[Begun, dict[str, Any]]] | None = getattr(
            self._started, "by_id", None
        )
        if by_id is None:
            by_id = self._started.by_id = {}
        return by_id

    def send_task(self, name: str, *args: Any, **options: Any) -> Any:
        """``app.send_task``, with a gated task's decision started before Celery's work."""
        original = self.original
        if len(args) > 4:
            return original(name, *args, **options)
        try:
            found = self.lookup(name)
            early = found is not None and self.enabled()
        except Exception:  # an app that cannot list its tasks must not break publishing
            early = False
        if not early or not self.routes_leave_headers(options):
            return original(name, *args, **options)
        assert found is not None
        try:
            task_id = str(options.get("task_id") or uuid())
            countdown = args[2] if len(args) > 2 else options.get("countdown")
            eta = args[3] if len(args) > 3 else options.get("eta")
            headers = dict(options.get("headers") or {})
            delay = max(0.0, float(countdown)) if countdown else None
            if delay is None and eta:
                headers["eta"] = eta if isinstance(eta, str) else eta.isoformat()
            publish = Publish(
                task=name,
                job_id=task_id,
                retries=int(options.get("retries") or 0),
                max_retries=found.max_retries,
                spec=found.spec,
                headers=headers,
                spec_error=found.error,
                delay_s=delay,
            )
            begun = self.pipeline.begin(publish)
        except Exception:  # decided in the sender instead, where faults fail closed
            return original(name, *args, **options)
        options["task_id"] = task_id
        started = self.started()
        started[task_id] = (begun, own_headers(options.get("headers") or {}))
        try:
            return original(name, *args, **options)
        except BaseException as exc:
            left = started.pop(task_id, None)
            if left is not None:
                self.abandon(left[0], f"{type(exc).__name__}: {exc}")
            raise
        finally:
            left = started.pop(task_id, None)
            if left is not None:
                self.abandon(left[0], "celery returned without sending the message")

    def take(self, job_id: str, name: str, headers: Mapping[str, Any]) -> Begun | None:
        """The decision started for this publish, if any and still valid (for the sender).

        Headers that changed after the decision started (the routes said they would not), or
        a renamed task: that decision saw other inputs, so it is given back and None returned
        for the sender to decide again (the first decision's counters stay in the window).
        """
        by_id: dict[str, tuple[Begun, dict[str, Any]]] | None = getattr(
            self._started, "by_id", None
        )
        early = by_id.pop(job_id, None) if by_id else None
        if early is None:
            return None
        begun, seen = early
        if begun.publish.task != name or seen != own_headers(headers):
            self.abandon(begun, "inputs changed after send_task", "decision_redone")
            return None
        return begun

    def routes_leave_headers(self, options: Mapping[str, Any]) -> bool:
        """Whether Celery's routing cannot add headers to this publish after send_task starts:
        every route is a plain mapping without ``headers``."""
        if options.get("router") is not None:
            return False
        router = self.app.amqp.router
        known = self._router_verdict
        if known is not None and known[0] is router:
            return known[1]
        safe = all(
            isinstance(route, MapRoute)
            and not any(
                isinstance(target, dict) and "headers" in target
                for target in (*route.map.values(), *route.patterns.values())
            )
            for route in router.routes
        )
        self._router_verdict = (router, safe)
        return safe

    def abandon(self, begun: Begun, error: str, event: str = "publish_abandoned") -> None:
        """A decision started for a message not sent as decided: finish it, give back its hold."""
        with contextlib.suppress(Exception):
            routing = self.pipeline.complete(begun)
            publish = begun.publish
            self.pipeline.log.warning(
                event,
                task=publish.task,
                job_id=publish.job_id,
                attempt=publish.attempt,
                decision=routing.decision,
                error=error,
            )
            if routing.decision == "admit_free":
                self.pipeline.store.release(
                    publish.job_id, publish.attempt, int(begun.win), unpublished=True
                )
