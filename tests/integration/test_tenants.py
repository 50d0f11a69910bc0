"""Tenants on SQLite and PostgreSQL: stored on the job, migrated from 0002, shown by `status`."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import orjson
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from airflow_deadline_batch.cli import main
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore, NewJob
from airflow_deadline_batch.store.engine import normalize_url
from airflow_deadline_batch.store.manifest_store import MIGRATIONS_DIR
from tests.helpers.schema import head_revision

UTC = dt.timezone.utc
SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"


def _job(tenant: str | None = None, **extra: object) -> NewJob:
    fields: dict[str, object] = {
        "deadline": dt.datetime(2030, 1, 1, tzinfo=UTC),
        "input_uri": "file:///in.jsonl",
        "input_sha256": "e" * 64,
        "input_lines": 0,
        "input_total_lines": 0,
        "output_uri": "file:///out",
        "config": {"engine": "echo"},
        **extra,
    }
    if tenant is not None:
        fields["tenant"] = tenant
    return NewJob(**fields)  # type: ignore[arg-type]


def test_a_job_belongs_to_its_tenant_and_default_when_none(store: ManifestStore) -> None:
    team, _ = store.create_job(_job("team-a"))
    anyone, _ = store.create_job(_job())
    assert store.get_job(team.job_id).tenant == "team-a"
    assert store.get_job(anyone.job_id).tenant == "default"


@pytest.mark.parametrize("bad", ["Team_A", "-x", "a" * 64, "a b"])
def test_a_tenant_name_must_be_a_dns_label(bad: str) -> None:
    with pytest.raises(ValueError, match="not a valid name"):
        _job(bad)


def test_upgrade_from_0002_keeps_existing_jobs_as_the_default_tenant(store_url: str) -> None:
    engine = sa.create_engine(normalize_url(store_url))
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    try:
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, "0002")
            now = dt.datetime(2026, 1, 1, tzinfo=UTC)
            conn.execute(
                sa.text(
                    "INSERT INTO adb_jobs (job_id, state, created_at, updated_at, deadline, input_uri, "
                    "input_sha256, input_lines, input_total_lines, output_uri, config, max_attempts) "
                    "VALUES ('j-old', 'completed', :t, :t, :t, 'in', :sha, 1, 1, 'out', '{}', 3)"
                ),
                {"t": now.replace(tzinfo=None) if conn.dialect.name == "sqlite" else now, "sha": "e" * 64},
            )
    finally:
        engine.dispose()
    store = ManifestStore.open(store_url)
    try:
        assert store.schema_revision() == head_revision()
        old = store.get_job("j-old")
        assert old.tenant == "default"
        assert old.state.value == "completed" and old.input_lines == 1
        assert store.list_capacity() == [] and store.list_quotas() == [] and store.usage() == []
    finally:
        store.close()


def test_plan_records_the_tenant_and_status_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(url)
    request = PlanRequest(
        input_uri=str(SAMPLE),
        deadline=dt.datetime.now(UTC) + dt.timedelta(hours=2),
        output_uri=str(tmp_path / "out"),
        pools=default_local_pools("echo"),
        tenant="search",
    )
    plan = plan_job(store, request)
    store.close()
    assert main(["status", plan.job_id, "--store", url, "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out.splitlines()[-1])["tenant"] == "search"
    assert main(["status", plan.job_id, "--store", url]) == 0
    assert "tenant: search" in capsys.readouterr().out


def test_plan_request_refuses_a_bad_tenant(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="not a valid name"):
        PlanRequest(
            input_uri=str(SAMPLE),
            deadline=dt.datetime.now(UTC) + dt.timedelta(hours=2),
            output_uri=str(tmp_path),
            tenant="Not Valid",
        )


def test_cli_plan_reports_the_tenant(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(SAMPLE), "--deadline", "+2h", "--tenant", "ads", "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out.splitlines()[-1])["tenant"] == "ads"
