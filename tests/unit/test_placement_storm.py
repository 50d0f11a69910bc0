"""Preemption storms: the observed Spot tries, the escalation rule, the job view and the simulator.

docs/design.md §5, *Observed preemptions*: the placement learns from the job's finished Spot tries
and sends fresh tries on-demand once Spot stops making progress, whatever the slack.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest

from airflow_deadline_batch.core.calibration import SpotTries
from airflow_deadline_batch.core.job_view import build_job_view
from airflow_deadline_batch.core.placement import (
    JobSnapshot,
    PolicyParams,
    choose_pool,
    in_storm,
    storm_cooldown_s,
)
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState
from airflow_deadline_batch.sim.engine import SimConfig, on_demand_makespan, simulate
from airflow_deadline_batch.sim.policies import OnDemand, SlackAware
from airflow_deadline_batch.sim.traces import Trace

T0 = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc)


# -- the fold ------------------------------------------------------------------------------------


def test_spot_tries_count_the_latest_fruitless_preemptions_and_reset_on_progress() -> None:
    tries = SpotTries(prior_per_hour=0.5)
    assert tries.mean_run_s == pytest.approx(7200.0)  # the declared rate until something is seen
    for end in (10.0, 20.0, 30.0):
        tries = tries.observe(ended_s=end, duration_s=5.0, preempted=True, commits=0)
    assert (tries.fruitless, tries.fruitless_end_s, tries.preemptions) == (3, 30.0, 3)
    # a failure that is not a preemption neither extends nor breaks the streak
    tries = tries.observe(ended_s=40.0, duration_s=5.0, preempted=False, commits=0)
    assert tries.fruitless == 3
    # a preempted try that committed something is progress: the streak is over
    tries = tries.observe(ended_s=50.0, duration_s=5.0, preempted=True, commits=1)
    assert (tries.fruitless, tries.fruitless_end_s, tries.tries, tries.preemptions) == (0, None, 5, 4)
    # 4 preemptions in 25 s of Spot, shrunk to one declared hour at 0.5/h
    assert tries.preemptions_per_hour == pytest.approx(4.5 / (25 / 3600 + 1.0))


def test_a_storm_of_preemptions_drives_the_observed_rate_far_above_the_declared_one() -> None:
    tries = SpotTries(prior_per_hour=0.5)
    for i in range(20):
        tries = tries.observe(ended_s=float(i), duration_s=1.0, preempted=True, commits=0)
    assert tries.preemptions_per_hour > 20
    assert tries.mean_run_s is not None and tries.mean_run_s < 200


# -- the rule ------------------------------------------------------------------------------------


def snapshot(**overrides: Any) -> JobSnapshot:
    """A job with hours of slack: without a storm, Spot is the choice."""
    fields: dict[str, Any] = {
        "now": T0,
        "deadline": T0 + dt.timedelta(hours=2),
        "remaining_work_s": 600.0,
        "shard_work_s": 60.0,
        "parallelism": 2,
        "changeover_s": 10.0,
        "started_at": T0,
        "total_work_s": 600.0,
    }
    fields.update(overrides)
    return JobSnapshot(**fields)


def test_without_fruitless_tries_spot_is_chosen() -> None:
    assert choose_pool(snapshot()).pool is PoolKind.SPOT
    # one reclaim of both workers plus five more (need = 6 + 2 - 1 = 7) is not a storm yet
    assert choose_pool(snapshot(spot_fruitless_tries=6, spot_fruitless_age_s=0.0)).pool is PoolKind.SPOT


def test_a_storm_escalates_fresh_tries_to_on_demand_whatever_the_slack() -> None:
    storm = snapshot(spot_fruitless_tries=7, spot_fruitless_age_s=0.0)
    decision = choose_pool(storm)
    assert decision.pool is PoolKind.ON_DEMAND
    assert "preemption storm" in decision.reason
    assert decision.slack_s > 3600  # not the safety net: slack is plentiful
    # off when storm_tries is 0
    assert choose_pool(storm, PolicyParams(storm_tries=0)).pool is PoolKind.SPOT


def test_a_running_spot_try_is_kept_in_a_storm_while_safe() -> None:
    storm = snapshot(
        spot_fruitless_tries=9, spot_fruitless_age_s=0.0, previous_pool=PoolKind.SPOT, running=True
    )
    assert choose_pool(storm).pool is PoolKind.SPOT


def test_one_probe_after_a_cool_down_that_doubles_with_every_fruitless_probe() -> None:
    base = snapshot(spot_fruitless_tries=7)
    cooldown = storm_cooldown_s(base)
    assert cooldown == pytest.approx(4.0 * (10.0 + 60.0))
    assert in_storm(dataclasses.replace(base, spot_fruitless_age_s=cooldown - 1))
    probe = dataclasses.replace(base, spot_fruitless_age_s=cooldown + 1)
    assert not in_storm(probe) and choose_pool(probe).pool is PoolKind.SPOT
    # another worker already on Spot is the probe: this one stays on-demand
    assert choose_pool(dataclasses.replace(probe, spot_workers=1)).pool is PoolKind.ON_DEMAND
    # a round of failed probes, one per worker (2 here): twice the wait
    failed = snapshot(spot_fruitless_tries=9, spot_fruitless_age_s=cooldown + 1)
    assert storm_cooldown_s(failed) == pytest.approx(2 * cooldown)
    assert choose_pool(failed).pool is PoolKind.ON_DEMAND
    # with one worker every failed probe doubles it
    alone = snapshot(parallelism=1, spot_fruitless_tries=7)
    assert storm_cooldown_s(alone) == pytest.approx(
        2 * storm_cooldown_s(snapshot(parallelism=1, spot_fruitless_tries=6))
    )
    # an unknown age keeps the storm on
    assert in_storm(snapshot(spot_fruitless_tries=7))


def test_a_second_gang_reclaim_is_one_more_failure_not_one_per_worker() -> None:
    """Two reclaims of 8 workers (16 fruitless tries, the storm needs 13) wait one cool-down;
    counted per try it was 2^3 of them, 14 h of on-demand on gang8-902 with 1 h Spot spells."""
    gang = snapshot(parallelism=8, spot_fruitless_tries=16)
    one_round = storm_cooldown_s(snapshot(parallelism=8, spot_fruitless_tries=13))
    assert one_round == pytest.approx(4.0 * 70.0)
    assert storm_cooldown_s(gang) == pytest.approx(one_round)
    assert storm_cooldown_s(snapshot(parallelism=8, spot_fruitless_tries=21)) == pytest.approx(2 * one_round)
    assert storm_cooldown_s(snapshot(parallelism=8, spot_fruitless_tries=12)) is None


def test_the_backoff_is_capped() -> None:
    policy = PolicyParams(storm_backoff_cap=3)
    assert storm_cooldown_s(snapshot(spot_fruitless_tries=50), policy) == pytest.approx(4.0 * 70.0 * 8)


# -- the job view from attempt rows ----------------------------------------------------------------

SPOT = PoolSpec(
    name="gpu-spot",
    kind=PoolKind.SPOT,
    startup_seconds=10,
    preemptions_per_hour=0.5,
    preemption_notice_seconds=5,
)
ON_DEMAND = PoolSpec(name="gpu-on-demand", kind=PoolKind.ON_DEMAND, startup_seconds=10)


@dataclasses.dataclass(frozen=True)
class Job:
    job_id: str = "j-1"
    state: JobState = JobState.RUNNING
    deadline: dt.datetime = T0 + dt.timedelta(hours=2)
    created_at: dt.datetime = T0
    completed_at: dt.datetime | None = None
    input_lines: int = 40
    config: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"workers": 2, "pools": [SPOT.to_dict(), ON_DEMAND.to_dict()]}
    )


@dataclasses.dataclass(frozen=True)
class Shard:
    shard_index: int
    est_work_s: float = 60.0
    num_microbatches: int = 4
    cursor: int = 0
    state: ShardState = ShardState.RETRYABLE_FAILURE
    last_pool: str | None = "gpu-spot"


@dataclasses.dataclass(frozen=True)
class Commit:
    attempt_id: str
    pool: str | None = "gpu-spot"
    prompt_tokens: int = 100
    completion_tokens: int = 100
    elapsed_s: float = 1.0
    records: int = 1
    committed_at: dt.datetime = T0


@dataclasses.dataclass(frozen=True)
class Attempt:
    attempt_id: str
    shard_index: int
    started_s: float
    ended_s: float | None
    outcome: AttemptOutcome = AttemptOutcome.PREEMPTED
    pool: str | None = "gpu-spot"
    failure_class: str | None = None

    @property
    def started_at(self) -> dt.datetime:
        return T0 + dt.timedelta(seconds=self.started_s)

    @property
    def ended_at(self) -> dt.datetime | None:
        return None if self.ended_s is None else T0 + dt.timedelta(seconds=self.ended_s)


def view_at(now_s: float, attempts: list[Attempt], commits: list[Commit] = [], leased: int | None = None):  # noqa: B006
    shards = [
        Shard(i, state=ShardState.LEASED if i == leased else ShardState.RETRYABLE_FAILURE) for i in range(4)
    ]
    return build_job_view(Job(), shards, commits, now=T0 + dt.timedelta(seconds=now_s), attempts=attempts)


def fruitless(
    n: int, *, start: float = 0.0, outcome: AttemptOutcome = AttemptOutcome.PREEMPTED
) -> list[Attempt]:
    return [Attempt(f"a-{start + i}", i % 4, start + 2 * i, start + 2 * i + 1, outcome) for i in range(n)]


def test_the_view_counts_spot_tries_preempted_before_any_commit() -> None:
    view = view_at(100.0, fruitless(7))
    snap = view.snapshot(0)
    assert snap.spot_fruitless_tries == 7
    assert snap.spot_fruitless_age_s == pytest.approx(100.0 - 13.0)
    assert snap.spot_preemptions_per_hour > 0.5  # learned, above the declared 0.5/h
    assert snap.spot_mean_run_s is not None and snap.spot_mean_run_s < 7200
    assert choose_pool(snap).pool is PoolKind.ON_DEMAND


def test_abandoned_and_lost_leases_count_a_commit_ends_the_storm_and_other_pools_do_not_count() -> None:
    mixed = fruitless(3) + fruitless(2, start=10.0, outcome=AttemptOutcome.ABANDONED)
    assert view_at(100.0, mixed).snapshot(0).spot_fruitless_tries == 5
    lost = fruitless(5, outcome=AttemptOutcome.LOST_LEASE)
    assert view_at(100.0, lost).snapshot(0).spot_fruitless_tries == 5
    # the latest Spot try committed a microbatch before its preemption: progress
    progress = [*fruitless(5), Attempt("a-last", 1, 20.0, 25.0)]
    after = view_at(100.0, progress, [Commit("a-last")])
    assert after.spot_tries.fruitless == 0
    assert after.snapshot(0).spot_fruitless_tries == 2  # shard 0's own two tries still count
    assert choose_pool(after.snapshot(0)).pool is PoolKind.SPOT
    # on-demand tries and tries still running are not Spot evidence
    others = [Attempt(f"od-{i}", i, 0.0, 1.0, pool="gpu-on-demand") for i in range(5)]
    others.append(Attempt("running", 0, 0.0, None, AttemptOutcome.RUNNING))
    assert view_at(100.0, others).snapshot(0).spot_fruitless_tries == 0
    # without attempt rows nothing is observed: the declared rate stands
    plain = view_at(100.0, []).snapshot(0)
    assert plain.spot_fruitless_tries == 0 and plain.spot_preemptions_per_hour == pytest.approx(0.5)


def test_a_crash_loop_on_spot_is_spot_time_not_a_storm() -> None:
    """Tries the launcher saw die of a crash (``abandoned``, class ``deterministic``) are no
    preemptions: no storm, no learned rate above the declared one; the launcher's kills are."""
    crashes = [
        dataclasses.replace(a, failure_class="deterministic")
        for a in fruitless(7, outcome=AttemptOutcome.ABANDONED)
    ]
    view = view_at(100.0, crashes)
    assert (view.spot_tries.tries, view.spot_tries.preemptions) == (7, 0)
    assert view.spot_tries.spot_s == pytest.approx(7.0)  # their Spot time still counts
    snap = view.snapshot(0)
    assert snap.spot_fruitless_tries == 0 and snap.spot_preemptions_per_hour < 0.5
    assert choose_pool(snap).pool is PoolKind.SPOT
    kills = [
        dataclasses.replace(a, failure_class="preempted")
        for a in fruitless(7, outcome=AttemptOutcome.ABANDONED)
    ]
    killed = view_at(100.0, kills).snapshot(0)
    assert killed.spot_fruitless_tries == 7 and choose_pool(killed).pool is PoolKind.ON_DEMAND
    # a crash between two preemptions neither extends nor ends their run of fruitless tries
    mixed = [
        *fruitless(3),
        dataclasses.replace(crashes[0], attempt_id="crash", ended_s=9.0),
        *fruitless(3, start=10.0),
    ]
    assert view_at(100.0, mixed).spot_tries.fruitless == 6


def test_a_shard_whose_own_spot_tries_never_commit_escalates_although_others_progress() -> None:
    own = [Attempt(f"s3-{i}", 3, 10.0 * i, 10.0 * i + 5) for i in range(7)]
    others = [Attempt("s0-ok", 0, 60.0, 70.0)]
    view = view_at(100.0, own + others, [Commit("s0-ok")])
    assert view.snapshot(0).spot_fruitless_tries == 0
    assert view.snapshot(3).spot_fruitless_tries == 7
    assert choose_pool(view.snapshot(3)).pool is PoolKind.ON_DEMAND


def test_a_leased_spot_shard_is_the_running_probe() -> None:
    view = view_at(10_000.0, fruitless(7), leased=2)
    assert view.spot_shards == frozenset({2})
    assert view.snapshot(0).spot_workers == 1 and view.snapshot(2).spot_workers == 0


# -- the simulator ---------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 4])
def test_sim_slack_aware_escalates_in_a_storm_and_meets_the_deadline(workers: int) -> None:
    """Spot capacity for 5 minutes, gone for 5, forever: shorter than a changeover, so every Spot
    try is preempted before it commits anything (all Spot time wasted)."""
    cfg = SimConfig(
        work_h=4.0 * workers, deadline_h=8.0, workers=workers, changeover_h=0.1, price_ratio=3.0, shard_h=0.25
    )
    storm = Trace("storm", 300.0, tuple([workers, 0] * 500))
    result = simulate(storm, 0, cfg, SlackAware(), record=True)
    assert not result.missed and result.work_done_h == pytest.approx(cfg.work_h)
    assert result.redone_hours == 0  # nothing was ever committed on Spot to lose
    # escalated after 6 + N - 1 fruitless tries (a reclaim takes all N workers at once)
    assert result.preemptions <= 6 + 2 * (workers - 1)
    first_on_demand = min(t for t, _, mode in result.switches if mode == "on_demand")
    assert first_on_demand < 1.0
    assert result.finish_h < on_demand_makespan(cfg) + 1.0
    on_demand_cost = simulate(storm, 0, cfg, OnDemand()).cost
    assert result.cost <= 1.05 * on_demand_cost  # the few Spot tries the storm took to notice
    # without the rule (and the expected-cost rule, which learns the 5-minute spells as well) the
    # same policy wastes Spot until the slack runs low
    off = simulate(storm, 0, cfg, SlackAware(PolicyParams(storm_tries=0, spot_cost_limit=None)))
    assert off.preemptions > 2 * result.preemptions and off.cost > result.cost
    cost_rule_only = simulate(storm, 0, cfg, SlackAware(PolicyParams(storm_tries=0)))
    assert cost_rule_only.cost <= 1.05 * on_demand_cost
