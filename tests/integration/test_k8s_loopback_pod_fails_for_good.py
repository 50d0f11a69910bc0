"""A shard pod that fails on Airflow's last try fails its shard in the store (s25).

The pod's worker can never start (its store Secret is missing: ``CreateContainerConfigError``), so
no try claims and the store never counts one: the shard stays retryable however many tries fail.
Beside the shards (``plan >> [shards, done]``, the Kubernetes example), the completeness sensor
reads only the store and used to wait for that shard until its timeout. Now the try Airflow will
not retry fails the shard in the store (``_ShardTryMixin.fail_shard_for_good``), so the job can
end ``partial``; a try with retries left leaves it retryable. The real ``DeadlineShardPodOperator``
against the loopback Kubernetes API (tests/k8s/).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowRescheduleException

from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.store import ManifestStore
from tests.integration.test_k8s_loopback_operator import (
    PlannedJob,
    ShortStartupShardPodOperator,
    context,
    shard_operator,
)
from tests.integration.test_k8s_loopback_operator import planned as planned  # noqa: F401 - a fixture
from tests.k8s.fixtures import LoopbackCluster, loopback_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
MISSING = 'secret "deadline-batch-store" not found'


@pytest.fixture()
def k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        yield cluster


@pytest.mark.parametrize(
    ("try_number", "fails_for_good"), [(6, True), (5, False)], ids=["last", "retry-left"]
)
def test_a_pod_that_never_starts_fails_its_shard_on_airflows_last_try_only(
    k8s: LoopbackCluster,
    planned: PlannedJob,
    monkeypatch: pytest.MonkeyPatch,
    try_number: int,
    fails_for_good: bool,
) -> None:
    monkeypatch.setenv("AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S", "0")
    ctx = context(try_number)
    ctx["ti"].max_tries = 5  # retries=5: try 6 is Airflow's last
    # no store_secret(): the container waits with CreateContainerConfigError until the startup timeout
    with pytest.raises(AirflowException) as failed:
        shard_operator(k8s, planned, operator_class=ShortStartupShardPodOperator).execute(ctx)
    error = failed.value
    assert not isinstance(error, AirflowRescheduleException | AirflowFailException), repr(error)
    assert MISSING in str(error) and len(k8s.api.created_pods) == 1

    store = ManifestStore.open(planned.store_url)
    try:
        shard = store.get_shard(planned.job_id, 0)
        assert store.list_attempts(planned.job_id) == [] and shard.failures == 0  # the store saw no try
    finally:
        store.close()
    if fails_for_good:
        assert shard.state is ShardState.TERMINAL_FAILURE
        assert str(shard.last_error).startswith("its Airflow task shard[0] failed for good on try 6: ")
        assert MISSING in str(shard.last_error)
    else:
        assert shard.state is ShardState.PENDING and shard.last_error is None
