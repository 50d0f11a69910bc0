"""The local runner and the Airflow shard operators place a shard the same way for one store state."""

from __future__ import annotations

import datetime as dt

import pytest

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.local.runner import LocalRun, RunOptions
from airflow_deadline_batch.operators.placement import TryAction, TryDecision
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator, LocalShardOperator
from airflow_deadline_batch.store import ManifestStore, NewJob
from tests.helpers.commits import Microbatch, commit
from tests.helpers.shards import uniform_shards

T0 = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
SPOT = PoolSpec(
    name="gpu-spot",
    kind=PoolKind.SPOT,
    startup_seconds=120,
    queue_wait_seconds=30,
    preemptions_per_hour=0.5,
    preemption_notice_seconds=120,
)
ON_DEMAND = PoolSpec(
    name="gpu-on-demand",
    kind=PoolKind.ON_DEMAND,
    price_per_gpu_hour=3.0,
    startup_seconds=60,
    queue_wait_seconds=300,
)
WORKERS = 3


@pytest.fixture()
def store_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture()
def job_id(store_url: str) -> str:
    """A three-hour job of 6 shards of 30 GPU-minutes each, run by 3 workers."""
    store = ManifestStore(store_url)
    store.migrate()
    job, _ = store.create_job(
        NewJob(
            deadline=T0 + dt.timedelta(hours=3),
            input_uri="/data/in.jsonl",
            input_sha256="0" * 64,
            input_lines=60,
            input_total_lines=60,
            output_uri="/data/out",
            config={"workers": WORKERS, "engine": "echo", "pools": [SPOT.to_dict(), ON_DEMAND.to_dict()]},
        ),
        uniform_shards(6, microbatches=5, est_work_s=1800.0),
        None,
    )
    return job.job_id


@pytest.fixture(autouse=True)
def same_turnaround(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one input that differs by design: the time from a try's end to the next decision (the
    runner's poll; Airflow's delays and latency). Made equal here: the runner's poll is 0.1 s."""
    monkeypatch.setenv("AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S", "0")
    monkeypatch.setenv("AIRFLOW__DEADLINE_BATCH__SCHEDULER_LATENCY_S", str(RunOptions().poll_interval_s))


def decisions(store_url: str, job_id: str, index: int, clock: ManualClock) -> list[TryDecision]:
    """The runner's decision and both shard operators' decisions for one shard, now."""
    runner = LocalRun(ManifestStore(store_url), job_id, RunOptions(workers=WORKERS), clock)
    operators = [
        cls(
            task_id="shard",
            job_id=job_id,
            shard_index=index,
            store_url=store_url,
            clock=clock,
            retry_delay=dt.timedelta(0),
            **extra,
        )
        for cls, extra in ((LocalShardOperator, {}), (DeadlineShardPodOperator, {"image": "worker:0.1"}))
    ]
    return [runner.decide(index), *(op.decide() for op in operators)]


#: what the parity's measured rates read of each commit
MICROBATCH: Microbatch = {"records": 2, "prompt_tokens": 6000, "completion_tokens": 6000}


def test_runner_and_operators_decide_alike_as_the_job_runs(store_url: str, job_id: str) -> None:
    clock = ManualClock(T0)
    store = ManifestStore(store_url)

    # a fresh job: plenty of slack, Spot for everyone
    fresh = decisions(store_url, job_id, 0, clock)
    assert fresh[0].action is TryAction.RUN and fresh[0].pool == SPOT
    assert fresh[1:] == [fresh[0], fresh[0]]

    # shard 0 commits two slow microbatches on Spot and is preempted; shard 1 runs on on-demand
    lease = store.claim_shard(job_id, 0, ttl_s=60, worker="w0", pool=SPOT.name)
    lease = commit(store, lease, 0, pool=SPOT.name, elapsed_s=400.0, **MICROBATCH)
    lease = commit(store, lease, 1, pool=SPOT.name, elapsed_s=400.0, **MICROBATCH)
    store.release(lease, AttemptOutcome.PREEMPTED, "spot reclaimed")
    on_demand = store.claim_shard(job_id, 1, ttl_s=3600, worker="w1", pool=ON_DEMAND.name)
    commit(store, on_demand, 0, pool=ON_DEMAND.name, elapsed_s=300.0, **MICROBATCH)
    clock.advance(1800)
    later = decisions(store_url, job_id, 0, clock)
    assert later[0].action is TryAction.RUN
    assert later[1:] == [later[0], later[0]]
    assert later[0].placement is not None and fresh[0].placement is not None
    assert later[0].placement.slack_s < fresh[0].placement.slack_s - 1800

    # close to the deadline: both escalate shard 0 to on-demand, with the same reason and timeouts
    clock.advance(3600)
    late = decisions(store_url, job_id, 0, clock)
    assert late[0].pool == ON_DEMAND
    assert late[1:] == [late[0], late[0]]

    # a cancelled job: every path stops
    store.cancel_job(job_id)
    stopped = decisions(store_url, job_id, 2, clock)
    assert {d.action for d in stopped} == {TryAction.JOB_STOPPED}
    assert stopped[1:] == [stopped[0], stopped[0]]


def test_runner_and_operators_escalate_alike_in_a_preemption_storm(store_url: str, job_id: str) -> None:
    """docs/design.md §5, Observed preemptions: Spot tries preempted before any commit, plenty of slack."""
    clock = ManualClock(T0)
    store = ManifestStore(store_url)
    # a reclaim of all three workers, twice, is not a storm (6 + 3 - 1 = 8 fruitless tries are)
    for index in (0, 1, 2, 3, 4, 5):
        lease = store.claim_shard(job_id, index, ttl_s=60, worker=f"w{index}", pool=SPOT.name)
        store.release(lease, AttemptOutcome.PREEMPTED, "spot reclaimed")
    # (six instant preemptions also make Spot dear per hour of work: the expected-cost rule may
    # send the try on-demand, but not the storm)
    calm = decisions(store_url, job_id, 0, clock)
    assert "preemption storm" not in calm[0].reason and calm[1:] == [calm[0], calm[0]]

    for index in (0, 1):
        lease = store.claim_shard(job_id, index, ttl_s=60, worker=f"w{index}", pool=SPOT.name)
        store.release(lease, AttemptOutcome.PREEMPTED, "spot reclaimed")
    storm = decisions(store_url, job_id, 0, clock)
    assert storm[0].action is TryAction.RUN and storm[0].pool == ON_DEMAND
    assert "preemption storm" in storm[0].reason
    assert storm[0].placement is not None and storm[0].placement.slack_s > 3600  # not the safety net
    assert storm[1:] == [storm[0], storm[0]]

    # a Spot try that commits ends the storm for everyone
    lease = store.claim_shard(job_id, 1, ttl_s=60, worker="w1", pool=SPOT.name)
    lease = commit(store, lease, 0, pool=SPOT.name, elapsed_s=1.0, **MICROBATCH)
    store.release(lease, AttemptOutcome.PREEMPTED, "spot reclaimed")
    over = decisions(store_url, job_id, 2, clock)
    assert "preemption storm" not in over[0].reason and over[1:] == [over[0], over[0]]
