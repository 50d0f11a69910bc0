"""The tail race: the decision rule (core.placement.should_speculate) and the simulator's accounting."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from airflow_deadline_batch.core.placement import PolicyParams, race_gain, should_speculate
from airflow_deadline_batch.sim import traces
from airflow_deadline_batch.sim.engine import Choice, Mode, SimConfig, Speculate, View, simulate
from airflow_deadline_batch.sim.policies import SlackAware, pool_priors, slack_aware_at


def test_race_gain_matches_a_monte_carlo_of_the_race() -> None:
    rng = random.Random(3)
    r, price, run, dup, dup_price = 600.0, 1.0, 1800.0, 1500.0, 3.0
    samples = []
    for _ in range(200_000):
        preempted_at = rng.expovariate(1 / run)
        if preempted_at >= r:  # the running try wins: both paid until it commits
            samples.append(dup_price * dup - (price + dup_price) * r)
        else:  # preempted: the duplicate runs to its end
            samples.append(dup_price * dup - (price * preempted_at + dup_price * dup))
    gain = race_gain(remaining_s=r, price=price, mean_run_s=run, duplicate_s=dup, duplicate_price=dup_price)
    assert gain == pytest.approx(sum(samples) / len(samples), rel=0.02)


def test_race_only_when_the_running_try_can_win_and_is_worth_keeping() -> None:
    race = {"price": 1.0, "duplicate_s": 1200.0, "duplicate_price": 3.0}
    assert should_speculate(remaining_s=300.0, mean_run_s=3600.0, **race)
    assert not should_speculate(remaining_s=1200.0, mean_run_s=None, **race)  # cannot finish first
    assert not should_speculate(remaining_s=300.0, mean_run_s=30.0, **race)  # almost surely preempted
    assert not should_speculate(remaining_s=300.0, mean_run_s=0.0, **race)
    with pytest.raises(ValueError, match=">= 0"):
        race_gain(remaining_s=-1.0, price=1.0, mean_run_s=None, duplicate_s=1.0, duplicate_price=1.0)


class Scripted:
    """Slot 0 on Spot from the start; at tick 1 slot 1 races it on on-demand."""

    name = "scripted"

    def reset(self, config: SimConfig, gap_h: float) -> None:
        pass

    def decide(self, view: View) -> Sequence[Choice]:
        if view.tick == 0:
            return [Mode.SPOT, Mode.NONE]
        second = Speculate(0, Mode.ON_DEMAND) if view.tick == 1 else Mode.NONE
        first = Mode.SPOT if view.slots[0].mode is Mode.SPOT else Mode.NONE
        return [first, second if view.slots[1].mode is Mode.NONE else Mode.ON_DEMAND]


CFG = SimConfig(work_h=1.0, deadline_h=10.0, workers=2, changeover_h=0.25, shard_h=1.0, price_ratio=3.0)


def test_the_first_try_to_commit_wins_and_both_are_billed() -> None:
    trace = traces.constant(1, 20.0, gap_s=900.0)
    result = simulate(trace, 0, CFG, Scripted())
    # Spot commits at 1.25 h (changeover + shard); the duplicate started at 0.25 h is cancelled
    assert result.finish_h == pytest.approx(1.25)
    assert (result.races, result.races_won_by_original) == (1, 1)
    assert result.race_loser_cost == pytest.approx(3.0 * 1.0)
    assert result.cost == pytest.approx(1.25 + 3.0)
    assert result.work_done_h == pytest.approx(1.0) and result.starts == 2


def test_a_preempted_original_leaves_the_shard_to_its_duplicate() -> None:
    trace = traces.from_segments([(0.5, 1), (20.0, 0)], gap_s=900.0)
    result = simulate(trace, 0, CFG, Scripted())
    # Spot is gone at 0.5 h; the duplicate (0.25 h + 0.25 h changeover + 1 h) wins alone
    assert result.finish_h == pytest.approx(1.5)
    assert (result.races, result.races_won_by_original, result.preemptions) == (1, 0, 1)
    assert result.starts == 2  # the shard never went back to the queue
    assert result.cost == pytest.approx(0.5 + 3.0 * 1.25)


def test_slack_aware_races_in_the_tail_for_less_and_in_time() -> None:
    """The synthetic tuning case where the race shows (gang4-602, start 197, ``N = 4``)."""
    trace = traces.multi_gpu_suite(600, capacity=4)
    gang = next(t for t in trace if t.name == "gang4-602")
    cfg = SimConfig(work_h=32, deadline_h=10, workers=4, changeover_h=0.1)
    raced = simulate(gang, 197, cfg, SlackAware())
    plain = simulate(gang, 197, cfg, SlackAware(PolicyParams(race_tail=False)))
    assert raced.races > 0 and not raced.missed
    assert raced.cost < plain.cost and raced.finish_h <= plain.finish_h


def test_persisted_priors_read_only_the_capacity_before_the_start() -> None:
    past_dry = traces.from_segments([(48.0, 0), (48.0, 4)], gap_s=600.0)
    future_dry = traces.from_segments([(48.0, 0), (48.0, 0)], gap_s=600.0)
    start = 48 * 6
    (dry,) = pool_priors([past_dry], start, workers=4)
    assert pool_priors([future_dry], start, workers=4) == (dry,)  # the future is not read
    assert dry.value < 0.1 < PolicyParams().availability_prior
    (fresh,) = pool_priors([past_dry], 0, workers=4)  # nothing before the trace's first tick
    assert fresh.value == PolicyParams().availability_prior
    policy = slack_aware_at([past_dry], start, 4)
    assert policy.priors == (dry,)
