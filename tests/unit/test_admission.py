"""core.admission: the earliest-deadline-first test against shared capacity, quotas and budgets."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.admission import (
    Demand,
    budget_refusal,
    edf_test,
    gpu_quota_refusals,
    projected_cost,
    reserved_gpu_seconds,
    supply_seconds,
    window_needed_s,
)
from airflow_deadline_batch.core.feasibility import AdmissionPolicy

UTC = dt.timezone.utc
NOW = dt.datetime(2026, 12, 1, 0, 0, tzinfo=UTC)
POLICY = AdmissionPolicy()  # reserve: max(60 s, 10 % of the run)


def demand(job: str, hours: float, gpu_s: float, tenant: str = "a") -> Demand:
    return Demand(job_id=job, tenant=tenant, deadline=NOW + dt.timedelta(hours=hours), gpu_seconds=gpu_s)


def test_supply_keeps_the_recovery_reserve() -> None:
    assert supply_seconds(2, 3600, POLICY) == pytest.approx(2 * 3600 / 1.1)
    assert supply_seconds(2, 100, POLICY) == pytest.approx(2 * 40)  # the 60 s minimum reserve
    assert supply_seconds(2, 30, POLICY) == 0
    assert window_needed_s(supply_seconds(3, 5000, POLICY), 3, POLICY) == pytest.approx(5000)


def test_three_jobs_on_one_pool_the_third_is_refused_with_what_would_work() -> None:
    # 2 GPUs for an hour give 6545 GPU-seconds after the reserve; two jobs hold 3000 each
    held = [demand("j-1", 1, 3000, "ads"), demand("j-2", 1, 3000, "search")]
    alone = edf_test(demand("j-3", 1, 3000), [], gpus=2, now=NOW)
    assert alone.feasible
    third = edf_test(demand("j-3", 1, 3000), held, gpus=2, now=NOW)
    assert not third.feasible
    assert third.violated is not None and third.violated.demand_s == 9000
    # 9000 GPU-s on 2 GPUs: 4500 s of run plus 450 s of reserve
    assert third.earliest_feasible_deadline == NOW + dt.timedelta(seconds=4950)
    assert third.gpus_needed == 3
    [reason] = third.reasons()
    assert "rejected by shared capacity" in reason and "9,000 GPU-seconds" in reason
    assert "earliest feasible deadline is 2026-12-01T01:22:30Z" in reason and "3 shared GPU(s)" in reason
    # once the first job is done, the third fits
    assert edf_test(demand("j-3", 1, 3000), held[1:], gpus=2, now=NOW).feasible


def test_a_new_urgent_job_cannot_take_capacity_an_earlier_job_needs() -> None:
    held = [demand("j-late", 2, 12000)]  # 2 GPUs for 2 h give 13090 GPU-s: little room to spare
    urgent = edf_test(demand("j-urgent", 0.5, 2000), held, gpus=2, now=NOW)
    assert not urgent.feasible
    assert urgent.violated is not None and urgent.violated.job_id == "j-late"
    # no earlier or equal deadline helps: the held job's deadline breaks, so later than it
    assert urgent.earliest_feasible_deadline is not None
    assert urgent.earliest_feasible_deadline > held[0].deadline


def test_past_deadlines_and_the_job_itself_are_not_held() -> None:
    held = [demand("j-old", -1, 1e9), demand("j-3", 1, 1e9)]
    assert edf_test(demand("j-3", 1, 1000), held, gpus=1, now=NOW).feasible


def test_no_capacity_admits_nothing_and_names_no_deadline() -> None:
    refused = edf_test(demand("j", 1, 10), [], gpus=0, now=NOW)
    assert not refused.feasible and refused.earliest_feasible_deadline is None
    assert refused.gpus_needed == 1


def test_lead_time_shortens_every_window() -> None:
    assert edf_test(demand("j", 1, 3000), [], gpus=1, now=NOW).feasible
    assert not edf_test(demand("j", 1, 3000), [], gpus=1, now=NOW, lead_s=600).feasible


def test_reserved_work_scales_the_plan_by_the_work_left() -> None:
    admission = {"chosen": {"run_seconds": 1000.0, "gpus": 4, "cost_units": 2.5}}
    assert reserved_gpu_seconds(admission, 800.0, 200.0, POLICY) == pytest.approx(1000.0)
    assert reserved_gpu_seconds(None, 800.0, 400.0, POLICY) == pytest.approx(500.0)
    assert projected_cost(admission) == 2.5 and projected_cost({"chosen": None}) == 0.0


def test_budget_and_quota_refusals_carry_the_numbers() -> None:
    assert budget_refusal("ads", 3.0, [4.0, 2.0], 10.0, 86400) is None
    refusal = budget_refusal("ads", 5.0, [4.0, 2.0], 10.0, 86400)
    assert (
        refusal is not None
        and "6.00 spent or reserved" in refusal
        and "11.00, above the budget of 10.00" in refusal
    )
    assert budget_refusal("ads", 1e9, [], None, None) is None
    [quota] = gpu_quota_refusals("ads", {"spot": 4, "on_demand": 1}, {"spot": 2, "on_demand": None})
    assert "needs 4 spot GPU(s) at once, the quota allows 2" in quota


deadlines = st.floats(min_value=0.05, max_value=12.0)
works = st.floats(min_value=0.0, max_value=50_000.0)
helds = st.lists(st.tuples(deadlines, works), max_size=6)


def _run(new_h: float, new_w: float, held: list[tuple[float, float]], gpus: int):  # type: ignore[no-untyped-def]
    jobs = [demand(f"h{i}", h, w) for i, (h, w) in enumerate(held)]
    return edf_test(demand("new", new_h, new_w), jobs, gpus=gpus, now=NOW, lead_s=30.0)


@settings(max_examples=300, deadline=None)
@given(deadlines, works, helds, st.integers(min_value=0, max_value=8))
def test_a_refusal_names_a_deadline_and_a_capacity_that_work(
    new_h: float, new_w: float, held: list[tuple[float, float]], gpus: int
) -> None:
    result = _run(new_h, new_w, held, gpus)
    if result.feasible:
        # more capacity never turns an admission into a refusal
        assert _run(new_h, new_w, held, gpus + 1).feasible
        return
    if result.gpus_needed is not None:
        assert result.gpus_needed > gpus
        assert _run(new_h, new_w, held, result.gpus_needed).feasible
        assert not _run(new_h, new_w, held, result.gpus_needed - 1).feasible
    earliest = result.earliest_feasible_deadline
    if earliest is not None:
        hours = (earliest - NOW).total_seconds() / 3600
        assert _run(hours, new_w, held, gpus).feasible
        sooner = hours - 2 / 3600
        assume(sooner > (new_h if new_h < hours else 0))
        assert not _run(sooner, new_w, held, gpus).feasible


@settings(max_examples=200, deadline=None)
@given(helds, st.integers(min_value=1, max_value=8))
def test_admitted_work_meets_every_deadline_under_edf(held: list[tuple[float, float]], gpus: int) -> None:
    """Admit jobs one by one; a fluid EDF schedule of the admitted ones then meets every deadline."""
    admitted: list[Demand] = []
    for i, (h, w) in enumerate(held):
        candidate = demand(f"j{i}", h, w)
        if edf_test(candidate, admitted, gpus=gpus, now=NOW, lead_s=30.0).feasible:
            admitted.append(candidate)
    done = 0.0
    for job in sorted(admitted, key=lambda d: d.deadline):
        done += job.gpu_seconds
        run = done / gpus
        finish = 30.0 + run + max(POLICY.min_recovery_reserve_s, POLICY.recovery_reserve_fraction * run)
        assert finish <= (job.deadline - NOW).total_seconds() + 1e-3


def test_measured_slowdown_scales_the_reservation() -> None:
    admission = {"chosen": {"run_seconds": 1000.0, "gpus": 4}}
    assert reserved_gpu_seconds(admission, 800.0, 400.0, POLICY, 1.5) == pytest.approx(3000.0)
    assert reserved_gpu_seconds(admission, 800.0, 400.0, POLICY, float("nan")) == pytest.approx(2000.0)
