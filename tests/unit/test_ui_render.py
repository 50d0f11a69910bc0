"""The jobs view's renderers: escaping, chart geometry, refresh only while running, key parsing."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re

import pytest

from airflow_deadline_batch.core.states import JobState, ShardState
from airflow_deadline_batch.ui import render
from airflow_deadline_batch.ui.model import (
    CostSummary,
    DagRunRef,
    ErrorSample,
    HistoryPoint,
    JobPage,
    JobSummary,
    ShardLine,
    planned_by,
)
from airflow_deadline_batch.ui.render import CHART_H, CHART_W, MARGIN_B, MARGIN_L, MARGIN_R, MARGIN_T, Scale

T0 = dt.datetime(2026, 3, 1, 0, 0, tzinfo=dt.timezone.utc)
EVIL = '<script>alert("x")</script>'


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def page(*, state: JobState = JobState.RUNNING, job_id: str = "j-1", evil: str = "") -> JobPage:
    """100 records, deadline at 60 min, now at 30 min with 40 left, predicted finish at 45 min."""
    summary = JobSummary(
        job_id=job_id,
        tenant="team" + evil,
        planned_by=DagRunRef(dag_id="dag" + evil, run_id="run" + evil, task_id="plan"),
        state=state,
        deadline=at(60),
        predicted_finish=at(45),
        slack_s=15 * 60.0,
        committed_records=60,
        total_records=100,
        cost=CostSummary(so_far=1.5, projected=2.5, spot_share=0.75, on_demand_share=0.25, redone_work_s=30),
        stopped=state is not JobState.RUNNING,
    )
    history = (
        HistoryPoint(at=at(0), remaining_records=100, predicted_finish=at(50), slack_s=600.0),
        HistoryPoint(at=at(10), remaining_records=80, predicted_finish=at(47), slack_s=780.0),
        HistoryPoint(at=at(30), remaining_records=40, predicted_finish=at(45), slack_s=900.0),
    )
    return JobPage(
        summary=summary,
        started_at=at(0),
        now=at(30),
        history=history,
        finish_spread=(at(44), at(47)),
        shards=(
            ShardLine(
                shard_index=0,
                state=ShardState.LEASED,
                pool="spot" + evil,
                capacity="spot",
                attempts=2,
                preemptions=1,
                cursor=3,
                num_microbatches=5,
                records=50,
                last_error=evil or None,
                racing=True,
                racing_on="on-demand" + evil,
            ),
        ),
        shards_by_state_pool={("leased", "spot" + evil): 1},
        preemptions=1,
        errors=ErrorSample(
            errored_records=2,
            codes={"invalid_json" + evil: 2},
            lines=(f"line 3: invalid_json: {evil}",),
            objects_read=1,
            try_failures={"transient": 1},
            try_messages={"transient": evil},
        ),
        manifest_uri=None if state is JobState.RUNNING else f"/out/{job_id}/manifest.json{evil}",
        outcomes=None if state is JobState.RUNNING else {"succeeded": 60, "cancelled": 40, "x" + evil: 0},
        error=evil or None,
        running_workers=2,
    )


def path_d(html: str, element_id: str) -> str:
    match = re.search(rf'<path id="{element_id}" class="[^"]*" d="([^"]*)"', html)
    assert match, f"no path #{element_id}"
    return match.group(1)


@pytest.mark.parametrize(
    "key, expected",
    [
        (
            "dag/manual__2026-01-01T00:00:00+00:00/plan",
            DagRunRef(dag_id="dag", run_id="manual__2026-01-01T00:00:00+00:00", task_id="plan"),
        ),
        ("dag/run/with/slashes/plan", DagRunRef(dag_id="dag", run_id="run/with/slashes", task_id="plan")),
        (  # a rejected job's key carries a mark; the DAG run that planned it stays readable
            "dag/run/plan#rejected-j-abcdefghij0123456789",
            DagRunRef(dag_id="dag", run_id="run", task_id="plan"),
        ),
        ("my-own-key", None),
        ("my-own-key#rejected-j-abcdefghij0123456789", None),
        ("a/b", None),
        ("/run/task", None),
        (None, None),
    ],
)
def test_planned_by_reads_the_plan_operators_default_key(key, expected):
    assert planned_by(key) == expected


def test_scale_maps_the_corners_of_the_plot_area():
    scale = Scale(at(0), at(60), 0.0, 100.0)
    assert scale.x(at(0)) == MARGIN_L and scale.x(at(60)) == CHART_W - MARGIN_R
    assert scale.y(0.0) == CHART_H - MARGIN_B and scale.y(100.0) == MARGIN_T
    assert scale.x(at(30)) == pytest.approx((MARGIN_L + CHART_W - MARGIN_R) / 2, abs=0.01)


def test_step_path_holds_each_value_until_the_next_instant():
    scale = Scale(at(0), at(60), 0.0, 100.0)
    d = render.step_path(scale, [(at(0), 100.0), (at(30), 40.0)])
    assert d == f"M{scale.x(at(0))},{scale.y(100)}H{scale.x(at(30))}V{scale.y(40)}"


def test_burndown_geometry_uniform_line_prediction_and_spread():
    p = page()
    html = render.burndown_svg(p)
    scale = Scale(at(0), at(60), 0.0, 100.0)  # the deadline is the latest instant on the chart
    assert path_d(html, "uniform") == f"M{scale.x(at(0))},{scale.y(100)}L{scale.x(at(60))},{scale.y(0)}"
    assert path_d(html, "predicted") == f"M{scale.x(at(30))},{scale.y(40)}L{scale.x(at(45))},{scale.y(0)}"
    assert path_d(html, "spread") == (
        f"M{scale.x(at(30))},{scale.y(40)}L{scale.x(at(44))},{scale.y(0)}L{scale.x(at(47))},{scale.y(0)}Z"
    )
    burn = path_d(html, "burndown")
    assert burn.startswith(f"M{scale.x(at(0))},{scale.y(100)}") and burn.endswith(f"V{scale.y(40)}")
    assert f'x1="{scale.x(at(60))}"' in html  # the deadline's line


def test_a_late_prediction_widens_the_chart_to_the_predicted_finish():
    late = dataclasses.replace(page(), summary=dataclasses.replace(page().summary, predicted_finish=at(90)))
    html = render.burndown_svg(late)
    scale = Scale(at(0), at(90), 0.0, 100.0)
    assert path_d(html, "predicted").endswith(f"L{scale.x(at(90))},{scale.y(0)}")
    assert path_d(html, "uniform").endswith(f"L{scale.x(at(60))},{scale.y(0)}")


def test_running_pages_reload_themselves_finished_ones_do_not():
    running = render.render_job_page(page(), prefix="/deadline-batch")
    done = render.render_job_page(page(state=JobState.COMPLETED), prefix="/deadline-batch")
    assert f'http-equiv="refresh" content="{render.REFRESH_S}"' in running
    assert "refresh" not in done
    assert 'id="predicted"' in running and 'id="predicted"' not in done
    jobs = render.render_jobs_page([page().summary], prefix="/p")
    assert "refresh" in jobs and "refresh" not in render.render_jobs_page([], prefix="/p")


def test_every_value_is_escaped():
    p = page(state=JobState.COMPLETED, job_id=f"j-{EVIL}", evil=EVIL)
    for html in (
        render.render_job_page(p, prefix="/deadline-batch"),
        render.render_jobs_page([p.summary], prefix="/deadline-batch"),
        render.render_message(EVIL, EVIL, prefix="/deadline-batch"),
    ):
        assert "<script" not in html
        assert "&lt;script&gt;" in html
    job_page = render.render_job_page(p, prefix="/deadline-batch")
    # the job id in a link is a quoted path segment, not markup
    assert "/deadline-batch/api/jobs/j-%3Cscript%3Ealert%28%22x%22%29%3C%2Fscript%3E/manifest" in job_page


def test_the_page_shows_the_numbers_it_is_given():
    html = render.render_job_page(page(), prefix="/deadline-batch")
    assert '<dd id="records">60 / 100</dd>' in html
    assert '<dd id="cost-so-far">1.50</dd>' in html and '<dd id="cost-projected">2.50</dd>' in html
    assert '<dd id="capacity-share">75% / 25%</dd>' in html
    assert '<dd id="deadline">2026-03-01 01:00:00 UTC</dd>' in html
    assert render.fmt_duration(-3723) == "-1h 02m 03s" and render.fmt_duration(59.6) == "1m 00s"


def test_a_racing_shard_says_so_and_its_racer_is_a_running_worker() -> None:
    html = render.render_job_page(page(), prefix="/deadline-batch")
    assert '<dd id="running-workers">2</dd>' in html
    assert "<td>spot <span class='racing'>racing on on-demand</span></td>" in html
    alone = dataclasses.replace(page(), shards=(dataclasses.replace(page().shards[0], racing=False),))
    assert "racing on" not in render.render_job_page(alone, prefix="/deadline-batch")


def test_a_published_job_shows_every_outcome_count() -> None:
    html = render.render_job_page(page(state=JobState.CANCELLED), prefix="/deadline-batch")
    assert '<dd id="outcomes">cancelled 40, succeeded 60, x 0</dd>' in html
    running = render.render_job_page(page(), prefix="/deadline-batch")
    assert 'id="outcomes"' not in running


def test_a_released_key_fits_the_column_and_gives_the_submitted_key_back() -> None:
    from airflow_deadline_batch.core.ids import IDEMPOTENCY_KEY_MAX, new_job_id, released_key, submitted_key

    job_id = new_job_id()
    assert submitted_key(released_key("dag/run/plan", job_id)) == "dag/run/plan"
    long = released_key("k" * IDEMPOTENCY_KEY_MAX, job_id)
    assert len(long) == IDEMPOTENCY_KEY_MAX and long.endswith(job_id)
    assert submitted_key("a#rejected-not-a-job") == "a#rejected-not-a-job"
