"""PostgreSQL goes away while a run waits for a slot of a managed pool, for longer than its TTL.

The runner talks to a real PostgreSQL server through a loopback fault proxy; another tenant holds
the pool's one Spot GPU, so the run's shards wait for it. The server goes away (connections reset
and refused) for longer than the run's TTL, so the dispatcher expires the run's requests; the
other tenant's slot is given back meanwhile. Once the server is back the run must ask again, be
granted, and complete every record: no crash loop, no lost shard, no row left behind.
"""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.local.runner import RunOptions, RunSummary, run_job
from airflow_deadline_batch.service.planning import PlanRequest
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import wait_for
from tests.fixtures.faultproxy import FaultProxy
from tests.helpers.inputs import mixed_input

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

#: the run's TTL (dispatch rows and leases); the outage lasts longer
TTL_S = 3.0
OUTAGE_S = 4.5


def test_a_store_outage_longer_than_the_ttl_while_waiting_for_a_slot_completes_the_job(
    tmp_path: Path, pg_store_url: str
) -> None:
    target = make_url(pg_store_url)
    direct = ManifestStore.open(pg_store_url)
    direct.set_capacity("local-spot", 1)
    blocker = direct.request_dispatch(
        "j-other", 0, tenant="search", pool="local-spot", latest_start=0, ttl_s=600
    )
    assert blocker is not None and blocker.granted
    mixed = mixed_input(32, seed=5, bad_fraction=0.0, blank_fraction=0.0)
    request = PlanRequest(
        input_uri=str(mixed.write(tmp_path / "input.jsonl")),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=2,
        microbatch_size=8,
        max_shards=2,
        lease_ttl_s=TTL_S,
    )
    options = RunOptions(workers=2, lease_ttl_s=TTL_S, backoff_cap_s=2.0, worker_log=str(tmp_path / "w.log"))
    result: list[RunSummary | BaseException] = []
    with FaultProxy(target.host or "127.0.0.1", int(target.port or 5432)) as proxy:
        url = target.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        store = ManifestStore.open(url)

        def run() -> None:
            try:
                result.append(run_job(store, request, options))
            except BaseException as exc:  # reported below
                result.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            waiting = wait_for(
                lambda: [r for r in direct.dispatch_requests("local-spot") if not r.granted],
                timeout_s=60,
                what="the run's requests for the Spot slot",
            )
            proxy.outage()
            assert proxy.wait_for_attempt(refused_at_least=3, timeout=60), "the run never met the outage"
            direct.release_dispatch("j-other")  # the slot frees while the run cannot see it
            threading.Event().wait(OUTAGE_S)  # the outage's length, not a synchronisation
            proxy.heal()
            thread.join(90)
            assert not thread.is_alive(), "the run did not finish"
        finally:
            proxy.heal()
        store.close()
    try:
        assert len(result) == 1 and isinstance(result[0], RunSummary), result
        summary = result[0]
        assert summary.state == "completed" and summary.deadline_met, summary.to_dict()
        job_id = waiting[0].job_id
        assert {s.state.value for s in direct.list_shards(job_id)} == {"succeeded"}
        grants = direct.dispatch_grants(job_id=job_id)
        assert grants and all(g.release is not None for g in grants)  # every slot came back
        expired = [g for g in direct.dispatch_grants() if g.release == "expired"]
        assert direct.dispatch_requests() == [], (direct.dispatch_requests(), expired)
    finally:
        direct.close()
