"""Learned service times in Redis: the worker counts runs, the publisher reads them cached.

A worker counts a run in its task's bucket hash in the same ``finish.lua`` call that writes
the run's row (:meth:`gatekeeper.redis.runs.RunLedger.finish`: no round trip of its own);
:meth:`ServiceTimes.observe` counts one run directly, the same way (``HINCRBY`` of one
bucket, ``SADD`` of the name), for runs timed elsewhere. The publish side
(:class:`LearnedService`) reads a task's hash at most once per ``flag_cache_s`` per process,
so a publish costs no round trip of its own for it, and on that read says
``service_time_drift`` once per window per task (``SET NX`` with the window's TTL, across all
processes) when the p95 exceeds the declared guess by ``service_drift_factor``. A Redis that
cannot be read leaves the last histogram in force (none before the first read: the declared
value), never a failed publish.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from gatekeeper.core.ledger import window_id
from gatekeeper.core.service import ServiceHistogram, bucket_of, choose_service, drifted
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.forks import renew_in_children
from gatekeeper.redis.breaker import Breaker
from gatekeeper.redis.cluster import home
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import text_of
from gatekeeper.settings import GatekeeperSettings

__all__ = ["LearnedService", "ServiceTimes"]


class ServiceTimes:
    """The bucket hashes of one namespace."""

    def __init__(self, client: redis.Redis, keys: Keys, breaker: Breaker | None = None) -> None:
        self.client = client
        self.keys = keys
        self.breaker = breaker

    def observe(self, task: str, seconds: float, lower_bound: bool = False) -> None:
        """Count one run of ``task`` that took ``seconds`` (``lower_bound``: it was killed by
        its time limit, so it would have taken at least that)."""
        key = self.keys.service(task)
        try:
            pipe = home(self.client, key).pipeline(transaction=False)
            pipe.hincrby(key, f"b{bucket_of(seconds)}", 1)
            if lower_bound:
                pipe.hincrby(key, "lower_bounds", 1)
            pipe.sadd(self.keys.service_tasks, task)
            pipe.execute()
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot count a run of {task}: {exc}") from exc

    def read(self, task: str) -> ServiceHistogram:
        """The task's histogram as stored (empty when it has none)."""
        if self.breaker is not None:
            self.breaker.check("cannot read service times")
        try:
            raw = self.client.hgetall(self.keys.service(task))
        except redis.RedisError as exc:
            if self.breaker is not None:
                self.breaker.failed(exc)
            raise LedgerUnavailable(f"cannot read service times of {task}: {exc}") from exc
        return ServiceHistogram.from_fields({text_of(k): text_of(v) for k, v in raw.items()})

    def names(self) -> list[str]:
        """The tasks that have a histogram, sorted."""
        try:
            members = self.client.smembers(self.keys.service_tasks)
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot read the service-time tasks: {exc}") from exc
        return sorted(str(text_of(member)) for member in members)

    def mark_drift(self, task: str, window: int, ttl_s: int) -> bool:
        """True for the first caller in ``window`` (across all processes)."""
        try:
            return bool(self.client.set(self.keys.service_drift(task, window), "1",
                                        nx=True, ex=max(1, ttl_s)))  # fmt: skip
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot mark the drift of {task}: {exc}") from exc


class LearnedService:
    """Per task, the service time a decision uses and the fields its line carries."""

    def __init__(
        self,
        times: ServiceTimes,
        settings: GatekeeperSettings,
        logger: Any,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.times = times
        self.settings = settings
        self.log = logger
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._cached: dict[str, tuple[float, ServiceHistogram | None]] = {}
        renew_in_children(self)

    def _forked(self) -> None:
        """In a forked child: a lock of its own (the parent's may be held mid-read)."""
        self._lock = threading.Lock()

    def histogram(self, task: str, declared_s: float) -> ServiceHistogram | None:
        """The task's histogram, at most ``flag_cache_s`` old (None before any read)."""
        now = self._clock()
        cached = self._cached.get(task)  # fresh most of the time: no lock to read it
        if cached is not None and now - cached[0] < self.settings.flag_cache_s:
            return cached[1]
        with self._lock:
            cached = self._cached.get(task)
            if cached is not None and now - cached[0] < self.settings.flag_cache_s:
                return cached[1]
            previous = cached[1] if cached is not None else None
            try:
                histogram: ServiceHistogram | None = self.times.read(task)
            except LedgerUnavailable:
                histogram = previous  # stale beats absent; asked again after the interval
            self._cached[task] = (now, histogram)
        if histogram is not None and histogram is not previous:
            self._drift(task, declared_s, histogram)
        return histogram

    def choose(self, task: str, declared_s: float) -> tuple[float, dict[str, Any]]:
        """The service time to decide with, and the decision line's fields for it."""
        histogram = self.histogram(task, declared_s)
        p95 = histogram.p95 if histogram is not None else None
        samples = histogram.samples if histogram is not None else 0
        used, source = choose_service(self.settings.service_time, declared_s, p95, samples,
                                      self.settings.service_time_min_samples)  # fmt: skip
        return used, {
            "service_declared_s": declared_s,
            "service_learned_p95_s": p95,  # exact (the decision record's); the line rounds it
            "service_samples": samples,
            "service_source": source,
        }

    def _drift(self, task: str, declared_s: float, histogram: ServiceHistogram) -> None:
        """One ``service_time_drift`` line per window per task, across all processes."""
        p95, samples = histogram.p95, histogram.samples
        factor = self.settings.service_drift_factor
        if samples < self.settings.service_time_min_samples or not math.isfinite(declared_s):
            return
        if not drifted(declared_s, p95, factor):
            return
        width = self.settings.window_seconds
        window = window_id(self._wall(), width)
        with contextlib.suppress(Exception):  # a drift line must never change a decision
            if self.times.mark_drift(task, window, width):
                self.log.warning(
                    "service_time_drift", task=task, service_declared_s=declared_s,
                    service_learned_p95_s=round(p95 or 0.0, 6), service_samples=samples,
                    lower_bounds=histogram.lower_bounds, service_drift_factor=factor,
                    window=window, service_time=self.settings.service_time,
                )  # fmt: skip
