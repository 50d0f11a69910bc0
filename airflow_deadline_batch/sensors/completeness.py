"""``CompletenessSensor``: succeeds only once the job's manifest is verified and published.

When every shard is terminal it calls the shared ``finalize_job`` (verification of expected vs.
committed outcomes, checksums, then the conditional publication of ``manifest.json``) and emits an
Asset event for the manifest. Anything short of a published manifest fails the task with the
verification report, so downstream tasks never see partial output by accident.

Placed after the shard tasks (``plan >> shards >> done``) it runs once they are all done, whatever
their end (trigger rule ``all_done``), and reads their ends from Airflow: a plan task that failed
ends it in one line (no job was planned), and a shard task that failed for good (retries spent: a
worker that kept crashing, a pod that never started) fails its shard in the store unless the
store has it committed (:meth:`ManifestStore.fail_shard`), so the job is published ``partial``
instead of waiting for ever on a shard nothing will run again. A shard task that failed on a
configuration error (a bad option, another store than the plan's) will run again once fixed and
cleared: its shard is left to run, and the sensor fails in one line saying so, publishing nothing.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import Asset, BaseSensorOperator, TriggerRule, XComArg
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from airflow_deadline_batch.core.clock import UTC, SystemClock
from airflow_deadline_batch.core.states import JobState, ShardState
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.hooks.s3 import connection_s3
from airflow_deadline_batch.hooks.store import ManifestStoreHook
from airflow_deadline_batch.lineage import job_lineage, openlineage_facets
from airflow_deadline_batch.lineage import report as report_lineage
from airflow_deadline_batch.links.progress import DeadlineBatchProgressLink
from airflow_deadline_batch.metrics import emit_job
from airflow_deadline_batch.notifiers.deadline_risk import DeadlineRiskNotifier, track_risk
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.triggers.completeness import (
    CompletenessEvent,
    CompletenessStatus,
    CompletenessTrigger,
    evaluate_progress,
    plain,
)
from airflow_deadline_batch.triggers.pod import min_resume_delay_s

#: Airflow task instance states of a task that ended without running to success, nor was skipped
FAILED_TASK_STATES = frozenset({"failed", "upstream_failed"})


def upstream_tasks(task: Any) -> list[Any]:
    """Every task upstream of ``task`` in its DAG, nearest first."""
    found: list[Any] = []
    seen: set[str] = set()
    queue = sorted(task.upstream_task_ids)
    while queue:
        task_id = queue.pop(0)
        if task_id in seen:
            continue
        seen.add(task_id)
        upstream = task.dag.get_task(task_id)
        found.append(upstream)
        queue.extend(sorted(upstream.upstream_task_ids))
    return found


def is_shard_task(task: Any) -> bool:
    """Whether ``task`` runs shards of a job: a shard operator, mapped or not."""
    from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator, LocalShardOperator

    cls = getattr(task, "operator_class", None) if getattr(task, "is_mapped", False) else type(task)
    return isinstance(cls, type) and issubclass(cls, (DeadlineShardPodOperator, LocalShardOperator))


def task_states(context: Any, task_id: str) -> dict[int, str]:
    """The states of ``task_id``'s instances in this DAG run, by map index (-1: not mapped), read
    from Airflow's API through the running task instance."""
    ti = context["ti"]
    found = ti.get_task_states(dag_id=ti.dag_id, task_ids=[task_id], run_ids=[ti.run_id])
    states: dict[int, str] = {}
    for key, state in (found.get(ti.run_id) or {}).items():
        if key == task_id:
            index = -1
        elif key.startswith(f"{task_id}_") and key[len(task_id) + 1 :].isdigit():
            index = int(key[len(task_id) + 1 :])
        else:
            continue
        states[index] = str(getattr(state, "value", state))
    return states


def shard_specs(task: Any, context: Any) -> list[Mapping[str, Any]]:
    """A shard task's specs by map index: what ``expand_kwargs`` gave each mapped instance (the
    plan's ``[{"job_id", "shard_index"}, ...]`` resolved from its XCom), or the one instance's own
    ``job_id`` and ``shard_index``."""
    if not getattr(task, "is_mapped", False):
        return [{"job_id": task.job_id, "shard_index": task.shard_index}]
    given = task.expand_input.value
    if isinstance(given, XComArg):
        return list(given.resolve(context) or [])
    return [spec if isinstance(spec, Mapping) else spec.resolve(context) for spec in given]


def default_manifest_asset(dag_id: str | None, task_id: str) -> Asset:
    """One Asset per sensor task, so downstream DAGs can schedule on "this job's manifest"."""
    return Asset(
        name=f"deadline_batch_manifest__{dag_id or 'dag'}__{task_id}",
        uri=f"deadline-batch://manifests/{dag_id or 'dag'}/{task_id}",
    )


class CompletenessSensor(BaseSensorOperator):
    """Wait for a job's shards, then verify and publish its manifest.

    :param job_id: the job (templated; default with ``plan_task_id``: that task's XCom ``job_id``).
    :param plan_task_id: the plan task; its job and connection IDs are used unless given here.
    :param store_url: manifest store URL (wins over ``store_conn_id``).
    :param store_conn_id: Airflow connection of the manifest store (default: the plan's).
    :param aws_conn_id: Airflow AWS connection for verification and publication on ``s3://``
        (default: the plan's); without one, the ambient credentials (instance profile, IRSA).
    :param deferrable: wait in the triggerer (:class:`CompletenessTrigger`) instead of a worker slot.
    :param expire_unfinished: once the job's deadline has passed, mark unfinished records
        ``expired`` and publish a partial manifest instead of waiting on.
    :param manifest_asset: the Asset to emit (default: one per DAG and task).
    :param risk_notifier: called once when the job's deadline is predicted to be at risk.
    :param parallelism: workers the job runs at once, for the risk prediction (default: the job's).

    Its ``trigger_rule`` defaults to ``all_done``: placed after the shard tasks
    (``plan >> shards >> done``), it runs once they all ended, whatever their end. Skipped (Airflow
    skips a mapped task whose plan returned no shard: an empty input, or one whose every line is
    invalid), the job's empty manifest is published; failed for good, their shards fail in the
    store (:meth:`settle_failed_shard_tasks`) and the job's ``partial`` manifest is published,
    unless one failed on a configuration error: then nothing is published and the sensor fails
    naming the task to fix and clear; a failed plan ends the sensor in one line (:meth:`check_plan`).
    """

    template_fields: Sequence[str] = ("job_id", "store_url", "store_conn_id")
    operator_extra_links = (DeadlineBatchProgressLink(),)
    ui_color = "#d7f0e3"

    def __init__(
        self,
        *,
        job_id: str | None = None,
        plan_task_id: str | None = None,
        store_url: str | None = None,
        store_conn_id: str | None = None,
        aws_conn_id: str | None = None,
        deferrable: bool = True,
        poke_interval: float = 30.0,
        expire_unfinished: bool = False,
        manifest_asset: Asset | None = None,
        risk_notifier: DeadlineRiskNotifier | None = None,
        parallelism: int | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.ALL_DONE)
        super().__init__(poke_interval=poke_interval, **kwargs)
        if not job_id and not plan_task_id:
            raise ValueError(f"{self.task_id}: give job_id or plan_task_id (the task that planned the job)")
        self.job_id = job_id or ""
        self.plan_task_id = plan_task_id
        self.store_url = store_url
        self.store_conn_id = store_conn_id
        self.aws_conn_id = aws_conn_id
        self._plan_connections: dict[str, str] = {}
        self.deferrable = deferrable
        self.expire_unfinished = expire_unfinished
        self.risk_notifier = risk_notifier
        self.parallelism = parallelism
        self.manifest_asset = manifest_asset or default_manifest_asset(
            self.dag_id if self.has_dag() else None, self.task_id
        )
        if self.manifest_asset not in self.outlets:
            self.outlets = [*self.outlets, self.manifest_asset]
        #: the once-per-crossing risk watch (notifiers.deadline_risk.track_risk); deferred, the
        #: trigger's kwargs carry it
        self._risk_armed = True

    def _resolve_plan(self, context: Any) -> None:
        """Take the job and the connection IDs this task was not given from the plan task's XComs."""
        if not self.plan_task_id:
            return
        ti = context["ti"]
        if not self.job_id:
            self.job_id = str(ti.xcom_pull(task_ids=self.plan_task_id, key="job_id") or "")
            if not self.job_id:
                raise AirflowFailException(f"task {self.plan_task_id!r} pushed no job_id: did it run?")
        self._plan_connections = dict(ti.xcom_pull(task_ids=self.plan_task_id, key="plan_connections") or {})

    def _upstream(self) -> list[Any]:
        return upstream_tasks(self) if self.has_dag() else []

    def check_plan(self, context: Any) -> None:
        """End the task in one line when a plan task upstream failed or was skipped: no job to verify.

        The plan tasks are the upstream ``DeadlineBatchOperator`` tasks and ``plan_task_id``'s.
        """
        from airflow_deadline_batch.operators.plan import DeadlineBatchOperator

        for task in self._upstream():
            if not (isinstance(task, DeadlineBatchOperator) or task.task_id == self.plan_task_id):
                continue
            state = task_states(context, task.task_id).get(-1)
            if state in FAILED_TASK_STATES:
                raise AirflowFailException(
                    f"plan task {task.task_id!r} is {state}: no job was planned, so there is nothing "
                    "to verify (see that task's log)"
                )
            if state == "skipped":
                raise AirflowSkipException(f"plan task {task.task_id!r} was skipped: no job to verify")

    def settle_failed_shard_tasks(self, context: Any) -> None:
        """Fail in the store the shards of this job whose Airflow task failed for good.

        The sensor runs after its upstream tasks ended (``all_done``), so a shard task upstream
        that failed has no retry left and nothing will run its shard again: its uncommitted
        records must get ``errored`` / ``shard_failed`` outcomes rather than leave the job
        unfinished for ever. The store is the truth for records: a shard it has ``succeeded``
        (the commit landed, then the task was lost) stays succeeded (``ManifestStore.fail_shard``).

        A shard task that failed on a configuration error (it pushed
        :data:`~airflow_deadline_batch.operators.shard.CONFIGURATION_ERROR_KEY`) is the exception:
        the user fixes it and clears the task, which runs the shard, so failing the shard would
        lose its records for the whole job. Its shard is left to run, and once the others are
        settled this task fails in one line naming each such task, its error and the fix; the job
        stays open and nothing is published (the sensor is not deferred, so nothing cancels it).
        """
        from airflow_deadline_batch.operators.shard import CONFIGURATION_ERROR_KEY

        store = None
        misconfigured: list[tuple[str, str]] = []
        for task in self._upstream():
            if not is_shard_task(task):
                continue
            failed = sorted(i for i, state in task_states(context, task.task_id).items() if state == "failed")
            if not failed:
                continue
            specs = shard_specs(task, context)
            for map_index in failed:
                spec = specs[max(map_index, 0)]
                if str(spec.get("job_id")) != self.job_id:
                    continue
                name = task.task_id if map_index < 0 else f"{task.task_id}[{map_index}]"
                error = context["ti"].xcom_pull(
                    task_ids=task.task_id, key=CONFIGURATION_ERROR_KEY, map_indexes=map_index
                )
                if error:
                    misconfigured.append((name, str(error)))
                    continue
                store = store or self._hook().get_store()
                index = int(spec["shard_index"])
                after = store.fail_shard(
                    self.job_id, index, f"its Airflow task {name} failed for good (no retry left)"
                )
                self.log.warning(
                    "job %s: shard task %s failed for good; shard %s is %s in the store%s",
                    self.job_id,
                    name,
                    index,
                    after.value,
                    "" if after is ShardState.TERMINAL_FAILURE else " (the store's state stands)",
                )
        if misconfigured:
            plural = "s" if len(misconfigured) > 1 else ""
            names = ", ".join(name for name, _ in misconfigured)
            errors = "; ".join(f"{name}: {error}" for name, error in misconfigured)
            raise AirflowFailException(
                f"job {self.job_id}: shard task{plural} {names} failed on a configuration error "
                f"({errors}); fix {'them' if plural else 'it'}, then clear {names} and {self.task_id}: "
                "the job stays open, nothing was published"
            )

    def _store_conn_id(self) -> str | None:
        return self.store_conn_id or self._plan_connections.get("store_conn_id")

    def _aws_conn_id(self) -> str | None:
        return self.aws_conn_id or self._plan_connections.get("aws_conn_id")

    def _hook(self) -> ManifestStoreHook:
        return ManifestStoreHook(store_conn_id=self._store_conn_id(), store_url=self.store_url)

    def _progress(self) -> dict[str, Any]:
        store = self._hook().get_store()
        progress = plain(store.progress(self.job_id))
        emit_job(store, self.job_id, dag_id=self.dag_id if self.has_dag() else None, now=dt.datetime.now(UTC))
        return progress

    def _check_store(self) -> None:
        """Fail at once, saying so, when this task reads another store than the plan's."""
        try:
            self._hook().get_job_store(
                self.job_id, plan_store_conn_id=self._plan_connections.get("store_conn_id")
            )
        except ConfigurationError as exc:
            raise AirflowFailException(str(exc)) from exc

    def _past_deadline(self, progress: dict[str, Any]) -> bool:
        deadline = progress.get("deadline")
        if not deadline:
            return False
        return dt.datetime.now(UTC) >= dt.datetime.fromisoformat(str(deadline))

    def _check_risk(self, context: Any) -> None:
        if self.risk_notifier is None:
            return
        store = self._hook().get_store()
        view = read_job_view(store, self.job_id, now=dt.datetime.now(UTC), parallelism=self.parallelism)
        watch = track_risk(
            view,
            self.risk_notifier.threshold_s,
            armed=self._risk_armed,
            attempts=store.list_attempts(self.job_id),
        )
        self._risk_armed = watch.armed
        if watch.alert is not None:
            self.risk_notifier.notify_risk(context, watch.alert)

    def _risk_trigger_kwargs(self) -> dict[str, Any]:
        if self.risk_notifier is None:
            return {}
        return {"risk_threshold_s": self.risk_notifier.threshold_s, "risk_armed": self._risk_armed}

    def execute(self, context: Any) -> Any:
        """Deferrable: finish at once when the job is already over, else wait in the triggerer.

        A job that is over when the sensor starts (the usual case when the sensor runs after the
        shard tasks) is verified and published here, without a triggerer round trip. Otherwise the
        :class:`CompletenessTrigger` takes over; its first read comes ``max(poke_interval,
        [deadline_batch] min_resume_delay_s)`` later: a task that resumes within a scheduler loop
        of deferring can be failed by Airflow 3.3's scheduler (docs/airflow.md, *Resuming tasks*).
        """
        self.check_plan(context)
        self._resolve_plan(context)
        self._check_store()
        self.settle_failed_shard_tasks(context)
        DeadlineBatchProgressLink.persist(context, self.job_id)
        if not self.deferrable:
            return super().execute(context)
        progress = self._progress()
        self._check_risk(context)
        event = evaluate_progress(self.job_id, progress)
        if event is None and self.expire_unfinished and self._past_deadline(progress):
            event = CompletenessEvent(CompletenessStatus.TIMEOUT, self.job_id, progress, "deadline passed")
        if event is not None:
            return self._finish(context, event)
        try:
            resume_delay = min_resume_delay_s()
        except ConfigurationError as exc:  # a bad setting: no retry can fix it
            raise AirflowFailException(str(exc)) from exc
        timeout_at = dt.datetime.now(UTC) + dt.timedelta(seconds=self.timeout)
        if self.expire_unfinished and progress.get("deadline"):
            timeout_at = min(timeout_at, dt.datetime.fromisoformat(str(progress["deadline"])))
        self.log.info(
            "job %s: %s/%s records committed; deferring until every shard is terminal (at most until %s)",
            self.job_id,
            progress.get("committed_records"),
            progress.get("total_records"),
            timeout_at.isoformat(),
        )
        self.defer(
            trigger=CompletenessTrigger(
                job_id=self.job_id,
                store_url=self.store_url,
                store_conn_id=self._store_conn_id(),
                poll_interval_s=self.poke_interval,
                timeout_at=timeout_at.isoformat(),
                dag_id=self.dag_id if self.has_dag() else None,
                aws_conn_id=self._aws_conn_id(),
                first_poll_delay_s=max(self.poke_interval, resume_delay),
                **self._risk_trigger_kwargs(),
            ),
            method_name="execute_complete",
        )

    def poke(self, context: Any) -> bool:
        progress = self._progress()
        self._check_risk(context)
        event = evaluate_progress(self.job_id, progress)
        if event is None and self.expire_unfinished and self._past_deadline(progress):
            event = CompletenessEvent(CompletenessStatus.TIMEOUT, self.job_id, progress, "deadline passed")
        if event is None:
            self.log.info(
                "job %s: %s/%s records committed; waiting",
                self.job_id,
                progress.get("committed_records"),
                progress.get("total_records"),
            )
            return False
        self._finish(context, event)
        return True

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Input and published manifest (the model as a facet) for OpenLineage; None without its provider."""
        return openlineage_facets(getattr(self, "_lineage", None))

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        """Resume after the trigger: finalize on a terminal job, fail clearly on anything else."""
        self._resolve_plan(context)
        completeness = CompletenessEvent.from_payload(event)
        if completeness.status is CompletenessStatus.RISK:
            # the trigger's risk watch fired or re-armed: alert, then wait on with its new state
            if completeness.risk is not None and self.risk_notifier is not None:
                self.risk_notifier.notify_payload(context, completeness.risk)
            self.defer(
                trigger=CompletenessTrigger(**(completeness.resume or {})), method_name="execute_complete"
            )
        return self._finish(context, completeness)

    def _finish(self, context: Any, event: CompletenessEvent) -> str:
        self.log.info("%s", event.message)
        if event.status is CompletenessStatus.ERROR:
            raise AirflowException(f"{event.message}; check the store connection (the task will retry)")
        expire = event.status is CompletenessStatus.TIMEOUT
        if expire and not self.expire_unfinished:
            raise AirflowFailException(
                f"{event.message}; nothing was published. Set expire_unfinished=True to publish a "
                "partial manifest after the deadline, or raise the sensor's timeout"
            )
        from airflow_deadline_batch.service.finalize import finalize_job

        # verification reads and publication writes go through the AWS connection, if any
        with connection_s3(self._aws_conn_id()):
            result = finalize_job(
                self._hook().get_store(), self.job_id, clock=SystemClock(), expire_unfinished=expire
            )
        summary = result.report.summary()
        self.log.info("verification of job %s: %s", self.job_id, summary)
        if result.manifest_uri is None:
            raise AirflowFailException(
                f"job {self.job_id} ended {result.state.value} without a published manifest: {summary}"
            )
        state = result.state.value
        if result.state is not JobState.COMPLETED and not (
            result.state is JobState.PARTIAL and self.expire_unfinished
        ):
            # every line has an outcome, but some are not results (shards failed, cancelled):
            # downstream tasks must opt in to partial output
            raise AirflowFailException(
                f"job {self.job_id} ended {state}; its manifest {result.manifest_uri} lists failed, "
                f"expired or cancelled outcomes: {summary}. Set expire_unfinished=True to accept "
                "partial output downstream"
            )
        outcomes = result.report.outcomes
        self._lineage = job_lineage(
            self._hook().get_store().get_job(self.job_id),
            manifest_uri=result.manifest_uri,
            model_digests=result.report.model_digests,
        )
        report_lineage(self, self._lineage)
        extra = {
            **self._lineage.facts(),
            "job_id": self.job_id,
            "manifest_uri": result.manifest_uri,
            "input_uri": self._lineage.input_uri,
            "state": state,
            "records": result.report.expected,
            "outcomes": {str(k): int(v) for k, v in outcomes.items()},
        }
        outlet_events = context.get("outlet_events") if hasattr(context, "get") else None
        if outlet_events is not None:
            outlet_events[self.manifest_asset].extra.update(extra)
        context["ti"].xcom_push(key="manifest_uri", value=result.manifest_uri)
        DeadlineBatchProgressLink.persist(context, self.job_id, result.manifest_uri)
        self.log.info("published manifest %s", result.manifest_uri)
        return result.manifest_uri
