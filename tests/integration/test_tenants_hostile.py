"""A hostile tenant: budgets reaching back past the calendar, cancelled jobs, absurd limits, a huge ledger."""

from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import math
import tracemalloc
from pathlib import Path

import orjson
import pytest
import sqlalchemy as sa

from airflow_deadline_batch.cli import main
from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.service.planning import plan_job
from airflow_deadline_batch.store import ManifestStore, TenantQuotaRow
from airflow_deadline_batch.store.schema import jobs, usage
from tests.integration.test_shared_admission import RACERS, SHARED, _rejected, _request, race_submissions

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc


def test_a_budget_period_longer_than_the_calendar_counts_every_job(
    store: ManifestStore, tmp_path: Path
) -> None:
    """`quota set --period +1000000d` is accepted; admission used to raise OverflowError for every job."""
    first = plan_job(store, _request(tmp_path, "ads"))
    cost = float(first.report.chosen.cost_units)  # type: ignore[union-attr]
    store.set_quota(TenantQuotaRow(tenant="ads", budget=cost * 2.5, budget_period_s=1e6 * 86400))
    assert plan_job(store, _request(tmp_path, "ads")).created
    refused = _rejected(store, _request(tmp_path, "ads"))
    assert f"{2 * cost:.2f} spent or reserved" in refused.message


def test_a_job_cancelled_before_it_ran_charges_nothing_to_the_budget(
    store: ManifestStore, tmp_path: Path
) -> None:
    """Finalized without an attempt, it has no ledger row: it was charged its projected cost until the
    period rolled, so the tenant could not resubmit the job it had just cancelled."""
    first = plan_job(store, _request(tmp_path, "ads"))
    cost = float(first.report.chosen.cost_units)  # type: ignore[union-attr]
    store.set_quota(TenantQuotaRow(tenant="ads", budget=cost * 1.5, budget_period_s=86400))
    store.cancel_job(first.job_id)
    finalize_job(store, first.job_id)
    assert store.job_usage(first.job_id) == []
    second = plan_job(store, _request(tmp_path, "ads"))
    assert second.created
    # the admitted job still holds its projected cost: a third does not fit
    refused = _rejected(store, _request(tmp_path, "ads"))
    assert f"{cost:.2f} spent or reserved" in refused.message


@pytest.mark.parametrize("price", [math.nan, math.inf])
def test_a_pool_price_that_is_no_amount_is_refused(tmp_path: Path, price: float) -> None:
    """A NaN price (pools given in Python, as to the Airflow operator) made the projected cost NaN,
    which passed any budget (it read as 0), and the ledger settled its cost as NaN; PostgreSQL's JSON
    refused the job's config with a raw DataError. The pool is refused when it is built, and the
    budget refuses a cost that is no amount whatever made it so."""
    with pytest.raises(ValueError, match=f"price_per_gpu_hour must be a finite number >= 0, got {price}"):
        dataclasses.replace(SHARED, price_per_gpu_hour=price)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    store.set_quota(TenantQuotaRow(tenant="ads", budget=0.01, budget_period_s=86400))
    request = _request(tmp_path, "ads")
    unpriced = dataclasses.replace(SHARED, price_per_gpu_hour=0.0)
    object.__setattr__(unpriced, "price_per_gpu_hour", price)  # past the check, as an older pool row
    refused = _rejected(store, dataclasses.replace(request, pools=(unpriced,)))
    assert f"this job's projected cost is {price}, not an amount" in refused.message
    free = dataclasses.replace(request, pools=(dataclasses.replace(SHARED, price_per_gpu_hour=0.0),))
    assert plan_job(store, free).created  # the budget still admits what it can price
    store.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["quota", "set", "ads", "--budget", "9", "--period", "+99999999999d"],
            "--period +99999999999d: too",
        ),
        (["quota", "set", "ads", "--spot-gpus", "99999999999"], "spot_gpus must be <= 2147483647"),
        (["quota", "set", "ads", "--on-demand-gpus", "1" + "0" * 30], "on_demand_gpus must be <= 2147483647"),
        (["capacity", "list", "--until", "+99999999999d"], "--until +99999999999d: beyond the calendar"),
        (["usage", "--since", "1000000d"], "--since 1000000d: reaches back before the calendar"),
        (["usage", "--since", "99999999999d"], "leave --since out for everything"),
        (["quota", "delete", "ADS"], "tenant 'ADS' is not a valid name"),
        # an unset shell variable ("$TEAM") set the budget of the default tenant, every untagged job's
        # (the command's check of every empty value, before the tenant's own)
        (["quota", "set", "", "--budget", "5"], "TENANT is empty: give a value"),
        (["quota", "delete", " "], "TENANT is empty: give a value"),
        (["usage", "--tenant", ""], "--tenant is empty: give a value, or leave --tenant out for its default"),
    ],
)
def test_values_beyond_the_calendar_or_the_columns_and_empty_names_are_refused_in_one_line(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    ManifestStore.open(url).close()
    assert main([*args, "--store", url]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_capacity_refuses_a_pool_name_longer_than_its_column(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite stored it; PostgreSQL refused it as an unreachable store ("check the --store URL")."""
    ManifestStore.open(store_url).close()
    assert main(["capacity", "set", "p" * 129, "--gpus", "2", "--store", store_url]) == 2
    err = capsys.readouterr().err
    assert "pool name must be at most 128 characters, got 129" in err and "--store" not in err
    assert main(["capacity", "set", "p" * 128, "--gpus", "2", "--store", store_url]) == 0


def test_quota_delete_removes_the_quota_set_under_the_same_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`quota set " ads"` stores ads; `quota delete " ads"` said "had no quota" and left it in force."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    assert main(["quota", "set", " ads", "--spot-gpus", "1", "--store", url]) == 0
    assert main(["quota", "delete", " ads", "--store", url]) == 0
    assert "tenant ads: quota removed" in capsys.readouterr().out
    store = ManifestStore.open(url)
    assert store.list_quotas() == []
    store.close()


def _seed_ledger(url: str, attempts: int) -> None:
    """``attempts`` settled attempts of 100 jobs of two tenants on two pools (one bulk insert)."""
    ManifestStore.open(url).close()
    now = dt.datetime.now(UTC)
    rows = [
        {
            "attempt_id": f"a-{i:09d}",
            "job_id": f"j-{i % 100:03d}",
            "tenant": "ads" if i % 100 < 75 else "search",
            "shard_index": i,
            "pool": "spot-a100" if i % 2 else None,
            "pool_kind": "spot" if i % 2 else None,
            "price_per_gpu_hour": 3.6,
            "outcome": "succeeded",
            "prompt_tokens": 1000,
            "completion_tokens": 100,
            "committed_records": 10,
            "superseded_records": i % 3,
            "gpu_seconds": 10.0,
            "cost": 0.01,
            "started_at": now,
            "ended_at": now,
            "settled_at": now,
        }
        for i in range(attempts)
    ]
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.insert(usage), rows)
    engine.dispose()


def test_usage_of_a_huge_ledger_is_summed_by_the_database_not_in_memory(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`deadline-batch usage` loaded one object per attempt: ~1 GB for a million attempts."""
    n = 60_000
    _seed_ledger(store_url, n)
    assert main(["usage", "--store", store_url, "--json"]) == 0  # warm: imports, compiled queries
    capsys.readouterr()
    gc.collect()
    tracemalloc.start()
    try:
        assert main(["usage", "--store", store_url, "--json"]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    data = orjson.loads(capsys.readouterr().out.splitlines()[-1])
    by_tenant = {t["tenant"]: t for t in data["tenants"]}
    ads, search = by_tenant["ads"], by_tenant["search"]
    assert (ads["attempts"], ads["jobs"], search["attempts"], search["jobs"]) == (45_000, 75, 15_000, 25)
    assert ads["prompt_tokens"] == 45_000_000 and ads["completion_tokens"] == 4_500_000
    assert ads["superseded_records"] + search["superseded_records"] == n  # i % 3 sums to n
    assert ads["gpu_seconds"] == pytest.approx(450_000.0) and search["cost"] == pytest.approx(150.0)
    # residues 0..74 of 100 hold 37 odd (spot-a100) and 38 even (no pool recorded) ones
    assert (ads["pools"]["spot-a100"]["attempts"], ads["pools"]["unknown"]["attempts"]) == (22_200, 22_800)
    # one object per attempt takes well over 30 MB here; the sums take a few rows
    assert peak < 5_000_000, f"peak {peak / 1e6:.1f} MB for {n} attempts"


def test_racing_submissions_of_one_tenant_never_exceed_its_budget(store_url: str, tmp_path: Path) -> None:
    """Real processes submit the tenant's jobs at once; a budget of 1.5 jobs admits exactly one."""
    store = ManifestStore.open(store_url)
    probe = plan_job(store, _request(tmp_path, "probe"))  # the same request's projected cost
    cost = float(probe.report.chosen.cost_units)  # type: ignore[union-attr]
    store.set_quota(TenantQuotaRow(tenant="ads", budget=cost * 1.5, budget_period_s=86400))
    outcomes = race_submissions(store_url, tmp_path / "out", ["ads"] * RACERS)
    assert sorted(verdict for verdict, _ in outcomes) == ["admitted"] + ["rejected"] * (RACERS - 1)
    ads = [j for j in store.list_jobs() if j.tenant == "ads"]
    assert sorted(j.state.value for j in ads) == ["admitted"] + ["rejected"] * (RACERS - 1)
    store.close()


def test_capacity_list_shows_no_reservation_for_a_job_past_its_deadline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job whose runner died stays `admitted` past its deadline: admission leaves its work out,
    `capacity list` showed it holding its whole reservation and the pool's free capacity without it."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(url)
    store.set_capacity("shared", 2)
    gone = plan_job(store, _request(tmp_path, "ads"))
    live = plan_job(store, _request(tmp_path, "search"))
    past = dt.datetime.now(UTC) - dt.timedelta(minutes=1)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.update(jobs).where(jobs.c.job_id == gone.job_id).values(deadline=past))
    engine.dispose()
    assert main(["capacity", "list", "--store", url, "--until", "+1h", "--json"]) == 0
    [pool] = orjson.loads(capsys.readouterr().out.splitlines()[-1])["pools"]
    assert [r["job_id"] for r in pool["reservations"]] == [live.job_id]
    assert pool["free_gpu_s_until"] == pytest.approx(2 * 3600 / 1.1 - pool["reserved_gpu_s"], rel=0.01)
    # admission agrees: the expired job's work is free for a third job
    assert plan_job(store, _request(tmp_path, "ads")).created
    store.close()
