"""``CompletenessTrigger.on_kill`` in Airflow's own trigger runner, against a real store and storage.

The trigger runs in Airflow 3.3's ``TriggerRunner.run_trigger`` and is cancelled by its
``cancel_triggers`` with the user-action message, as the triggerer does when a DAG run is failed
while the sensor waits. The triggerer then sends the same cancel again at each loop (its
supervisor lists the trigger in ``to_cancel`` until the runner reports it finished), which ends
``on_kill`` wherever it awaits. The DAG run's state comes over Airflow's real comms decoder from a
supervisor thread on the other end of a socket pair, which answers when the test lets it: the
answer can come after the second cancel, as it does from a loaded triggerer.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
from airflow.jobs.triggerer_job_runner import TriggerCommsDecoder, TriggerRunner
from airflow.sdk.exceptions import AirflowFailException
from airflow.sdk.execution_time import task_runner
from airflow.sdk.execution_time.comms import DagRunStateResult, _RequestFrame, _ResponseFrame
from structlog.testing import capture_logs

from airflow_deadline_batch.core.states import JobState
from airflow_deadline_batch.sensors.completeness import CompletenessSensor
from airflow_deadline_batch.storage import open_storage
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.triggers.completeness import CompletenessTrigger
from tests.helpers.messy_job import build_messy_job
from tests.helpers.outcomes import read_manifest, read_outcomes
from tests.helpers.waiting import wait_for
from tests.integration.test_airflow_connections import Run

pytestmark = pytest.mark.integration
WAIT_S = 60.0
TRIGGER_ID = 7
DAG_ID, RUN_ID = "nightly", "manual__1"


class Supervisor:
    """The triggerer supervisor's end of the comms socket: answers each ``GetDagRunState`` with
    ``state``, once ``answer`` is set; ``asked`` is set when a request has arrived."""

    def __init__(self, state: str) -> None:
        self.sock, self.runner_end = socket.socketpair()  # the supervisor's end, the runner's
        self.state = state
        self.asked, self.answer = threading.Event(), threading.Event()
        self.decoder = msgspec.msgpack.Decoder(_RequestFrame)
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while header := self._read(4):
                frame = self.decoder.decode(self._read(int.from_bytes(header, "big")))
                assert frame.body is not None and frame.body["type"] == "GetDagRunState", frame
                self.asked.set()
                self.answer.wait(WAIT_S)
                body = DagRunStateResult(state=self.state).model_dump(mode="json")
                self.sock.sendall(_ResponseFrame(id=frame.id, body=body).as_bytes())

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return b""
            data += chunk
        return data


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[ManifestStore]:
    s = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(autouse=True)
def supervisor_comms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The task SDK's channel to the supervisor, which each test sets, is put back afterwards."""
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", None, raising=False)


@pytest.fixture()
def logs() -> Iterator[list[dict[str, Any]]]:
    """Every structlog event, with the context variables the triggerer routes a line by."""
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as entries:
        yield entries


def said(logs: list[dict[str, Any]], start: str) -> list[dict[str, Any]]:
    """The events whose message (its arguments formatted in) starts with ``start``."""
    return [e for e in logs if str(e["event"]).startswith(start)]


def kill(
    store: ManifestStore, job_id: str, run_state: str, logs: list[dict[str, Any]], *, again: bool
) -> None:
    """Run the job's trigger in Airflow's runner and cancel it as a user action does; the DAG run
    is ``run_state``; ``again``: the runner's next loop cancels again before the state is known."""
    asyncio.run(
        kill_in_the_runner(make_trigger(store, job_id), Supervisor(run_state), logs, cancel_again=again)
    )


async def kill_in_the_runner(
    trigger: CompletenessTrigger, supervisor: Supervisor, logs: list[dict[str, Any]], *, cancel_again: bool
) -> None:
    supervisor.thread.start()
    reader, writer = await asyncio.open_connection(sock=supervisor.runner_end)
    comms = TriggerCommsDecoder(async_reader=reader, async_writer=writer, socket=supervisor.runner_end)
    await comms.start_reader()
    task_runner.SUPERVISOR_COMMS = comms
    runner = TriggerRunner()
    task = asyncio.create_task(runner.run_trigger(TRIGGER_ID, trigger))
    runner.triggers[TRIGGER_ID] = {"task": task, "name": "verify", "events": 0, "is_watcher": False}
    started = time.monotonic()
    while not said(logs, "trigger verify starting"):  # then it waits: its first poll is an hour away
        assert time.monotonic() - started < WAIT_S, "the trigger did not start"
        await asyncio.sleep(0.01)
    runner.to_cancel.append(TRIGGER_ID)
    await runner.cancel_triggers()
    if cancel_again:
        assert await asyncio.to_thread(supervisor.asked.wait, WAIT_S), "on_kill did not ask the run's state"
        runner.to_cancel.append(TRIGGER_ID)
        await runner.cancel_triggers()
    supervisor.answer.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT_S)
    assert task.cancelled() and (await runner.cleanup_finished_triggers()) == [TRIGGER_ID]
    # a triggerer's loop and comms reader live on after the trigger has ended, serving the thread
    # that finishes the cancellation; here they are torn down only once that thread is done
    for thread in [t for t in threading.enumerate() if t.name == f"cancel-{trigger.job_id}"]:
        await asyncio.to_thread(thread.join, WAIT_S * 3)
        assert not thread.is_alive(), "the cancellation thread did not finish"
    comms._reader_task.cancel()
    writer.close()
    await writer.wait_closed()
    await asyncio.to_thread(supervisor.thread.join, WAIT_S)  # it reads the end of the stream
    assert not supervisor.thread.is_alive()
    supervisor.sock.close()


def make_trigger(store: ManifestStore, job_id: str) -> CompletenessTrigger:
    trigger = CompletenessTrigger(job_id=job_id, store_url=store.url, first_poll_delay_s=3600)
    trigger.task_instance = types.SimpleNamespace(  # what the triggerer reads of a TaskInstanceDTO
        id="0199",
        dag_id=DAG_ID,
        task_id="verify",
        run_id=RUN_ID,
        try_number=1,
        map_index=-1,
        context_carrier=None,
    )
    return trigger


def assert_cancelled_and_published(store: ManifestStore, job_id: str, logs: list[dict[str, Any]]) -> None:
    job = wait_for(
        lambda: (j := store.get_job(job_id)).manifest_uri and j, timeout_s=WAIT_S, what="the manifest"
    )
    assert job.state is JobState.CANCELLED and job.error == f"its DAG run {DAG_ID}/{RUN_ID} failed"
    outcomes = read_outcomes(read_manifest(job.manifest_uri))
    assert len(outcomes) == job.input_lines and "cancelled" in {o["status"] for o in outcomes.values()}
    # the outcome is logged with the trigger's ID: the triggerer writes it to the trigger's log
    done = f"job {job_id} cancelled (its DAG run failed); manifest {job.manifest_uri}"
    (line,) = wait_for(lambda: said(logs, done), timeout_s=WAIT_S, what="the outcome's log line")
    assert line["trigger_id"] == TRIGGER_ID


def test_a_cancel_sent_again_while_on_kill_asks_the_run_state_still_cancels_and_publishes(
    store: ManifestStore, tmp_path: Path, logs: list[dict[str, Any]]
) -> None:
    """The bug: the second cancel ended ``on_kill`` while it awaited the DAG run's state, so the
    job ran on (cut short in the publication, it stayed cancelled without a manifest), and
    nothing said so. Now ``on_kill`` says it was stopped, and its thread finishes the work."""
    job_id = build_messy_job(store, tmp_path)
    kill(store, job_id, "failed", logs, again=True)
    assert_cancelled_and_published(store, job_id, logs)
    assert said(logs, f"job {job_id}: Airflow stopped waiting for on_kill; the cancellation goes on")


def test_a_publication_that_fails_once_is_tried_again_before_on_kill_returns(
    store: ManifestStore, tmp_path: Path, logs: list[dict[str, Any]]
) -> None:
    """A storage failure in the publication (a directory in the way of the third ``cancelled``
    object: the local storage's rename fails) is retried; once the way is clear, it publishes,
    and ``on_kill`` (not cancelled again) returns only then: the outcome is in the trigger's log."""
    job_id = build_messy_job(store, tmp_path)
    blocker = Path(open_storage(store.get_job(job_id).output_uri).uri("finalize/shard-00003-cancelled.jsonl"))
    blocker.mkdir(parents=True)
    failed = f"job {job_id}: publishing the cancelled manifest failed: "

    def clear_the_way() -> None:
        wait_for(lambda: said(logs, failed), timeout_s=WAIT_S, what="the first publication to fail")
        assert store.get_job(job_id).manifest_uri is None
        shutil.rmtree(blocker)  # storage is back

    clearer = threading.Thread(target=clear_the_way)
    clearer.start()
    kill(store, job_id, "failed", logs, again=False)
    clearer.join()
    assert store.get_job(job_id).manifest_uri  # published before on_kill returned
    assert_cancelled_and_published(store, job_id, logs)
    (retry,) = said(logs, failed)
    assert "a file and a folder clash on this path" in retry["event"]


def test_a_run_that_did_not_fail_leaves_the_job_running(
    store: ManifestStore, tmp_path: Path, logs: list[dict[str, Any]]
) -> None:
    job_id = build_messy_job(store, tmp_path)
    kill(store, job_id, "running", logs, again=True)
    left = f"job {job_id}: left running (the DAG run is running, not failed)"
    (line,) = wait_for(lambda: said(logs, left), timeout_s=WAIT_S, what="the outcome's log line")
    assert line["trigger_id"] == TRIGGER_ID
    job = store.get_job(job_id)
    assert job.state is JobState.RUNNING and job.manifest_uri is None and job.error is None


def test_a_cancelled_job_left_unpublished_is_published_by_the_sensors_next_try(
    store: ManifestStore, tmp_path: Path
) -> None:
    """The recovery docs/airflow.md names when ``on_kill`` could not publish (storage down past
    its retries, the triggerer stopped): clearing the sensor. Its next try publishes the
    cancelled manifest, then fails saying the job was cancelled."""
    job_id = build_messy_job(store, tmp_path)
    store.cancel_job(job_id, reason=f"its DAG run {DAG_ID}/{RUN_ID} failed")
    sensor = CompletenessSensor(task_id="verify", job_id=job_id, store_url=store.url)
    with pytest.raises(AirflowFailException, match=f"job {job_id} ended cancelled; its manifest "):
        sensor.execute(Run().context("verify"))
    job = store.get_job(job_id)
    assert job.state is JobState.CANCELLED and job.manifest_uri
    assert len(read_outcomes(read_manifest(job.manifest_uri))) == job.input_lines
