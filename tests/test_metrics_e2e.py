"""gatekeeper metrics end to end: after the demo's workload, and under a real Prometheus
scraping the exporter while gated tasks run on real workers, the metrics agree with
``gatekeeper status``, ``gatekeeper report`` and the ledger's rows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import (
    REPO_ROOT,
    clear_of_a_window_edge,
    gate_settings,
    missing_server,
    running_worker,
    unused_port,
    wait_until,
)
from tests.prometheus import PrometheusServer, find_prometheus
from tests.scrape import Samples, by_label, exporter, scrape, value

pytestmark = pytest.mark.celery

ROOMY = "1000000"
"""A budget no run of these tests nears: which free admissions the exposure budget turns away
depends on how many are still running when a replay is decided, which is timing."""


def cli(env: dict[str, str], *args: str) -> list[str]:
    """A ``gatekeeper`` command's output lines (it must succeed)."""
    done = subprocess.run([sys.executable, "-m", "gatekeeper", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def ledger_rows(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Every row of every window of the namespace."""
    pattern = keys.window_rows(0).replace(":0:", ":*:")
    return [json.loads(raw) for key in client.scan_iter(match=pattern)
            for raw in client.lrange(key, 0, -1)]  # fmt: skip


def agrees_with_status(samples: Samples, status: list[str], roles: dict[str, str]) -> None:
    """Every figure of ``gatekeeper status`` is the scrape's."""
    window = fields(next(line for line in status if line.startswith("window=")))
    assert round(value(samples, "gatekeeper_window_tax_units") or 0, 1) == float(
        window["tax_units"]
    )
    assert round(value(samples, "gatekeeper_window_exposure_units") or 0) == float(
        window["exposure"]
    )
    assert value(samples, "gatekeeper_budget_units") == float(window["budget_units"])
    assert round(value(samples, "gatekeeper_budget_left_units") or 0) == float(
        window["budget_left"]
    )
    assert value(samples, "gatekeeper_window_free_admissions") == int(window["admitted_free"])
    assert value(samples, "gatekeeper_window_slack_misses") == int(window["slack_misses"])
    waiting = fields(next(line for line in status if line.startswith("free_queue_age_s=")))
    assert value(samples, "gatekeeper_free_waiting_attempts") == int(waiting["waiting_free"])
    queues = fields(next(line for line in status if line.startswith("queues ")))
    lengths = by_label(samples, "gatekeeper_queue_messages", "queue")
    assert {role: lengths[(role,)] for role in roles} == {
        role: int(queues[name]) for role, name in roles.items()
    }
    assert value(samples, "gatekeeper_defer_claimed_messages") == int(
        queues[f"{roles['defer']}:replaying"]
    )
    for name in ("free_path_enabled", "dwell_gate_enabled"):
        shown = fields(next(line for line in status if line.startswith(f"flag {name}=")))
        assert value(samples, f"gatekeeper_{name}") == (shown[name] == "true")
    stats = fields(next(line for line in status if line.startswith("reruns_after_row=")))
    for name, count in stats.items():
        assert value(samples, f"gatekeeper_{name}_total") == int(count)
    assert value(samples, "gatekeeper_state_missing") == any(
        line.startswith("state=MISSING") for line in status
    )


def agrees_with_the_ledger(
    samples: Samples, report: list[str], rows: list[dict[str, Any]]
) -> Counter[tuple[str, str]]:
    """Decision counts are the report's (the windows' counters, replays included); killed,
    abandoned and rejected rows the ledger's. Returns the decisions by (decision, reason)."""
    decided = by_label(samples, "gatekeeper_decisions_total", "decision", "reason")
    reported = {
        tuple(name.removeprefix("decision ").split("/")): int(count)
        for name, count in (line.split("=") for line in report if line.startswith("decision "))
    }
    assert {key: int(n) for key, n in decided.items()} == reported
    ratios = fields(report[1].replace("(", " ").replace(")", " "))  # free_missed's line
    assert value(samples, "gatekeeper_free_admissions_total") == int(ratios["free_admissions"])
    assert value(samples, "gatekeeper_slack_misses_total") == int(ratios["slack_misses"])
    outcomes = Counter(row["outcome"] for row in rows)
    assert value(samples, "gatekeeper_killed_rows_total") == outcomes["killed"]
    assert value(samples, "gatekeeper_abandoned_total") == outcomes["abandoned"]
    assert decided.get(("reserved", "retry_tax_budget"), 0) == outcomes["rejected"]
    return Counter({key: int(n) for key, n in decided.items()})


def test_after_the_demo_once_quiet_a_scrape_agrees_with_status_and_the_ledger(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env["GATEKEEPER_REDIS_URL"] = redis_url  # the suite's Redis: its state outlives the demo
    out = tmp_path / "ledger.json"
    demo = subprocess.run([sys.executable, "-m", "gatekeeper", "demo", "--out", str(out),
                           "--keep"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "removed the demo's" not in demo.stdout  # --keep: its namespace is read below
    run = json.loads(out.read_text())["run"]
    roles = {role: f"{run}.{role}" for role in ("free", "defer", "reserved", "dead_letter")}
    env.update({f"GATEKEEPER_{role.upper()}_QUEUE": name for role, name in roles.items()})
    env["GATEKEEPER_NAMESPACE"] = run
    # The scrapes, status and report read the current window: none may straddle its edge.
    clear_of_a_window_edge(900, 30)
    with exporter(env) as url:
        samples = scrape(url)
        status = cli(env, "status")
        report = cli(env, "report", "--since", "1h")
        again = scrape(url)
    rows = ledger_rows(redis_client, Keys(namespace=run))
    assert value(samples, "gatekeeper_redis_up") == value(samples, "gatekeeper_broker_up") == 1
    agrees_with_status(samples, status, roles)
    decided = agrees_with_the_ledger(samples, report, rows)
    assert {kind for kind, _ in decided} == {"admit_free", "defer", "reserved"}  # all paths
    tasks = by_label(samples, "gatekeeper_decisions_total", "task")
    assert set(tasks) == {("workers.embed_chunk",)}  # replays too, by a replayer with no app
    assert value(samples, "gatekeeper_replayer_last_pass_timestamp_seconds") is not None
    moving = {"gatekeeper_scrape_duration_seconds", "gatekeeper_free_queue_age_seconds",
              "gatekeeper_defer_next_deadline_seconds"}  # fmt: skip
    assert {k: v for k, v in again.items() if k[0] not in moving} == {
        k: v for k, v in samples.items() if k[0] not in moving
    }  # quiet: nothing counted between the two scrapes


@contextmanager
def prometheus(folder: Path, target: str) -> Iterator[PrometheusServer]:
    """Debian's Prometheus (tests/prometheus.py) scraping ``target`` every second."""
    if find_prometheus() is None:
        missing_server("prometheus is not installed (apt-get install prometheus)")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "gatekeeper", "static_configs": [
            {"targets": [urllib.parse.urlsplit(target).netloc]}]}],
    }  # fmt: skip
    with PrometheusServer(folder / "prometheus", config, unused_port()) as server:
        yield server


def promql(server: PrometheusServer, query: str) -> dict[tuple[tuple[str, str], ...], float]:
    """An instant query's vector: labels -> value."""
    return {tuple(sorted(item["metric"].items())): float(item["value"][1])
            for item in server.query(query)}  # fmt: skip


@pytest.mark.servers
def test_a_real_prometheus_scraping_the_replayers_metrics_gives_the_ledgers_decisions(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(GATEKEEPER_REDIS_URL=redis_url, GATEKEEPER_DWELL_GATE_ENABLED="true",
               GATEKEEPER_CANARY_PERCENT="100", GATEKEEPER_REPLAY_POLL_S="0.2",
               GATEKEEPER_REPLAY_BACKOFF_S="0.2", GATEKEEPER_BUDGET_UNITS=ROOMY)  # fmt: skip
    keys = Keys()
    clear_of_a_window_edge(900, 120)  # its decisions, budget and report in one window
    settings = gate_settings(redis_url, max_queue_age_s=1.0, budget_units=float(ROOMY))
    app = create_app(settings, redis_url)
    embed, flaky = app.tasks["tests.embed"], app.tasks["tests.flaky"]
    served = exporter(env, "replay", "--metrics-port", "{port}",
                      log=(tmp_path / "replayer.log").open("wb"))  # fmt: skip
    working = running_worker(redis_url, tmp_path / "worker.log", queues="free,reserved",
                             concurrency=2, GATEKEEPER_BUDGET_UNITS=ROOMY)  # fmt: skip
    with (
        served as url,
        prometheus(tmp_path, url) as api,
        working,
    ):
        ids = [embed.delay(n).id for n in range(4)]
        ids.append(flaky.delay().id)  # killed once, then retried: a second decision
        ids.append(embed.apply_async((9,), headers={"gatekeeper_deadline_s": 1.5}).id)
        redis_client.zadd(keys.free_waiting, {"stale:1": (time.time() - 5) * 1000})
        ids += [embed.delay(n).id for n in range(2)]  # the age cap defers them; replayed
        redis_client.zrem(keys.free_waiting, "stale:1")
        runs = lambda: len(redis_client.lrange(RUNS_KEY, 0, -1))  # noqa: E731
        assert wait_until(lambda: runs() == len(ids) + 1, timeout_s=90), runs()
        assert wait_until(lambda: redis_client.zcard(keys.started) == 0)
        samples = scrape(url)
        status = cli(env, "status")
        report = cli(env, "report", "--since", "1h")
        rows = ledger_rows(redis_client, keys)
        decided = agrees_with_the_ledger(samples, report, rows)
        assert decided[("defer", "queue_age_cap")] == 2 and decided[("admit_free", "fits")] == 8
        agrees_with_status(samples, status, {r: r for r in ("free", "defer", "reserved",
                                                           "dead_letter")})  # fmt: skip
        expected = {(("decision", d), ("reason", r)): float(n) for (d, r), n in decided.items()}
        query = "sum by (decision, reason) (gatekeeper_decisions_total)"
        assert wait_until(lambda: promql(api, query) == expected, timeout_s=30), (
            promql(api, query), expected)  # fmt: skip
        admitted = promql(api, "gatekeeper_free_admissions_total")
        assert list(admitted.values()) == [value(samples, "gatekeeper_free_admissions_total")]
        window = fields(next(line for line in status if line.startswith("window=")))
        assert list(promql(api, "gatekeeper_window_free_admissions").values()) == [
            float(window["admitted_free"])
        ]
        assert list(promql(api, "gatekeeper_redis_up").values()) == [1.0]
        last_pass = promql(api, "time() - gatekeeper_replayer_last_pass_timestamp_seconds")
        assert [age < 10 for age in last_pass.values()] == [True]


def test_the_celery_command_serves_the_apps_metrics(
    redis_url: str, redis_client: redis.Redis
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env["CONF_APP_REDIS_URL"] = redis_url
    command = ("celery", "-A", "tests.apps.conf_app", "gatekeeper", "metrics", "--port", "{port}")
    with exporter(env, *command) as url:
        samples = scrape(url)
    assert value(samples, "gatekeeper_dwell_gate_enabled") == 1  # the app's own setting
    assert value(samples, "gatekeeper_redis_up") == 1


@pytest.mark.servers
def test_on_rabbitmq_the_queue_lengths_are_a_passive_declares_as_in_status(
    redis_url: str, redis_client: redis.Redis, rabbitmq_url: str
) -> None:
    settings = gate_settings(redis_url, broker_url=rabbitmq_url)
    embed = create_app(settings, rabbitmq_url).tasks["tests.embed"]
    for n in range(3):
        embed.delay(n)
    embed.apply_async((9,), headers={"gatekeeper_deadline_s": 1.5})
    embed.apply_async((8,), headers={"gatekeeper_expected_service_s": 0})
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(GATEKEEPER_REDIS_URL=redis_url, GATEKEEPER_BROKER_URL=rabbitmq_url)
    with exporter(env) as url:
        expected = {("free",): 3, ("defer",): 1, ("reserved",): 1, ("dead_letter",): 0}
        lengths = lambda: by_label(scrape(url), "gatekeeper_queue_messages", "queue")  # noqa: E731
        assert wait_until(lambda: lengths() == expected, timeout_s=10), lengths()
        samples = scrape(url)
    status = cli(env, "status")
    queues = fields(next(line for line in status if line.startswith("queues ")))
    assert {role: int(queues[role]) for role in ("free", "defer", "reserved", "dead_letter")} == {
        role: int(n) for (role,), n in expected.items()
    }
    assert value(samples, "gatekeeper_broker_up") == 1
    assert value(samples, "gatekeeper_defer_claimed_messages") is None  # RabbitMQ holds them


def test_by_default_the_exporter_serves_on_the_loopback_address_at_port_9808(
    redis_url: str,
) -> None:
    """README: ``gatekeeper metrics`` serves at http://127.0.0.1:9808/metrics by default, on
    that address alone (127.0.0.2 reaches this host too, but only a socket bound to every
    address answers there)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (an earlier run's)
        try:
            probe.bind(("127.0.0.1", 9808))
        except OSError as exc:
            missing_server(f"port 9808 is taken, the default cannot be tried: {exc}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(GATEKEEPER_REDIS_URL=redis_url, PYTHONPATH=str(REPO_ROOT))
    process = subprocess.Popen([sys.executable, "-m", "gatekeeper", "metrics"], env=env,
                               cwd=REPO_ROOT, stdout=subprocess.DEVNULL)  # fmt: skip
    url = "http://127.0.0.1:9808/metrics"
    try:
        assert wait_until(lambda: _answers(url) or process.poll() is not None, timeout_s=60)
        assert process.poll() is None, f"the exporter exited with {process.returncode}"
        assert value(scrape(url), "gatekeeper_redis_up") == 1
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", 9808), timeout=2).close()
    finally:
        process.terminate()
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except OSError:
        return False
    return True
