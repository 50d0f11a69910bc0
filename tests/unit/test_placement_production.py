"""decide_for_try with the job's pools: prices, several Spot and on-demand pools, learned rates."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest

from airflow_deadline_batch.core.calibration import PoolHistory, spot_prior
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState
from airflow_deadline_batch.core.tenants import DEFAULT_TENANT
from airflow_deadline_batch.operators.placement import (
    PlacementView,
    TryDecision,
    decide_for_try,
    job_view_of,
    placement_snapshot,
)

T0 = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc)
SPOT_A = PoolSpec(name="spot-a", kind=PoolKind.SPOT, price_per_gpu_hour=1.0, preemptions_per_hour=0.2)
SPOT_B = PoolSpec(name="spot-b", kind=PoolKind.SPOT, price_per_gpu_hour=1.3, preemptions_per_hour=0.2)
OD = PoolSpec(name="od", kind=PoolKind.ON_DEMAND, price_per_gpu_hour=3.0)


@dataclasses.dataclass(frozen=True)
class Job:
    pools: tuple[PoolSpec, ...]
    job_id: str = "j-1"
    state: JobState = JobState.RUNNING
    deadline: dt.datetime = T0 + dt.timedelta(hours=8)
    created_at: dt.datetime = T0
    completed_at: dt.datetime | None = None
    input_lines: int = 100
    tenant: str = DEFAULT_TENANT

    @property
    def config(self) -> Mapping[str, Any]:
        return {"workers": 2, "pools": [p.to_dict() for p in self.pools]}


@dataclasses.dataclass(frozen=True)
class Shard:
    shard_index: int
    est_work_s: float = 1800.0
    num_microbatches: int = 4
    cursor: int = 0
    state: ShardState = ShardState.PENDING
    last_pool: str | None = None
    last_error: str | None = None


@dataclasses.dataclass(frozen=True)
class Attempt:
    attempt_id: str
    pool: str
    started_at: dt.datetime
    ended_at: dt.datetime
    shard_index: int = 0
    outcome: AttemptOutcome = AttemptOutcome.PREEMPTED
    failure_class: str | None = None


def decide(
    pools: tuple[PoolSpec, ...],
    attempts: list[Attempt] | None = None,
    history: Mapping[str, PoolHistory] | None = None,
) -> TryDecision:
    shards = [Shard(i) for i in range(6)]
    view = job_view_of(Job(pools), shards, [], attempts or [], now=T0, history=history)  # type: ignore[arg-type]
    return decide_for_try(view, shards[0])  # type: ignore[arg-type]


def flaky(pool: str, tries: int, minutes: float = 10.0) -> list[Attempt]:
    """``tries`` tries on ``pool`` preempted after ``minutes`` each, before committing."""
    span = dt.timedelta(minutes=minutes)
    return [
        Attempt(f"a{n}", pool, T0 - (n + 1) * span, T0 - n * span, shard_index=n % 6) for n in range(tries)
    ]


def test_the_price_ratio_reaches_the_rule_and_a_dear_spot_pool_goes_on_demand() -> None:
    view = job_view_of(Job((SPOT_A, OD)), [Shard(0)], [], [], now=T0)
    snapshot = placement_snapshot(view, 0, OD)
    assert snapshot.price_ratio == pytest.approx(3.0)
    assert decide((SPOT_A, OD)).pool == SPOT_A
    shaky = dataclasses.replace(SPOT_A, preemptions_per_hour=6.0)  # a 10-minute spell, a 30-minute shard
    decision = decide((shaky, OD))
    assert decision.pool == OD and "expected to cost" in decision.reason
    free = dataclasses.replace(OD, price_per_gpu_hour=0.0)  # reserved capacity already paid for
    assert decide((SPOT_A, free)).pool == free


def test_the_cheaper_spot_pool_wins_until_the_job_sees_it_preempted() -> None:
    assert decide((SPOT_A, SPOT_B, OD)).pool == SPOT_A
    decision = decide((SPOT_A, SPOT_B, OD), attempts=flaky(SPOT_A.name, 4))
    assert decision.pool == SPOT_B
    assert decision.placement is not None and decision.placement.spot_pool == SPOT_B.name
    # tries on the other pool teach nothing about this one
    assert decide((SPOT_A, SPOT_B, OD), attempts=flaky(SPOT_B.name, 4)).pool == SPOT_A


def test_earlier_jobs_history_is_the_prior_and_the_jobs_own_tries_still_move_it() -> None:
    history = {SPOT_A.name: PoolHistory(pool=SPOT_A.name, tries=40, preemptions=40, spot_s=40 * 600.0)}
    assert decide((SPOT_A, SPOT_B, OD), history=history).pool == SPOT_B
    # a long calm run of this job on spot-a outweighs the capped history
    calm = [Attempt("calm", SPOT_A.name, T0 - dt.timedelta(hours=100), T0, outcome=AttemptOutcome.SUCCEEDED)]
    view = job_view_of(Job((SPOT_A, SPOT_B, OD)), [Shard(0)], [], calm, now=T0, history=history)  # type: ignore[arg-type]
    assert isinstance(view, PlacementView)
    assert view.pool_tries[SPOT_A.name].preemptions_per_hour < 0.5


def test_spot_prior_weighs_declaration_and_capped_history() -> None:
    assert spot_prior(0.5).preemptions_per_hour == pytest.approx(0.5)
    seen = spot_prior(0.5, PoolHistory(pool="p", tries=10, preemptions=9, spot_s=3 * 3600.0))
    assert seen.preemptions_per_hour == pytest.approx((0.5 + 9) / (1 + 3))
    long = spot_prior(0.0, PoolHistory(pool="p", tries=1000, preemptions=480, spot_s=240 * 3600.0))
    assert long.prior_hours == pytest.approx(1 + 24) and long.preemptions_per_hour == pytest.approx(48 / 25)
    with pytest.raises(ValueError, match="must be >= 0"):
        PoolHistory(pool="p", tries=-1)


def test_several_on_demand_pools_escalate_to_the_cheapest_not_slower_one() -> None:
    slow = PoolSpec(
        name="od-slow", kind=PoolKind.ON_DEMAND, price_per_gpu_hour=1.0, decode_tokens_per_s=500.0
    )
    cheap = dataclasses.replace(OD, name="od-cheap", price_per_gpu_hour=2.5)
    shaky = dataclasses.replace(SPOT_A, preemptions_per_hour=6.0)
    decision = decide((shaky, OD, slow, cheap))
    assert decision.pool == cheap
    # with only a slower on-demand pool, it is still the one to escalate to
    assert decide((shaky, slow)).pool == slow
