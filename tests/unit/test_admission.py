"""core.admission: the earliest-deadline-first test against shared capacity, quotas and budgets."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.admission import (
    Demand,
    SharedPool,
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


def one(gpus: int, lead_s: float = 0.0) -> list[SharedPool]:
    return [SharedPool(name="shared", gpus=gpus, lead_s=lead_s)]


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
    alone = edf_test(demand("j-3", 1, 3000), [], pools=one(2), now=NOW)
    assert alone.feasible
    third = edf_test(demand("j-3", 1, 3000), held, pools=one(2), now=NOW)
    assert not third.feasible
    assert third.violated is not None and third.violated.demand_s == 9000
    # 9000 GPU-s on 2 GPUs: 4500 s of run plus 450 s of reserve
    assert third.earliest_feasible_deadline == NOW + dt.timedelta(seconds=4950)
    assert third.gpus_needed == 3
    [reason] = third.reasons()
    assert "rejected by shared capacity" in reason and "9,000 GPU-seconds" in reason
    assert "earliest feasible deadline is 2026-12-01T01:22:30Z" in reason and "3 shared GPU(s)" in reason
    # once the first job is done, the third fits
    assert edf_test(demand("j-3", 1, 3000), held[1:], pools=one(2), now=NOW).feasible
    # under the admission lock the search for what would work is skipped: the same verdict and cut,
    # no advice (neither a made-up "nothing would admit it"), and it says it was not searched
    quick = edf_test(demand("j-3", 1, 3000), held, pools=one(2), now=NOW, explain=False)
    assert not quick.feasible and quick.violated == third.violated and not quick.explained
    assert quick.earliest_feasible_deadline is None and quick.gpus_needed is None
    [short] = quick.reasons()
    assert reason.startswith(short) and "would admit" not in short and "earliest" not in short
    assert third.explained and third.to_dict()["explained"]


def test_a_new_urgent_job_cannot_take_capacity_an_earlier_job_needs() -> None:
    held = [demand("j-late", 2, 12000)]  # 2 GPUs for 2 h give 13090 GPU-s: little room to spare
    urgent = edf_test(demand("j-urgent", 0.5, 2000), held, pools=one(2), now=NOW)
    assert not urgent.feasible
    assert urgent.violated is not None and urgent.violated.job_id == "j-late"
    # no earlier or equal deadline helps: the held job's deadline breaks, so later than it
    assert urgent.earliest_feasible_deadline is not None
    assert urgent.earliest_feasible_deadline > held[0].deadline


def test_past_deadlines_and_the_job_itself_are_not_held() -> None:
    held = [demand("j-old", -1, 1e9), demand("j-3", 1, 1e9)]
    assert edf_test(demand("j-3", 1, 1000), held, pools=one(1), now=NOW).feasible


def test_no_capacity_admits_nothing_and_names_no_deadline() -> None:
    refused = edf_test(demand("j", 1, 10), [], pools=one(0), now=NOW)
    assert not refused.feasible and refused.earliest_feasible_deadline is None
    assert refused.gpus_needed == 1


def test_lead_time_shortens_every_window() -> None:
    assert edf_test(demand("j", 1, 3000), [], pools=one(1), now=NOW).feasible
    assert not edf_test(demand("j", 1, 3000), [], pools=one(1, 600), now=NOW).feasible


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
    return edf_test(demand("new", new_h, new_w), jobs, pools=one(gpus, 30.0), now=NOW)


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
        if edf_test(candidate, admitted, pools=one(gpus, 30.0), now=NOW).feasible:
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


# -- several managed pools: the exact (flow) condition ---------------------------------------------

NO_RESERVE = AdmissionPolicy(recovery_reserve_fraction=0.0, min_recovery_reserve_s=0.0)


def on(job: str, hours: float, gpu_s: float, *pools: str) -> Demand:
    return Demand(
        job_id=job,
        tenant="a",
        deadline=NOW + dt.timedelta(hours=hours),
        gpu_seconds=gpu_s,
        pools=frozenset(pools),
    )


def test_one_cut_off_per_pool_set_is_not_enough_the_flow_refuses() -> None:
    """X fills pools a and b for the first hour; Y, on a only, then has 9 h of a, not 9.5 h."""
    pools = [SharedPool(name="a", gpus=1), SharedPool(name="b", gpus=1)]
    held = [on("x", 1, 7200, "a", "b")]
    y = on("y", 10, 9.5 * 3600, "a")
    # every (pool set, deadline) sum holds: {a,b} by 10 h 41,400 <= 72,000, {a} by 10 h 34,200 <= 36,000
    result = edf_test(y, held, pools=pools, now=NOW, policy=NO_RESERVE)
    assert not result.feasible
    cut = result.violated
    assert cut is not None and cut.job_id == "y" and cut.pools == ("a", "b")
    assert cut.pool_deadlines == {"a": NOW + dt.timedelta(hours=10), "b": NOW + dt.timedelta(hours=1)}
    assert (cut.demand_s, cut.supply_s) == (pytest.approx(41400), pytest.approx(39600))
    assert result.earliest_feasible_deadline == NOW + dt.timedelta(hours=10.5)
    assert result.gpus_needed == 2
    [reason] = result.reasons()
    assert "due on pools a until 2026-12-01T10:00:00Z, b until 2026-12-01T01:00:00Z" in reason
    # where Y may also use b, it fits
    assert edf_test(on("y", 10, 9.5 * 3600, "a", "b"), held, pools=pools, now=NOW, policy=NO_RESERVE).feasible


def test_pools_not_linked_to_the_new_job_do_not_count() -> None:
    pools = [SharedPool(name="a", gpus=1), SharedPool(name="z", gpus=100)]
    held = [on("z-job", 1, 1e9, "z")]  # an overcommitted pool the new job never touches
    result = edf_test(on("new", 1, 3000, "a"), held, pools=pools, now=NOW)
    assert result.feasible and result.linked_pools == ("a",) and result.linked_jobs == 0


def _brute_fits(jobs: list[Demand], pools: list[SharedPool], policy: AdmissionPolicy) -> bool:
    """Edmonds-Karp on the explicit job -> (pool, interval) network: all work routed?"""
    deadlines = sorted({j.deadline for j in jobs})
    supply = {
        (p.name, k): supply_seconds(p.gpus, (d - NOW).total_seconds() - p.lead_s, policy)
        - (supply_seconds(p.gpus, (deadlines[k - 1] - NOW).total_seconds() - p.lead_s, policy) if k else 0.0)
        for p in pools
        for k, d in enumerate(deadlines)
    }
    cap: dict[tuple[object, object], float] = {}
    for i, j in enumerate(jobs):
        cap["s", ("j", i)] = j.gpu_seconds
        for p in j.pools or {p.name for p in pools}:
            for k, d in enumerate(deadlines):
                if d <= j.deadline:
                    cap[("j", i), ("c", p, k)] = float("inf")
    for (p, k), c in supply.items():
        cap[("c", p, k), "t"] = c
    graph: dict[object, set[object]] = {}
    for a, b in list(cap):
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set()).add(a)
        cap.setdefault((b, a), 0.0)
    flow = 0.0
    while True:
        parent: dict[object, object] = {"s": None}
        queue: list[object] = ["s"]
        for node in queue:
            for nxt in graph.get(node, ()):
                if nxt not in parent and cap[node, nxt] > 1e-9:
                    parent[nxt] = node
                    queue.append(nxt)
        if "t" not in parent:
            break
        path, node = [], "t"
        while parent[node] is not None:
            path.append((parent[node], node))
            node = parent[node]  # type: ignore[assignment]
        amount = min(cap[e] for e in path)
        for a, b in path:
            cap[a, b] -= amount
            cap[b, a] += amount
        flow += amount
    return flow >= sum(j.gpu_seconds for j in jobs) - 1e-6


POOL_NAMES = ("a", "b", "c")
pool_sets = st.sets(st.sampled_from(POOL_NAMES), min_size=1, max_size=3).map(frozenset)
#: whole GPU-seconds: the float tolerances (a millionth of a GPU-second) are not what is compared
whole_works = st.integers(min_value=0, max_value=30_000).map(float)
jobs_on_pools = st.lists(st.tuples(st.integers(min_value=1, max_value=8), whole_works, pool_sets), max_size=4)
shared_pools = st.tuples(
    st.integers(min_value=0, max_value=3),
    st.integers(min_value=0, max_value=3),
    st.integers(min_value=0, max_value=3),
)


@settings(max_examples=300, deadline=None)
@given(
    jobs_on_pools,
    st.integers(min_value=1, max_value=8),
    whole_works,
    pool_sets,
    shared_pools,
)
def test_several_pools_agree_with_a_brute_force_max_flow(
    held_spec: list[tuple[int, float, frozenset[str]]],
    new_h: int,
    new_w: float,
    new_pools: frozenset[str],
    gpus: tuple[int, int, int],
) -> None:
    pools = [
        SharedPool(name=n, gpus=g, lead_s=60.0 * i)
        for i, (n, g) in enumerate(zip(POOL_NAMES, gpus, strict=True))
    ]
    held = [on(f"h{i}", h / 2, w, *ps) for i, (h, w, ps) in enumerate(held_spec)]
    assume(_brute_fits(held, pools, POLICY))  # the admitted work can be done: admission kept it so
    new = on("new", new_h / 2, new_w, *new_pools)
    result = edf_test(new, held, pools=pools, now=NOW)
    assert result.feasible == _brute_fits([*held, new], pools, POLICY)
    if result.feasible:
        return
    cut = result.violated
    assert cut is not None and cut.demand_s > cut.supply_s
    if result.earliest_feasible_deadline is not None:
        later = replace(new, deadline=result.earliest_feasible_deadline)
        assert _brute_fits([*held, later], pools, POLICY)
        sooner = replace(new, deadline=result.earliest_feasible_deadline - dt.timedelta(seconds=2))
        assert sooner.deadline <= new.deadline or not _brute_fits([*held, sooner], pools, POLICY)
    if result.gpus_needed is not None:
        mine = [p for p in pools if p.name in new_pools]
        slowest = max(mine, key=lambda p: (p.lead_s, p.name))
        extra = result.gpus_needed - sum(p.gpus for p in mine)
        assert extra >= 1
        grown = [replace(p, gpus=p.gpus + extra) if p is slowest else p for p in pools]
        assert _brute_fits([*held, new], grown, POLICY)
        fewer = [replace(p, gpus=p.gpus + extra - 1) if p is slowest else p for p in pools]
        assert not _brute_fits([*held, new], fewer, POLICY)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(deadlines, whole_works), max_size=6), deadlines, whole_works, st.integers(0, 8))
def test_on_one_pool_it_is_the_earliest_deadline_first_prefix_test(
    held: list[tuple[float, float]], new_h: float, new_w: float, gpus: int
) -> None:
    """W(d)/C + reserve(W(d)/C) <= d - now - lead for every deadline d from the new job's on."""
    jobs = [demand(f"h{i}", h, w) for i, (h, w) in enumerate(held)]
    new = demand("new", new_h, new_w)

    def prefix_ok(work: list[Demand], since: dt.datetime) -> bool:
        for d in {j.deadline for j in work if j.deadline >= since}:
            due = sum(j.gpu_seconds for j in work if j.deadline <= d)
            if due > supply_seconds(gpus, (d - NOW).total_seconds() - 30.0, POLICY) + 1e-6:
                return False
        return True

    assume(prefix_ok(jobs, NOW))
    result = edf_test(new, jobs, pools=one(gpus, 30.0), now=NOW)
    assert result.feasible == prefix_ok([*jobs, new], new.deadline)
