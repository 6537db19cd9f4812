"""The week's review as pictures: one self-contained HTML page (``gatekeeper report --html``).

The page opens offline and fetches nothing: no CDN, no font, no image. Its charts are inline
SVG drawn by the page's own script from a JSON block of per-window figures; its
Content-Security-Policy (``default-src 'none'``, the script and the style allowed by their
hashes) makes the browser refuse any fetch, so a mistake here shows up as a console error.

Four charts, one bar per ledger window: decisions by kind (admit_free, defer, reserved;
replays included), the budget's burn (``tax_units`` against ``budget_units``), the free
queue's oldest age a decision saw (against ``max_queue_age_s``) and slack misses. Then the
three review ratios with their counts, and every decision by kind and reason.

Everything read from Redis reaches the page either as a number in the JSON block (escaped so
that it cannot close its ``<script>``) or as text through :func:`html.escape`; the script
writes text with ``textContent`` only. Each chart it draws carries ``data-windows`` (the
windows plotted) and ``data-marks`` (the bars drawn), which the browser test reads.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from gatekeeper.core.review import KINDS, RATIO_MEANINGS, Review, summarize_review, window_figures
from gatekeeper.defaults import WINDOW_RETENTION_S
from gatekeeper.settings import GatekeeperSettings

__all__ = ["CHARTS", "review_page"]

CHARTS = ("decisions", "burn", "age", "misses")
"""The charts' ids (``chart-<id>``), in page order."""

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1000px;
  color: #1d232a; padding: 0 12px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 6px; }
.meta, .note, figcaption small { color: #56606b; }
.ratios { display: flex; gap: 12px; flex-wrap: wrap; }
.ratio { flex: 1 1 280px; border: 1px solid #d5dbe1; border-radius: 6px; padding: 10px 14px; }
.ratio h3 { margin: 0; font: 600 14px ui-monospace, monospace; }
.ratio .value { font-size: 26px; font-weight: 600; margin: 2px 0; }
figure { margin: 18px 0; } figcaption { font-weight: 600; }
figcaption small { font-weight: normal; }
.key { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 10px; }
svg { display: block; width: 100%; height: auto; background: #fbfcfd; }
.grid { stroke: #e3e7eb; } .axis { font: 11px system-ui, sans-serif; fill: #56606b; }
.limit { stroke: #c0392b; stroke-dasharray: 5 4; stroke-width: 1.5; }
.limit-label { font: 11px system-ui, sans-serif; fill: #c0392b; paint-order: stroke;
  stroke: #fbfcfd; stroke-width: 3px; }
.admit_free { fill: #2e9e5b; background: #2e9e5b; } .defer { fill: #e0a526; background: #e0a526; }
.reserved { fill: #3a6fb0; background: #3a6fb0; } .tax { fill: #7d5ba6; background: #7d5ba6; }
.age { fill: #e07b26; background: #e07b26; } .miss { fill: #c0392b; background: #c0392b; }
table { border-collapse: collapse; } td, th { padding: 2px 12px 2px 0; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
"""

_SCRIPT = """
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("review-data").textContent);
  const NS = "http://www.w3.org/2000/svg";
  const W = 960, H = 220, L = 60, R = 14, T = 14, B = 28;
  function el(name, attrs, parent, text) {
    const node = document.createElementNS(NS, name);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function when(start) {
    return new Date(start * 1000).toISOString().slice(5, 16).replace("T", " ");
  }
  function nice(max) {
    if (!(max > 0)) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(max)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * power >= max) return m * power;
    return 10 * power;
  }
  function fmt(v) {
    return Math.abs(v) >= 1000 ? Math.round(v).toLocaleString("en") : String(+v.toFixed(2));
  }
  function chart(id, series, limit, extra, whole) {
    const figure = document.getElementById("chart-" + id);
    const rows = data.windows, n = rows.length;
    const totals = rows.map((w) => series.reduce((sum, s) => sum + (s.value(w) || 0), 0));
    const most = nice(Math.max(limit ? limit.value : 0, ...totals));
    const top = whole ? Math.max(2, 2 * Math.ceil(most / 2)) : most;  // whole counts: 0, n, 2n
    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
    const y = (v) => T + (H - T - B) * (1 - v / top);
    const step = (W - L - R) / Math.max(n, 1), gap = step > 4 ? step * 0.12 : 0;
    for (const f of [0, 0.5, 1]) {
      el("line", { x1: L, x2: W - R, y1: y(top * f), y2: y(top * f), class: "grid" }, svg);
      el("text", { x: L - 6, y: y(top * f) + 4, class: "axis", "text-anchor": "end" }, svg,
        fmt(top * f));
    }
    const ticks = new Set([0, 1, 2, 3, 4].map((q) => Math.round((q * (n - 1)) / 4)));
    for (const i of n ? ticks : []) {
      const anchor = i === 0 ? "start" : i === n - 1 ? "end" : "middle";
      const x = i === 0 ? L : i === n - 1 ? W - R : L + step * (i + 0.5);
      el("text", { x: x, y: H - 8, class: "axis", "text-anchor": anchor }, svg,
        when(rows[i].start) + " UTC");
    }
    let marks = 0;
    rows.forEach((w, i) => {
      const values = series.map((s) => s.value(w));
      const tip = `window ${w.id}, ${when(w.start)} UTC: ` + series.map((s, k) =>
        `${s.name}=${values[k] === null ? "n/a" : fmt(values[k])}`).join(" ") +
        (extra ? " " + extra(w) : "");
      let base = 0;
      series.forEach((s, k) => {
        const v = values[k];
        if (!(v > 0)) return;
        const width = Math.min(48, Math.max(1, step - gap));  // a few windows: not a wall
        const rect = el("rect", { x: L + step * (i + 0.5) - width / 2, y: y(base + v),
          width: width, height: Math.max(1, y(base) - y(base + v)), class: s.cls }, svg);
        el("title", {}, rect, tip);
        base += v;
        marks += 1;
      });
    });
    if (limit) {
      el("line", { x1: L, x2: W - R, y1: y(limit.value), y2: y(limit.value), class: "limit" },
        svg);
      el("text", { x: W - R, y: y(limit.value) - 4, class: "limit-label", "text-anchor": "end" },
        svg, limit.label);
    }
    svg.setAttribute("data-chart", id);
    svg.setAttribute("data-windows", String(n));
    svg.setAttribute("data-marks", String(marks));
    figure.appendChild(svg);
    if (!marks) {
      const empty = document.createElement("p");
      empty.className = "note";
      empty.textContent = "Nothing to draw: every window is zero (or not recorded).";
      figure.appendChild(empty);
    }
  }
  chart("decisions", [
    { name: "admit_free", cls: "admit_free", value: (w) => w.admit_free },
    { name: "defer", cls: "defer", value: (w) => w.defer },
    { name: "reserved", cls: "reserved", value: (w) => w.reserved },
  ], null, null, true);
  chart("burn", [{ name: "tax_units", cls: "tax", value: (w) => w.tax_units }],
    { value: data.budget_units, label: "budget_units " + fmt(data.budget_units) },
    (w) => `killed_free=${w.killed_free}`);
  chart("age", [{ name: "free_age_max_s", cls: "age", value: (w) => w.free_age_max_s }],
    { value: data.max_queue_age_s, label: "age cap " + fmt(data.max_queue_age_s) + " s" });
  chart("misses", [{ name: "slack_misses", cls: "miss", value: (w) => w.slack_misses }],
    null, (w) => `admitted_free=${w.admitted_free}`, true);
})();
"""

_CAPTIONS = {
    "decisions": (
        "Decisions per window, by kind",
        "Every scoring counts, replays included: a deferred task the replayer scores again "
        "counts once more each time.",
    ),
    "burn": (
        "The budget's burn per window: tax_units against budget_units",
        "Declared units, not money: the tokens of killed free attempts plus the wait "
        "charged. The line is the current setting.",
    ),
    "age": (
        "The free queue's age: the oldest a decision saw in the window, seconds",
        "As the gate script saw it at its decisions; windows written before it kept this "
        "show no bar (n/a). The line is the age cap (max_queue_age_s): past it, work defers.",
    ),
    "misses": (
        "Slack misses per window: free admissions that ended after their deadline",
        "Charged to the window that admitted them. The free path freezes when they exceed "
        "miss_error_budget of a window's free admissions.",
    ),
}
_KEYS = {"decisions": KINDS, "burn": ("tax",), "age": ("age",), "misses": ("miss",)}


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _json_block(value: Any) -> str:
    """JSON that cannot end its ``<script>`` element, whatever strings it holds."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _finite(value: float | None) -> float | None:
    """A number JSON can carry (a garbled field in Redis is shown as not recorded)."""
    return value if value is not None and math.isfinite(value) else None


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _share(part: int, whole: int) -> str:
    return "n/a" if not whole else f"{100 * part / whole:.1f}%"


def _ratios(review: Review) -> str:
    cards = (
        ("free_missed", review.slack_misses, review.free_admissions, "free admissions"),
        ("defer_savable", review.defers_savable, review.defers, "defers"),
        ("reserved_age_shift", review.reserved_age_shifts, review.reserved, "shifts to reserved"),
    )
    return "\n".join(
        f'<div class="ratio" id="ratio-{name}"><h3>{name}</h3>'
        f'<p class="value">{_share(part, whole)}</p>'
        f"<p><b>{part}</b> of <b>{whole}</b> {html.escape(noun)}</p>"
        f"<p>{html.escape(RATIO_MEANINGS[name])}</p></div>"
        for name, part, whole, noun in cards
    )


def _decisions_table(review: Review) -> str:
    rows = "".join(
        f'<tr><td>{html.escape(name)}</td><td class="n">{count}</td></tr>'
        for name, count in sorted(review.decisions.items())
    )
    return (
        f"<table><tr><th>kind/reason</th><th>decisions</th></tr>{rows}</table>"
        if rows
        else '<p class="note">No decisions in these windows.</p>'
    )


def _figure(name: str) -> str:
    title, note = _CAPTIONS[name]
    keys = "".join(f'<span class="key {key}"></span>{key}' for key in _KEYS[name])
    return (
        f'<figure id="chart-{name}"><figcaption>{html.escape(title)}'
        f"<small>{keys}</small><br><small>{html.escape(note)}</small></figcaption></figure>"
    )


def review_page(
    windows: Sequence[Mapping[str, str]],
    first_window: int,
    settings: GatekeeperSettings,
    *,
    since: str,
    generated_at: float,
) -> str:
    """The page for ``windows`` (window hashes as text, consecutive from ``first_window``)."""
    size = settings.window_seconds
    figures = []
    for offset, fields in enumerate(windows):
        figure = window_figures(first_window + offset, fields)
        figures.append({
            "id": figure.window_id,
            "start": figure.window_id * size,
            **{kind: figure.decisions.get(kind, 0) for kind in KINDS},  # not Redis's names
            "tax_units": _finite(round(figure.tax_units, 3)),
            "killed_free": figure.killed_free,
            "free_age_max_s": _finite(figure.free_age_max_s),
            "slack_misses": figure.slack_misses,
            "admitted_free": figure.admitted_free,
        })  # fmt: skip
    data = {
        "budget_units": settings.budget_units,
        "max_queue_age_s": settings.max_queue_age_s,
        "windows": figures,
    }
    review = summarize_review(windows)
    kinds = review.by_kind
    end = (first_window + len(windows)) * size
    plural = "" if len(windows) == 1 else "s"
    meta = (
        f"namespace {settings.namespace} · since {since} · {_when(first_window * size)} to "
        f"{_when(end)} · {len(windows)} window{plural} of {size} s · budget_units "
        f"{settings.budget_units:g} per window · generated {_when(generated_at)}"
    )
    totals = " · ".join(f"{kind} {kinds.get(kind, 0)}" for kind in KINDS)
    policy = (
        f"default-src 'none'; script-src {_sha256(_SCRIPT)}; style-src {_sha256(_STYLE)}; "
        "base-uri 'none'; form-action 'none'"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{html.escape(policy)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gatekeeper review: {html.escape(settings.namespace)}, since {html.escape(since)}</title>
<style>{_STYLE}</style></head>
<body>
<h1>gatekeeper: the review, since {html.escape(since)}</h1>
<p class="meta">{html.escape(meta)}</p>
<p>Decisions: {html.escape(totals)} (replays included). Free admissions {review.free_admissions},
slack misses {review.slack_misses}.</p>
<h2>The three review ratios</h2>
<div class="ratios">
{_ratios(review)}
</div>
<noscript><p class="note">The charts are drawn by this page's own script; the numbers above
and below do not need it.</p></noscript>
{"".join(_figure(name) for name in CHARTS)}
<h2>Decisions by kind and reason</h2>
{_decisions_table(review)}
<p class="note">Made by gatekeeper from the ledger windows in Redis, which are kept
{WINDOW_RETENTION_S // 86400} days: older ones count as empty.</p>
<script type="application/json" id="review-data">{_json_block(data)}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
