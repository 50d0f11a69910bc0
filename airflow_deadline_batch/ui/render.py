"""The jobs list and the job page as HTML with inline SVG charts, rendered on the server (pure).

No JavaScript: the charts are SVG paths computed here, and a running job's page reloads itself
with ``<meta http-equiv="refresh">`` (nothing to build, nothing to load from elsewhere, and the
page reads the same inside Airflow's iframe, in a plain browser tab, and with scripts off). Every
value that reaches the page goes through :func:`esc` (text and attributes) or :func:`quote`
(URL path segments).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import html
import re
from collections.abc import Iterable, Sequence
from urllib.parse import quote

from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.ui.model import HistoryPoint, JobPage, JobSummary, ShardLine

#: seconds between reloads of a page that shows a running job
REFRESH_S = 15
#: shard rows the job page lists at most (a job can have thousands of shards, each with an error of
#: up to 4000 characters); the counts by state and pool cover every shard
SHARD_ROWS = 200
#: which shards make the list when they do not all fit: failed first, then running, then waiting
_SHARD_INTEREST = {
    ShardState.TERMINAL_FAILURE: 0,
    ShardState.RETRYABLE_FAILURE: 1,
    ShardState.LEASED: 2,
    ShardState.PENDING: 3,
    ShardState.SUCCEEDED: 4,
}
CHART_W, CHART_H = 720, 280
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 64, 16, 28, 36

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#1f2328;background:#fff}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:20px 0 6px}
table{border-collapse:collapse}td,th{border-bottom:1px solid #d0d7de;padding:3px 10px;text-align:left}
th{background:#f6f8fa}td.n{text-align:right;font-variant-numeric:tabular-nums}
dl{display:grid;grid-template-columns:max-content auto;gap:2px 14px;margin:0}dt{color:#57606a}dd{margin:0}
.late{color:#cf222e;font-weight:600}.ok{color:#1a7f37}.muted{color:#57606a}
svg text{font:11px system-ui,sans-serif;fill:#57606a}
.axis{stroke:#8c959f}.grid{stroke:#eaeef2}.burndown{fill:none;stroke:#0969da;stroke-width:2}
.uniform{stroke:#8c959f;stroke-dasharray:6 4}.predicted{stroke:#bf8700;stroke-width:2;stroke-dasharray:3 3}
.spread{fill:#bf8700;fill-opacity:.15}.deadline{stroke:#cf222e;stroke-width:1.5}.now{stroke:#6e7781}
.slack{fill:none;stroke:#8250df;stroke-width:2}.zero{stroke:#cf222e;stroke-dasharray:4 3}
"""


#: what cannot stand on a page: lone surrogates (``"\ud800"`` is valid JSON, read from an error
#: object, yet no UTF-8 encodes it: the response would fail) and control characters but tab and
#: line breaks (HTML forbids them; a NUL ends a string for some readers)
_UNPRINTABLE = re.compile("[\ud800-\udfff\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def esc(value: object) -> str:
    """Text or attribute value, HTML-escaped (quotes too), anything unprintable as U+FFFD."""
    return html.escape(_UNPRINTABLE.sub("\ufffd", str(value)), quote=True)


def fmt_time(value: dt.datetime | None) -> str:
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if value else "-"


def fmt_duration(seconds: float) -> str:
    """``-1h 02m 03s`` style; negative means late."""
    sign = "-" if seconds < 0 else ""
    total = round(abs(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{sign}{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{sign}{minutes}m {secs:02d}s"
    return f"{sign}{secs}s"


def fmt_share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def fmt_money(value: float) -> str:
    return f"{value:.2f}"


# -- geometry --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scale:
    """Maps (time, value) into the plot area of a chart; y grows downwards in SVG."""

    t0: dt.datetime
    t1: dt.datetime
    v0: float
    v1: float
    width: float = CHART_W
    height: float = CHART_H

    def x(self, at: dt.datetime) -> float:
        span = max((self.t1 - self.t0).total_seconds(), 1e-9)
        frac = (at - self.t0).total_seconds() / span
        return round(MARGIN_L + frac * (self.width - MARGIN_L - MARGIN_R), 2)

    def y(self, value: float) -> float:
        span = (self.v1 - self.v0) or 1.0
        frac = (value - self.v0) / span
        return round(self.height - MARGIN_B - frac * (self.height - MARGIN_T - MARGIN_B), 2)


def step_path(scale: Scale, points: Sequence[tuple[dt.datetime, float]]) -> str:
    """An SVG path that holds each value until the next instant (committed work moves in steps)."""
    if not points:
        return ""
    (t, v), rest = points[0], points[1:]
    parts = [f"M{scale.x(t)},{scale.y(v)}"]
    for t, v in rest:
        parts.append(f"H{scale.x(t)}V{scale.y(v)}")
    return "".join(parts)


def line_path(scale: Scale, points: Sequence[tuple[dt.datetime, float]]) -> str:
    if not points:
        return ""
    return "M" + "L".join(f"{scale.x(t)},{scale.y(v)}" for t, v in points)


def _axes(scale: Scale, label: str, ticks: Iterable[float], fmt: str = "{:.0f}") -> str:
    bottom, left = CHART_H - MARGIN_B, MARGIN_L
    out = [
        f'<line class="axis" x1="{left}" y1="{MARGIN_T}" x2="{left}" y2="{bottom}"/>',
        f'<line class="axis" x1="{left}" y1="{bottom}" x2="{CHART_W - MARGIN_R}" y2="{bottom}"/>',
        f'<text x="4" y="14">{esc(label)}</text>',
    ]
    for value in ticks:
        y = scale.y(value)
        out.append(f'<line class="grid" x1="{left}" y1="{y}" x2="{CHART_W - MARGIN_R}" y2="{y}"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">{esc(fmt.format(value))}</text>')
    for at, anchor in ((scale.t0, "start"), (scale.t1, "end")):
        out.append(
            f'<text x="{scale.x(at)}" y="{bottom + 16}" text-anchor="{anchor}">'
            f"{esc(fmt_time(at)[11:19])}</text>"
        )
    return "".join(out)


def _vline(scale: Scale, at: dt.datetime, css: str, label: str, v_top: float, v_bottom: float) -> str:
    x = scale.x(at)
    # a label right of the middle ends at its line, so that it stays inside the chart
    text_x, anchor = (x - 3, "end") if x > CHART_W / 2 else (x + 3, "start")
    return (
        f'<line id="{css}" class="{css}" x1="{x}" y1="{scale.y(v_top)}" x2="{x}" y2="{scale.y(v_bottom)}"/>'
        f'<text x="{text_x}" y="{MARGIN_T - 6}" text-anchor="{anchor}">{esc(label)}</text>'
    )


def chart_span(page: JobPage) -> tuple[dt.datetime, dt.datetime]:
    """From the job's start to the latest of deadline, now, predicted finish and its spread."""
    s = page.summary
    end = max(s.deadline, page.now, s.predicted_finish, page.finish_spread[1])
    return page.started_at, end if end > page.started_at else page.started_at + dt.timedelta(seconds=1)


def burndown_svg(page: JobPage) -> str:
    """Records without an outcome over time against the deadline (see the module doc of ``ui.model``)."""
    s = page.summary
    total = max(s.total_records, 1)
    t0, t1 = chart_span(page)
    scale = Scale(t0, t1, 0.0, float(total))
    remaining_now = max(0, s.total_records - s.committed_records)
    burn = step_path(scale, [(p.at, float(p.remaining_records)) for p in page.history])
    uniform = line_path(scale, [(page.started_at, float(s.total_records)), (s.deadline, 0.0)])
    lo, hi = page.finish_spread
    parts = [
        f'<svg id="burndown-chart" xmlns="http://www.w3.org/2000/svg" width="{CHART_W}" height="{CHART_H}" '
        f'viewBox="0 0 {CHART_W} {CHART_H}" role="img" '
        'aria-label="burn-down of records left against the deadline">',
        _axes(scale, "records left", (0.0, total / 2, float(total))),
        f'<path id="uniform" class="uniform" d="{uniform}"/>',
    ]
    if not s.stopped:
        now = (scale.x(page.now), scale.y(remaining_now))
        parts.append(
            f'<path id="spread" class="spread" d="M{now[0]},{now[1]}L{scale.x(lo)},{scale.y(0)}'
            f'L{scale.x(hi)},{scale.y(0)}Z"/>'
        )
        parts.append(
            f'<path id="predicted" class="predicted" '
            f'd="{line_path(scale, [(page.now, float(remaining_now)), (s.predicted_finish, 0.0)])}"/>'
        )
    parts.append(f'<path id="burndown" class="burndown" d="{burn}"/>')
    parts.append(_vline(scale, s.deadline, "deadline", "deadline", float(total), 0.0))
    if not s.stopped:
        parts.append(_vline(scale, page.now, "now", "now", float(total), 0.0))
    parts.append("</svg>")
    return "".join(parts)


def slack_svg(page: JobPage) -> str:
    """Slack (deadline minus predicted finish) at each instant of the history; below zero is late."""
    history: Sequence[HistoryPoint] = page.history
    values = [p.slack_s for p in history] or [page.summary.slack_s]
    lo, hi = min(0.0, *values), max(0.0, *values)
    if hi == lo:
        hi = lo + 1.0
    t0, t1 = page.started_at, max(page.now, page.started_at + dt.timedelta(seconds=1))
    if history:
        t1 = max(t1, history[-1].at)
    scale = Scale(t0, t1, lo, hi)
    zero = scale.y(0.0)
    return (
        f'<svg id="slack-chart" xmlns="http://www.w3.org/2000/svg" width="{CHART_W}" height="{CHART_H}" '
        f'viewBox="0 0 {CHART_W} {CHART_H}" role="img" aria-label="slack over time">'
        + _axes(scale, "slack s", (lo, 0.0, hi) if lo < 0 < hi else (lo, hi))
        + f'<line class="zero" x1="{MARGIN_L}" y1="{zero}" x2="{CHART_W - MARGIN_R}" y2="{zero}"/>'
        + f'<path id="slack" class="slack" d="{line_path(scale, [(p.at, p.slack_s) for p in history])}"/>'
        + "</svg>"
    )


# -- pages -----------------------------------------------------------------------------------------


def _document(title: str, body: str, *, refresh_s: int | None) -> str:
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s else ""
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width'>{refresh}<title>{esc(title)}</title>"
        f"<style>{CSS}</style></head><body>{body}</body></html>"
    )


def _slack_cell(slack_s: float, stopped: bool) -> str:
    css = "muted" if stopped else ("late" if slack_s < 0 else "ok")
    return f'<span class="{css}">{esc(fmt_duration(slack_s))}</span>'


def _planned_by(summary: JobSummary) -> str:
    ref = summary.planned_by
    if ref is None:
        return '<span class="muted">not planned by a DAG</span>'
    return f"{esc(ref.dag_id)} / {esc(ref.run_id)}"


def render_jobs_page(
    summaries: Sequence[JobSummary], *, prefix: str, hidden: int = 0, unreadable: int = 0, unlisted: int = 0
) -> str:
    """The jobs the user may read, newest first; reloads while any of them runs. ``hidden``: jobs
    of DAGs the user may not read; ``unreadable``: jobs whose rows could not be shown;
    ``unlisted``: older jobs past the list's length."""
    rows = []
    for s in summaries:
        href = f"{esc(prefix)}/jobs/{esc(quote(s.job_id, safe=''))}"
        rows.append(
            "<tr>"
            f'<td><a href="{href}">{esc(s.job_id)}</a></td><td>{esc(s.tenant)}</td><td>{_planned_by(s)}</td>'
            f"<td>{esc(s.state.value)}</td><td>{esc(fmt_time(s.deadline))}</td>"
            f"<td>{esc(fmt_time(s.predicted_finish))}</td>"
            f"<td class='n'>{_slack_cell(s.slack_s, s.stopped)}</td>"
            f"<td class='n'>{s.committed_records:d} / {s.total_records:d}</td>"
            f"<td class='n'>{esc(fmt_money(s.cost.so_far))}</td>"
            f"<td class='n'>{esc(fmt_money(s.cost.projected))}</td>"
            f"<td class='n'>{esc(fmt_share(s.cost.spot_share))} / "
            f"{esc(fmt_share(s.cost.on_demand_share))}</td>"
            "</tr>"
        )
    note = f'<p class="muted">{hidden:d} job(s) of DAGs you may not read are not shown.</p>' if hidden else ""
    if unreadable:
        note += (
            f'<p id="unreadable" class="late">{unreadable:d} job(s) could not be shown: their rows'
            " cannot be read as a job view (the api-server log says why).</p>"
        )
    if unlisted:
        note += f'<p id="unlisted" class="muted">{unlisted:d} older job(s) are not listed.</p>'
    table = (
        "<table id='jobs'><tr><th>job</th><th>tenant</th><th>DAG / run</th><th>state</th><th>deadline</th>"
        "<th>predicted finish</th><th>slack</th><th>records done / total</th><th>cost so far</th>"
        "<th>cost projected</th><th>Spot / on-demand</th></tr>" + "".join(rows) + "</table>"
        if rows
        else "<p>No deadline-batch jobs.</p>"
    )
    running = any(not s.stopped for s in summaries)
    return _document(
        "Deadline Batch jobs",
        f"<h1>Deadline Batch jobs</h1>{table}{note}",
        refresh_s=REFRESH_S if running else None,
    )


def _facts(page: JobPage, prefix: str) -> str:
    s = page.summary
    lo, hi = page.finish_spread
    manifest = (
        f'<a id="manifest" href="{esc(prefix)}/api/jobs/{esc(quote(s.job_id, safe=""))}/manifest">'
        f"{esc(page.manifest_uri)}</a>"
        if page.manifest_uri
        else '<span id="manifest" class="muted">not published yet</span>'
    )
    rows = [
        ("state", "state", esc(s.state.value)),
        ("tenant", "tenant", esc(s.tenant)),
        ("planned-by", "DAG / run", _planned_by(s)),
        ("deadline", "deadline", esc(fmt_time(s.deadline))),
        ("predicted-finish", "predicted finish", esc(fmt_time(s.predicted_finish))),
        ("finish-spread", "spread of the prediction", f"{esc(fmt_time(lo))} … {esc(fmt_time(hi))}"),
        ("slack", "slack", _slack_cell(s.slack_s, s.stopped)),
        ("records", "records done / total", f"{s.committed_records:d} / {s.total_records:d}"),
        ("running-workers", "running workers", f"{page.running_workers:d}"),
        ("cost-so-far", "cost so far", esc(fmt_money(s.cost.so_far))),
        ("cost-projected", "cost projected", esc(fmt_money(s.cost.projected))),
        (
            "capacity-share",
            "Spot / on-demand (GPU time)",
            f"{esc(fmt_share(s.cost.spot_share))} / {esc(fmt_share(s.cost.on_demand_share))}",
        ),
        ("preemptions", "preemptions", f"{page.preemptions:d}"),
        ("redone-work", "redone work", esc(fmt_duration(s.cost.redone_work_s))),
        ("manifest-uri", "manifest", manifest),
    ]
    if page.outcomes is not None:  # published: every line's outcome, cancelled and expired included
        counts = ", ".join(f"{esc(k)} {int(v):d}" for k, v in sorted(page.outcomes.items()))
        rows.append(("outcomes", "published outcomes", counts))
    if page.error:
        rows.append(("job-error", "stopped because", f'<span class="late">{esc(page.error)}</span>'))
    return (
        "<dl id='facts'>"
        + "".join(f'<dt>{label}</dt><dd id="{key}">{value}</dd>' for key, label, value in rows)
        + "</dl>"
    )


def _shards(page: JobPage) -> str:
    summary = "".join(
        f"<tr><td>{esc(state)}</td><td>{esc(pool)}</td><td class='n'>{count:d}</td></tr>"
        for (state, pool), count in page.shards_by_state_pool.items()
    )
    listed = listed_shards(page.shards)
    rows = "".join(
        f"<tr><td class='n'>{line.shard_index:d}</td><td>{esc(line.state.value)}</td>"
        f"<td>{esc(line.pool or '-')}{_racing(line)}</td><td>{esc(line.capacity or '-')}</td>"
        f"<td class='n'>{line.attempts:d}</td><td class='n'>{line.preemptions:d}</td>"
        f"<td class='n'>{line.cursor:d} / {line.num_microbatches:d}</td>"
        f"<td class='n'>{line.records:d}</td><td>{esc(line.last_error or '')}</td></tr>"
        for line in listed
    )
    unlisted = len(page.shards) - len(listed)
    note = (
        f"<p id='shards-unlisted' class='muted'>{unlisted:d} more shard(s) not listed: the first "
        f"{len(listed):d} that failed, run or wait are; the counts above cover all {len(page.shards):d}.</p>"
        if unlisted
        else ""
    )
    return (
        "<h2>Shards by state and pool</h2><table id='shards-by-state'><tr><th>state</th><th>last pool</th>"
        f"<th>shards</th></tr>{summary}</table>"
        "<h2>Shards</h2><table id='shards'><tr><th>shard</th><th>state</th><th>last pool</th>"
        "<th>capacity</th>"
        "<th>attempts</th><th>preemptions</th><th>microbatches</th><th>records</th><th>last error</th></tr>"
        f"{rows}</table>{note}"
    )


def listed_shards(lines: Sequence[ShardLine]) -> list[ShardLine]:
    """At most :data:`SHARD_ROWS` shards, the most telling first chosen, listed by index."""
    if len(lines) <= SHARD_ROWS:
        return list(lines)
    chosen = sorted(lines, key=lambda line: (_SHARD_INTEREST.get(line.state, 0), line.shard_index))
    return sorted(chosen[:SHARD_ROWS], key=lambda line: line.shard_index)


def _racing(line: ShardLine) -> str:
    if not line.racing:
        return ""
    return f" <span class='racing'>racing on {esc(line.racing_on or 'an unnamed pool')}</span>"


def _errors(page: JobPage) -> str:
    e = page.errors
    codes = "".join(
        f"<tr><td>{esc(code)}</td><td class='n'>{count:d}</td></tr>" for code, count in e.codes.items()
    )
    lines = "".join(f"<li><code>{esc(line)}</code></li>" for line in e.lines)
    tries = "".join(
        f"<tr><td>{esc(cls)}</td><td class='n'>{count:d}</td><td>{esc(e.try_messages.get(cls, ''))}</td></tr>"
        for cls, count in e.try_failures.items()
    )
    out = [f"<h2>Errors</h2><p>errored records: <span id='errored-records'>{e.errored_records:d}</span>"]
    out.append(f" <span class='muted'>(codes from {e.objects_read:d} object(s) read)</span></p>")
    if e.unavailable:
        out.append(f"<p class='muted'>{esc(e.unavailable)}</p>")
    if codes:
        out.append(f"<table id='error-codes'><tr><th>code</th><th>records</th></tr>{codes}</table>")
    if lines:
        out.append(f"<ul id='error-lines'>{lines}</ul>")
    if tries:
        out.append(
            "<h2>Failed tries</h2><table id='try-failures'><tr><th>class</th><th>tries</th>"
            f"<th>latest message</th></tr>{tries}</table>"
        )
    return "".join(out)


def render_job_page(page: JobPage, *, prefix: str) -> str:
    """One job: facts, burn-down, slack over time, shards, errors; reloads while it runs."""
    s = page.summary
    body = (
        f'<p><a href="{esc(prefix)}/jobs">all jobs</a></p>'
        f"<h1>Deadline Batch job <span id='job-id'>{esc(s.job_id)}</span></h1>"
        f"{_facts(page, prefix)}"
        "<h2>Burn-down</h2><p class='muted'>records without an outcome (blue), uniform progress to the "
        "deadline (grey), predicted finish from measured throughput (amber) and its spread.</p>"
        f"{burndown_svg(page)}"
        f"<h2>Slack over time</h2>{slack_svg(page)}"
        f"{_shards(page)}{_errors(page)}"
        f"<p class='muted'>as of {esc(fmt_time(page.now))}</p>"
    )
    return _document(f"Deadline Batch {s.job_id}", body, refresh_s=None if s.stopped else REFRESH_S)


def render_message(title: str, message: str, *, prefix: str) -> str:
    return _document(
        title,
        f'<p><a href="{esc(prefix)}/jobs">all jobs</a></p><h1>{esc(title)}</h1><p>{esc(message)}</p>',
        refresh_s=None,
    )
