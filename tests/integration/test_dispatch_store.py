"""The store's dispatcher on SQLite and PostgreSQL: grants by the rule, release, expiry, the record."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from airflow_deadline_batch.store import ManifestStore, TenantQuotaRow
from airflow_deadline_batch.store.engine import normalize_url
from airflow_deadline_batch.store.manifest_store import MIGRATIONS_DIR
from tests.helpers.schema import head_revision

pytestmark = pytest.mark.integration


def _ask(
    store: ManifestStore, job: str, shard: int, tenant: str, latest_start: float, pool: str = "gpu"
) -> bool:
    row = store.request_dispatch(job, shard, tenant=tenant, pool=pool, latest_start=latest_start, ttl_s=60)
    assert row is not None
    return row.granted


def test_slots_are_granted_by_the_rule_released_and_recorded(store: ManifestStore) -> None:
    store.set_capacity("gpu", 3)
    store.set_quota(TenantQuotaRow(tenant="ads", weight=2.0))
    assert [_ask(store, "a1", i, "ads", 100.0 + i) for i in range(3)] == [True, True, True]
    # the pool is full: search's relaxed job and ads's urgent one wait
    assert not _ask(store, "s1", 0, "search", 900.0)
    assert not _ask(store, "a2", 0, "ads", 1.0)
    store.release_dispatch("a1", 0)  # a worker ends: search is below its share (1 of 3), ads is not
    rows = {(r.job_id, r.shard_index): r for r in store.dispatch_requests("gpu")}
    assert rows[("s1", 0)].granted and not rows[("a2", 0)].granted
    store.release_dispatch("a1", 1)
    assert store.poll_dispatch("a2", 60)[0].granted

    grants = store.dispatch_grants(pool="gpu")
    assert [g.seq for g in grants] == [1, 2, 3, 4, 5]
    assert [(g.job_id, g.reason) for g in grants[3:]] == [("s1", "below_share"), ("a2", "below_share")]
    fourth = grants[3].state["tenants"]
    assert fourth["ads"]["held"] == 2 and fourth["ads"]["share"] == 2.0 and fourth["ads"]["weight"] == 2.0
    assert fourth["search"] == {
        "held": 0,
        "share": 1.0,
        "weight": 1.0,
        "waiting": 1,
        "best": [900.0, grants[3].requested_at, "s1", 0],
    }
    assert [(g.release, g.released_at is not None) for g in grants[:2]] == [("released", True)] * 2
    assert grants[2].released_at is None


def test_a_request_on_another_pool_gives_the_old_slot_back_and_a_dead_runner_expires(
    store: ManifestStore,
) -> None:
    store.set_capacity("spot", 1)
    store.set_capacity("od", 1)
    assert _ask(store, "a", 0, "ads", 5.0, pool="spot")
    assert not _ask(store, "b", 0, "ads", 9.0, pool="spot")
    assert _ask(store, "a", 0, "ads", 5.0, pool="od")  # a's decision moved to on-demand
    assert store.poll_dispatch("b", 60)[0].granted
    assert [g.release for g in store.dispatch_grants(job_id="a")] == ["withdrawn", None]

    store.request_dispatch("c", 0, tenant="ads", pool="od", latest_start=0.0, ttl_s=0.0)  # expires at once
    store.release_dispatch("a")  # a's run ends; c's row has expired meanwhile: nothing is granted to it
    assert [r.job_id for r in store.dispatch_requests()] == ["b"]
    assert store.dispatch_grants(job_id="c") == []


def test_pools_without_capacity_are_never_granted(store: ManifestStore) -> None:
    assert not _ask(store, "a", 0, "ads", 1.0, pool="unmanaged")
    assert store.dispatch_grants() == []


def test_upgrade_from_0003_gives_existing_quotas_weight_1(store_url: str) -> None:
    engine = sa.create_engine(normalize_url(store_url))
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    try:
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, "0003")
            now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
            conn.execute(
                sa.text(
                    "INSERT INTO adb_tenant_quotas (tenant, spot_gpus, updated_at) VALUES ('ads', 4, :t)"
                ),
                {"t": now.replace(tzinfo=None) if conn.dialect.name == "sqlite" else now},
            )
    finally:
        engine.dispose()
    store = ManifestStore.open(store_url)
    try:
        assert store.schema_revision() == head_revision()
        quota = store.get_quota("ads")
        assert quota is not None and quota.weight == 1.0 and quota.spot_gpus == 4
        assert store.dispatch_requests() == [] and store.dispatch_grants() == []
    finally:
        store.close()
