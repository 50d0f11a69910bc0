"""``CompletenessTrigger``: waits in the triggerer until every shard of a job is terminal.

It polls the manifest store's committed progress (never attempts: docs/design.md §4.5, invariant 4)
in a worker thread and yields exactly one typed event. ``run()`` never raises: a store failure
becomes an ``error`` event so the sensor can report it instead of the triggerer logging a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import datetime as dt
import enum
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from airflow.triggers.base import BaseTrigger, TriggerEvent
from tenacity import RetryCallState, Retrying, stop_after_attempt, wait_exponential

from airflow_deadline_batch.core.clock import UTC, ensure_aware
from airflow_deadline_batch.core.job_view import JobView, is_stopped
from airflow_deadline_batch.core.states import TERMINAL_SHARD_STATES, ShardState
from airflow_deadline_batch.metrics import emit_view

if TYPE_CHECKING:
    from airflow_deadline_batch.store import ManifestStore

_T = TypeVar("_T")


class CompletenessStatus(str, enum.Enum):
    """What the trigger saw: all shards done, some failed, the store failed, or time ran out."""

    COMPLETE = "complete"
    FAILED = "failed"
    ERROR = "error"
    TIMEOUT = "timeout"
    #: the deadline-risk watch changed state (an alert to send, or re-armed); the sensor re-defers
    RISK = "risk"


@dataclasses.dataclass(frozen=True)
class CompletenessEvent:
    """The one event a :class:`CompletenessTrigger` yields, as typed data (payload is its dict)."""

    status: CompletenessStatus
    job_id: str
    progress: dict[str, Any]
    message: str
    #: ``risk`` events only: the alert (``RiskAssessment.to_dict()``) or None on a re-arm
    risk: dict[str, Any] | None = None
    #: ``risk`` events only: the trigger's kwargs to re-defer with (the watch's new state in them)
    resume: dict[str, Any] | None = None

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "status": self.status.value,
            "job_id": self.job_id,
            "progress": self.progress,
            "message": self.message,
        }
        if self.status is CompletenessStatus.RISK:
            payload.update(risk=self.risk, resume=self.resume)
        return payload

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> CompletenessEvent:
        return cls(
            status=CompletenessStatus(payload["status"]),
            job_id=str(payload["job_id"]),
            progress=dict(payload.get("progress") or {}),
            message=str(payload.get("message", "")),
            risk=dict(payload["risk"]) if payload.get("risk") else None,
            resume=dict(payload["resume"]) if payload.get("resume") else None,
        )


def plain(value: Any) -> Any:
    """JSON-able copy of a progress value: dataclasses, enums, datetimes and mappings flattened."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    return value


def evaluate_progress(job_id: str, progress: Mapping[str, Any]) -> CompletenessEvent | None:
    """Decide from plain progress whether the wait is over (pure; ``None`` means keep polling)."""
    by_state = {ShardState(k): int(v) for k, v in (progress.get("shards_by_state") or {}).items()}
    total_shards = sum(by_state.values())
    unfinished = sum(n for s, n in by_state.items() if s not in TERMINAL_SHARD_STATES)
    failed = by_state.get(ShardState.TERMINAL_FAILURE, 0)
    job_state = str(progress.get("state") or "")
    counts = (
        f"{progress.get('committed_records', 0)}/{progress.get('total_records', 0)} records "
        f"committed, {total_shards - unfinished}/{total_shards} shards terminal"
    )
    if unfinished == 0 and failed == 0:
        return CompletenessEvent(
            CompletenessStatus.COMPLETE,
            job_id,
            dict(progress),
            f"job {job_id}: every shard succeeded ({counts})",
        )
    if unfinished == 0:
        return CompletenessEvent(
            CompletenessStatus.FAILED,
            job_id,
            dict(progress),
            f"job {job_id}: {failed} shard(s) failed terminally ({counts})",
        )
    if job_state and is_stopped(job_state):
        cause = f": {progress['error']}" if progress.get("error") else ""
        return CompletenessEvent(
            CompletenessStatus.FAILED,
            job_id,
            dict(progress),
            f"job {job_id} is {job_state} with {unfinished} unfinished shard(s) ({counts}){cause}",
        )
    return None


@dataclasses.dataclass(frozen=True)
class _Poll:
    """What one poll read: the progress, and the job view with the attempts (None if unreadable)."""

    progress: dict[str, Any]
    view: JobView | None
    attempts: Sequence[Any]


class CompletenessTrigger(BaseTrigger):
    """Poll a job's committed progress until all shards are terminal, the job stops, or ``timeout_at``.

    :param job_id: the job to watch.
    :param store_url: SQLAlchemy URL of the manifest store (wins over ``store_conn_id``).
    :param store_conn_id: Airflow connection of the manifest store.
    :param poll_interval_s: seconds between two progress reads.
    :param timeout_at: ISO-8601 aware instant after which a ``timeout`` event is sent; absolute so a
        triggerer restart does not restart the clock.
    :param dag_id: the sensor's DAG, the ``dag_id`` tag of the metrics each poll sends
        (:func:`airflow_deadline_batch.metrics.emit_view`).
    :param aws_conn_id: the AWS connection :meth:`on_kill` publishes a cancelled job's manifest with.
    :param first_poll_delay_s: seconds before the first read. The sensor sets it (it has just read
        progress itself) so that the task never resumes within seconds of deferring: Airflow 3.3's
        scheduler can fail a task that resumes before it has processed the executor's report of the
        try that deferred (docs/airflow.md, *Resuming tasks*).
    :param risk_threshold_s: watch the deadline risk (``notifiers.deadline_risk.track_risk``) with
        this threshold; a ``risk`` event when the watch fires or re-arms. None: no watch.
    :param risk_armed: the watch's state, persisted here so a triggerer restart keeps it.
    """

    def __init__(
        self,
        *,
        job_id: str,
        store_url: str | None = None,
        store_conn_id: str | None = None,
        poll_interval_s: float = 30.0,
        timeout_at: str | None = None,
        dag_id: str | None = None,
        aws_conn_id: str | None = None,
        first_poll_delay_s: float = 0.0,
        risk_threshold_s: float | None = None,
        risk_armed: bool = True,
    ) -> None:
        super().__init__()
        self.job_id = job_id
        self.store_url = store_url
        self.store_conn_id = store_conn_id
        self.poll_interval_s = float(poll_interval_s)
        self.timeout_at = timeout_at
        self.dag_id = dag_id
        self.aws_conn_id = aws_conn_id
        self.first_poll_delay_s = max(0.0, float(first_poll_delay_s))
        self.risk_threshold_s = None if risk_threshold_s is None else float(risk_threshold_s)
        self.risk_armed = bool(risk_armed)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs: dict[str, Any] = {
            "job_id": self.job_id,
            "store_url": self.store_url,
            "store_conn_id": self.store_conn_id,
            "poll_interval_s": self.poll_interval_s,
            "timeout_at": self.timeout_at,
            "dag_id": self.dag_id,
            "aws_conn_id": self.aws_conn_id,
            "first_poll_delay_s": self.first_poll_delay_s,
        }
        if self.risk_threshold_s is not None:
            kwargs.update(risk_threshold_s=self.risk_threshold_s, risk_armed=self.risk_armed)
        return ("airflow_deadline_batch.triggers.completeness.CompletenessTrigger", kwargs)

    def _watch_risk(self, poll: _Poll) -> CompletenessEvent | None:
        """A ``risk`` event when the once-per-crossing watch fires or re-arms; None otherwise."""
        from airflow_deadline_batch.notifiers.deadline_risk import track_risk

        if self.risk_threshold_s is None or poll.view is None:
            return None
        try:
            armed, attempts = self.risk_armed, poll.attempts
            watch = track_risk(poll.view, self.risk_threshold_s, armed=armed, attempts=attempts)
        except Exception:  # the alert is best effort: it never ends the wait for completeness
            self.log.warning("job %s: deadline-risk watch failed; polling on", self.job_id, exc_info=True)
            return None
        if watch.alert is None and watch.armed == self.risk_armed:
            return None
        what = watch.alert.reason if watch.alert else "slack is back above the threshold; re-armed"
        return CompletenessEvent(
            CompletenessStatus.RISK,
            self.job_id,
            poll.progress,
            f"job {self.job_id}: deadline risk: {what}",
            risk=watch.alert.to_dict() if watch.alert else None,
            resume={**self.serialize()[1], "risk_armed": watch.armed},
        )

    def _poll(self, store: ManifestStore) -> _Poll:
        """One read of the job: its progress (what the wait decides on), and the job view the
        metrics and the risk watch share (best effort: a failure there never ends the wait)."""
        from airflow_deadline_batch.operators.placement import job_view_of

        progress = plain(store.progress(self.job_id))
        try:
            job, shards = store.get_job(self.job_id), store.list_shards(self.job_id)
            commits, attempts = store.list_commits(self.job_id), store.list_attempts(self.job_id)
            view = job_view_of(job, shards, commits, attempts, now=dt.datetime.now(UTC))
        except Exception:
            self.log.warning("job %s: reading the job view failed; polling on", self.job_id, exc_info=True)
            return _Poll(progress, None, ())
        emit_view(view, attempts, commits, dag_id=self.dag_id)
        return _Poll(progress, view, attempts)

    def _open_store(self) -> ManifestStore:
        from airflow_deadline_batch.hooks.store import ManifestStoreHook

        return ManifestStoreHook(store_conn_id=self.store_conn_id, store_url=self.store_url).get_store()

    def _timed_out(self) -> bool:
        if not self.timeout_at:
            return False
        deadline = ensure_aware(dt.datetime.fromisoformat(self.timeout_at), "timeout_at")
        return dt.datetime.now(UTC) >= deadline

    async def run(self) -> AsyncIterator[TriggerEvent]:
        progress: dict[str, Any] = {}
        try:
            # The store's drivers are synchronous; a thread keeps the triggerer's event loop free.
            store = await asyncio.to_thread(self._open_store)
            if self.first_poll_delay_s:
                await asyncio.sleep(self.first_poll_delay_s)
            while True:
                poll = await asyncio.to_thread(self._poll, store)
                progress = poll.progress
                event = evaluate_progress(self.job_id, progress)
                if event is not None:
                    break
                if self._timed_out():
                    event = CompletenessEvent(
                        CompletenessStatus.TIMEOUT,
                        self.job_id,
                        progress,
                        f"job {self.job_id}: shards still unfinished at {self.timeout_at}",
                    )
                    break
                if self.risk_threshold_s is not None:
                    event = self._watch_risk(poll)
                    if event is not None:
                        break
                await asyncio.sleep(self.poll_interval_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never raise from a trigger: report it as an event instead
            event = CompletenessEvent(
                CompletenessStatus.ERROR,
                self.job_id,
                progress,
                f"job {self.job_id}: reading progress failed: {exc}",
            )
        yield TriggerEvent(event.to_payload())

    async def on_kill(self) -> None:
        """A user ended the waiting sensor: when its DAG run was failed, cancel the job.

        Airflow calls this when a user acts on the deferred task (fails its run, marks the task
        failed or succeeded, clears it), never on a triggerer restart. Only a *failed DAG run*
        cancels the job: clearing or marking the sensor alone must not throw a night's work
        away. The job then stops leasing, its running attempts are fenced (their next heartbeat
        or commit is refused, so they stop) and its ``cancelled`` manifest is published: every
        committed outcome, ``cancelled`` for every other record.

        The work runs in a thread of its own, started before the first ``await``: Airflow 3.3's
        triggerer cancels the trigger again at each of its loops (about every second) until it
        has ended, and the second cancel ends ``on_kill`` wherever it waits. An ``await`` on the
        DAG run's state or on the publication was cut short there, so a loaded triggerer could
        leave a failed run's job running, or cancelled without its manifest, and log nothing.
        Here a cancelled ``on_kill`` only stops waiting: the thread finishes the cancellation and
        logs its outcome (in the trigger's log while Airflow keeps it open, in the triggerer's
        log after that).
        """
        ti = self.task_instance
        if ti is None:
            return
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()

        def work() -> None:
            try:
                self._cancel_if_run_failed(ti.dag_id, ti.run_id)
            finally:
                with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody waits
                    loop.call_soon_threadsafe(_resolve, ended)

        # the thread logs with the trigger's context (its ID routes the lines to the trigger's log);
        # a daemon, so a stopping triggerer never hangs on it: a job it leaves cancelled without a
        # manifest is published by `deadline-batch cancel` or the sensor's next try (docs/airflow.md)
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(work,), name=f"cancel-{self.job_id}", daemon=True).start()
        try:
            await asyncio.shield(ended)
        except asyncio.CancelledError:
            self.log.info(
                "job %s: Airflow stopped waiting for on_kill; the cancellation goes on", self.job_id
            )
            raise

    def _cancel_if_run_failed(self, dag_id: str, run_id: str) -> None:
        """Cancel the job and publish its manifest if the DAG run failed; log what was done.

        Each step is retried (:data:`_ON_KILL_RETRIES`): a store, S3 or triggerer hiccup must not
        leave a failed run's job running, or cancelled without its manifest.
        """
        try:
            state = self._retrying("asking the DAG run's state", lambda: _dag_run_state(dag_id, run_id))
        except Exception as exc:  # never raise from on_kill: say why nothing was cancelled
            self.log.warning("job %s: not cancelled; the DAG run's state is unknown: %s", self.job_id, exc)
            return
        if state != "failed":
            self.log.info("job %s: left running (the DAG run is %s, not failed)", self.job_id, state)
            return
        try:
            store = self._retrying("opening the store", self._open_store)
            reason = f"its DAG run {dag_id}/{run_id} failed"
            self._retrying("cancelling", lambda: store.cancel_job(self.job_id, reason=reason))
        except Exception as exc:
            self.log.error("job %s: not cancelled after its DAG run failed: %s", self.job_id, exc)
            return
        try:
            manifest = self._retrying("publishing the cancelled manifest", lambda: self._publish(store))
        except Exception as exc:
            self.log.error(
                "job %s cancelled (its DAG run failed), but its manifest was not published: %s; publish "
                "it with `deadline-batch cancel %s` or by clearing the sensor",
                self.job_id,
                exc,
                self.job_id,
            )
            return
        self.log.info("job %s cancelled (its DAG run failed); manifest %s", self.job_id, manifest)

    def _retrying(self, what: str, step: Callable[[], _T]) -> _T:
        """``step()``, tried again (:data:`_ON_KILL_RETRIES`) while it raises, each failure logged."""

        def say(retry: RetryCallState) -> None:
            wait = retry.next_action.sleep if retry.next_action else 0.0
            exc = retry.outcome.exception() if retry.outcome else None
            self.log.warning("job %s: %s failed: %s; trying again in %.0f s", self.job_id, what, exc, wait)

        return Retrying(**_ON_KILL_RETRIES, before_sleep=say)(step)

    def _publish(self, store: ManifestStore) -> str:
        """Publish the cancelled job's manifest; its URI (an error if finalization published none)."""
        from airflow_deadline_batch.hooks.s3 import connection_s3
        from airflow_deadline_batch.service.finalize import finalize_job

        # S3 clients are routed process-wide (storage.s3.use_client): one finalization at a time
        with _PUBLISHING, connection_s3(self.aws_conn_id):
            result = finalize_job(store, self.job_id)
        if result.manifest_uri is None:
            raise RuntimeError(f"the job is {result.state.value} and unpublished: {result.report.summary()}")
        return result.manifest_uri


#: serialises :meth:`CompletenessTrigger.on_kill` publications in the triggerer (see there)
_PUBLISHING = threading.Lock()


def _dag_run_state(dag_id: str, run_id: str) -> str:
    """The DAG run's state, asked of the triggerer's supervisor (Airflow's task SDK)."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    state = RuntimeTaskInstance.get_dagrun_state(dag_id=dag_id, run_id=run_id)
    return str(getattr(state, "value", state))  # a DagRunState (a str enum) or its value


#: how :meth:`CompletenessTrigger.on_kill` retries each of its steps: 5 tries over about 30 s
_ON_KILL_RETRIES: dict[str, Any] = {
    "stop": stop_after_attempt(5),
    "wait": wait_exponential(multiplier=2, max=16),
    "reraise": True,
}


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
