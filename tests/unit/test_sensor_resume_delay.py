"""``CompletenessSensor``'s first read after it defers waits out ``[deadline_batch]
min_resume_delay_s`` (the resume guard, docs/airflow.md *Resuming tasks*), the configured value
and not a fixed 5 s; a bad value fails the task with a one-line error naming the setting."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from airflow_deadline_batch.core.failures import MIN_RESUME_DELAY_S
from airflow_deadline_batch.sensors.completeness import CompletenessSensor
from airflow_deadline_batch.store import ManifestStore
from tests.unit.test_risk_crossing import make_job

ENV = "AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S"


class TaskInstance:
    def __init__(self) -> None:
        self.xcoms: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any, **_: Any) -> None:
        self.xcoms[key] = value


def first_poll_delay(store_url: str, job_id: str, poke_interval: float) -> float:
    sensor = CompletenessSensor(
        task_id="verify", job_id=job_id, store_url=store_url, poke_interval=poke_interval
    )
    context = {"ti": TaskInstance(), "run_id": "manual__1", "dag": SimpleNamespace(dag_id="d")}
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context)
    return float(deferred.value.trigger.serialize()[1]["first_poll_delay_s"])


@pytest.fixture()
def unfinished(tmp_path) -> tuple[str, str]:
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        return store.url, make_job(store, work_s=60)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("setting", "poke", "delay"),
    [(None, 0.1, MIN_RESUME_DELAY_S), ("12", 0.1, 12.0), ("0", 0.1, 0.1), ("2", 30.0, 30.0)],
)
def test_the_first_read_waits_the_configured_resume_delay(
    unfinished: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
    setting: str | None,
    poke: float,
    delay: float,
) -> None:
    if setting is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, setting)
    assert first_poll_delay(*unfinished, poke_interval=poke) == delay


def test_a_bad_resume_delay_fails_the_task_naming_the_setting(
    unfinished: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(AirflowFailException, match="min_resume_delay_s"):
        first_poll_delay(*unfinished, poke_interval=0.1)
