"""A stand-in for ``gatekeeper metrics``: an HTTP server on a loopback port whose ``/metrics``
is a fixed exposition of every metric docs/metrics.md names, with plausible values for a
healthy gate (free path open, budget mostly left, replayer passing), its counters growing a
little at each scrape so that rates have something to show.

It lets the dashboard's queries and the alert rules be checked against a real Prometheus
before the exporter exists. To check them against the exporter itself, the test's
``exporter_target`` fixture serves ``gatekeeper metrics --port`` instead (over a Redis a
workload ran against); nothing else in the test depends on this module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DECISIONS = [
    # (task, decision, reason, at the first scrape, added per scrape)
    ("reports.render", "admit_free", "fits", 412, 9),
    ("reports.render", "defer", "queue_age_cap", 57, 2),
    ("reports.render", "reserved", "dwell_over_slack", 88, 3),
    ("reports.render", "reserved", "retry_tax_budget", 31, 1),
    ("other", "admit_free", "fits", 68, 1),
    ("other", "reserved", "free_path_disabled", 12, 0),
]
QUEUES = {"free": 3, "defer": 7, "reserved": 12, "dead_letter": 2}


def exposition(scrape: int, now: float) -> str:
    """The text of the ``scrape``-th scrape (from 1) at Unix time ``now``."""
    n = scrape - 1
    free_admissions = sum(first + step * n for _, kind, _, first, step in DECISIONS
                          if kind == "admit_free")  # fmt: skip
    lines = [
        "# HELP gatekeeper_decisions_total Gate decisions, replays included.",
        "# TYPE gatekeeper_decisions_total counter",
        *(
            f'gatekeeper_decisions_total{{task="{task}",decision="{decision}",'
            f'reason="{reason}"}} {first + step * n}'
            for task, decision, reason, first, step in DECISIONS
        ),
        *_metric("gatekeeper_free_admissions_total", "counter", free_admissions),
        *_metric("gatekeeper_slack_misses_total", "counter", 3),
        *_metric("gatekeeper_killed_rows_total", "counter", 21 + n),
        *_metric("gatekeeper_abandoned_total", "counter", 2),
        *_metric("gatekeeper_freezes_total", "counter", 1),
        *_metric("gatekeeper_window_tax_units", "gauge", 4620.0),
        *_metric("gatekeeper_window_exposure_units", "gauge", 3200.0),
        *_metric("gatekeeper_budget_units", "gauge", 12000.0),
        *_metric("gatekeeper_budget_left_units", "gauge", 7380.0),
        *_metric("gatekeeper_window_seconds", "gauge", 900.0),
        *_metric("gatekeeper_free_queue_age_seconds", "gauge", 4.2),
        "# HELP gatekeeper_queue_messages Messages waiting, by queue.",
        "# TYPE gatekeeper_queue_messages gauge",
        *(
            f'gatekeeper_queue_messages{{queue="{queue}"}} {count}'
            for queue, count in QUEUES.items()
        ),
        *_metric("gatekeeper_defer_next_deadline_seconds", "gauge", 240.0),
        *_metric("gatekeeper_free_path_enabled", "gauge", 1),
        *_metric("gatekeeper_dwell_gate_enabled", "gauge", 1),
        *_metric("gatekeeper_canary_ratio", "gauge", 0.05),
        *_metric("gatekeeper_state_missing", "gauge", 0),
        *_metric("gatekeeper_replayer_last_pass_timestamp_seconds", "gauge", round(now - 0.4, 3)),
        *_metric("gatekeeper_redis_up", "gauge", 1),
        *_metric("gatekeeper_scrape_duration_seconds", "gauge", 0.0031),
        *_metric("gatekeeper_window_free_admissions", "gauge", 38),
        *_metric("gatekeeper_window_slack_misses", "gauge", 0),
        *_metric("gatekeeper_free_waiting_attempts", "gauge", 3),
        *_metric("gatekeeper_defer_claimed_messages", "gauge", 0),
        *_metric("gatekeeper_reruns_after_row_total", "counter", 1),
        *_metric("gatekeeper_forged_runs_total", "counter", 0 + n),
        *_metric("gatekeeper_unverified_runs_total", "counter", 2),
        *_metric("gatekeeper_state_initialised_timestamp_seconds", "gauge", round(now - 86400)),
        *_metric("gatekeeper_redis_noeviction", "gauge", 1),
        *_metric("gatekeeper_broker_up", "gauge", 1),
    ]
    return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, value: float) -> list[str]:
    return [f"# HELP {name} {name}", f"# TYPE {name} {kind}", f"{name} {value}"]


class _Exporter(ThreadingHTTPServer):
    scrapes = 0


class _Handler(BaseHTTPRequestHandler):
    server: _Exporter

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404)
            return
        self.server.scrapes += 1
        body = exposition(self.server.scrapes, time.time()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # quiet in the test log
        pass


@contextmanager
def fake_exporter() -> Iterator[str]:
    """Serve the exposition on a free loopback port; yields ``host:port`` to scrape."""
    server = _Exporter(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
