"""Admission against shared capacity, quotas and budgets, on SQLite and PostgreSQL.

The sample input on a deliberately slow pool holds ~1,850 GPU-seconds per job; the pool shares
2 GPUs, so with a 45-minute deadline two jobs fit and a third, feasible alone, does not.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa

from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import JobState
from airflow_deadline_batch.exceptions import AdmissionRejected
from airflow_deadline_batch.service.planning import PlanRequest, PlanResult, plan_job
from airflow_deadline_batch.store import ManifestStore, TenantQuotaRow
from airflow_deadline_batch.store.schema import jobs
from tests.helpers.commits import commit

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc
SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"
SHARED = PoolSpec(
    name="shared",
    kind=PoolKind.ON_DEMAND,
    gpus=2,
    price_per_gpu_hour=1.0,
    prefill_tokens_per_s=100.0,
    decode_tokens_per_s=1.0,
    startup_seconds=0.0,
)


def _request(
    tmp_path: Path, tenant: str, minutes: float = 45, workers: int = 2, key: str | None = None
) -> PlanRequest:
    return PlanRequest(
        input_uri=str(SAMPLE),
        deadline=dt.datetime.now(UTC) + dt.timedelta(minutes=minutes),
        output_uri=str(tmp_path / "out"),
        pools=(SHARED,),
        workers=workers,
        tenant=tenant,
        idempotency_key=key,
    )


def _rejected(store: ManifestStore, request: PlanRequest) -> AdmissionRejected:
    with pytest.raises(AdmissionRejected) as info:
        plan_job(store, request)
    return info.value


def test_without_capacity_or_quota_every_job_is_judged_alone(store: ManifestStore, tmp_path: Path) -> None:
    for tenant in ("ads", "search", "ads"):
        assert plan_job(store, _request(tmp_path, tenant)).created


def test_the_third_job_on_a_shared_pool_waits_for_the_first_to_finish(
    store: ManifestStore, tmp_path: Path
) -> None:
    store.set_capacity("shared", 2)
    first = plan_job(store, _request(tmp_path, "ads"))
    plan_job(store, _request(tmp_path, "search"))
    third = _request(tmp_path, "ads", key="ads/nightly")
    refused = _rejected(store, third)
    assert "rejected by shared capacity" in refused.message
    assert "the earliest feasible deadline is" in refused.message
    job = store.get_job(str(refused.fields["job_id"]))
    assert job.state is JobState.REJECTED and job.tenant == "ads"
    assert store.list_shards(job.job_id) == []
    assert not (tmp_path / "out" / job.job_id / "validation" / "errors.jsonl").exists()  # garbage gone
    edf = (job.admission or {})["shared"]["edf"]
    earliest = dt.datetime.fromisoformat(edf["earliest_feasible_deadline"])
    assert earliest > third.deadline and edf["gpus_needed"] == 3
    assert edf["explained"]  # searched after the admission lock, recorded on the rejected job
    assert (job.admission or {})["verdict"] == "rejected_shared"

    # the same job with the earliest feasible deadline it was told is admitted
    later = plan_job(
        store, _request(tmp_path, "ads", minutes=(earliest - dt.datetime.now(UTC)).total_seconds() / 60 + 1)
    )
    assert later.created
    store.cancel_job(later.job_id)

    # resubmitted with the same key while the pool is still full: admission runs again, and refuses
    again = _rejected(store, _request(tmp_path, "ads", key="ads/nightly"))
    assert again.fields["job_id"] != job.job_id and "rejected by shared capacity" in again.message

    # the first job completes: it holds nothing any more, and the same request (same key) is admitted
    store.set_job_state(first.job_id, JobState.FINALIZING)
    store.set_job_state(first.job_id, JobState.COMPLETED)
    admitted = plan_job(store, _request(tmp_path, "ads", key="ads/nightly"))
    assert admitted.created and admitted.job_id not in (job.job_id, again.fields["job_id"])
    assert store.get_job(admitted.job_id).idempotency_key == "ads/nightly"
    # the refusals stay as records, their keys marked; the admitted job now holds the key
    assert store.get_job(job.job_id).idempotency_key == f"ads/nightly#rejected-{job.job_id}"
    assert store.get_job(job.job_id).state is JobState.REJECTED
    repeat = plan_job(store, _request(tmp_path, "ads", key="ads/nightly"))
    assert not repeat.created and repeat.job_id == admitted.job_id


def test_a_job_rejected_before_keys_were_released_gives_its_key_up(
    store: ManifestStore, store_url: str, tmp_path: Path
) -> None:
    """A rejected row that still holds its key (recorded by an older version) does not block it."""
    store.set_capacity("shared", 2)
    plan_job(store, _request(tmp_path, "ads"))
    plan_job(store, _request(tmp_path, "search"))
    refused = _rejected(store, _request(tmp_path, "ads", key="k"))
    old_id = str(refused.fields["job_id"])
    engine = sa.create_engine(store_url)
    with engine.begin() as conn:  # as an older version recorded it: the key kept as submitted
        conn.execute(sa.update(jobs).where(jobs.c.job_id == old_id).values(idempotency_key="k"))
    engine.dispose()
    store.set_capacity("shared", 4)
    admitted = plan_job(store, _request(tmp_path, "ads", key="k"))
    assert admitted.created and admitted.job_id != old_id
    assert store.get_job(old_id).idempotency_key == f"k#rejected-{old_id}"
    assert store.get_job_by_idempotency_key("k").job_id == admitted.job_id  # type: ignore[union-attr]


def test_a_tenant_over_its_budget_is_rejected_with_the_numbers(store: ManifestStore, tmp_path: Path) -> None:
    first = plan_job(store, _request(tmp_path, "ads"))
    cost = float(first.report.chosen.cost_units)  # type: ignore[union-attr]
    store.set_quota(TenantQuotaRow(tenant="ads", budget=cost * 1.5, budget_period_s=86400))
    refused = _rejected(store, _request(tmp_path, "ads"))
    assert "rejected by tenant ads's budget" in refused.message
    assert f"{cost:.2f} spent or reserved in the last 1d" in refused.message.replace("24h00m", "1d")
    assert f"above the budget of {cost * 1.5:.2f}" in refused.message
    assert plan_job(store, _request(tmp_path, "search")).created  # other tenants are not charged


def test_a_plan_above_the_tenant_gpu_quota_is_rejected(store: ManifestStore, tmp_path: Path) -> None:
    store.set_quota(TenantQuotaRow(tenant="ads", on_demand_gpus=1))
    refused = _rejected(store, _request(tmp_path, "ads"))
    assert "needs 2 on_demand GPU(s) at once, the quota allows 1" in refused.message
    assert plan_job(store, _request(tmp_path, "ads", workers=1, minutes=90)).created


def test_allowing_an_infeasible_deadline_still_holds_the_quota_and_the_budget(
    store: ManifestStore, tmp_path: Path
) -> None:
    """Bug: ``PlanRequest.allow_infeasible`` skipped the whole shared admission, so a job could
    pass its tenant's GPU quota and budget. It waives the deadline only: full shared capacity
    admits it, the quota and the budget refuse it."""
    store.set_capacity("shared", 2)
    plan_job(store, _request(tmp_path, "search"))
    plan_job(store, _request(tmp_path, "search"))
    waived = replace(_request(tmp_path, "ads", key="ads/full"), allow_infeasible=True)
    assert plan_job(store, waived).created  # the shared pool is full: the deadline test is waived
    store.set_quota(TenantQuotaRow(tenant="ads", on_demand_gpus=1))
    refused = _rejected(store, replace(waived, idempotency_key="ads/quota"))
    assert "needs 2 on_demand GPU(s) at once, the quota allows 1" in refused.message
    store.set_quota(TenantQuotaRow(tenant="ads", budget=0.0, budget_period_s=86400))
    refused = _rejected(store, replace(waived, idempotency_key="ads/budget"))
    assert "budget" in refused.message


def _submit(
    url: str, out: str, tenant: str, barrier: object, results: object, key: str | None = None
) -> None:
    store = ManifestStore(url)
    try:
        request = PlanRequest(
            input_uri=str(SAMPLE),
            deadline=dt.datetime.now(UTC) + dt.timedelta(minutes=45),
            output_uri=out,
            pools=(SHARED,),
            workers=2,
            tenant=tenant,
            idempotency_key=key,
        )
        barrier.wait()  # type: ignore[attr-defined]
        try:
            plan: PlanResult = plan_job(store, request)
            results.put(("admitted", plan.job_id))  # type: ignore[attr-defined]
        except AdmissionRejected as exc:
            results.put(("rejected", str(exc.fields.get("job_id"))))  # type: ignore[attr-defined]
    finally:
        store.close()


RACERS = 5


def race_submissions(
    url: str, out: Path, tenants: list[str], key: str | None = None
) -> list[tuple[str, str]]:
    """Real processes, one per tenant in ``tenants``, submit at once (a barrier); each one's
    verdict (``admitted``/``rejected``) and job, once every process has exited cleanly."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(tenants))
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_submit, args=(url, str(out), tenant, barrier, results, key)) for tenant in tenants
    ]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=240) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * len(tenants)
    return outcomes


def test_concurrent_admissions_never_overcommit_a_pool(store_url: str, tmp_path: Path) -> None:
    """Real processes submit at once; the pool takes two jobs, whoever wins, never three."""
    store = ManifestStore.open(store_url)
    store.set_capacity("shared", 2)
    outcomes = race_submissions(store_url, tmp_path / "out", [f"t{i}" for i in range(RACERS)])
    admitted = [job for verdict, job in outcomes if verdict == "admitted"]
    assert len(admitted) == 2, outcomes
    states = sorted(j.state.value for j in store.list_jobs())
    assert states == ["admitted"] * 2 + ["rejected"] * (RACERS - 2)
    store.close()


def test_concurrent_resubmissions_of_a_rejected_key_make_one_live_job(store_url: str, tmp_path: Path) -> None:
    """After a refusal, real processes resubmit the same key at once: one job is admitted, the rest get it."""
    store = ManifestStore.open(store_url)
    store.set_capacity("shared", 2)
    first = plan_job(store, _request(tmp_path, "ads"))
    plan_job(store, _request(tmp_path, "ads"))
    refused = _rejected(store, _request(tmp_path, "ads", key="retry-me"))
    store.set_job_state(first.job_id, JobState.CANCELLED)  # capacity frees for one more job
    outcomes = race_submissions(store_url, tmp_path / "out", ["ads"] * RACERS, key="retry-me")
    assert {verdict for verdict, _ in outcomes} == {"admitted"}, outcomes
    (live,) = {job for _, job in outcomes}  # every racer got the one job that holds the key
    assert live != refused.fields["job_id"]
    keyed = [j for j in store.list_jobs() if (j.idempotency_key or "").startswith("retry-me")]
    assert sorted(j.state.value for j in keyed) == ["admitted", "rejected"]
    store.close()


def test_held_work_is_rerated_by_the_throughput_its_commits_measured(
    store: ManifestStore, tmp_path: Path
) -> None:
    from airflow_deadline_batch.operators.placement import read_job_view
    from airflow_deadline_batch.service.admission import capacity_view

    store.set_capacity("shared", 2)
    plan = plan_job(store, _request(tmp_path, "ads"))
    until = dt.datetime.now(UTC) + dt.timedelta(hours=1)
    [before] = capacity_view(store.admission_snapshot("ads"), until)
    shards = store.list_shards(plan.job_id)
    lease = store.claim_shard(plan.job_id, 0, ttl_s=60, worker="test", pool="shared")
    # one microbatch that ran ten times slower than the pool's nominal rates
    slow_s = 10 * (shards[0].est_work_s / shards[0].num_microbatches)
    commit(store, lease, 0, prompt_tokens=70, completion_tokens=36, elapsed_s=slow_s, pool="shared")
    view = read_job_view(store, plan.job_id, now=dt.datetime.now(UTC))
    assert view.work_scale > 1.0  # one slow microbatch moves the calibrated rate a step
    [after] = capacity_view(store.admission_snapshot("ads"), until)
    total = sum(s.est_work_s for s in shards)
    left = total - shards[0].est_work_s / shards[0].num_microbatches
    assert after.reserved_gpu_s == pytest.approx(
        before.reserved_gpu_s * left / total * view.work_scale, rel=1e-6
    )


def test_the_plan_task_retried_after_a_shared_refusal_runs_admission_again(tmp_path: Path) -> None:
    """The same task instance's second try (same default key) is admitted once capacity freed."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
    from tests.integration.test_airflow_connections import Run

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(store_url)
    store.set_capacity("shared", 2)
    first = plan_job(store, _request(tmp_path, "ads"))
    plan_job(store, _request(tmp_path, "search"))
    plan = DeadlineBatchOperator(
        task_id="plan",
        input_uri=str(SAMPLE),
        deadline="+45m",
        output_uri=str(tmp_path / "out"),
        store_url=store_url,
        pools=[SHARED],
        workers=2,
        tenant="ads",
    )
    run = Run()
    with pytest.raises(AirflowException) as info:
        plan.execute(run.context("plan"))
    assert not isinstance(info.value, AirflowFailException)  # retryable: capacity may free
    assert "rejected by shared capacity" in str(info.value)
    refused = run.xcoms[("plan", "admission_report")]
    assert refused["verdict"] == "rejected_shared"

    store.set_job_state(first.job_id, JobState.CANCELLED)
    specs = plan.execute(run.context("plan"))  # the retry: same dag, run and task, same key
    job = store.get_job(specs[0]["job_id"])
    assert job.state is JobState.ADMITTED and job.idempotency_key == "connections/manual__2026-01-01/plan"
    assert run.xcoms[("plan", "admission_report")]["verdict"] != "rejected_shared"
    store.close()


def test_a_job_on_two_managed_pools_takes_the_room_left_on_either(
    store: ManifestStore, tmp_path: Path
) -> None:
    """Pool a is full with two jobs; a job that may also use pool b is admitted, one on a alone is not."""
    other = PoolSpec.from_dict({**SHARED.to_dict(), "name": "other"})
    store.set_capacity("shared", 2)
    store.set_capacity("other", 2)
    plan_job(store, _request(tmp_path, "ads"))
    plan_job(store, _request(tmp_path, "search"))
    both = plan_job(store, replace(_request(tmp_path, "ads"), pools=(SHARED, other)))
    edf = store.get_job(both.job_id).admission or {}
    assert both.created and store.get_job(both.job_id).state is JobState.ADMITTED, edf
    refused = _rejected(store, _request(tmp_path, "search"))
    shared = (store.get_job(str(refused.fields["job_id"])).admission or {})["shared"]["edf"]
    assert shared["linked_pools"] == ["other", "shared"] and shared["linked_jobs"] == 3
    assert (
        shared["violated"]["pools"]
        and shared["violated"]["demand_gpu_s"] > shared["violated"]["supply_gpu_s"]
    )


def test_a_full_managed_pool_does_not_refuse_a_job_its_own_unmanaged_pool_can_carry(
    store: ManifestStore, tmp_path: Path
) -> None:
    """Spot is managed and has no GPU left; the job's on-demand pool has no capacity row, so the
    GPUs the job declares there are its own: it is admitted, and a job on the full pool alone is not."""
    spot = PoolSpec.from_dict({**SHARED.to_dict(), "name": "spot", "kind": "spot", "gpus": 2})
    own = PoolSpec.from_dict({**SHARED.to_dict(), "name": "own-on-demand", "gpus": 2})
    store.set_capacity("spot", 0)
    admitted = plan_job(store, replace(_request(tmp_path, "ads"), pools=(spot, own)))
    assert admitted.created and store.get_job(admitted.job_id).state is JobState.ADMITTED

    refused = _rejected(store, replace(_request(tmp_path, "search"), pools=(spot,)))
    assert "rejected by shared capacity" in refused.message
    # its own pool carries a job only as far as its GPUs go: with one GPU of its own, a deadline
    # that its three GPUs would meet is refused on the shared capacity
    small = PoolSpec.from_dict({**own.to_dict(), "gpus": 1})
    tight = replace(_request(tmp_path, "search", minutes=25, workers=3), pools=(spot, small))
    refused = _rejected(store, tight)
    assert "rejected by shared capacity" in refused.message, refused.message


def test_a_held_jobs_own_unmanaged_pool_carries_its_work_so_a_later_job_fits(
    store: ManifestStore, tmp_path: Path
) -> None:
    """Two jobs fill the shared pool when each is reserved there whole; once the first may also run
    on GPUs of its own (an unmanaged pool), its work goes there and a third job on the shared pool
    alone is admitted. The held job's own GPUs serve it only: they never admit a job beyond them."""
    own = PoolSpec.from_dict({**SHARED.to_dict(), "name": "own-on-demand"})
    store.set_capacity("shared", 2)
    first = plan_job(store, _request(tmp_path, "ads"))
    plan_job(store, _request(tmp_path, "search"))
    assert "rejected by shared capacity" in _rejected(store, _request(tmp_path, "ads")).message
    store.cancel_job(first.job_id)

    carried = plan_job(store, replace(_request(tmp_path, "ads"), pools=(SHARED, own)))
    third = plan_job(store, _request(tmp_path, "ads"))
    assert third.created and store.get_job(third.job_id).state is JobState.ADMITTED
    # the shared pool is full now: the held job's own GPUs do not admit a fourth
    refused = _rejected(store, _request(tmp_path, "search"))
    edf = (store.get_job(str(refused.fields["job_id"])).admission or {})["shared"]["edf"]
    assert edf["linked_pools"] == [f"own-on-demand of {carried.job_id}", "shared"]
    assert edf["violated"]["pools"] == ["shared"]
    # what would admit it counts the held job's own GPUs too (searched after the lock, explained())
    assert edf["explained"] and edf["gpus_needed"] == 3
    assert "rejected by shared capacity" in refused.message, refused.message
