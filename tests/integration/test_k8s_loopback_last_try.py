"""Airflow's last try of a deferrable shard pod keeps its worker slot (docs/airflow.md, *Resuming
tasks*), on the loopback Kubernetes API with the real worker in its pod.

With no retry left (``try_number > max_tries``) a try must not hand its slot back: a resume could be
failed by Airflow 3.3's scheduler (the resume race) and would fail the shard for good with its
store budget unspent. So the example DAG's deferrable pod settings wait for the pod in the try, and
a Spot eviction mid-shard launches the next pod in the same try (no reschedule, no deferral),
which finishes the shard from its committed cursor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.operators.shard import TRY_LEDGER_KEY
from tests.integration.test_k8s_loopback_deferred import (
    TaskStateStore,
    attempts,
    evict_when_committing,
    operator,
    shard_state,
    try_context,
)
from tests.integration.test_k8s_loopback_operator import PlannedJob, store_secret
from tests.integration.test_k8s_loopback_operator import planned as planned  # noqa: F401 - a fixture
from tests.k8s.fixtures import LoopbackCluster, loopback_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
WAIT_S = 120.0  # deadline for conditions on a loaded 2-core machine (nothing sleeps)


@pytest.fixture()
def loopback_k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        yield cluster


def test_the_last_try_of_a_deferrable_shard_pod_runs_again_in_its_slot_after_an_eviction(
    loopback_k8s: LoopbackCluster, planned: PlannedJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S", "0")
    store_secret(loopback_k8s, planned.store_url)
    state = TaskStateStore()
    ctx = try_context(6, state)
    ctx["ti"].max_tries = 5  # retries=5 spent: try 6 is Airflow's last
    returned: list[object] = []
    failed: list[BaseException] = []

    def last_try() -> None:
        try:
            returned.append(operator(loopback_k8s, planned).execute(ctx))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            failed.append(exc)

    runner = threading.Thread(target=last_try, name="shard-try-6")
    runner.start()
    try:
        evicted = evict_when_committing(loopback_k8s, planned)
    finally:
        runner.join(timeout=WAIT_S)
    assert not runner.is_alive(), "the last try did not end after the eviction"
    # neither a deferral (TaskDeferred) nor a reschedule: the try ran the shard to its end
    assert failed == [] and returned == [None], failed
    assert shard_state(planned) is ShardState.SUCCEEDED
    assert attempts(planned) == [AttemptOutcome.PREEMPTED, AttemptOutcome.SUCCEEDED]
    pods = [p["metadata"]["name"] for p in loopback_k8s.api.created_pods]
    assert len(pods) == 2 and pods[0] == evicted
    ledger = state.values[TRY_LEDGER_KEY]
    assert ledger["ended"] == [6] and ledger["handed_back"] == [], ledger
