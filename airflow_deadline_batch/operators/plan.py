"""``DeadlineBatchOperator``: validate, estimate, admit and partition a job; hand out shard specs.

It calls the shared planner (``service.planning.plan_job``) that the CLI uses too, so the DAG and
``deadline-batch plan`` give the same verdict. The default idempotency key is
``{dag_id}/{run_id}/{task_id}``: re-running the task returns the job it created the first time,
unless admission rejected that job: a rejected job does not keep its key, so a retry (or a clear)
of the task runs admission afresh. A refusal by shared capacity, a quota or a budget
(``rejected_shared``) may pass later, so it fails the try with the task's retries left to run; a
job infeasible alone or with too many invalid lines fails the task for good.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_deadline_batch.core.clock import Clock, SystemClock
from airflow_deadline_batch.core.deadlines import parse_deadline
from airflow_deadline_batch.core.feasibility import AdmissionReport
from airflow_deadline_batch.core.pools import PoolSpec, default_local_pools
from airflow_deadline_batch.core.tenants import DEFAULT_TENANT, check_tenant
from airflow_deadline_batch.exceptions import AdmissionRejected, ConfigurationError, InputError
from airflow_deadline_batch.hooks.s3 import connection_s3
from airflow_deadline_batch.hooks.store import ManifestStoreHook
from airflow_deadline_batch.lineage import job_lineage, openlineage_facets
from airflow_deadline_batch.lineage import report as report_lineage
from airflow_deadline_batch.links.progress import DeadlineBatchProgressLink
from airflow_deadline_batch.notifiers.deadline_risk import DeadlineRiskNotifier, assess_risk
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.service.admission import REJECTED_SHARED
from airflow_deadline_batch.triggers.completeness import plain

if TYPE_CHECKING:
    from airflow_deadline_batch.service.planning import PlanRequest
    from airflow_deadline_batch.store import ManifestStore


def report_dict(report: AdmissionReport | Mapping[str, Any] | None) -> dict[str, Any]:
    """The admission report as plain values (XCom-safe)."""
    if report is None:
        return {}
    if isinstance(report, AdmissionReport):
        return dict(plain(report.to_dict()))
    return dict(plain(report))


def report_summary(report: AdmissionReport | Mapping[str, Any]) -> str:
    if isinstance(report, AdmissionReport):
        return report.summary()
    data = report_dict(report)
    reasons = data.get("reasons") or []
    return f"verdict {data.get('verdict', '?')}: " + "; ".join(map(str, reasons))


def shard_kwargs(spec: Mapping[str, Any], connections: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The literal kwargs a shard task gets from one planner spec (mapped fields are not templated).

    ``plan_connections`` carries the plan's connection IDs (never a URL or a secret), so a DAG names
    them on the plan task only; a shard's own ``store_conn_id``/``aws_conn_id`` win over them. The
    key is not an argument name of its own because ``expand_kwargs`` lets mapped values override
    ``partial()`` ones, and explicit arguments must win.
    """
    kwargs: dict[str, Any] = {"job_id": str(spec["job_id"]), "shard_index": int(spec["shard_index"])}
    if connections:
        kwargs["plan_connections"] = dict(connections)
    return kwargs


def default_idempotency_key(context: Mapping[str, Any]) -> str:
    ti = context["ti"]
    return f"{ti.dag_id}/{context['run_id']}/{ti.task_id}"


class DeadlineBatchOperator(BaseOperator):
    """Plan one deadline-bound batch job and return its shard specs for ``expand_kwargs``.

    :param input_uri: JSON Lines input, a local path or ``s3://bucket/key`` (templated).
    :param deadline: aware datetime, ISO-8601 instant or ``+DURATION`` from now (templated).
    :param output_uri: output base, a local directory or ``s3://bucket/prefix`` (templated).
    :param store_url: manifest store URL (wins over ``store_conn_id``; templated).
    :param store_conn_id: Airflow connection of the manifest store.
    :param aws_conn_id: Airflow AWS connection for ``s3://`` input and output.
    :param engine: ``echo``, ``transformers``, ``vllm`` or ``openai``.
    :param model: model name or path for the engine.
    :param generation: generation parameters (``max_tokens``, ``temperature``, ...).
    :param pools: Spot and on-demand pools (``PoolSpec`` or dicts); default: the local CPU pools.
    :param workers: shards run at once.
    :param idempotency_key: default ``{dag_id}/{run_id}/{task_id}`` (templated).
    :param risk_notifier: alerted when admission leaves less slack than its threshold.
    :param tenant: the team the job belongs to (docs/tenants.md; templated); default: the task's
        owner (the DAG's ``default_args`` owner) when it is a valid tenant name and not Airflow's
        default owner (``[operators] default_owner``, ``airflow``), else ``default``.
    """

    template_fields: Sequence[str] = (
        "input_uri",
        "deadline",
        "output_uri",
        "store_url",
        "store_conn_id",
        "idempotency_key",
        "model",
        "engine",
        "tenant",
    )
    operator_extra_links = (DeadlineBatchProgressLink(),)
    ui_color = "#e8e0f7"

    def __init__(
        self,
        *,
        input_uri: str,
        deadline: str | dt.datetime,
        output_uri: str,
        store_url: str | None = None,
        store_conn_id: str | None = None,
        aws_conn_id: str | None = None,
        engine: str = "echo",
        model: str | None = None,
        generation: Mapping[str, Any] | None = None,
        pools: Sequence[PoolSpec | Mapping[str, Any]] | None = None,
        workers: int = 4,
        idempotency_key: str | None = None,
        microbatch_size: int = 16,
        max_invalid_fraction: float = 0.1,
        max_attempts: int = 10,
        risk_notifier: DeadlineRiskNotifier | None = None,
        clock: Clock | None = None,
        tenant: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.tenant = tenant
        self.input_uri = input_uri
        self.deadline = deadline
        self.output_uri = output_uri
        self.store_url = store_url
        self.store_conn_id = store_conn_id
        self.aws_conn_id = aws_conn_id
        self.engine = engine
        self.model = model
        self.generation = dict(generation or {})
        self.pools = [p.to_dict() if isinstance(p, PoolSpec) else dict(p) for p in pools] if pools else None
        self.workers = workers
        self.idempotency_key = idempotency_key
        self.microbatch_size = microbatch_size
        self.max_invalid_fraction = max_invalid_fraction
        self.max_attempts = max_attempts
        self.risk_notifier = risk_notifier
        self.clock = clock

    def build_request(self, context: Mapping[str, Any], now: dt.datetime) -> PlanRequest:
        from airflow_deadline_batch.service.planning import PlanRequest

        if self.pools:
            pools = tuple(PoolSpec.from_dict(p) for p in self.pools)
        else:  # the embedded default: CPU "pools" rated for this engine
            pools = default_local_pools(self.engine)
        try:
            deadline = parse_deadline(self.deadline, now)
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from exc
        return PlanRequest(
            input_uri=str(self.input_uri),
            deadline=deadline,
            output_uri=str(self.output_uri),
            engine=self.engine,
            model=self.model,
            generation=self.generation,
            pools=pools,
            workers=self.workers,
            idempotency_key=self.idempotency_key or default_idempotency_key(context),
            microbatch_size=self.microbatch_size,
            max_invalid_fraction=self.max_invalid_fraction,
            max_attempts=self.max_attempts,
            tenant=self.resolve_tenant(),
        )

    def resolve_tenant(self) -> str:
        """The ``tenant`` argument, else the first owner if it is a valid tenant name, else ``default``."""
        if self.tenant:
            try:
                return check_tenant(str(self.tenant))
            except ValueError as exc:
                raise AirflowFailException(str(exc)) from exc
        owner = str(self.owner or "").split(",")[0].strip().lower()
        if owner == _airflow_default_owner():  # no owner given: Airflow filled in its default
            return DEFAULT_TENANT
        try:
            return check_tenant(owner)
        except ValueError:
            return DEFAULT_TENANT

    def execute(self, context: Any) -> list[dict[str, Any]]:
        from airflow_deadline_batch.service.planning import plan_job

        clock = self.clock or SystemClock()
        ti = context["ti"]
        store = ManifestStoreHook(store_conn_id=self.store_conn_id, store_url=self.store_url).get_store(
            migrate=True
        )
        try:
            request = self.build_request(context, clock.now())
            with connection_s3(self.aws_conn_id):
                result = plan_job(store, request, clock=clock)
        except AdmissionRejected as exc:
            report = exc.fields.get("report")
            ti.xcom_push(key="admission_report", value=report_dict(report))
            summary = report_summary(report) if report is not None else exc.message
            self.log.error("admission rejected the job:\n%s", summary)
            if exc.fields.get("job_id"):
                DeadlineBatchProgressLink.persist(context, str(exc.fields["job_id"]))
            message = f"job rejected at admission: {exc.message}\n{summary}"
            if report_dict(report).get("verdict") == REJECTED_SHARED:
                # capacity frees as admitted jobs finish: the task's retries re-run admission
                raise AirflowException(message) from exc
            raise AirflowFailException(message) from exc
        except (InputError, ConfigurationError) as exc:
            raise AirflowFailException(str(exc)) from exc
        ti.xcom_push(key="admission_report", value=report_dict(result.report))
        ti.xcom_push(key="job_id", value=result.job_id)
        ti.xcom_push(key="plan_connections", value=self.plan_connections())
        self.log.info(
            "job %s %s; admission:\n%s",
            result.job_id,
            "created" if result.created else "already existed (same idempotency key)",
            report_summary(result.report),
        )
        self.log.info("progress: %s", DeadlineBatchProgressLink.persist(context, result.job_id))
        self._lineage = job_lineage(store.get_job(result.job_id))
        report_lineage(self, self._lineage)
        self._warn_if_thin(context, store, result.job_id, clock)
        connections = self.plan_connections()
        return [shard_kwargs(spec, connections) for spec in result.shard_specs]

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """The job's input (and the model as a facet) for OpenLineage; None without its provider."""
        return openlineage_facets(getattr(self, "_lineage", None))

    def plan_connections(self) -> dict[str, str]:
        """The connection IDs shard tasks and the sensor inherit (XCom ``plan_connections``)."""
        named = (("store_conn_id", self.store_conn_id), ("aws_conn_id", self.aws_conn_id))
        return {key: str(value) for key, value in named if value}

    def _warn_if_thin(self, context: Any, store: ManifestStore, job_id: str, clock: Clock) -> None:
        if self.risk_notifier is None:
            return
        view = read_job_view(store, job_id, now=clock.now(), parallelism=self.workers)
        risk = assess_risk(view, threshold_s=self.risk_notifier.threshold_s)
        if risk is not None:
            self.risk_notifier.notify_risk(context, risk)


def _airflow_default_owner() -> str:
    """Airflow's ``[operators] default_owner`` (what a task without an owner gets), lower-cased."""
    try:
        from airflow.configuration import conf

        return str(conf.get("operators", "default_owner", fallback="airflow")).strip().lower()
    except Exception:  # no configuration to read: Airflow's own default
        return "airflow"
