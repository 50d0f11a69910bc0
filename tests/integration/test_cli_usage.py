"""`deadline-batch usage`: the settled ledger per tenant, text and --json."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch.cli import main
from airflow_deadline_batch.store import ManifestStore, NewJob, UsageRow

UTC = dt.timezone.utc


def _seed(url: str) -> None:
    store = ManifestStore.open(url)
    now = dt.datetime.now(UTC)
    for tenant, n, started in (("ads", 2, now), ("search", 1, now), ("ads", 1, now - dt.timedelta(days=3))):
        job, _ = store.create_job(
            NewJob(
                deadline=now + dt.timedelta(hours=1),
                input_uri="file:///in",
                input_sha256="e" * 64,
                input_lines=0,
                input_total_lines=0,
                output_uri="file:///out",
                config={},
                tenant=tenant,
            )
        )
        store.settle_usage(
            job.job_id,
            [
                UsageRow(
                    attempt_id=f"a-{job.job_id}-{i}",
                    job_id=job.job_id,
                    tenant=tenant,
                    shard_index=i,
                    pool="spot-a100",
                    pool_kind="spot",
                    price_per_gpu_hour=3.6,
                    outcome="succeeded",
                    prompt_tokens=1000,
                    completion_tokens=100,
                    committed_records=10,
                    superseded_records=0,
                    gpu_seconds=100.0,
                    cost=0.1,
                    started_at=started,
                    ended_at=started,
                )
                for i in range(n)
            ],
        )
    store.close()


def test_usage_reports_per_tenant_since_a_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    _seed(url)
    assert main(["usage", "--store", url, "--since", "24h", "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out.splitlines()[-1])
    by_tenant = {t["tenant"]: t for t in data["tenants"]}
    assert set(by_tenant) == {"ads", "search"}
    assert by_tenant["ads"]["attempts"] == 2 and by_tenant["ads"]["jobs"] == 1
    assert by_tenant["ads"]["prompt_tokens"] == 2000
    assert by_tenant["ads"]["cost"] == pytest.approx(0.2)
    assert by_tenant["ads"]["pools"]["spot-a100"]["gpu_seconds"] == pytest.approx(200.0)

    assert main(["usage", "--store", url, "--tenant", "ads", "--json"]) == 0
    everything = orjson.loads(capsys.readouterr().out.splitlines()[-1])
    assert [t["tenant"] for t in everything["tenants"]] == ["ads"]
    assert everything["tenants"][0]["attempts"] == 3 and everything["since"] is None

    since = (dt.datetime.now(UTC) - dt.timedelta(days=1)).isoformat()
    assert main(["usage", "--store", url, "--tenant", "search", "--since", since]) == 0
    text = capsys.readouterr().out
    assert "search: 1 job(s), 1 attempt(s), 1,000 prompt + 100 completion tokens" in text
    assert "spot-a100: 1 attempt(s)" in text

    assert main(["usage", "--store", url, "--tenant", "nobody"]) == 0
    assert "nothing settled for tenant nobody" in capsys.readouterr().out


@pytest.mark.parametrize("since", ["yesterday", "2026-01-01T00:00:00"])
def test_usage_refuses_a_bad_since(tmp_path: Path, since: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    _seed(url)
    assert main(["usage", "--store", url, "--since", since]) == 2
    err = capsys.readouterr().err
    assert "--since" in err and "a duration back from now (24h, 7d)" in err
