"""A deferred shard try learns how late Airflow resumed it, on the loopback Kubernetes API.

A deferred Spot try learns of its pod's end only when Airflow resumes it after its trigger fired;
the placement counts that resume at Airflow's latency (``_ShardTryMixin.turnaround_s``). Only the
configured minimum (``[deadline_batch] scheduler_latency_s``) used to count there: a scheduler
slower to resume than that made every deferred Spot decision of the shard under-estimate its
turnaround. Now the trigger stamps its event with the time it fired (the triggerer's clock,
``FIRED_AT_KEY``) and the resumed run (``resume_execution``, Airflow's entry point of a resume)
folds how late it came into the try ledger, capped and robust as a start's lateness is.

The operator's halves run as Airflow runs them (``execute`` defers; the trigger in an event loop
of its own; a fresh operator resumes through ``resume_execution`` with ``{"event": ...}``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_deadline_batch.core.failures import MAX_LATE_S, SCHEDULER_LATENCY_S, TryLedger
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.operators.shard import TRY_LEDGER_KEY
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.triggers.pod import FIRED_AT_KEY
from tests.integration.test_k8s_loopback_deferred import TaskStateStore, try_context
from tests.integration.test_k8s_loopback_operator import (
    DEFERRABLE,
    PlannedJob,
    defer,
    first_trigger_event,
    shard_operator,
    store_secret,
)
from tests.integration.test_k8s_loopback_operator import planned as planned  # noqa: F401 - a fixture
from tests.k8s.fixtures import LoopbackCluster, loopback_cluster
from tests.unit.test_turnaround import LATENCY_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

#: how long after its trigger fired Airflow resumes the try here: a scheduler that slow
SLOW_RESUME_S = 400.0


@pytest.fixture()
def default_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """``[deadline_batch] scheduler_latency_s`` at its default (60 s)."""
    monkeypatch.delenv(LATENCY_ENV, raising=False)


@pytest.fixture()
def loopback_k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        yield cluster


@pytest.mark.usefixtures("default_latency")
def test_a_deferred_try_learns_how_late_airflow_resumed_it(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    store_secret(loopback_k8s, planned.store_url)
    state = TaskStateStore()
    ctx = try_context(1, state)
    deferred = defer(shard_operator(loopback_k8s, planned, **DEFERRABLE), ctx)
    before = time.time()
    event = first_trigger_event(deferred)
    assert event["status"] == "success", event
    assert before <= event[FIRED_AT_KEY] <= time.time()  # stamped as the trigger yielded it

    # Airflow resumes the task SLOW_RESUME_S after the trigger fired: the event as it then arrives
    late = {**event, FIRED_AT_KEY: event[FIRED_AT_KEY] - SLOW_RESUME_S}
    fresh = shard_operator(loopback_k8s, planned, **DEFERRABLE)
    resumed_at = time.time()
    assert fresh.resume_execution(deferred.method_name, {"event": late}, ctx) is None
    store = ManifestStore.open(planned.store_url)
    try:
        assert store.get_shard(planned.job_id, 0).state is ShardState.SUCCEEDED
    finally:
        store.close()
    ledger = TryLedger.from_dict(state.values[TRY_LEDGER_KEY])
    assert ledger.ended == {1} and ledger.handed_back == {1} and ledger.lost == frozenset()
    assert resumed_at - late[FIRED_AT_KEY] <= ledger.late_s <= time.time() - late[FIRED_AT_KEY]
    assert len(ledger.late) == 1, ledger
    # the next decision of this task instance counts the resume that slow, not the configured 60 s
    assert fresh.latency_s() == ledger.late_s > SCHEDULER_LATENCY_S


@pytest.mark.usefixtures("default_latency")
def test_a_resume_stamped_by_a_skewed_triggerer_clock_is_capped(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    """The fire time is the triggerer's clock and the resume the worker's: a triggerer clock a day
    behind teaches an hour at most (``MAX_LATE_S``), as a start's lateness does."""
    store_secret(loopback_k8s, planned.store_url)
    state = TaskStateStore()
    ctx = try_context(1, state)
    deferred = defer(shard_operator(loopback_k8s, planned, **DEFERRABLE), ctx)
    event = first_trigger_event(deferred)
    behind = {**event, FIRED_AT_KEY: event[FIRED_AT_KEY] - 86_400.0}
    shard_operator(loopback_k8s, planned, **DEFERRABLE).resume_execution(
        deferred.method_name, {"event": behind}, ctx
    )
    assert TryLedger.from_dict(state.values[TRY_LEDGER_KEY]).late_s == MAX_LATE_S
