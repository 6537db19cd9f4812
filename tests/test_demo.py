"""``gatekeeper demo`` end to end: the README's first command, from a clean directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.core.ledger import Outcome, make_row
from gatekeeper.core.ledger import Path as LedgerPath
from gatekeeper.core.review import RATIO_MEANINGS
from gatekeeper.ops.cli import main
from gatekeeper.ops.demo import run_summary
from gatekeeper.ops.leftovers import remove_demo
from gatekeeper.redis.keys import Keys
from tests.conftest import REPO_ROOT, unused_port

pytestmark = pytest.mark.celery


@dataclass(frozen=True)
class DemoRun:
    """One run of ``python -m gatekeeper demo`` from a clean directory, and what it wrote."""

    result: subprocess.CompletedProcess[str]
    out: Path
    page: Path

    @property
    def lines(self) -> list[str]:
        return self.result.stdout.splitlines()

    @property
    def summary(self) -> str:
        return next(line for line in self.lines if line.startswith("finished="))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The demo, run once for the tests of this module (it takes about a minute)."""
    folder = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    out, page = folder / "ledger.json", folder / "review.html"
    result = subprocess.run(
        [sys.executable, "-m", "gatekeeper", "demo", "--out", str(out), "--html", str(page)],
        cwd=folder, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    return DemoRun(result, out, page)


def test_the_demo_runs_the_workload_to_its_summary_and_leaves_nothing_behind(
    demo_run: DemoRun,
) -> None:
    result, out, page = demo_run.result, demo_run.out, demo_run.page
    assert result.returncode == 0, result.stdout + result.stderr
    lines, summary = demo_run.lines, demo_run.summary
    counts = dict(part.split("=") for part in summary.split())
    # Only first attempts die (max_retries=1): every job ends ok or dead-lettered.
    assert int(counts["finished"]) + int(counts["abandoned"]) == 40
    assert lines[-2:] == [
        f"wrote {out} (the JSON ledger: every row)",
        f"wrote {page} (the review as charts: open it in a browser, offline)",
    ]
    document = json.loads(out.read_text())
    assert document["summary"] == summary
    jobs = {row["job_id"] for row in document["rows"]}
    assert len(jobs) == 40
    run = document["run"]
    leftovers = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert run not in leftovers and str(REPO_ROOT) not in run


def test_a_job_is_accounted_for_only_by_a_final_row() -> None:
    from gatekeeper.ops.demo import _finished

    rows = [
        {"job_id": "ok", "attempt": 1, "outcome": "ok"},
        {"job_id": "retried", "attempt": 1, "outcome": "killed"},  # will retry: not final
        {"job_id": "rejected", "attempt": 1, "outcome": "rejected"},  # then runs reserved
        {"job_id": "dead", "attempt": 1, "outcome": "abandoned"},
        {"job_id": "failed", "attempt": 2, "outcome": "killed"},  # no retry left (max 1)
    ]
    assert _finished(rows, max_retries=1) == {"ok", "dead", "failed"}


def test_the_demos_output_explains_its_numbers_to_a_newcomer(demo_run: DemoRun) -> None:
    assert demo_run.result.returncode == 0, demo_run.result.stdout + demo_run.result.stderr
    lines = demo_run.lines
    at = lines.index(demo_run.summary)
    # One ledger window, or several when the run crossed a window's end (every 15 minutes of
    # the clock: CI runs at 05:30 and 16:15 did): then first a line saying the lowest budget
    # left was taken, each window's named.
    if lines[at + 1].startswith("  budget_left: the lowest of the "):
        at += 1
    assert lines[at + 1].startswith("  budget_left: declared units, not money (budget_units=")
    decisions = lines[at + 2]
    assert decisions.startswith("decisions admit_free=")
    assert "(replays included: a deferred task counts again" in decisions
    counts = {k: int(v) for k, v in (p.split("=") for p in decisions.split(" (")[0].split()[1:])}
    assert sum(counts.values()) >= 40  # one per job at least; a replay's re-scoring adds one
    for offset, name in enumerate(("free_missed", "defer_savable", "reserved_age_shift")):
        ratio, meaning = lines[at + 3 + 2 * offset], lines[at + 4 + 2 * offset]
        assert ratio.startswith(f"{name}=")
        assert meaning == f"  = the share of {RATIO_MEANINGS[name]}"
    # The page shows the same run: its windows hold the decisions the output counted.
    text = demo_run.page.read_text(encoding="utf-8")
    block = re.search(r'id="review-data">([^<]*)</script>', text)
    assert block is not None
    data = json.loads(block.group(1))
    shown = {kind: sum(w[kind] for w in data["windows"]) for kind in counts}
    assert shown == counts
    assert not re.search(r"""(?:src|href)\s*=\s*["']?[a-z]*:?//""", text)


def test_the_demo_names_a_redis_it_cannot_reach_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", f"redis://:s3cret@127.0.0.1:{unused_port()}/0")
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 1 and "the demo's Redis (redis://:***@127.0.0.1:" in result.output
    assert "s3cret" not in result.output and "Traceback" not in result.output


def test_the_demo_removes_what_it_wrote_to_a_redis_it_did_not_start(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Left there, every run's namespace (flags, totals, stats: no TTL) and queues stayed in
    # a shared Redis for good. Only the run's own go: another namespace, a queue whose name
    # only starts like the run's, a key that merely contains it, all stay.
    run_id = "demo-1-a[b]*"
    keys = Keys("gatekeeper", run_id)
    ours = [keys.flags, keys.totals, keys.run("j", 1), f"{run_id}.free",
            f"{run_id}.defer\x06\x163", f"{run_id}.defer:replaying:x",
            f"_kombu.binding.{run_id}.free", f"_kombu.binding_permanent.{run_id}.free"]  # fmt: skip
    theirs = [Keys().flags, Keys("gatekeeper", "demo-1-a").flags, "demo-1-ab.free",
              f"{run_id}free", f"x{run_id}.free", "_kombu.binding.celery",
              "_kombu.binding_deadlines"]  # fmt: skip
    for name in ours + theirs:
        redis_client.set(name, "1")
    remove_demo(redis_url, redis_url, keys, run_id)
    assert [redis_client.exists(name) for name in ours] == [0] * len(ours)
    assert [redis_client.exists(name) for name in theirs] == [1] * len(theirs)
    assert f"removed the demo's {len(ours)} keys" in capsys.readouterr().out


def test_the_demo_removes_its_queues_from_a_broker_of_their_own(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # A reviewer: with GATEKEEPER_BROKER_URL another database, the queues' keys and kombu's
    # bindings stayed there; only the gate's Redis was cleaned.
    run_id, keys = "demo-2-b", Keys("gatekeeper", "demo-2-b")
    broker_url = redis_url.rsplit("/", 1)[0] + "/3"
    broker = redis.Redis.from_url(broker_url)
    queues = [f"{run_id}.free", f"_kombu.binding.{run_id}.free", f"{run_id}.defer:replayers"]
    for name in [*queues, "celery"]:
        broker.set(name, "1")
    redis_client.set(keys.flags, "1")
    redis_client.set(f"{run_id}.free", "1")  # the gate's server is not the broker: not a queue
    remove_demo(redis_url, broker_url, keys, run_id)
    assert [broker.exists(name) for name in queues] == [0, 0, 0] and broker.exists("celery")
    assert not redis_client.exists(keys.flags) and redis_client.exists(f"{run_id}.free")
    assert "removed the demo's 3 keys from" in capsys.readouterr().out
    broker.flushdb()


def test_the_demo_removes_its_queues_from_rabbitmq(
    rabbitmq_url: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from amqp.exceptions import NotFound
    from kombu import Connection, Exchange, Queue

    # A reviewer: the replayer's delay queues (`<defer>.delay.<ms>`) stayed.
    run_id = "demo-3-c"
    names = [f"{run_id}.{role}" for role in ("free", "defer", "reserved", "dead_letter")]
    names.append(f"{run_id}.defer.delay.500")  # of the ladder 500, 1000: only one was made
    with Connection(rabbitmq_url) as connection:
        for name in names:
            Queue(name, Exchange(name), name)(connection.default_channel).declare()
    remove_demo(redis_url, rabbitmq_url, Keys("gatekeeper", run_id), run_id, [500, 1000])
    assert "removed the demo's 5 queues from" in capsys.readouterr().out
    with Connection(rabbitmq_url) as connection:
        for name in names:
            with pytest.raises(NotFound):
                connection.channel().queue_declare(name, passive=True)


def test_the_demo_on_its_embedded_redis_cleans_a_broker_of_its_own(
    redis_url: str, tmp_path: Path
) -> None:
    # A reviewer: with GATEKEEPER_BROKER_URL alone set (the gate's Redis embedded), the
    # queues' keys and kombu's bindings stayed on that broker.
    broker_url = redis_url.rsplit("/", 1)[0] + "/6"
    broker = redis.Redis.from_url(broker_url)
    broker.flushdb()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env["GATEKEEPER_BROKER_URL"] = broker_url
    result = subprocess.run([sys.executable, "-m", "gatekeeper", "demo"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    left = sorted(key.decode() for key in broker.scan_iter() if b"demo-" in key)
    assert left == [], left


def test_a_demo_that_spans_two_ledger_windows_shows_the_lowest_budget_left() -> None:
    # Seen at the end of a session: a demo that crossed a 900 s window's edge printed
    # budget_left=-3154, the free rows of both windows charged to one window's budget (each
    # window has its own; neither was over). A window over its budget must still show.
    def killed(job: str, tax_ms: int) -> dict[str, object]:
        row = make_row(job_id=job, attempt=1, path=LedgerPath.FREE, outcome=Outcome.KILLED,
                       queue_wait_ms=tax_ms, tokens_in=1000, tokens_out=0,
                       deadline_slack_ms=1)  # fmt: skip
        return row.to_json()

    one = {7: [killed("a", 0)]}
    assert run_summary(one, 12000.0)[0].budget_left == 11000 and run_summary(one, 12000.0)[1] == ""
    two = {7: [killed("a", 0), killed("b", 0)], 8: [killed("c", 45_000)]}  # 2000 and 10000
    summary, spanned = run_summary(two, 12000.0)
    assert summary.line() == "finished=0 killed_rows=3 rejected=0 abandoned=0 budget_left=2000"
    assert spanned.endswith("(window 7: 10000, window 8: 2000)")
