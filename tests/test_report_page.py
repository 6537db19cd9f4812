"""``gatekeeper report --html``: one self-contained page, checked in a real headless Chromium.

The ledger history is made by the real scripts on the suite's Redis, as workers make it:
``gate.lua`` decides (with the free queue made old where a test needs it), ``start.lua``
starts the admitted runs and ``finish.lua`` writes their rows, over several windows.
"""

from __future__ import annotations

import html
import re
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.core.ledger import BudgetMode, Outcome, window_id
from gatekeeper.ops.cli import main
from gatekeeper.ops.review_page import CHARTS
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.push import new_nonce
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.store import GateStore
from tests.browser import find_chromium, load, png_size, screenshot
from tests.calls import gate_call
from tests.conftest import clear_of_a_window_edge, missing_server

KEYS = Keys()
SIZE = 900
FILLED = (0, 1, 3, 5)
"""How many windows back each filled window is (the others in the report stay empty)."""
HOSTILE = '<img src=x onerror="alert(1)">'
"""A reason name someone with write access to Redis could plant in a window hash (and one
more below, ``decided:start:planted``, whose kind is the name of a figure of the page)."""


def decide(store: GateStore, client: redis.Redis, job: str, at: float, *, age_s: float = 0.0,
           service: float = 1.0, slack: float = 60.0) -> tuple[str, str]:  # fmt: skip
    """One decision by gate.lua at ``at``, the free queue ``age_s`` old; (decision, nonce)."""
    client.delete(KEYS.free_waiting)
    if age_s:
        client.zadd(KEYS.free_waiting, {"old:1": (at - age_s) * 1000})
    nonce = new_nonce()
    scored = store.score(gate_call(
        now_s=at, window_id=window_id(at, SIZE), job_id=job, attempt=1, nonce=nonce,
        expected_service_s=service, deadline_slack_s=slack, max_queue_age_s=30,
        tokens_in=1000, budget_units=12_000, queue_wait_unit_per_second=200,
        budget_mode=BudgetMode.EXPOSURE, wait_allowance_s=10,
    ))  # fmt: skip
    return f"{scored.decision.value}/{scored.reason.value}", nonce


def run(runs: RunLedger, job: str, nonce: str, started_s: float, ended_s: float,
        outcome: Outcome, *, late: bool = False) -> None:  # fmt: skip
    """A worker's run of an admitted attempt: started, then its row."""
    started = runs.start(job, 1, nonce, {"task": "t", "retries": "0"}, round(started_s * 1000))
    assert started.record is not None, started.refused
    row = runs.row_for(job, 1, started.record, outcome, round(ended_s * 1000))
    assert runs.finish(row, started.run, started.record, round(ended_s * 1000),
                       slack_miss=late).written  # fmt: skip


def history(client: redis.Redis, now: float) -> None:
    """Per filled window: 3 free admissions (one killed, one late in two windows), one
    age-cap defer that fit its slack, one reserved for its service, one for the age."""
    store = GateStore(client, KEYS, horizon_s=1e9)
    runs = RunLedger(client, KEYS, window_seconds=SIZE, queue_wait_unit_per_second=200,
                     wait_allowance_s=10)  # fmt: skip
    current = window_id(now, SIZE)
    for back in FILLED:
        at = now - 30 if back == 0 else (current - back) * SIZE + 60
        for n in range(3):
            job = f"w{back}-a{n}"
            decided, nonce = decide(store, client, job, at + n, age_s=2 + back)
            assert decided == "admit_free/fits"
            outcome = Outcome.KILLED if n == 0 else Outcome.OK
            late = n == 2 and back in (1, 5)
            run(runs, job, nonce, at + n + 1.5, at + n + (90 if late else 3), outcome, late=late)
        assert decide(store, client, f"w{back}-d", at + 5, age_s=40)[0] == "defer/queue_age_cap"
        assert decide(store, client, f"w{back}-r", at + 6, service=70)[0] == (
            "reserved/dwell_over_slack"
        )
        assert decide(store, client, f"w{back}-s", at + 7, age_s=25, service=40)[0] == (
            "reserved/dwell_over_slack"  # 40 s of service fit the 60 s: the age sent it away
        )
    client.hincrby(KEYS.window(current), f"decided:defer:{HOSTILE}", 1)
    # A planted kind named like a figure of the page's data must not replace it.
    client.hincrby(KEYS.window(current), "decided:start:planted", 10**18)


@pytest.fixture()
def chromium() -> str:
    binary = find_chromium()
    if binary is None:
        missing_server("chromium is not installed (apt-get install chromium)")
    assert binary is not None
    return binary


@pytest.fixture()
def page(redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
         tmp_path: Path) -> Path:  # fmt: skip
    # The report must see the windows the history wrote: the current one's events, 23 to 30 s
    # before now, must not fall in the one before it.
    clear_of_a_window_edge(SIZE, 30, since_start_s=35)
    now = time.time()
    history(redis_client, now)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    out = tmp_path / "review.html"
    result = CliRunner().invoke(main, ["report", "--since", "2h", "--html", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == f"wrote {out}"
    return out


def charts(dom: str) -> dict[str, tuple[int, int]]:
    """Each drawn chart's (windows plotted, bars drawn), as the page's script marked it."""
    found = re.findall(r'data-chart="(\w+)" data-windows="(\d+)" data-marks="(\d+)"', dom)
    return {name: (int(windows), int(marks)) for name, windows, marks in found}


def test_the_page_fetches_nothing_and_names_no_address(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"""\b(?:src|href|action|poster|data)\s*=\s*["']?\s*[a-z]*:?//""", text)
    assert not re.search(r"<link|<iframe|<object|<embed|@import|url\(|fetch\(|XMLHttpRequest", text)
    assert "default-src 'none'" in html.unescape(text)  # the browser refuses any fetch


def test_what_redis_holds_reaches_the_page_escaped(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert HOSTILE not in text and html.escape(HOSTILE) in text


@pytest.mark.servers
def test_the_page_draws_every_chart_offline_with_no_console_message(
    page: Path, chromium: str, tmp_path: Path
) -> None:
    loaded = load(chromium, page, tmp_path / "profile")
    assert loaded.console == []
    windows = 9  # 2 h of 900 s windows, the current one included
    assert charts(loaded.dom) == {
        "decisions": (windows, 3 * len(FILLED)),  # a bar of each kind in each filled window
        "burn": (windows, len(FILLED)),
        "age": (windows, len(FILLED)),
        "misses": (windows, 2),
    }
    # The ratios and their counts, from the same windows (and the planted name as text).
    assert "<b>2</b> of <b>12</b> free admissions" in loaded.dom
    assert "<b>4</b> of <b>5</b> defers" in loaded.dom  # the planted defer fits nothing
    assert "<b>4</b> of <b>8</b> shifts to reserved" in loaded.dom
    assert "<img" not in loaded.dom and html.escape(HOSTILE, quote=False) in loaded.dom

    shot = tmp_path / "review.png"
    screenshot(chromium, page, shot, tmp_path / "profile", (1100, 1900))
    assert png_size(shot) == (1100, 1900)
    assert shot.stat().st_size > 40_000  # charts and text; a blank page is about 4 kB


@pytest.mark.servers
def test_the_browser_check_fails_a_page_whose_script_breaks_or_fetches(
    page: Path, chromium: str, tmp_path: Path
) -> None:
    # The checks above can fail: a broken data block and a fetch are both caught.
    text = page.read_text(encoding="utf-8")
    broken = tmp_path / "broken.html"
    broken.write_text(re.sub(r'(id="review-data">)[^<]*', r"\1{", text), encoding="utf-8")
    loaded = load(chromium, broken, tmp_path / "profile")
    assert charts(loaded.dom) == {} and any("SyntaxError" in line for line in loaded.console)

    fetching = tmp_path / "fetching.html"
    fetching.write_text(text.replace("<body>", '<body><img src="https://example.com/a.png">'))
    loaded = load(chromium, fetching, tmp_path / "profile")
    assert set(charts(loaded.dom)) == set(CHARTS)
    assert any("Content Security Policy" in line for line in loaded.console)
