"""The values behind the deadline_batch.* metrics, from hand-made rows (exact numbers)."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest

from airflow_deadline_batch import metrics
from airflow_deadline_batch.core.job_view import build_job_view
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
POOLS = default_local_pools("echo")  # local-spot at 1.0 per GPU-hour, local-on-demand at 3.0
SPOT, OD = POOLS[0].name, POOLS[1].name


def attempt(aid: str, index: int, pool: str, start_s: float, end_s: float | None, outcome: AttemptOutcome):
    return SimpleNamespace(
        attempt_id=aid,
        shard_index=index,
        pool=pool,
        started_at=T0 + dt.timedelta(seconds=start_s),
        ended_at=None if end_s is None else T0 + dt.timedelta(seconds=end_s),
        outcome=outcome,
        failure_class=None,
    )


def commit(aid: str, records: int, elapsed_s: float, at_s: float, pool: str):
    return SimpleNamespace(
        attempt_id=aid,
        records=records,
        prompt_tokens=10,
        completion_tokens=10,
        elapsed_s=elapsed_s,
        pool=pool,
        committed_at=T0 + dt.timedelta(seconds=at_s),
        shard_index=0,
    )


def view_and_rows():
    job = SimpleNamespace(
        job_id="j-x",
        state=JobState.RUNNING,
        deadline=T0 + dt.timedelta(seconds=3600),
        created_at=T0,
        completed_at=None,
        input_lines=10,
        config={"workers": 2},
    )
    plan = {"est_work_s": 100.0, "num_microbatches": 2}
    shards = [
        SimpleNamespace(shard_index=0, state=ShardState.LEASED, cursor=1, last_pool=OD, **plan),
        SimpleNamespace(shard_index=1, state=ShardState.PENDING, cursor=0, last_pool=SPOT, **plan),
    ]
    attempts = [
        # preempted after 360 s on Spot, 60 s of it committed: 300 s redone
        attempt("a1", 0, SPOT, 0, 360, AttemptOutcome.PREEMPTED),
        # running on on-demand for 720 s at "now"
        attempt("a2", 0, OD, 480, None, AttemptOutcome.RUNNING),
    ]
    commits = [commit("a1", 3, 60.0, 100, SPOT)]
    now = T0 + dt.timedelta(seconds=1200)
    view = build_job_view(job, shards, commits, now=now, pools=POOLS, attempts=attempts)
    return view, attempts, commits


def test_attempt_totals_price_each_try_and_count_uncommitted_preempted_time():
    view, attempts, commits = view_and_rows()
    totals = metrics.attempt_totals(view, attempts, commits)
    assert totals.redone_work_s == 300.0
    assert totals.cost == pytest.approx(360 * 1.0 / 3600 + 720 * 3.0 / 3600)


def test_a_stalled_try_s_uncommitted_time_is_redone_work_but_no_preemption():
    view, attempts, commits = view_and_rows()
    # the same try, but its worker reported back alive after its lease went to another claim
    stalled = [attempt("a1", 0, SPOT, 0, 360, AttemptOutcome.STALLED), attempts[1]]
    assert metrics.attempt_totals(view, stalled, commits).redone_work_s == 300.0
    lost_race = [attempt("a1", 0, SPOT, 0, 360, AttemptOutcome.LOST_RACE), attempts[1]]
    assert metrics.attempt_totals(view, lost_race, commits).redone_work_s == 0.0


def test_job_metrics_read_the_view():
    view, attempts, commits = view_and_rows()
    values = metrics.job_metrics(view, metrics.attempt_totals(view, attempts, commits))
    assert set(values) == set(metrics.GAUGES)
    assert values[metrics.RECORDS_COMMITTED] == 3
    assert values[metrics.RECORDS_REMAINING] == 7
    assert values[metrics.LEASES_ACTIVE] == 1
    assert values[metrics.LEASES_ON_DEMAND] == 1
    assert values[metrics.PREEMPTIONS] == 1
    assert values[metrics.DEADLINE_IN_S] == 2400
    assert values[metrics.SLACK_S] == view.slack_s
    assert values[metrics.DEADLINE_IN_S] - values[metrics.PREDICTED_FINISH_S] == pytest.approx(view.slack_s)


def test_names_share_one_prefix_and_tags_avoid_airflows_disabled_job_id():
    names = [*metrics.GAUGES, metrics.DECISIONS, metrics.ESCALATIONS, metrics.RACES]
    assert len(set(names)) == len(names)
    assert all(n.startswith(metrics.PREFIX + ".") for n in names)
    assert "job_id" not in metrics.JOB_TAG
    assert metrics.tags("j-x", "d") == {metrics.JOB_TAG: "j-x", "dag_id": "d"}
