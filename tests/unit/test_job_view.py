"""The job view: stopped states, work left, calibrated rates, predicted finish and slack, snapshots."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest

from airflow_deadline_batch.core.calibration import prior_tokens_per_s
from airflow_deadline_batch.core.job_view import build_job_view, is_stopped
from airflow_deadline_batch.core.placement import choose_pool, od_need_s
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import TERMINAL_JOB_STATES, JobState, ShardState

T0 = dt.datetime(2026, 3, 1, 0, 0, tzinfo=dt.timezone.utc)
SPOT = PoolSpec(
    name="gpu-spot",
    kind=PoolKind.SPOT,
    prefill_tokens_per_s=1000,
    decode_tokens_per_s=100,
    startup_seconds=100,
    queue_wait_seconds=20,
    preemption_notice_seconds=30,
)
ON_DEMAND = PoolSpec(
    name="gpu-on-demand",
    kind=PoolKind.ON_DEMAND,
    prefill_tokens_per_s=1000,
    decode_tokens_per_s=100,
    startup_seconds=60,
    queue_wait_seconds=120,
)


@dataclasses.dataclass(frozen=True)
class Job:
    job_id: str = "j-1"
    state: JobState = JobState.RUNNING
    deadline: dt.datetime = T0 + dt.timedelta(hours=4)
    created_at: dt.datetime = T0
    completed_at: dt.datetime | None = None
    input_lines: int = 100
    config: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"workers": 2, "pools": [SPOT.to_dict(), ON_DEMAND.to_dict()]}
    )


@dataclasses.dataclass(frozen=True)
class Shard:
    shard_index: int
    est_work_s: float = 1000.0
    num_microbatches: int = 4
    cursor: int = 0
    state: ShardState = ShardState.PENDING
    last_pool: str | None = None


@dataclasses.dataclass(frozen=True)
class Commit:
    pool: str | None
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float
    records: int = 5
    committed_at: dt.datetime = T0


def test_stopped_is_terminal_rejected_included() -> None:
    assert {s for s in JobState if is_stopped(s)} == set(TERMINAL_JOB_STATES)
    assert is_stopped("rejected") and not is_stopped("finalizing")
    assert build_job_view(Job(state=JobState.CANCELLED), [], [], now=T0).stopped


def test_work_left_counts_committed_microbatches_and_succeeded_shards() -> None:
    shards = [
        Shard(0, cursor=1),  # 3/4 left
        Shard(1, cursor=4, state=ShardState.SUCCEEDED),
        Shard(2, num_microbatches=0),  # nothing to run
        Shard(3, est_work_s=2000.0, state=ShardState.LEASED, last_pool="gpu-on-demand"),
    ]
    view = build_job_view(Job(), shards, [], now=T0)
    assert view.shard_work_s == {0: 750.0, 3: 2000.0}
    assert view.remaining_work_s == 2750.0 and view.committed_work_s == 250.0 + 1000.0 + 1000.0
    assert view.work_scale == 1.0 and view.parallelism == 2
    assert view.changeover_s == 180.0  # the on-demand pool's 60 s startup + 120 s queue wait
    assert view.on_demand_shards == {3}


def test_predicted_finish_and_slack_are_the_placement_need_of_the_largest_shard() -> None:
    shards = [Shard(0, est_work_s=1000.0), Shard(1, est_work_s=3000.0)]
    view = build_job_view(Job(), shards, [], now=T0 + dt.timedelta(hours=1))
    # 180 s changeover + 4000 s over 2 workers + half of the 3000 s shard of imbalance
    need = 180 + 4000 / 2 + 3000 / 2
    assert od_need_s(view.snapshot()) == pytest.approx(need)
    assert view.predicted_finish == view.now + dt.timedelta(seconds=need)
    assert view.slack_s == pytest.approx(3 * 3600 - need)
    # and it is the slack the placement of that shard decides with
    assert choose_pool(view.snapshot(1)).slack_s == pytest.approx(view.slack_s)
    done = build_job_view(Job(completed_at=T0 + dt.timedelta(hours=2)), shards, [], now=T0)
    assert done.finished and done.slack_s == pytest.approx(2 * 3600)


def test_snapshot_carries_the_shards_previous_pool_and_the_spot_pools_notice() -> None:
    shards = [Shard(0, last_pool="spot"), Shard(1, state=ShardState.LEASED, last_pool="gpu-on-demand")]
    view = build_job_view(Job(), shards, [], now=T0)
    snap = view.snapshot(0)
    assert snap.previous_pool is PoolKind.SPOT and snap.on_demand_workers == 1
    assert snap.notice_s == 30 and snap.spot_available and snap.started_at == T0
    assert view.snapshot(1).on_demand_workers == 0  # a shard is not its own other worker


def test_measured_rates_scale_the_work_and_show_per_pool() -> None:
    # the Spot pool runs at half its nominal rate for this mix of tokens (20 % completion)
    nominal = prior_tokens_per_s(SPOT, 0.2)
    commits = [Commit("gpu-spot", 4000, 1000, 2 * 5000 / nominal)] * 40 + [Commit(None, 0, 0, 0.0)]
    view = build_job_view(Job(), [Shard(0)], commits, now=T0)
    assert view.work_scale == pytest.approx(2.0, rel=0.02)
    assert view.remaining_work_s == pytest.approx(2000.0, rel=0.02)
    spot, on_demand = view.rates()
    assert spot.microbatches == 40 and spot.tokens_per_s == pytest.approx(nominal / 2, rel=0.02)
    assert on_demand.microbatches == 0 and on_demand.tokens_per_s == on_demand.nominal_tokens_per_s
    assert view.committed_records == 41 * 5


def test_before_the_reference_pool_runs_the_pool_measured_longest_stands_in() -> None:
    nominal = prior_tokens_per_s(ON_DEMAND, 0.2)
    commits = [Commit("on_demand", 4000, 1000, 3 * 5000 / nominal)] * 40  # recorded by kind
    view = build_job_view(Job(), [Shard(0)], commits, now=T0)
    assert view.work_scale == pytest.approx(3.0, rel=0.02)


def test_operator_pools_and_parallelism_override_the_jobs() -> None:
    view = build_job_view(Job(), [Shard(0)], [], now=T0, pools=[SPOT], parallelism=5)
    assert view.pools == (SPOT,) and view.parallelism == 5 and view.changeover_s == 120.0
    with pytest.raises(ValueError, match="no pools"):
        build_job_view(Job(config={}), [], [], now=T0)
