"""A pool's start, learned from what its tries took, when its declaration is too short (issue 13).

The placement's safety rule assumes a (re)launch costs the pools' declared ``startup_seconds``
(plus queue wait). A model that loads slower than declared would make every "last safe" decision
too late: the on-demand fallback would start with less time than it needs. The job view now takes
the longest start its tries were seen to make (claim to first commit, less that microbatch's own
time: ``core.job_view.startup_seen_s``) when it is longer. Real worker processes (the echo engine
loading for 3 s), a real SQLite store; no clock is faked.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import pytest

from airflow_deadline_batch.core.job_view import changeover_s
from airflow_deadline_batch.core.placement import od_need_s
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.local.launcher import run_worker_subprocess
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.inputs import mixed_input

LOAD_S = 3.0  # the echo engine's simulated model load; the pools declare a 1 s start


@pytest.fixture()
def planned(tmp_path: Path) -> tuple[str, str]:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    data = mixed_input(24, seed=5, bad_fraction=0.0, blank_fraction=0.0).write(tmp_path / "in.jsonl")
    store = ManifestStore.open(store_url)
    try:
        job = plan_job(
            store,
            PlanRequest(
                input_uri=str(data),
                deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2),
                output_uri=str(tmp_path / "out"),
                engine="echo",
                pools=default_local_pools("echo"),
                workers=2,
                microbatch_size=4,
                max_shards=3,
            ),
        )
    finally:
        store.close()
    return store_url, job.job_id


def test_a_slow_start_seen_on_a_pool_raises_the_changeover(planned: tuple[str, str]) -> None:
    store_url, job_id = planned
    spot, on_demand = default_local_pools("echo")
    store = ManifestStore.open(store_url)
    try:
        before = read_job_view(store, job_id, now=dt.datetime.now(dt.timezone.utc))
        assert before.startup_seen_s == {} and before.changeover_s == spot.startup_seconds == 1.0

        code = run_worker_subprocess(
            store_url, job_id, 0, pool=spot.name, env={"ADB_ECHO_LOAD_S": str(LOAD_S)}
        )
        assert code == 0
        code = run_worker_subprocess(store_url, job_id, 1, pool=on_demand.name)  # loads at once
        assert code == 0

        view = read_job_view(store, job_id, now=dt.datetime.now(dt.timezone.utc))
    finally:
        store.close()
    seen = view.startup_seen_s
    assert seen[spot.name] >= LOAD_S, seen  # the load, not the microbatch's own time
    assert seen.get(on_demand.name, 0.0) < LOAD_S, seen
    # the job's changeover is the slowest pool's, now the Spot pool's seen start
    assert view.changeover_s == seen[spot.name]
    assert od_need_s(view.snapshot()) == pytest.approx(
        od_need_s(dataclasses.replace(view, startup_seen_s={}).snapshot()) + seen[spot.name] - 1.0
    )


def test_a_declaration_longer_than_what_was_seen_stands() -> None:
    spot, on_demand = default_local_pools("echo")
    slow = dataclasses.replace(on_demand, startup_seconds=600)
    assert changeover_s((spot, slow), {spot.name: 30.0}) == 600.0
    assert changeover_s((spot, slow), {spot.name: 900.0}) == 900.0
    assert changeover_s((spot, slow), {"a pool the job no longer has": 5000.0}) == 600.0
