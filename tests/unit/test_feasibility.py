"""Admission and slack (docs/design.md §5), including the seed's worked example."""

from __future__ import annotations

import datetime as dt
import math

import orjson
import pytest

from airflow_deadline_batch.core.estimate import WorkSummary
from airflow_deadline_batch.core.feasibility import (
    AdmissionPolicy,
    AdmissionReport,
    Verdict,
    assess,
    format_duration,
    work_seconds_on,
)
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.exceptions import AdmissionRejected, ConfigurationError

NOW = dt.datetime(2026, 3, 1, 0, 0, tzinfo=dt.timezone.utc)
MIN = 60.0

# The seed's example: 12,000 documents x 2 GPU-seconds, 4 GPUs at 80 % efficiency, a 15-minute
# recovery reserve (max(15 min, 10 % of 125 min)), a deadline 150 minutes away.
SEED_WORK = WorkSummary(
    records=12_000, invalid=0, lines=12_000, prompt_tokens=0, output_tokens=0, gpu_seconds=24_000.0
)
SEED_POLICY = AdmissionPolicy(efficiency=0.8, min_recovery_reserve_s=15 * MIN, recovery_reserve_fraction=0.1)
DEADLINE = NOW + dt.timedelta(minutes=150)


def spot(queue_s: float = 0.0, gpus: int = 4, rate: float = 0.0, **kw: object) -> PoolSpec:
    return PoolSpec(
        name="spot",
        kind=PoolKind.SPOT,
        gpus=gpus,
        startup_seconds=0.0,
        queue_wait_seconds=queue_s,
        preemptions_per_hour=rate,
        price_per_gpu_hour=1.0,
        **kw,
    )  # type: ignore[arg-type]


def on_demand(queue_s: float = 0.0, gpus: int = 4) -> PoolSpec:
    return PoolSpec(
        name="od",
        kind=PoolKind.ON_DEMAND,
        gpus=gpus,
        startup_seconds=0.0,
        queue_wait_seconds=queue_s,
        price_per_gpu_hour=3.0,
    )


def check(pools: list[PoolSpec], **kw: object) -> AdmissionReport:
    """Assess the seed's work against ``pools`` with the seed's policy unless told otherwise."""
    kw.setdefault("policy", SEED_POLICY)
    return assess(SEED_WORK, pools, deadline=DEADLINE, now=NOW, **kw)  # type: ignore[arg-type]


def test_seed_example_has_ten_minutes_of_slack() -> None:
    report = assess(SEED_WORK, [spot()], deadline=DEADLINE, now=NOW, policy=SEED_POLICY)
    assert report.verdict is Verdict.FEASIBLE and report.feasible
    assert report.chosen is not None and report.chosen.name == "spot"
    assert report.chosen.run_seconds == pytest.approx(125 * MIN)
    assert report.chosen.reserve_seconds == pytest.approx(15 * MIN)
    assert report.slack_seconds == pytest.approx(10 * MIN)
    assert report.predicted_finish == NOW + dt.timedelta(minutes=125)


def test_seed_example_with_twenty_minutes_of_queue_wait_is_infeasible() -> None:
    report = assess(SEED_WORK, [spot(queue_s=20 * MIN)], deadline=DEADLINE, now=NOW, policy=SEED_POLICY)
    assert report.verdict is Verdict.INFEASIBLE and not report.feasible
    assert report.chosen is None
    assert report.slack_seconds == pytest.approx(-10 * MIN)
    text = report.summary()
    assert "slack -10m00s" in text
    # 130 min left after queueing; run + max(15 min, 10 %) must fit: run <= 115 min
    # -> 24000 / (0.8 * 6900 s) = 4.35 -> 5 GPUs
    assert "plan spot would need about 5 GPUs instead of 4" in text
    with pytest.raises(AdmissionRejected) as info:
        report.raise_if_not_feasible()
    assert info.value.report is report  # type: ignore[attr-defined]
    assert info.value.exit_code == 3


def test_seed_example_escalates_to_on_demand_when_spot_queues() -> None:
    report = assess(
        SEED_WORK, [spot(queue_s=20 * MIN), on_demand()], deadline=DEADLINE, now=NOW, policy=SEED_POLICY
    )
    assert report.verdict is Verdict.FEASIBLE_WITH_ON_DEMAND
    assert [o.name for o in report.options] == ["spot", "spot+on_demand", "on_demand"]
    assert [o.feasible for o in report.options] == [False, True, True]
    # 8 GPUs for half as long cost less than 4 on-demand GPUs for the whole run
    assert report.chosen is not None and report.chosen.name == "spot+on_demand"
    assert report.chosen.cost_units == pytest.approx((4 * 1.0 + 4 * 3.0) * 62.5 / 60)
    assert report.options[2].cost_units == pytest.approx(4 * 3.0 * 125 / 60)
    # the mixed plan waits for the slower pool's queue: 150 - 20 - 62.5 - 15 minutes
    assert report.slack_seconds == pytest.approx(52.5 * MIN)
    assert "Spot alone would miss the deadline" in report.summary()


def test_cheapest_feasible_plan_wins() -> None:
    report = assess(SEED_WORK, [spot(), on_demand()], deadline=DEADLINE, now=NOW, policy=SEED_POLICY)
    assert report.verdict is Verdict.FEASIBLE
    assert report.chosen is not None and report.chosen.name == "spot"
    spot_cost = 4 * 1.0 * 125 / 60
    assert report.chosen.cost_units == pytest.approx(spot_cost)


def test_mixed_plan_when_neither_alone_suffices() -> None:
    report = check([spot(gpus=2), on_demand(gpus=2)])
    assert report.verdict is Verdict.FEASIBLE_WITH_ON_DEMAND
    assert report.chosen is not None and report.chosen.name == "spot+on_demand" and report.chosen.gpus == 4


def test_on_demand_forbidden_by_policy() -> None:
    policy = AdmissionPolicy(efficiency=0.8, min_recovery_reserve_s=15 * MIN, allow_on_demand=False)
    report = check([spot(queue_s=20 * MIN), on_demand()], policy=policy)
    assert report.verdict is Verdict.INFEASIBLE
    assert [o.name for o in report.options] == ["spot"]
    assert "allow_on_demand=True" in report.summary()
    only_od = assess(SEED_WORK, [on_demand()], deadline=DEADLINE, now=NOW, policy=policy)
    assert only_od.verdict is Verdict.INFEASIBLE and "forbids on-demand" in only_od.summary()


def test_preemptions_cost_slack_on_spot() -> None:
    calm = assess(SEED_WORK, [spot()], deadline=DEADLINE, now=NOW, policy=SEED_POLICY, shard_seconds=600)
    stormy_pool = PoolSpec(
        name="spot", kind=PoolKind.SPOT, gpus=4, startup_seconds=60.0, preemptions_per_hour=2.0
    )
    stormy = check([stormy_pool], shard_seconds=600)
    assert stormy.chosen is None or stormy.slack_seconds < calm.slack_seconds
    option = stormy.options[0]
    # each GPU loses 2/h x (60 s + 300 s) = 720 s an hour: a fifth of its time
    assert option.run_seconds == pytest.approx(125 * MIN / 0.8)
    assert option.preemption_overhead_seconds == pytest.approx(125 * MIN / 0.8 - 125 * MIN)
    assert stormy.verdict is Verdict.INFEASIBLE


def test_preemptions_that_eat_all_the_time_never_finish() -> None:
    pool = PoolSpec(
        name="spot", kind=PoolKind.SPOT, gpus=4, startup_seconds=1000.0, preemptions_per_hour=10.0
    )
    report = assess(SEED_WORK, [pool], deadline=DEADLINE, now=NOW, policy=SEED_POLICY)
    assert report.verdict is Verdict.INFEASIBLE
    assert report.options[0].predicted_finish is None
    assert math.isinf(report.slack_seconds)
    assert "never finish" in report.summary()
    assert orjson.loads(orjson.dumps(report.to_dict()))["slack_seconds"] is None


def test_deadline_already_passed() -> None:
    report = assess(SEED_WORK, [spot()], deadline=NOW - dt.timedelta(minutes=5), now=NOW, policy=SEED_POLICY)
    assert report.verdict is Verdict.INFEASIBLE
    assert "the deadline passed 5m00s ago" in report.summary()


def test_queue_longer_than_time_left_cannot_be_fixed_with_gpus() -> None:
    report = assess(SEED_WORK, [spot(queue_s=200 * MIN)], deadline=DEADLINE, now=NOW, policy=SEED_POLICY)
    assert "cannot meet the deadline with any number of GPUs" in report.summary()


def test_max_parallel_caps_gpus() -> None:
    report = assess(SEED_WORK, [spot(gpus=8)], deadline=DEADLINE, now=NOW, policy=SEED_POLICY, max_parallel=4)
    assert report.options[0].gpus == 4
    assert report.slack_seconds == pytest.approx(10 * MIN)
    capped = assess(SEED_WORK, [spot(gpus=8)], deadline=DEADLINE, now=NOW, policy=SEED_POLICY, max_parallel=2)
    assert "above max_parallel=2" in capped.summary()


def test_too_many_invalid_records_are_rejected() -> None:
    work = WorkSummary(records=80, invalid=20, lines=100, prompt_tokens=0, output_tokens=0, gpu_seconds=10.0)
    report = assess(work, [spot()], deadline=DEADLINE, now=NOW)
    assert report.verdict is Verdict.REJECTED_INVALID and not report.feasible
    assert report.chosen is None
    assert "20 of 100 lines are invalid (20.0%)" in report.summary()
    lenient_policy = AdmissionPolicy(max_invalid_fraction=0.2)
    lenient = assess(work, [spot()], deadline=DEADLINE, now=NOW, policy=lenient_policy)
    assert lenient.verdict is Verdict.FEASIBLE


def test_tokens_are_priced_at_each_pools_rates() -> None:
    work = WorkSummary(
        records=10, invalid=0, lines=10, prompt_tokens=20_000, output_tokens=3_000, gpu_seconds=0.0
    )
    fast = PoolSpec(name="fast", kind=PoolKind.SPOT, prefill_tokens_per_s=10_000, decode_tokens_per_s=1_000)
    assert work_seconds_on(work, fast) == pytest.approx(2 + 3)
    assert work_seconds_on(work, fast, per_record_overhead_s=0.5) == pytest.approx(2 + 3 + 5)


def test_empty_job_is_feasible() -> None:
    work = WorkSummary(records=0, invalid=0, lines=0, prompt_tokens=0, output_tokens=0, gpu_seconds=0.0)
    report = assess(work, [spot()], deadline=DEADLINE, now=NOW)
    assert report.verdict is Verdict.FEASIBLE
    assert report.slack_seconds == pytest.approx(150 * MIN - 60)


def test_report_to_dict_is_json_and_summary_is_readable() -> None:
    report = assess(SEED_WORK, [spot(), on_demand()], deadline=DEADLINE, now=NOW, policy=SEED_POLICY)
    data = orjson.loads(orjson.dumps(report.to_dict()))
    assert data["verdict"] == "feasible"
    assert data["predicted_finish"] == "2026-03-01T02:05:00Z"
    assert data["deadline"] == "2026-03-01T02:30:00Z"
    assert data["chosen"]["name"] == "spot" and len(data["options"]) == 3
    assert data["work"]["gpu_seconds"] == 24_000.0
    lines = report.summary().splitlines()
    assert lines[0] == "admission: feasible (plan spot, slack +10m00s)"
    assert any("12,000 valid records" in line for line in lines)
    assert any("finish at 2026-03-01T02:05:00Z" in line for line in lines)


def test_naive_datetimes_and_bad_config_are_refused() -> None:
    with pytest.raises(ValueError, match="deadline must be timezone-aware"):
        assess(SEED_WORK, [spot()], deadline=dt.datetime(2026, 3, 1, 3), now=NOW)
    with pytest.raises(ConfigurationError, match="no GPU pools"):
        assess(SEED_WORK, [], deadline=DEADLINE, now=NOW)
    with pytest.raises(ConfigurationError, match="max_parallel"):
        assess(SEED_WORK, [spot()], deadline=DEADLINE, now=NOW, max_parallel=0)
    with pytest.raises(ValueError, match="efficiency"):
        AdmissionPolicy(efficiency=0)


def test_format_duration() -> None:
    assert format_duration(45) == "45s"
    assert format_duration(600) == "10m00s"
    assert format_duration(7500) == "2h05m"
    assert format_duration(-600, signed=True) == "-10m00s"
    assert format_duration(600, signed=True) == "+10m00s"
    assert format_duration(math.inf) == "inf"
