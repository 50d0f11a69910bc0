"""`deadline-batch capacity` and `deadline-batch quota`: set, list, delete; text and --json."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch.cli import main
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.integration.test_shared_admission import SAMPLE, SHARED

UTC = dt.timezone.utc


def _last_json(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    return dict(orjson.loads(capsys.readouterr().out.splitlines()[-1]))


def test_capacity_set_list_delete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    ManifestStore.open(url).close()
    assert main(["capacity", "list", "--store", url]) == 0
    assert "no pool is managed" in capsys.readouterr().out
    assert main(["capacity", "set", "shared", "--gpus", "2", "--store", url]) == 0
    assert "pool shared: 2 shared GPU(s)" in capsys.readouterr().out

    store = ManifestStore.open(url)
    request = PlanRequest(
        input_uri=str(SAMPLE),
        deadline=dt.datetime.now(UTC) + dt.timedelta(minutes=45),
        output_uri=str(tmp_path / "out"),
        pools=(SHARED,),
        workers=2,
        tenant="ads",
    )
    plan = plan_job(store, request)
    store.close()
    assert main(["capacity", "list", "--store", url, "--until", "+1h", "--json"]) == 0
    [pool] = _last_json(capsys)["pools"]  # type: ignore[misc]
    assert pool["pool"] == "shared" and pool["gpus"] == 2
    [held] = pool["reservations"]
    assert held["job_id"] == plan.job_id and held["tenant"] == "ads"
    assert held["reserved_gpu_s"] == pytest.approx(pool["reserved_gpu_s"])
    # 2 GPUs for an hour keep 6545 GPU-s after the reserve; the job holds what its plan needs
    assert pool["free_gpu_s_until"] == pytest.approx(2 * 3600 / 1.1 - held["reserved_gpu_s"], rel=0.01)
    assert main(["capacity", "list", "--store", url]) == 0
    text = capsys.readouterr().out
    assert "shared: 2 GPU(s), 1 job(s) hold" in text and f"{plan.job_id} (ads)" in text

    assert main(["capacity", "delete", "shared", "--store", url, "--json"]) == 0
    assert _last_json(capsys) == {"pool": "shared", "deleted": True}
    assert main(["capacity", "set", "shared", "--gpus", "-1", "--store", url]) == 2
    assert "gpus must be >= 0" in capsys.readouterr().err


def test_quota_set_list_delete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'new' / 'store.db'}"
    assert main(["quota", "list", "--store", url]) == 2  # nothing there yet
    assert "no manifest store" in capsys.readouterr().err
    args = ["quota", "set", "ads", "--spot-gpus", "8", "--budget", "120", "--period", "+7d", "--store", url]
    assert main(args) == 0
    assert "ads: spot GPUs 8, on-demand GPUs unlimited, budget 120.00 per 168h00m" in capsys.readouterr().out
    assert main(["quota", "set", "search", "--on-demand-gpus", "2", "--store", url]) == 0
    capsys.readouterr()
    assert main(["quota", "list", "--store", url]) == 0
    assert "search: spot GPUs unlimited, on-demand GPUs 2, budget unlimited" in capsys.readouterr().out
    assert main(["quota", "list", "--store", url, "--json"]) == 0
    quotas = {q["tenant"]: q for q in _last_json(capsys)["quotas"]}  # type: ignore[attr-defined]
    assert quotas["ads"]["budget_period_s"] == 7 * 86400 and quotas["ads"]["on_demand_gpus"] is None
    assert quotas["search"] == {
        "tenant": "search",
        "spot_gpus": None,
        "on_demand_gpus": 2,
        "budget": None,
        "budget_period_s": None,
        "weight": 1.0,
    }
    assert main(["quota", "delete", "search", "--store", url]) == 0
    assert "quota removed" in capsys.readouterr().out
    assert main(["quota", "set", "Bad_Name", "--store", url]) == 2
    assert "not a valid name" in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["nan", "inf", "-5"])
def test_quota_refuses_a_budget_that_is_not_a_finite_amount(
    tmp_path: Path, budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """NaN compares false with everything: accepted, it would have read as "no budget"."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    assert main(["quota", "set", "ads", "--budget", budget, "--store", url]) == 2
    # nan and inf: the command's check of every float option, before the quota's own
    expected = (
        "budget must be a finite number >= 0"
        if budget == "-5"
        else f"--budget {budget}: give a finite number"
    )
    assert expected in capsys.readouterr().err


def test_quota_weight_is_set_listed_and_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    assert main(["quota", "set", "ads", "--weight", "2.5", "--store", url]) == 0
    assert "ads: spot GPUs unlimited, on-demand GPUs unlimited, budget unlimited, weight 2.5" in (
        capsys.readouterr().out
    )
    assert main(["quota", "list", "--store", url, "--json"]) == 0
    assert _last_json(capsys)["quotas"][0]["weight"] == 2.5  # type: ignore[index]
    for bad in ("0", "-1"):
        assert main(["quota", "set", "ads", "--weight", bad, "--store", url]) == 2
        assert "weight must be a finite number > 0" in capsys.readouterr().err
    assert main(["quota", "set", "ads", "--weight", "nan", "--store", url]) == 2
    assert "--weight nan: give a finite number" in capsys.readouterr().err
