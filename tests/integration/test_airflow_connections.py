"""Credentials only through Airflow connections, named once on the plan task.

A plan → local shards → deferrable sensor run over S3 (a real ``moto_server`` over HTTP) whose
credentials exist only in an Airflow AWS connection: no ``AWS_*`` variable is in this process's
environment, and any attempt to set one fails the test (``os.putenv`` is guarded: ``os.environ``
writes go through it). The shard tasks and the sensor are given no connection IDs at all; they
inherit the plan's from its shard specs and XComs. A shard or sensor pointed at another store fails
at once, saying so.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from airflow_deadline_batch.core.failures import MIN_RESUME_DELAY_S
from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator, LocalShardOperator
from airflow_deadline_batch.sensors.completeness import CompletenessSensor
from airflow_deadline_batch.store import ManifestStore
from tests.fixtures.s3 import MotoServer, start_moto_server, stop_moto_server
from tests.helpers.inputs import mixed_input

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY, SECRET_KEY, REGION = "conn-key", "conn-secret-never-in-env", "us-east-1"


@dataclass
class TaskInstance:
    """XComs recorded per (task, key), so one task can pull what another pushed."""

    task_id: str
    xcoms: dict[tuple[str, str], Any]
    dag_id: str = "connections"
    try_number: int = 1
    map_index: int = -1

    def xcom_push(self, key: str, value: Any, **_: Any) -> None:
        self.xcoms[(self.task_id, key)] = value

    def xcom_pull(self, task_ids: str, key: str = "return_value", **_: Any) -> Any:
        return self.xcoms.get((task_ids, key))


@dataclass
class Run:
    xcoms: dict[tuple[str, str], Any] = field(default_factory=dict)

    def context(self, task_id: str) -> dict[str, Any]:
        ti = TaskInstance(task_id, self.xcoms)
        return {"ti": ti, "run_id": "manual__2026-01-01", "dag": SimpleNamespace(dag_id=ti.dag_id)}


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = start_moto_server(log_path=tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        stop_moto_server(server)


@pytest.fixture()
def no_aws_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No ``AWS_*`` variable now, none set later, no ``~/.aws`` files: the connection is all there is."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    real_putenv = os.putenv

    def guarded_putenv(key: Any, value: Any) -> None:
        name = key.decode() if isinstance(key, bytes) else str(key)
        assert not name.startswith("AWS_"), f"{name} written to the process environment"
        real_putenv(key, value)

    monkeypatch.setattr(os, "putenv", guarded_putenv)


@pytest.fixture()
def connections(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, moto: MotoServer) -> dict[str, str]:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv(
        "AIRFLOW_CONN_ADB_STORE",
        json.dumps({"conn_type": "deadline_batch_store", "host": store_url}),
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_ADB_OTHER_STORE",
        json.dumps({"conn_type": "deadline_batch_store", "host": f"sqlite:///{tmp_path / 'other.db'}"}),
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_ADB_S3",
        json.dumps(
            {
                "conn_type": "aws",
                "login": KEY,
                "password": SECRET_KEY,
                "extra": {"endpoint_url": moto.endpoint_url, "region_name": REGION},
            }
        ),
    )
    return {"store_url": store_url}


def direct_client(moto: MotoServer) -> Any:
    """The test's own client, with explicit credentials (setup and checks only)."""
    return boto3.client(
        "s3",
        endpoint_url=moto.endpoint_url,
        region_name=REGION,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET_KEY,
    )


def plan_task(input_uri: str, output_uri: str) -> DeadlineBatchOperator:
    return DeadlineBatchOperator(
        task_id="plan",
        input_uri=input_uri,
        output_uri=output_uri,
        deadline="+2h",
        store_conn_id="adb_store",
        aws_conn_id="adb_s3",
        workers=2,
        microbatch_size=4,
        max_invalid_fraction=0.5,
    )


def test_s3_and_the_store_come_only_from_connections_named_on_the_plan(
    no_aws_environment: None, connections: dict[str, str], moto: MotoServer, tmp_path: Path
) -> None:
    s3 = direct_client(moto)
    s3.create_bucket(Bucket="conn-bucket")
    mixed = mixed_input(30, seed=3, bad_fraction=0.1, blank_fraction=0.05)
    s3.put_object(
        Bucket="conn-bucket", Key="in/requests.jsonl", Body=mixed.write(tmp_path / "in.jsonl").read_bytes()
    )
    run = Run()

    specs = plan_task("s3://conn-bucket/in/requests.jsonl", "s3://conn-bucket/out").execute(
        run.context("plan")
    )
    assert specs, "the plan cut no shards"
    for spec in specs:  # the plan's connection IDs travel with every shard spec, never a URL
        assert spec["plan_connections"] == {"store_conn_id": "adb_store", "aws_conn_id": "adb_s3"}
    assert connections["store_url"] not in json.dumps(specs)

    # the sensor starts beside the shards (the job is unfinished), so it defers
    sensor = CompletenessSensor(task_id="verify", plan_task_id="plan", poke_interval=0.1)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(run.context("verify"))
    trigger = deferred.value.trigger
    kwargs = trigger.serialize()[1]
    assert kwargs["store_conn_id"] == "adb_store"
    # the first read waits out the resume guard, however short the poke interval
    assert kwargs["first_poll_delay_s"] == MIN_RESUME_DELAY_S

    for spec in specs:  # shard tasks named with nothing but what expand_kwargs hands them
        shard = LocalShardOperator(task_id="shard", **spec)
        shard.execute(run.context("shard"))

    async def first_event() -> Any:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger yielded nothing")

    payload = asyncio.run(first_event())
    fresh = CompletenessSensor(task_id="verify", plan_task_id="plan", poke_interval=0.1)
    manifest_uri = fresh.execute_complete(run.context("verify"), payload)

    assert manifest_uri.startswith("s3://conn-bucket/out/")
    key = manifest_uri.removeprefix("s3://conn-bucket/")
    manifest = json.loads(s3.get_object(Bucket="conn-bucket", Key=key)["Body"].read())
    assert manifest["outcomes"]["expired"] == 0 and manifest["outcomes"]["cancelled"] == 0
    assert sum(manifest["outcomes"].values()) == len(mixed.expected)  # one outcome per non-blank line
    # a sensor that starts once the job is over finishes without deferring: same manifest
    again = CompletenessSensor(task_id="verify", plan_task_id="plan", poke_interval=0.1)
    assert again.execute(run.context("verify")) == manifest_uri
    assert not [k for k in os.environ if k.startswith("AWS_")]


@pytest.fixture()
def planned_locally(connections: dict[str, str], tmp_path: Path) -> tuple[Run, list[dict[str, Any]]]:
    mixed = mixed_input(12, seed=5, bad_fraction=0.0, blank_fraction=0.0)
    run = Run()
    plan = plan_task(str(mixed.write(tmp_path / "in.jsonl")), str(tmp_path / "out"))
    plan.aws_conn_id = None
    return run, plan.execute(run.context("plan"))


@pytest.mark.parametrize("other", ["empty", "migrated"])
def test_a_shard_pointed_at_another_store_fails_at_once_saying_so(
    planned_locally: tuple[Run, list[dict[str, Any]]], tmp_path: Path, other: str
) -> None:
    run, specs = planned_locally
    if other == "migrated":
        ManifestStore.open(f"sqlite:///{tmp_path / 'other.db'}").close()
    for make in (
        lambda: LocalShardOperator(task_id="shard", store_conn_id="adb_other_store", **specs[0]),
        lambda: DeadlineShardPodOperator(
            task_id="shard", image="worker:1", store_conn_id="adb_other_store", **specs[0]
        ),
    ):
        with pytest.raises(AirflowFailException) as failed:
            make().execute(run.context("shard"))
        message = str(failed.value)
        assert f"job {specs[0]['job_id']} is not in the manifest store this task reads" in message
        assert "connection 'adb_other_store'" in message
        assert "the plan task created it in connection 'adb_store'" in message
        assert "no such table" not in message and "migrate()" not in message


def test_a_sensor_pointed_at_another_store_fails_at_once_saying_so(
    planned_locally: tuple[Run, list[dict[str, Any]]],
) -> None:
    run, specs = planned_locally
    sensor = CompletenessSensor(task_id="verify", plan_task_id="plan", store_conn_id="adb_other_store")
    with pytest.raises(AirflowFailException) as failed:
        sensor.execute(run.context("verify"))
    assert "is not in the manifest store this task reads (connection 'adb_other_store')" in str(failed.value)


def test_explicit_arguments_win_over_the_plans(planned_locally: tuple[Run, list[dict[str, Any]]]) -> None:
    run, specs = planned_locally
    spec = {**specs[0], "plan_connections": {"store_conn_id": "adb_other_store"}}
    shard = LocalShardOperator(task_id="shard", store_conn_id="adb_store", **spec)
    assert shard.store_hook().store_conn_id == "adb_store"
    shard.execute(run.context("shard"))  # reads (and runs) the job in the explicitly named store
