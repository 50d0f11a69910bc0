"""Shard tasks: a ``KubernetesPodOperator`` subclass and its local twin, deciding placement per try.

At every try both re-read the job and the shard, skip a shard that another attempt already
committed, and choose Spot or on-demand from the slack left (:func:`decide_for_try`). The pod
variant turns the decision into node selector, tolerations, labels, startup timeout and grace
period; the store DSN reaches the pod only as a Kubernetes Secret reference.

A failed try is classified once (``core.failures``, docs/design.md §6.6): the worker writes its
class to the termination message (the pod's ``/dev/termination-log``, the local worker's
``$ADB_TERMINATION_LOG``), read here instead of guessing from the exit code. What Airflow lets an
operator do with each class:

* configuration, or a shard whose budget is spent: ``AirflowFailException`` (no retry);
* deterministic: ``AirflowException``, which spends one of the task's ``retries`` (and the store
  spends one of the shard's ``max_attempts`` when the try committed nothing);
* preempted and transient, with ``reschedule_retryable`` (the default, except for a
  ``LocalShardOperator`` that injects preemptions by try number): ``AirflowRescheduleException``
  at now + backoff (transient: jittered exponential, capped, bounded by the job's slack). The task
  goes ``up_for_reschedule`` and comes back with the same try number, so no retry is spent;
  Airflow has no other way for a regular operator to retry without spending a try (a computed
  ``retry_delay`` would still spend one). Without it, they raise ``AirflowException`` as before.

A try that spends the task's last retry (not a configuration error's ``AirflowFailException``,
which the user fixes before clearing the task) fails its shard in the store too
(:meth:`_ShardTryMixin.fail_shard_for_good`), so that a completeness sensor beside the shards sees
it terminal and publishes the job ``partial`` (docs/airflow.md). A configuration error is pushed to
XCom instead (:data:`CONFIGURATION_ERROR_KEY`), so that a completeness sensor after the shards
leaves the shard to run and the job unpublished until the task is fixed and cleared.

Airflow 3.3 can fail a try that resumes too soon after handing its slot back (the resume race,
docs/airflow.md *Resuming tasks*), spending a retry the operator never spent. Every try therefore
runs under :meth:`_ShardTryMixin.run_try`: it records the try in a ledger in Airflow's task state
store and logs (and counts) the earlier tries Airflow ended without the operator; and Airflow's
last try never hands its slot back (no reschedule, no deferral): it waits in the try and runs
again, deterministic failures the store counted included, so the store's ``max_attempts`` decides.
The resume delay is ``[deadline_batch] min_resume_delay_s`` (default 5 s).

A pod that ended (``Succeeded``, ``Failed`` or gone; never one only terminating) ends the attempts
that ran in it and still hold a lease at once, ``abandoned`` with the pod's class, as the local
launcher does for a worker it saw die (:meth:`DeadlineShardPodOperator.end_pod_attempts`,
docs/design.md §4.4): the next try claims without waiting out the lease's TTL, and a crash
(``deterministic``) is no preemption. Attempts are traced to their pod by the worker's name,
``<pod name>:<pid>``: the pod tells its worker its name through the downward API
(:func:`add_pod_name_env`), whatever hostname it has (:func:`attempts_of_pod`).

A Spot pod's wait to be scheduled is the one observation of missing capacity production has: the
pod operator records it as an ``unschedulable`` attempt (``ManifestStore.record_unschedulable``),
from the pod's creation until the try gives up at its startup timeout (:func:`unschedulable_reason`)
or until the pod is scheduled at last (:func:`scheduling_wait`); the next decisions learn the
pool's availability from it (``operators.placement``).

The tail race (issue 13, docs/kubernetes.md "The tail race"): while the pod operator's Spot pod
runs, a thread of its synchronous wait reads the job every ``race_check_interval_s``; once the job
is at its tail (:func:`~operators.placement.tail_has_room`) and
:func:`~operators.placement.race_decision` (the local runner's rule) says so, it creates ONE racer
pod on the on-demand pool, the same pod with the racer's placement and ``worker --race``. The
store's fencing decides the winner; once the shard is done the other pod is deleted, and the try
succeeds whoever finished it. A racer that outlives its Spot pod finishes the shard in the same
try; a later try finds a live racer holding the shard and reschedules instead of launching a pod.
A deferred try races too: its trigger (``triggers.pod.ShardPodTrigger``) hands it back every
``race_check_interval_s`` while the Spot pod runs, and the resumed task decides with the same rule,
the race's state travelling in the trigger's kwargs (:meth:`DeadlineShardPodOperator.race_step`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as dt
import enum
import os
import signal
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import POD_IDENTIFIER_STATE_KEY, KubernetesPodOperator
from airflow.providers.cncf.kubernetes.secret import Secret
from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.providers.cncf.kubernetes.utils.pod_manager import detect_pod_terminate_early_issues
from airflow.sdk import BaseOperator
from airflow.sdk.definitions.mappedoperator import MappedOperator, OperatorPartial
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    AirflowRescheduleException,
    AirflowSkipException,
    AirflowTaskTerminated,
    TaskDeferred,
)
from kubernetes.client import models as k8s
from kubernetes.client.exceptions import ApiException

from airflow_deadline_batch.core.clock import Clock, SystemClock
from airflow_deadline_batch.core.exit_codes import EXIT_OK, EXIT_RETRYABLE, EXIT_TERMINAL
from airflow_deadline_batch.core.failures import (
    FailureClass,
    TryFailure,
    TryLedger,
    backoff_s,
    classify_exit,
    finite_seconds,
    retry_delay_bound_s,
)
from airflow_deadline_batch.core.job_view import JobView
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.core.tenants import DEFAULT_TENANT, check_tenant, kueue_labels
from airflow_deadline_batch.core.worker_command import (
    POD_NAME_ENV,
    WORKER_MODULE,
    given_options,
    worker_arguments,
)
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.hooks.s3 import worker_environment
from airflow_deadline_batch.hooks.store import ManifestStoreHook
from airflow_deadline_batch.links.progress import DeadlineBatchProgressLink
from airflow_deadline_batch.metrics import dag_id_of, emit_decision, emit_race, emit_resume_races
from airflow_deadline_batch.operators.placement import (
    CAPACITY_VALUES,
    LABEL_PREFIX,
    TryAction,
    TryDecision,
    decide_for_try,
    parse_pools,
    pod_placement,
    race_decision,
    read_job_view,
    settled_decision,
    tail_has_room,
)
from airflow_deadline_batch.operators.plan import DeadlineBatchOperator, shard_kwargs
from airflow_deadline_batch.store.rows import AttemptRow
from airflow_deadline_batch.triggers.pod import (
    FIRED_AT_KEY,
    RACE_KEY,
    RUNNING,
    ShardPodTrigger,
    min_resume_delay_s,
    scheduler_latency_s,
)

#: pod / container reasons that mean the node went away under the pod (Spot reclaim, drain, shutdown)
PREEMPTION_REASONS = frozenset(
    {
        "Evicted",
        "Preempting",
        "NodeShutdown",
        "Shutdown",
        "Terminated",
        "NodeLost",
        "UnexpectedAdmissionError",
        "DeletionByTaintManager",
        "PreemptionByScheduler",
        "TerminationByKubelet",
        "EvictionByEvictionAPI",
    }
)


#: how often a shard pod operator looks at its running Spot try for the tail race (``race_check_interval_s``)
RACE_CHECK_S = 30.0
#: the same for a deferred try: each look resumes the task, which takes a worker slot for a few
#: seconds (a task start, a store read, a re-deferral), so 10 shards cost 2 task starts a minute;
#: a shard's tail lasts hours, and a racer 5 minutes late loses little of its gain
DEFERRED_RACE_CHECK_S = 300.0
#: the longest ``race_check_interval_s`` taken (a day; ``race=False`` never looks)
MAX_RACE_CHECK_S = 86_400.0
#: how often, once a racer runs, the operator looks whether the shard is done (at most)
RACE_POLL_S = 2.0
#: seconds of grace of a race's pod deleted once the shard is done: its attempt is over (the store
#: ended it ``lost_race``) and nothing it still writes is ever committed
LOSER_GRACE_S = 2
#: label of a racer pod (``"true"``); a try never reattaches to one (``find_pod`` excludes it)
RACE_LABEL = f"{LABEL_PREFIX}/race"
#: pod phases of a pod that ran to its end
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


#: a shard task's default retries (its preempted and transient tries reschedule without spending one)
SHARD_RETRIES = 5
#: how often Airflow's last try, waiting in its worker slot, reads whether its job stopped or its
#: shard was settled meanwhile (a cancel then ends the try within this, not after the whole wait)
SLOT_CHECK_S = 2.0
#: key of the shard task's :class:`~core.failures.TryLedger` in Airflow's task state store
TRY_LEDGER_KEY = "deadline_batch_tries"
#: XCom key a shard task pushes when a try fails on a configuration error (its message): the shard
#: is still to run once the user fixes it and clears the task, so a completeness sensor after the
#: shards must not fail it. Airflow clears a task's XComs when its next try starts (not when a
#: deferral resumes), so the key is never left over from an earlier try.
CONFIGURATION_ERROR_KEY = "configuration_error"
#: the job ID of the instance :meth:`ShardPartial.probe` unmaps while the DAG file is parsed
PROBE_JOB_ID = "parse-time-probe"
#: ``weight_rule`` for shard tasks: earliest deadline first (``plugins.priority``, registered by the
#: provider's plugin); the class path, so a DAG file need not import Airflow's scheduler side
DEADLINE_WEIGHT_RULE = "airflow_deadline_batch.plugins.priority.DeadlineWeightStrategy"


class ShardFailedInStore(AirflowFailException):
    """The store's verdict on a try: its shard failed for good there (budget spent, input changed).

    Fails the task without retry like any ``AirflowFailException``; unlike the others (a
    configuration error: :data:`CONFIGURATION_ERROR_KEY`), clearing the task cannot run the shard
    again, and the store already has it terminal.
    """


def tenant_pool(tenant: str) -> str:
    """The Airflow pool for a tenant's shard tasks, ``deadline-batch-<tenant>`` (docs/airflow.md).

    Optional: pass it as ``pool=`` to a shard task's ``partial()`` after creating the pool with
    ``airflow pools set deadline-batch-<tenant> <slots> "<description>"``; Airflow then runs at
    most that many of the tenant's shard tasks at once, across all its DAGs.
    """
    return f"deadline-batch-{check_tenant(tenant)}"


class PodOutcome(str, enum.Enum):
    """How a shard pod ended, for the log and the retry decision."""

    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"
    RETRYABLE = "retryable"
    TERMINAL = "terminal"


@dataclasses.dataclass(frozen=True)
class PodClassification:
    outcome: PodOutcome
    reason: str
    exit_code: int | None = None
    #: the worker's own word on the try (its termination message), when it wrote one
    failure: TryFailure | None = None


def parse_termination_message(message: str | bytes | None) -> TryFailure | None:
    """The worker's ``TryFailure`` from a termination message, or None if it wrote none."""
    if not message:
        return None
    import orjson

    try:
        data = orjson.loads(message)
        return TryFailure.from_dict(data) if isinstance(data, dict) else None
    except (orjson.JSONDecodeError, KeyError, ValueError):
        return None


def failure_class_of(found: PodClassification) -> FailureClass | None:
    """The class of a finished pod's try: the worker's word, else the pod's status (None: succeeded)."""
    if found.outcome is PodOutcome.SUCCEEDED:
        return None
    if found.outcome is PodOutcome.PREEMPTED and (found.failure is None or found.exit_code != EXIT_RETRYABLE):
        return FailureClass.PREEMPTED  # evicted, disrupted or killed: whatever the worker said
    if found.failure is not None:
        return found.failure.failure
    if found.outcome is PodOutcome.TERMINAL:
        return FailureClass.CONFIGURATION
    if found.exit_code is not None:
        return classify_exit(found.exit_code, signalled_by_launcher=False)
    return FailureClass.TRANSIENT  # the pod vanished: the node, most likely


def _container_terminated(pod: k8s.V1Pod, container: str) -> k8s.V1ContainerStateTerminated | None:
    statuses = (pod.status.container_statuses if pod.status else None) or []
    for status in statuses:
        if status.name == container and status.state is not None:
            return status.state.terminated or (status.last_state.terminated if status.last_state else None)
    return None


#: reasons a container waits with that no wait fixes: its configuration (a missing Secret, ConfigMap
#: or key, a bad command) cannot be created (the image pull errors are the provider's to judge)
NEVER_STARTS_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError"})


def never_started(pod: k8s.V1Pod, container: str) -> str | None:
    """Why ``pod``'s worker container cannot start, or None (pure): it waits on its configuration
    (:data:`NEVER_STARTS_REASONS`), or on an image the provider finds cannot be pulled
    (``detect_pod_terminate_early_issues``: not a registry's passing outage)."""
    statuses = (pod.status.container_statuses if pod.status else None) or []
    for status in statuses:
        waiting = status.state.waiting if status.name == container and status.state else None
        if waiting is not None and waiting.reason in NEVER_STARTS_REASONS:
            return f"container {container} cannot start: {waiting.reason}: {waiting.message or 'no detail'}"
    issue = detect_pod_terminate_early_issues(pod)
    return " ".join(issue.split()) if issue else None


def classify_pod(pod: k8s.V1Pod | None, container: str = "base") -> PodClassification:
    """Classify a finished shard pod from its status (pure; tests pass real ``V1Pod`` objects).

    A pod whose worker never started for its configuration or image (:func:`never_started`) is
    ``deterministic``, a try the store never saw: each spends one of the task's retries and the last
    one fails (a transient class would relaunch the same pod for ever, docs/airflow.md).
    """
    if pod is None or pod.status is None:
        return PodClassification(PodOutcome.RETRYABLE, "pod vanished before it reported a status")
    status = pod.status
    conditions = status.conditions or []
    disrupted = next((c for c in conditions if c.type == "DisruptionTarget" and c.status == "True"), None)
    terminated = _container_terminated(pod, container)
    if terminated is None and status.phase in ("Pending", None) and (why := never_started(pod, container)):
        unseen = TryFailure(FailureClass.DETERMINISTIC, why, claimed=False)
        return PodClassification(PodOutcome.RETRYABLE, why, failure=unseen)
    code = terminated.exit_code if terminated is not None else None
    said = parse_termination_message(terminated.message if terminated is not None else None)
    if said is not None and code not in (None, EXIT_OK):
        found = _classify_status(status, disrupted, terminated, code)
        return dataclasses.replace(
            found, failure=said, reason=f"{found.reason}: {said.failure.value}: {said.error}"
        )
    return _classify_status(status, disrupted, terminated, code)


def _classify_status(
    status: k8s.V1PodStatus,
    disrupted: k8s.V1PodCondition | None,
    terminated: k8s.V1ContainerStateTerminated | None,
    code: int | None,
) -> PodClassification:
    if code == EXIT_OK and status.phase == "Succeeded":
        return PodClassification(PodOutcome.SUCCEEDED, "worker exited 0", 0)
    if status.reason in PREEMPTION_REASONS:
        return PodClassification(
            PodOutcome.PREEMPTED, f"pod {status.reason}: {status.message or ''}".strip(), code
        )
    if disrupted is not None:
        return PodClassification(
            PodOutcome.PREEMPTED,
            f"DisruptionTarget ({disrupted.reason}): {disrupted.message or ''}".strip(),
            code,
        )
    if code == EXIT_RETRYABLE:
        return PodClassification(
            PodOutcome.PREEMPTED, "worker exited 75 (preempted, lost lease or transient)", code
        )
    if code == EXIT_TERMINAL:
        return PodClassification(PodOutcome.TERMINAL, "worker exited 1 (terminal: see the worker log)", code)
    if code in (128 + signal.SIGTERM, 128 + signal.SIGKILL):
        reason = terminated.reason if terminated is not None else None
        if reason == "OOMKilled":
            return PodClassification(
                PodOutcome.RETRYABLE, "container OOMKilled; raise its memory limit", code
            )
        return PodClassification(PodOutcome.PREEMPTED, f"worker killed by signal (exit {code})", code)
    return PodClassification(
        PodOutcome.RETRYABLE,
        f"pod {status.phase or 'unknown'} with exit code {code} ({status.reason or 'no reason'})",
        code,
    )


#: the longest hostname Kubernetes gives a pod (its name cut to this, docs/kubernetes.md)
POD_HOSTNAME_MAX = 63
#: the downward API's field of the pod's name
POD_NAME_FIELD = "metadata.name"


def pod_hostname(name: str) -> str:
    """The hostname a pod's containers see: its name cut to 63 characters, without a trailing
    ``-`` or ``.`` (the kubelet's ``GeneratePodHostNameAndDomain``), unless the pod has
    ``hostNetwork`` (the node's) or ``spec.hostname``. Workers before ``ADB_POD_NAME`` named their
    attempts ``<hostname>:<pid>``: :func:`attempts_of_pod` still finds those."""
    return name[:POD_HOSTNAME_MAX].rstrip("-.")


def add_pod_name_env(pod: k8s.V1Pod, container: str) -> None:
    """Tell ``pod``'s worker container its pod's name, which it names its attempts after
    (:func:`attempts_of_pod`): env :data:`POD_NAME_ENV` from the downward API (``metadata.name``).

    The name, not the hostname, which is the node's for a pod with ``hostNetwork: true``, and cut to
    63 characters otherwise. A user's env or pod template that sets the variable to the same field
    is kept; to anything else (in any of its entries: Kubernetes takes the last), it is refused
    (:class:`ConfigurationError`), never replaced silently: the operator could no longer end a dead
    pod's attempts (nor with ``--worker-name`` in ``worker_args``: :func:`check_worker_args`).
    """
    worker = next((c for c in pod.spec.containers if c.name == container), None)
    if worker is None:
        return
    env = list(worker.env or [])
    ours = [var for var in env if var.name == POD_NAME_ENV]
    for var in ours:
        ref = var.value_from.field_ref if var.value_from is not None else None
        if var.value is None and ref is not None and ref.field_path == POD_NAME_FIELD:
            continue
        raise ConfigurationError(
            f"container {container!r} of the shard pod sets env {POD_NAME_ENV}, which the operator "
            "sets to the pod's name (its worker names its attempts after it): remove it from "
            "env_vars or the pod template"
        )
    if ours:
        return
    field = k8s.V1ObjectFieldSelector(field_path=POD_NAME_FIELD)
    worker.env = [*env, k8s.V1EnvVar(name=POD_NAME_ENV, value_from=k8s.V1EnvVarSource(field_ref=field))]


def check_worker_args(worker_args: Sequence[str]) -> None:
    """Refuse ``worker_args`` that give an option the operator sets itself
    (:data:`~core.worker_command.OPERATOR_OPTIONS`), in any form the worker's ``argparse`` takes
    (:class:`ConfigurationError` naming them)."""
    if found := given_options(worker_args):
        raise ConfigurationError(
            f"worker_args give {', '.join(found)}, which the shard operator sets itself from the task "
            f"and its decision: remove {', '.join(found)} from worker_args"
        )


def attempts_of_pod(
    attempts: Sequence[AttemptRow], name: str, labels: Mapping[str, str] | None = None
) -> list[AttemptRow]:
    """Which of ``attempts`` ran in pod ``name`` (pure). Their worker is ``<name>:<pid>``, or
    ``<hostname>:<pid>`` (:func:`pod_hostname`) when a worker before ``ADB_POD_NAME`` wrote it
    (a rolling upgrade); the ``:`` keeps a pod from taking the attempts of a pod whose name merely
    starts with its own. A racer pod (label :data:`RACE_LABEL`, or a ``-race`` name when the labels
    are unknown) runs only speculative attempts, a try's own pod none, so that a racer named after
    its Spot pod, whose hostnames are the same once cut to 63 characters, is never taken for it.
    With ``labels``, the pool must match too.
    """
    names = (f"{name}:", f"{pod_hostname(name)}:")
    racer = labels.get(RACE_LABEL) == "true" if labels is not None else name.endswith("-race")
    pool = (labels or {}).get(f"{LABEL_PREFIX}/pool")
    return [
        a
        for a in attempts
        if a.worker.startswith(names) and a.speculative == racer and (pool is None or a.pool == pool)
    ]


def pod_ended(pod: k8s.V1Pod | None, container: str | None = None) -> bool:
    """Whether no container of ``pod`` can still run: it is gone (None), ``Succeeded`` or ``Failed``;
    or, with ``container`` (the worker's), whether that one terminated in a pod that never restarts
    it (``restartPolicy: Never``, the operator's), though a sidecar keeps the pod ``Running``.

    A pod terminating under an eviction is still ``Running`` (its worker may be committing within
    its grace period, and ends its own attempt): not ended.
    """
    if pod is None or (pod.status is not None and pod.status.phase in FINISHED_PHASES):
        return True
    if container is None or pod.spec is None or pod.spec.restart_policy != "Never" or pod.status is None:
        return False
    return any(
        s.name == container and s.state is not None and s.state.terminated is not None
        for s in pod.status.container_statuses or []
    )


def unschedulable_reason(pod: k8s.V1Pod | None) -> str | None:
    """Why a shard pod on Spot waits for capacity, or None (pure; not Spot, scheduled, or started).

    A pod of this package labelled for a Spot pool that is still ``Pending`` with
    ``PodScheduled=False`` (reason ``Unschedulable``: no node fits, the Spot pool has no capacity
    now) is waiting for capacity; a scheduled pod still pulling its image is not.
    """
    if pod is None or pod.status is None or pod.metadata is None:
        return None
    labels = pod.metadata.labels or {}
    if labels.get(f"{LABEL_PREFIX}/capacity") != CAPACITY_VALUES[PoolKind.SPOT]:
        return None
    if pod.status.phase != "Pending":
        return None
    for condition in pod.status.conditions or []:
        if (
            condition.type == "PodScheduled"
            and condition.status == "False"
            and condition.reason == "Unschedulable"
        ):
            return f"pod {pod.metadata.name} unschedulable: {condition.message or 'no node has capacity'}"
    return None


#: a shorter wait to be scheduled is not recorded (timestamps have whole seconds: 1 s apart may be
#: an instant)
MIN_RECORDED_WAIT_S = 2.0


def scheduling_wait(pod: k8s.V1Pod | None) -> tuple[dt.datetime, dt.datetime] | None:
    """When a scheduled shard pod on Spot was created and when it was scheduled, if it waited.

    Pure: from the pod's ``creationTimestamp`` and its ``PodScheduled=True`` condition's
    ``lastTransitionTime``; None when the pod is not on Spot, not scheduled, or waited less than
    :data:`MIN_RECORDED_WAIT_S`. The wait includes a node's provisioning where the cluster
    launches one for the pod (Karpenter): until then, there is no capacity for it either.
    """
    if pod is None or pod.status is None or pod.metadata is None:
        return None
    labels = pod.metadata.labels or {}
    created = pod.metadata.creation_timestamp
    if labels.get(f"{LABEL_PREFIX}/capacity") != CAPACITY_VALUES[PoolKind.SPOT] or created is None:
        return None
    for condition in pod.status.conditions or []:
        if condition.type == "PodScheduled" and condition.status == "True" and condition.last_transition_time:
            scheduled: dt.datetime = condition.last_transition_time
            if (scheduled - created).total_seconds() >= MIN_RECORDED_WAIT_S:
                return created, scheduled
    return None


def checked_pools(pools: Sequence[PoolSpec | Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """A shard operator's ``pools`` as dicts, each entry checked as every decision reads it
    (``PoolSpec.from_dict``), so that a malformed one is refused by the constructor, and so while
    the DAG file is parsed (:class:`ShardPartial`), not at every try of the task."""
    if not pools:
        return None
    out = []
    for i, pool in enumerate(pools):
        try:
            out.append(pool.to_dict() if isinstance(pool, PoolSpec) else dict(pool))
            PoolSpec.from_dict(out[-1])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"pools[{i}] is no pool ({exc}): give a PoolSpec or its dict") from exc
    return out


class ShardPartial(OperatorPartial):
    """``partial()`` of a shard operator: ``expand_kwargs(plan.output)`` bounds its concurrency and
    checks its arguments while the DAG file is parsed.

    Unless ``max_active_tis_per_dagrun`` is given (on ``partial`` or in ``default_args``), the
    mapped shard task runs at most the plan task's ``workers`` at once, the parallelism the plan
    admitted the job with, so a run never holds more GPU pods than the plan budgeted.

    Airflow runs a mapped operator's constructor only in the worker, when it unmaps one instance,
    before any of the operator's code: an argument the constructor (or ``KubernetesPodOperator``'s,
    or ``BaseOperator``'s) refuses would fail every instance there as an ordinary failure, retried
    until its retries are spent, and then the shard is failed for good (docs/airflow.md,
    *CompletenessSensor*). So ``expand_kwargs`` unmaps one probe instance the way the worker will
    (:meth:`probe`): a refused argument is a DAG import error, and nothing runs. A value that only
    the mapped XCom gives cannot be checked so; :func:`note_unbuilt_instance`, added to the task's
    failure callbacks, records its refusal as a configuration error instead.
    """

    @staticmethod
    def default_retries(kwargs: dict[str, Any], retries: int) -> dict[str, Any]:
        """``kwargs`` with ``retries`` unless given or in the DAG's / task group's ``default_args``.

        ``partial()`` fills every unset ``BaseOperator`` argument with Airflow's default (0 retries)
        before the operator's ``__init__`` could set its own, so a mapped shard's default goes here.
        """
        from airflow.sdk.bases.operator import get_merged_defaults
        from airflow.sdk.definitions._internal.contextmanager import DagContext, TaskGroupContext

        if "retries" in kwargs:
            return kwargs
        dag = kwargs.get("dag") or DagContext.get_current()
        group = kwargs.get("task_group") or (TaskGroupContext.get_current(dag) if dag else None)
        defaults, _ = get_merged_defaults(
            dag=dag, task_group=group, task_params=None, task_default_args=kwargs.get("default_args")
        )
        return kwargs if "retries" in defaults else {**kwargs, "retries": retries}

    @classmethod
    def adopt(cls, partial: OperatorPartial) -> ShardPartial:
        """``partial`` as a :class:`ShardPartial`, its failure callbacks with
        :func:`note_unbuilt_instance` after the DAG's own."""
        partial._expand_called = True  # replaced by this one, not forgotten: no "never mapped" warning
        callbacks = [*partial.kwargs["on_failure_callback"], note_unbuilt_instance]
        kwargs = {**partial.kwargs, "on_failure_callback": callbacks}
        return cls(operator_class=partial.operator_class, kwargs=kwargs, params=partial.params)

    def expand_kwargs(self, kwargs: Any, *, strict: bool = True) -> MappedOperator:
        mapped = super().expand_kwargs(kwargs, strict=strict)
        plan = getattr(kwargs, "operator", None)
        workers = getattr(plan, "workers", None)
        if mapped.max_active_tis_per_dagrun is None and isinstance(workers, int) and workers > 0:
            mapped.max_active_tis_per_dagrun = workers
        connections = plan.plan_connections() if isinstance(plan, DeadlineBatchOperator) else None
        self.probe(mapped, shard_kwargs({"job_id": PROBE_JOB_ID, "shard_index": 0}, connections))
        return mapped

    @staticmethod
    def probe(mapped: MappedOperator, spec: Mapping[str, Any]) -> None:
        """Unmap ``mapped`` with ``spec`` (a plan's shard spec) as the worker does, or raise
        :class:`ConfigurationError` in one line naming the refused argument.

        ``MappedOperator.unmap`` is the worker's own path (the same ``partial()`` arguments, the
        DAG's and task group's ``default_args``, ``expand_kwargs``'s duplicate check): the probe is
        built with ``_airflow_from_mapped``, so Airflow adds it to neither the DAG's tasks nor the
        task group. Only the mapped values differ (the plan's are a job ID, a shard index and its
        connection IDs, which no constructor refuses). Airflow would link a task built inside a
        ``with setup >> teardown:`` block to them when the block ends; the probe is taken out.
        """
        try:
            ShardPartial.unmap_probe(mapped, spec)
        except Exception as exc:
            refusal = " ".join(str(exc).split()) or type(exc).__name__
            name = ShardPartial.refused_argument(mapped, spec)
            what = f"argument {name}" if name else "arguments"
            raise ConfigurationError(
                f"shard task {mapped.task_id!r}: {mapped.operator_class.__name__} refuses its partial() "
                f"{what} ({refusal}); fix it in the DAG file (every mapped instance would fail on it "
                "in the worker, before running its shard)"
            ) from exc

    @staticmethod
    def unmap_probe(mapped: MappedOperator, spec: Mapping[str, Any]) -> None:
        """Build the instance the worker would build for ``spec`` and drop it (or raise its error)."""
        from airflow.sdk.definitions._internal.setup_teardown import SetupTeardownContext

        noted = SetupTeardownContext.context_map
        before = {key: list(tasks) for key, tasks in noted.items()}
        try:
            mapped.unmap(spec)
        finally:  # the constructor may raise after Airflow noted the probe
            for key in list(noted):
                if key in before:
                    noted[key][:] = before[key]
                else:
                    del noted[key]

    @staticmethod
    def refused_argument(mapped: MappedOperator, spec: Mapping[str, Any]) -> str | None:
        """The one ``partial()`` argument without which the probe unmaps (None: no single one;
        e.g. a refused ``default_args`` value, or two bad arguments)."""
        given = mapped.partial_kwargs
        try:
            for name in given:
                mapped.partial_kwargs = {key: value for key, value in given.items() if key != name}
                with contextlib.suppress(Exception):
                    ShardPartial.unmap_probe(mapped, spec)
                    return name
        finally:
            mapped.partial_kwargs = given
        return None


def note_unbuilt_instance(context: Any) -> None:
    """``on_failure_callback`` of a mapped shard task (:meth:`ShardPartial.adopt`): a last try that
    failed while Airflow built this instance's operator (in ``MappedOperator.unmap``: the
    constructor refused a value that exists only at run time, one the mapped XCom gives) ran none
    of the operator's code, so its shard never ran either. Pushes the refusal as
    :data:`CONFIGURATION_ERROR_KEY`, as the operator does for its own configuration errors, so that
    a completeness sensor after the shards leaves the shard to run until the task is fixed and
    cleared. Any other failure is left alone: the operator's own (it pushed what it had to), and a
    lost task's, which Airflow's DAG processor reports without an exception."""
    error = context.get("exception")
    if not isinstance(error, BaseException):
        return
    if not any(
        frame.f_code is MappedOperator.unmap.__code__ for frame, _ in traceback.walk_tb(error.__traceback__)
    ):
        return
    task = context["task"]
    refusal = " ".join(str(error).split()) or type(error).__name__
    context["ti"].xcom_push(
        key=CONFIGURATION_ERROR_KEY,
        value=f"{getattr(task, 'operator_class', type(task)).__name__} refuses the arguments of this "
        f"mapped instance ({refusal}); fix them in the DAG file or in the values expand_kwargs maps",
    )


def is_configuration_error(exc: BaseException) -> bool:
    """Whether a shard try failing with ``exc`` failed on a configuration error: an
    ``AirflowFailException`` (a bad option, another store than the plan's, bad worker arguments, a
    worker that says ``configuration``) other than the store's verdict (:class:`ShardFailedInStore`).
    The user fixes it and clears the task, which must find its shard still to run."""
    return isinstance(exc, AirflowFailException) and not isinstance(exc, ShardFailedInStore)


def _try_number(context: Any) -> int:
    return int(getattr(context["ti"], "try_number", 1) or 1)


def _max_tries(context: Any) -> int | None:
    """The task instance's ``max_tries`` (the try numbers after which Airflow retries no more)."""
    max_tries = getattr(context["ti"], "max_tries", None)
    return max_tries if isinstance(max_tries, int) else None


class _ShardTryMixin:
    """What both shard operators share: open the store, decide the try, record the decision, keep
    the try's ledger (:meth:`run_try`)."""

    job_id: str
    shard_index: int
    store_url: str | None
    store_conn_id: str | None
    plan_connections: dict[str, str]
    pools: Sequence[PoolSpec | Mapping[str, Any]] | None
    clock: Clock | None
    log: Any  # the operator's task logger (Airflow's, structured)
    #: whether this try's failure was classified and settled (:meth:`settle_failure` raised)
    _settled: bool = False
    #: this try is Airflow's last and keeps its worker slot to the end (:meth:`holds_slot`)
    _holding: bool = False
    #: set by ``on_kill``: Airflow is ending this try (set per run by :meth:`run_try`)
    _ending: threading.Event | None = None
    #: the shard's spent budget and cursor when this run decided (:meth:`store_counted_run`)
    _seen: tuple[int, int] | None = None
    #: the turnaround this run decided with (:meth:`turnaround_s`), which its race checks reuse
    _turnaround_s: float = 0.0
    #: how late Airflow was seen to start or resume this task instance (its ledger's ``late_s``,
    #: read by :meth:`note_lost_tries` when the run starts): part of :meth:`latency_s`
    _late_s: float = 0.0

    def run_try(self, context: Any, body: Callable[[], Any], *, fired_at: float | None = None) -> Any:
        """Run ``body`` (this run of the try) with the try's bookkeeping around it.

        First, the tries before this one that Airflow ended without this operator ending them are
        found in the task's :class:`~core.failures.TryLedger`, and this run's lateness is timed
        (:meth:`note_lost_tries`; ``fired_at``: when the trigger of a resumed deferral fired). Then, on
        the try that :meth:`holds_slot`, a reschedule never hands the slot back: the try waits here
        and runs ``body`` again, so no resume (and no resume race) can end Airflow's last try
        while the store's budget still allows another (docs/airflow.md, *Resuming tasks*).
        """
        try_number = _try_number(context)
        self._ending = threading.Event()
        self.note_lost_tries(context, try_number, fired_at=fired_at)
        self._holding = self.holds_slot(context)
        if self._holding:
            self.log.warning(
                "shard %s of job %s: try %d is Airflow's last (max_tries=%s): it keeps its worker slot "
                "and waits here instead of rescheduling or deferring, until the shard is done or the "
                "store's budget is spent",
                self.shard_index,
                self.job_id,
                try_number,
                _max_tries(context),
            )
            self.keep_slot()
        while True:
            try:
                result = body()
            except AirflowRescheduleException as exc:
                if not self._holding:
                    self.note_try(context, handed_back=[try_number], due_at=exc.reschedule_date.timestamp())
                    raise
                self.wait_in_slot(exc.reschedule_date)
                continue
            except TaskDeferred:
                self.note_try(context, handed_back=[try_number])
                raise
            except BaseException as exc:
                if not self._ending.is_set():  # a try Airflow kills is Airflow's to end, not ours
                    self.note_try(context, ended=[try_number], due_at=self.retry_due(context, exc))
                    if self.gives_up_shard(context, exc):
                        self.fail_shard_for_good(context, exc)
                    elif is_configuration_error(exc):
                        self.note_configuration_error(context, exc)
                raise
            self.note_try(context, ended=[try_number])
            return result

    def holds_slot(self, context: Any) -> bool:
        """Whether this try is Airflow's last (no retry after it) of an operator that reschedules.

        Such a try does not hand its worker slot back (no reschedule, no deferral), and a
        deterministic failure the store counted runs again in it: Airflow's retries are spent, so
        the store's ``max_attempts`` decides (docs/airflow.md, *Resuming tasks*).
        """
        max_tries = _max_tries(context)
        return self.reschedules() and max_tries is not None and _try_number(context) > max_tries

    def keep_slot(self) -> None:
        """Make this try keep its worker slot (a deferrable operator stops deferring)."""

    def wait_in_slot(self, until: dt.datetime) -> None:
        """Wait in this try until ``until`` (a kill ends the wait, and the try). Every
        :data:`SLOT_CHECK_S` it reads the store: a job that stopped (cancelled, expired, failed) or
        a shard settled meanwhile ends the wait at once, and the next run's decision ends the try."""
        assert self._ending is not None
        store: Any = None
        try:
            while (left := (until - dt.datetime.now(dt.timezone.utc)).total_seconds()) > 0:
                if self._ending.wait(min(left, SLOT_CHECK_S)):
                    raise AirflowException(
                        f"shard {self.shard_index} of job {self.job_id}: killed while it waited"
                    )
                try:
                    if store is None:
                        store = self._store()
                    if self.settled_elsewhere(store):
                        return
                except Exception:  # a store that cannot be read: wait on, the next run reads it again
                    self.log.debug("could not read shard %s while waiting", self.shard_index, exc_info=True)
        finally:
            if store is not None:
                store.close()

    def settled_elsewhere(self, store: Any) -> bool:
        """Whether this try's job stopped or its shard is done or failed for good (read from
        ``store``): what the next run's decision would settle without a worker."""
        job = store.get_job(self.job_id)
        shard = store.get_shard(self.job_id, int(self.shard_index))
        return settled_decision(self.job_id, job.state, shard) is not None

    def on_kill(self) -> None:
        if self._ending is not None:
            self._ending.set()
        super().on_kill()  # type: ignore[misc]  # BaseOperator's, or the KubernetesPodOperator's

    def read_ledger(self, context: Any) -> TryLedger | None:
        """This task instance's ledger (None: no task state store here, or it cannot be read)."""
        state = context.get("task_state_store") if hasattr(context, "get") else None
        if state is None:
            return None
        try:
            return TryLedger.from_dict(state.get(TRY_LEDGER_KEY))
        except Exception:
            self.log.warning("could not read the try ledger of shard %s", self.shard_index, exc_info=True)
            return None

    def note_try(self, context: Any, *, due_at: float | None = None, **tries: Sequence[int]) -> None:
        """Add ``tries`` to the ledger, with the time the next run is due (None: none, or not known;
        best effort: a failure is logged, the try goes on)."""
        max_tries = _max_tries(context)
        self.update_ledger(context, lambda ledger: ledger.with_(**tries).due(due_at, max_tries=max_tries))

    def update_ledger(self, context: Any, change: Callable[[TryLedger], TryLedger]) -> None:
        """Write ``change`` of the ledger back (best effort: a failure is logged, the try goes on)."""
        ledger = self.read_ledger(context)
        if ledger is None:
            return
        try:
            context["task_state_store"].set(TRY_LEDGER_KEY, change(ledger).to_dict())
        except Exception:
            self.log.warning("could not write the try ledger of shard %s", self.shard_index, exc_info=True)

    def gives_up_shard(self, context: Any, exc: BaseException) -> bool:
        """Whether this try, failing with ``exc``, spent the task's last retry: nothing will run its
        shard again, so the store must hear of it.

        Any exception Airflow retries, once the task's tries are spent (``max_tries`` 0, or this try
        past it). Not an ``AirflowFailException``: that is a configuration error (a bad option,
        another store than the plan's, bad worker arguments), fixed by the user and the task
        cleared, which must find its shard still to run; or the store's own verdict (a shard whose
        budget is spent), already there. Not ``AirflowTaskTerminated`` nor a try Airflow kills
        (:meth:`run_try`): their end is Airflow's, and a user's (a failed DAG run cancels the job
        through the sensor). Not a skip.
        """
        if isinstance(exc, AirflowSkipException | AirflowFailException | AirflowTaskTerminated):
            return False
        max_tries = _max_tries(context)
        return max_tries is not None and (max_tries == 0 or _try_number(context) > max_tries)

    def fail_shard_for_good(self, context: Any, exc: BaseException) -> None:
        """Fail this try's shard in the store: its task fails with ``exc`` and nothing runs it again.

        Without this, a shard whose task's tries were all spent while the store still had it
        retryable (a pod that never scheduled, a worker lost before it counted) stayed pending, and
        a completeness sensor beside the shards waited for it until its timeout; now the job can
        finish ``partial`` (docs/airflow.md, *Shards that fail for good*). ``ManifestStore.fail_shard``
        keeps a shard the store already settled (a commit landed) as it is. Best effort: a store
        that cannot be written is logged, and the task fails with its own error (the sensor after
        the shards, if there is one, fails the shard later).
        """
        try:
            ti = context["ti"]
            map_index = getattr(ti, "map_index", -1)
            name = ti.task_id if map_index is None or map_index < 0 else f"{ti.task_id}[{map_index}]"
            reason = f"its Airflow task {name} failed for good on try {_try_number(context)}: {exc}"
            store = self._store()
            try:
                after = store.fail_shard(self.job_id, int(self.shard_index), reason)
            finally:
                store.close()
        except Exception:
            self.log.error(
                "shard %s of job %s: could not fail it in the store after its task failed for good; "
                "the task fails with its own error",
                self.shard_index,
                self.job_id,
                exc_info=True,
            )
            return
        self.log.warning(
            "shard %s of job %s: its task failed for good; the shard is %s in the store%s",
            self.shard_index,
            self.job_id,
            after.value,
            "" if after is ShardState.TERMINAL_FAILURE else " (the store's state stands)",
        )

    def note_configuration_error(self, context: Any, exc: BaseException) -> None:
        """Push this try's configuration error to XCom (:data:`CONFIGURATION_ERROR_KEY`), so that a
        completeness sensor after the shards leaves the shard to run once the task is fixed and
        cleared, instead of failing it and publishing the job ``partial`` (docs/airflow.md).
        Best effort: a push that fails is logged, and the task fails with its own error."""
        try:
            context["ti"].xcom_push(key=CONFIGURATION_ERROR_KEY, value=" ".join(str(exc).split()))
        except Exception:
            self.log.error(
                "shard %s of job %s: could not record its configuration error; a completeness sensor "
                "after the shards will take the task as failed for good",
                self.shard_index,
                self.job_id,
                exc_info=True,
            )

    def check_exit_0(self) -> None:
        """A worker that exited 0 said its shard is done: believe the store, not the exit code.

        Only an attempt that completed the shard (or found it committed) exits 0, unless its engine
        ended the process itself (``os._exit(0)`` in a library: nothing in the worker can catch
        that), which would leave the shard leased and unfinished while its task succeeded. Such a
        try fails *deterministic* (its retries stop an engine that does it every time). A store
        that cannot be read is logged and the exit code believed (the sensor verifies the job).
        """
        try:
            store = self._store()
            try:
                state = store.get_shard(self.job_id, int(self.shard_index)).state
            finally:
                store.close()
        except Exception:
            self.log.warning(
                "shard %s of job %s: could not read the shard after its worker exited 0",
                self.shard_index,
                self.job_id,
                exc_info=True,
            )
            return
        if state is not ShardState.SUCCEEDED:
            self.settle_failure(
                FailureClass.DETERMINISTIC,
                f"the worker exited 0 with its shard {state.value}, not committed (an engine that "
                "ended the process?)",
            )

    def retry_due(self, context: Any, exc: BaseException) -> float | None:
        """When Airflow starts the retry after this try fails with ``exc`` (epoch seconds, at the
        latest), or None when no retry follows (a success, a skip, a failure for good, no retry
        left). Airflow retries any exception but those that fail or skip the task for good."""
        final = (AirflowFailException, AirflowSkipException)
        if not isinstance(exc, Exception) or isinstance(exc, final):
            return None
        max_tries = _max_tries(context)
        if max_tries is not None and _try_number(context) > max_tries:
            return None
        return time.time() + self.retry_wait_s(context)

    def retry_wait_s(self, context: Any | None) -> float:
        """The longest Airflow waits before the retry after this try (:func:`retry_delay_bound_s`)."""
        delay = getattr(self, "retry_delay", None)
        longest = getattr(self, "max_retry_delay", None)
        return retry_delay_bound_s(
            delay.total_seconds() if isinstance(delay, dt.timedelta) else 0.0,
            _try_number(context) if context is not None else 1,
            exponential_backoff=float(getattr(self, "retry_exponential_backoff", 0) or 0),
            max_retry_delay_s=longest.total_seconds() if isinstance(longest, dt.timedelta) else None,
        )

    def turnaround_s(self, context: Any | None) -> float:
        """Seconds from this try's end to the next try's decision, at worst
        (:attr:`core.placement.JobSnapshot.turnaround_s`).

        Airflow's last try (:meth:`holds_slot`) waits the resume delay in its slot and decides
        again. Any other try is started again by Airflow: after the resume delay when it
        reschedules, after its retry delay when it fails, and after the retry delay too when a
        resumed try loses the resume race (docs/airflow.md, *Resuming tasks*); then after Airflow's
        latency to start it (:meth:`latency_s`). A transient failure's longer backoff is bounded
        so that it fits (:meth:`settle_failure`).

        A deferred try (``deferrable``) learns of its pod's end only through its trigger: the
        trigger's poll (``poll_interval``; its event held to the resume delay after the deferral),
        then Airflow's latency to resume the task, which then reschedules or fails. A deferred
        try that may race (``race`` not False) is resumed for each race check: its pod can end
        just as it is, and the next trigger sees that end one more latency later.
        """
        resume = self.resume_delay_s()
        if self._holding:
            return resume
        latency = self.latency_s()
        turnaround = max(resume, self.retry_wait_s(context)) + latency
        if getattr(self, "deferrable", False):
            turnaround += max(float(getattr(self, "poll_interval", 0.0) or 0.0), resume) + latency
            if getattr(self, "race", False) is not False:
                turnaround += latency
        return turnaround

    def latency_s(self) -> float:
        """Airflow's latency to start (or resume) a task that is due, as this run counts it: the
        larger of ``[deadline_batch] scheduler_latency_s`` and the lateness this task instance's
        starts and resumes were seen to have (:attr:`~core.failures.TryLedger.late_s`: robust to
        one outlier). A bad option fails the task, naming it."""
        try:
            latency = scheduler_latency_s()
        except ConfigurationError as exc:
            raise AirflowFailException(str(exc)) from exc
        return max(latency, self._late_s)

    def note_lost_tries(self, context: Any, try_number: int, *, fired_at: float | None = None) -> None:
        """Log (and count as ``deadline_batch.resume_races``) the earlier tries Airflow ended
        without this operator ending them; record this try's start and how late it came: against
        the time its previous run asked for, or, resuming a deferral, the time its trigger fired
        (``fired_at``, the triggerer's clock)."""
        ledger = self.read_ledger(context)
        if ledger is None:
            self._late_s = 0.0
            return
        lost = ledger.newly_lost(try_number)
        races = ledger.resume_races(lost)
        for number in lost:
            self.log.warning(
                "shard %s of job %s: try %d was ended by Airflow, not by this operator (%s); it spent "
                "one of the task's retries, none of the shard's max_attempts",
                self.shard_index,
                self.job_id,
                number,
                "failed after it resumed: the resume race, see docs/airflow.md, Resuming tasks; "
                "consider raising [deadline_batch] min_resume_delay_s"
                if number in races
                else "its task process was killed, or the task was cleared",
            )
        emit_resume_races(self.job_id, len(races), dag_id=dag_id_of(context))
        # how late this run started against the time its previous run asked for; after a lost try
        # that time was the lost try's, and the retry's delay is counted apart (turnaround_s)
        max_tries = _max_tries(context)
        due = ledger.due(fired_at, max_tries=max_tries) if fired_at is not None else ledger
        arrived = ledger.due(None) if lost else due.arrived(time.time(), max_tries=max_tries)
        self._late_s = arrived.late_s
        if not lost and due.cleared_since_due(max_tries):
            self.log.info(
                "shard %s of job %s: try %d started after the task was cleared; how late it started "
                "is the clear's doing, not Airflow's latency, and is not counted",
                self.shard_index,
                self.job_id,
                try_number,
            )
        elif arrived.late_s > ledger.late_s:
            self.log.info(
                "shard %s of job %s: try %d %s %.0f s after it was due; the placement allows for "
                "Airflow's latency up to the larger of %.0f s and [deadline_batch] scheduler_latency_s",
                self.shard_index,
                self.job_id,
                try_number,
                "resumed" if fired_at is not None else "started",
                arrived.late[-1],
                arrived.late_s,
            )
        if lost or try_number not in ledger.started or arrived != ledger:
            self.update_ledger(context, lambda _: arrived.with_(started=[try_number], lost=lost))

    def resume_delay_s(self) -> float:
        """``[deadline_batch] min_resume_delay_s`` (a bad value fails the task, naming the fix)."""
        try:
            return min_resume_delay_s()
        except ConfigurationError as exc:
            raise AirflowFailException(str(exc)) from exc

    def store_hook(self) -> ManifestStoreHook:
        """The store: this task's own ``store_url``/``store_conn_id``, else the plan's connection."""
        conn_id = self.store_conn_id or self.plan_connections.get("store_conn_id")
        return ManifestStoreHook(store_conn_id=conn_id, store_url=self.store_url)

    def decide(self, context: Any | None = None) -> TryDecision:
        try:
            store = self.store_hook().get_job_store(
                self.job_id, plan_store_conn_id=self.plan_connections.get("store_conn_id")
            )
        except ConfigurationError as exc:  # another store than the plan's: no retry can fix it
            raise AirflowFailException(str(exc)) from exc
        now = (self.clock or SystemClock()).now()
        self._turnaround_s = self.turnaround_s(context)
        view = self.job_view(store, now)
        self.tenant = view.tenant  # the pod's Kueue queue (DeadlineShardPodOperator with kueue=True)
        shard = store.get_shard(self.job_id, int(self.shard_index))
        self._seen = (int(shard.failures), int(shard.cursor))
        decision = decide_for_try(view, shard)
        self.log.info(
            "placement for shard %s of job %s: %s (turnaround to the next try %.0f s)",
            self.shard_index,
            self.job_id,
            decision.reason,
            self._turnaround_s,
        )
        emit_decision(view, decision, dag_id=dag_id_of(context))
        if context is not None:
            context["ti"].xcom_push(key="placement", value=decision.to_dict())
            DeadlineBatchProgressLink.persist(context, self.job_id)
        return decision

    def job_view(self, store: Any, now: dt.datetime) -> JobView:
        """The job as this try decides on it: the store's view with this run's turnaround."""
        view = read_job_view(store, self.job_id, now=now, pools=self.pools)
        return dataclasses.replace(view, turnaround_s=self._turnaround_s)

    def settle_failure(self, failure: FailureClass, reason: str, *, shard_failed: bool = False) -> None:
        """Raise what Airflow should do with a failed try of this class (see the module doc).

        On the try that :meth:`holds_slot`, a deterministic failure that the store counted (it
        spent a unit of the shard's budget, or the run committed) runs again in the same try: the
        budget, not Airflow's last retry, decides. One the store never saw fails the task as before.
        """
        self._settled = True
        where = f"shard {self.shard_index} of job {self.job_id}"
        if shard_failed:
            raise ShardFailedInStore(f"{where}: {failure.value}: {reason}")
        if failure is FailureClass.CONFIGURATION:
            raise AirflowFailException(f"{where}: {failure.value}: {reason}")
        again = self._holding and failure is FailureClass.DETERMINISTIC and self.store_counted_run()
        if (failure is FailureClass.DETERMINISTIC and not again) or not self.reschedules():
            raise AirflowException(
                f"{where} {failure.value}: {reason}; the next try re-decides its pool from the slack left"
            )
        delay = self.resume_delay_s()
        if failure in (FailureClass.TRANSIENT, FailureClass.DETERMINISTIC):
            # a backoff longer than the resume delay may use only the slack that Airflow's latency
            # to start the next run leaves (none for the last try, which waits in its slot): the
            # decision allowed a turnaround of the resume or retry delay plus that latency, so a
            # longer backoff could otherwise bring the next decision past on-demand's last chance
            slack = self.slack_s()
            if slack is not None and not self._holding:
                slack -= self.latency_s()
            n = self.transient_in_a_row() if failure is FailureClass.TRANSIENT else self.budget_spent()
            delay = max(delay, backoff_s(n, slack_s=slack))
        self.log.warning(
            "%s %s (%s): %s in %.0f s, no retry spent",
            where,
            failure.value,
            reason,
            "runs again in this try" if self._holding else "rescheduled",
            delay,
        )
        raise AirflowRescheduleException(dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=delay))

    def reschedules(self) -> bool:
        return bool(getattr(self, "reschedule_retryable", True))

    def _store(self) -> Any:
        return self.store_hook().get_store()

    def transient_in_a_row(self) -> int:
        """The shard's latest tries that failed transiently, in a row (the backoff's exponent)."""
        try:
            tries = [
                a for a in self._store().list_attempts(self.job_id) if a.shard_index == int(self.shard_index)
            ]
        except Exception:
            return 1
        n = 0
        for attempt in reversed(tries):
            if attempt.failure_class != FailureClass.TRANSIENT.value:
                break
            n += 1
        return max(1, n)

    def store_counted_run(self) -> bool:
        """Whether the shard's budget or cursor moved since this run decided (the store saw the run)."""
        if self._seen is None:
            return False
        try:
            shard = self._store().get_shard(self.job_id, int(self.shard_index))
        except Exception:
            return False
        return (int(shard.failures), int(shard.cursor)) != self._seen

    def budget_spent(self) -> int:
        """Units of the shard's ``max_attempts`` spent (the backoff's exponent, deterministic failures)."""
        try:
            return int(self._store().get_shard(self.job_id, int(self.shard_index)).failures)
        except Exception:
            return 1

    def slack_s(self) -> float | None:
        try:
            now = (self.clock or SystemClock()).now()
            return read_job_view(self._store(), self.job_id, now=now, pools=self.pools).slack_s
        except Exception:
            return None

    def settle_without_running(self, decision: TryDecision) -> bool:
        """Return True when this try needs no worker; raise when it can never succeed."""
        if decision.action is TryAction.ALREADY_DONE:
            return True
        if decision.action is TryAction.SHARD_FAILED:
            raise ShardFailedInStore(decision.reason)
        if decision.action is TryAction.JOB_STOPPED:
            raise AirflowSkipException(decision.reason)
        return False


class DeadlineShardPodOperator(_ShardTryMixin, KubernetesPodOperator):
    """Run one shard's worker in a pod on the pool the slack allows, re-deciding at every try.

    :param job_id: job of the shard (a literal from the plan task's ``expand_kwargs`` specs).
    :param shard_index: the shard to run.
    :param store_url: manifest store URL for the *operator's* reads (wins over ``store_conn_id``).
    :param store_conn_id: Airflow connection of the manifest store (default: the plan's).
    :param plan_connections: the plan task's connection IDs, from its ``expand_kwargs`` specs
        (``store_conn_id``; explicit arguments win). Pods get S3 access from their service account
        (IRSA / workload identity) and the store URL from ``store_secret_name``, never from these.
    :param store_secret_name: Kubernetes Secret holding the store URL for the pod.
    :param store_secret_key: key of that Secret.
    :param pools: pool definitions (``PoolSpec`` or dicts); default: the pools the job was planned with.
    :param capacity_label: pod label set to ``spot`` / ``on-demand`` (``None`` to leave it out).
    :param gpus_per_pod: ``nvidia.com/gpu`` limit when ``container_resources`` is not given.
    :param lease_ttl_s: lease TTL passed to the worker.
    :param clock: injectable clock (tests).
    :param reschedule_retryable: preempted and transient tries reschedule the task instead of
        spending a retry (docs/design.md §6.6).
    :param kueue: label the pod for Kueue (docs/kubernetes.md): ``kueue.x-k8s.io/queue-name`` is
        the job's tenant (its LocalQueue), ``kueue.x-k8s.io/priority-class`` a WorkloadPriorityClass
        chosen from the job's slack at this try.
    :param race: the tail race (docs/kubernetes.md "The tail race"): a Spot try at the job's tail
        that the safety rule would escalate races one on-demand pod. ``None`` (default): on where
        the job's pools have a Spot and an on-demand pool; ``False``: off; ``True``: on, and a job
        without both kinds of pool is a configuration error. A deferred try races too: its
        trigger hands it back every ``race_check_interval_s`` while the pod runs.
    :param race_check_interval_s: how often a running Spot try is looked at for the race (default:
        30 s, and 300 s for a deferred try, whose every look resumes the task).

    GPU defaults: ``do_xcom_push=False`` (no XCom sidecar), ``retries=5``, and mapped with
    ``.partial(...).expand_kwargs(plan.output)`` at most the plan's ``workers`` pods at once
    (:class:`ShardPartial`). ``deferrable=True`` waits for the pod in the triggerer.
    """

    template_fields: Sequence[str] = (
        *KubernetesPodOperator.template_fields,
        "job_id",
        "store_url",
        "store_conn_id",
    )
    operator_extra_links = (DeadlineBatchProgressLink(),)

    @classmethod
    def partial(cls, **kwargs: Any) -> ShardPartial:
        return ShardPartial.adopt(super().partial(**ShardPartial.default_retries(kwargs, SHARD_RETRIES)))

    def __init__(
        self,
        *,
        job_id: str,
        shard_index: int,
        image: str,
        store_url: str | None = None,
        store_conn_id: str | None = None,
        plan_connections: Mapping[str, str] | None = None,
        store_secret_name: str = "deadline-batch-store",
        store_secret_key: str = "url",
        pools: Sequence[PoolSpec | Mapping[str, Any]] | None = None,
        capacity_label: str | None = "karpenter.sh/capacity-type",
        gpus_per_pod: int = 1,
        lease_ttl_s: float = 60.0,
        worker_args: Sequence[str] = (),
        clock: Clock | None = None,
        reschedule_retryable: bool = True,
        kueue: bool = False,
        race: bool | None = None,
        race_check_interval_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        if race_check_interval_s is not None and not 0 < race_check_interval_s <= MAX_RACE_CHECK_S:
            # above the bound, the watch thread's wait overflows (OverflowError): the race silently off
            raise ValueError(
                f"race_check_interval_s must be > 0 and <= {MAX_RACE_CHECK_S:g} seconds, got "
                f"{race_check_interval_s!r}: pass race=False to never race"
            )
        kwargs.setdefault("retries", SHARD_RETRIES)
        kwargs.setdefault("name", "deadline-batch-shard")
        self.race = race
        # the race of one try (threads and pods: set by execute, never serialized with the task)
        self._race_from: TryDecision | None = None
        #: the Spot pool of the racing try (a deferred try's resume reads it from the event)
        self._race_pool: str | None = None
        self._racer: k8s.V1Pod | None = None
        self._raced = False
        self._race_stop: threading.Event | None = None
        self._race_store: Any = None
        self.kueue = kueue
        self.tenant = DEFAULT_TENANT
        # no XCom sidecar: it would be one more image to pull on every fresh Spot node, and the
        # worker's result is in the store, not in the pod's return value
        kwargs.setdefault("do_xcom_push", False)
        self.reschedule_retryable = reschedule_retryable
        if kwargs.get("container_resources") is None and gpus_per_pod > 0:
            kwargs["container_resources"] = k8s.V1ResourceRequirements(
                limits={"nvidia.com/gpu": str(gpus_per_pod)}
            )
        super().__init__(image=image, **kwargs)
        default_interval = DEFERRED_RACE_CHECK_S if self.deferrable else RACE_CHECK_S
        self.race_check_interval_s = float(race_check_interval_s or default_interval)
        self.job_id = job_id
        self.shard_index = shard_index
        self.store_url = store_url
        self.store_conn_id = store_conn_id
        self.plan_connections = dict(plan_connections or {})
        self.store_secret_name = store_secret_name
        self.store_secret_key = store_secret_key
        self.pools = checked_pools(pools)
        self.capacity_label = capacity_label
        self.lease_ttl_s = lease_ttl_s
        self.worker_args = list(worker_args)
        self.clock = clock
        self._base: tuple[Any, ...] | None = None

    def apply_decision(self, decision: TryDecision) -> None:
        """Set this try's pod parameters from ``decision`` (idempotent across tries of one instance)."""
        if self._base is None:
            self._base = (
                dict(self.node_selector),
                list(self.tolerations),
                dict(self.labels),
                dict(self.annotations),
                list(self.secrets),
            )
        node_selector, tolerations, labels, annotations, secrets = self._base
        placement = pod_placement(decision, capacity_label=self.capacity_label)
        assert decision.pool is not None
        self.node_selector = {**node_selector, **placement.node_selector}
        self.tolerations = [*tolerations, *(k8s.V1Toleration(**t) for t in placement.tolerations)]
        self.labels = {**labels, **placement.labels}
        if self.kueue and decision.placement is not None:
            self.labels.update(kueue_labels(self.tenant, decision.placement.slack_s))
        self.annotations = {**annotations, **placement.annotations}
        self.startup_timeout_seconds = placement.startup_timeout_s
        self.schedule_timeout_seconds = placement.startup_timeout_s
        self.termination_grace_period = placement.grace_period_s
        # The DSN (with its password) is referenced, never copied into the pod spec.
        self.secrets = [
            *secrets,
            Secret("env", "ADB_STORE_URL", self.store_secret_name, self.store_secret_key),
        ]
        self.cmds = ["python3", "-m", WORKER_MODULE]
        self.arguments = worker_arguments(
            self.job_id,
            int(self.shard_index),
            pool=decision.pool.name,
            lease_ttl_s=self.lease_ttl_s,
            grace_s=placement.grace_period_s,
            extra=self.worker_args,
        )
        self.pod_request_obj = None
        self.pod = None

    def build_pod_request_obj(self, context: Any | None = None, *, dry_run: bool = False) -> k8s.V1Pod:
        """The provider's pod, its worker told the pod's name (:func:`add_pod_name_env`): a racer,
        a copy of this pod, learns its own from the same reference."""
        try:
            check_worker_args(self.worker_args)
        except ConfigurationError as exc:  # no retry can fix it
            raise AirflowFailException(str(exc)) from exc
        pod: k8s.V1Pod = super().build_pod_request_obj(context, dry_run=dry_run)
        try:
            add_pod_name_env(pod, self.base_container_name)
        except ConfigurationError as exc:  # no retry can fix it
            raise AirflowFailException(str(exc)) from exc
        return pod

    def is_istio_enabled(self, pod: k8s.V1Pod) -> bool:
        """Whether this try ends with its worker's container rather than its pod (the provider then
        stops waiting once the container completed, and judges it by the container's exit): with
        Istio, as the provider has it, and with any container beside the worker's (a sidecar from
        the pod template would keep the pod ``Running`` after the worker exited: the provider,
        without an XCom sidecar, would wait for it for ever)."""
        containers = (pod.spec.containers if pod is not None and pod.spec is not None else None) or []
        if any(c.name != self.base_container_name for c in containers):
            return True
        return bool(super().is_istio_enabled(pod))

    def await_pod_start(self, pod: k8s.V1Pod) -> None:
        try:
            super().await_pod_start(pod)
        except AirflowException:  # a launch timeout, or a pod that cannot start
            self.record_capacity_wait(pod)
            # what cleanup classifies: the pod now (the provider's read is from its creation), so
            # that a container that cannot start is told from a wait for capacity
            with contextlib.suppress(Exception):
                self.remote_pod = self.pod_manager.read_pod(pod)
            raise
        self.record_capacity_wait(pod)

    def defer(
        self,
        *,
        trigger: Any,
        method_name: str,
        kwargs: dict[str, Any] | None = None,
        timeout: dt.timedelta | float | None = None,
    ) -> Any:
        """Defer to :class:`~triggers.pod.ShardPodTrigger` where the provider defers to its own
        pod trigger: the same watch, its event held until the resume delay after now."""
        if type(trigger) is KubernetesPodTrigger:
            race = (trigger.trigger_kwargs or {}).get(RACE_KEY)
            racing = isinstance(race, dict) and not race.get("promoted")
            delay = self.resume_delay_s()
            trigger = ShardPodTrigger.adopt(
                trigger,
                resume_after=time.time() + delay,
                resume_delay_s=delay,
                race_check_interval_s=self.race_check_interval_s if racing else None,
            )
        super().defer(trigger=trigger, method_name=method_name, kwargs=kwargs, timeout=timeout)

    def trigger_reentry(self, context: Any, event: dict[str, Any]) -> Any:
        race = event.get(RACE_KEY)
        if not isinstance(race, dict):
            return self.pod_ended(context, event)
        # a racing try (docs/kubernetes.md "The tail race"): its state is the event's
        store = self.store_hook().get_store()
        self._race_store, self._race_pool = store, str(race["pool"])
        racer = race.get("racer")
        if racer and racer != event["name"]:  # once promoted, the racer is the try's own pod
            self._racer = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=racer, namespace=event["namespace"]))
        deferring = False
        try:
            if event["status"] == RUNNING:
                return self.race_step(context, event, race)
            if self._racer is not None and self.racer_running():
                return self.watch_racer_instead(context, event, race)
            return self.pod_ended(context, event)
        except TaskDeferred:
            deferring = True  # the racer lives on with the deferral
            raise
        finally:
            if not deferring:
                self.delete_racer()
            self._race_store = None
            store.close()

    def race_step(self, context: Any, event: dict[str, Any], race: dict[str, Any]) -> Any:
        """A deferred racing try's look at its running Spot pod: launch the racer when the race rule
        says so (as the synchronous watch does), end the try once the shard is done (the Spot
        pod, the race's loser, is deleted), and otherwise defer again."""
        spot = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=event["name"], namespace=event["namespace"]))
        self._turnaround_s = self.turnaround_s(context)  # a resumed run: as its try decided
        try:
            if self._racer is None:
                decision = self.racer_decision()
                if decision is not None:
                    self.prepare_racer(context, decision, spot)
                    self.launch_racer(decision)
                    assert self._racer is not None
                    race = {**race, "racer": self._racer.metadata.name}
            elif self.shard_done():
                self.delete_pod(spot, why="the shard is done; this Spot pod lost the race")
                self.log.info("shard %s of job %s is done; the try succeeds", self.shard_index, self.job_id)
                return None
        except Exception:  # as the synchronous watch: a failed look is not a failed try
            self.log.warning("tail race check of shard %s failed", self.shard_index, exc_info=True)
            if self._racer is not None:
                race = {**race, "racer": self._racer.metadata.name}  # created or not: deleted at the end
        last_log_time = event.get("last_log_time")
        self.defer_on(context, event["name"], event["namespace"], race, last_log_time=last_log_time)
        return None  # the pod ended just now: invoke_defer_method resumed this try in line

    def prepare_racer(self, context: Any, decision: TryDecision, spot: k8s.V1Pod) -> None:
        """A resumed try built no pod: build the racer's request as a try on its pool would."""
        self.apply_decision(decision)
        self._race_from = decision
        self.pod_request_obj = self.build_pod_request_obj(context)
        self.pod = spot  # the racer is named after it

    def racer_running(self) -> bool:
        """Whether this try's racer pod runs with the shard not done (the try waits for it)."""
        assert self._racer is not None
        try:
            racer = self.pod_manager.read_pod(self._racer)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return False
        return bool(racer.status and racer.status.phase == "Running") and not self.shard_done()

    def watch_racer_instead(self, context: Any, event: dict[str, Any], race: dict[str, Any]) -> None:
        """The Spot pod ended while its racer runs: defer on the racer, now this try's pod (the
        synchronous path waits for it in :meth:`await_racer`, which here would hold a worker slot)."""
        spot = self.read_pod_or_none(event["name"], event["namespace"])
        found = classify_pod(spot, self.base_container_name)
        assert self._racer is not None
        racer, self._racer = self._racer, None
        self.log.warning(
            "shard %s of job %s: Spot pod %s %s (%s) while its racer %s runs: the try waits for the racer",
            self.shard_index,
            self.job_id,
            event["name"],
            found.outcome.value,
            found.reason,
            racer.metadata.name,
        )
        self.end_pod_attempts(event["name"], spot, found)  # the racer takes the shard's lease at once
        if spot is not None:
            self.patch_already_checked(spot, reraise=False)
            self.process_pod_deletion(spot, reraise=False)
        promoted = {**race, "racer": racer.metadata.name, "promoted": True}
        self.defer_on(context, racer.metadata.name, event["namespace"], promoted)  # or resumed in line

    def defer_on(
        self, context: Any, name: str, namespace: str, race: dict[str, Any], *, last_log_time: Any = None
    ) -> None:
        """Defer (again) on pod ``name``, the race's state in the trigger's kwargs."""
        self.trigger_kwargs = {**(self.trigger_kwargs or {}), RACE_KEY: race}
        self.pod = self.hook.get_pod(name, namespace)
        self.invoke_defer_method(last_log_time=last_log_time, context=context)

    def read_pod_or_none(self, name: str, namespace: str) -> k8s.V1Pod | None:
        try:
            pod: k8s.V1Pod = self.hook.get_pod(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None
        return pod

    def pod_ended(self, context: Any, event: dict[str, Any]) -> Any:
        """The provider's resume with the pod's end: its cleanup classifies and settles the try."""
        # deferrable: the trigger gave up waiting for the start ("timeout"), or the pod ran
        self.record_capacity_wait(
            k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=event["name"], namespace=event["namespace"]))
        )
        self._settled = False
        try:
            return super().trigger_reentry(context, event)
        except AirflowException as exc:
            if self._settled or isinstance(exc, AirflowSkipException):
                raise
            # the provider failed the try without its cleanup (hence without :meth:`cleanup`'s
            # classification): the pod was gone when read (``PodNotFoundException``, an evicted
            # pod garbage-collected with its node), or vanished while awaited
            self.settle_unread_pod(event, exc)
            raise

    def settle_unread_pod(self, event: dict[str, Any], exc: AirflowException) -> None:
        """Classify and settle a deferred try whose pod the provider could not clean up."""
        remote = self.read_pod_or_none(event["name"], event["namespace"])
        found = classify_pod(remote, self.base_container_name)
        self.log.warning(
            "shard %s of job %s: pod %s %s (%s)",
            self.shard_index,
            self.job_id,
            event["name"],
            found.outcome.value,
            found.reason,
        )
        self.end_pod_attempts(event["name"], remote, found)
        self.settle_pod(found, exc)

    def settle_pod(self, found: PodClassification, exc: AirflowException) -> None:
        """Raise what Airflow should do with a try whose pod ended as ``found`` (the provider
        failed it with ``exc``): :meth:`settle_failure` of the pod's failure class."""
        failure = failure_class_of(found) or FailureClass.TRANSIENT
        shard_failed = found.failure is not None and found.failure.shard_failed
        try:
            self.settle_failure(failure, found.reason, shard_failed=shard_failed)
        except AirflowException as settled:
            raise settled from exc

    def end_pod_attempts(
        self,
        name: str,
        remote: k8s.V1Pod | None,
        found: PodClassification,
        labels: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Pod ``name`` ended (``remote``: its last state; None: gone): end the attempts that ran in
        it and still hold a lease, ``abandoned`` with the pod's class, as the local launcher does
        when it sees its worker die (docs/design.md §4.4). The next try then claims the shard at
        once instead of after the lease's TTL, and a crash (``deterministic``) is no preemption.

        Nothing happens while a container may still run (:func:`pod_ended`). Only this pod's
        attempts (:func:`attempts_of_pod`), never a racer's beside it; the store ends an attempt
        only under its own ID while it runs, so an abandon that comes late is harmless. Best
        effort: a store that cannot be read or written leaves the lease to lapse, as before.
        Returns the attempt IDs ended.
        """
        failure = failure_class_of(found)
        if failure is None or not pod_ended(remote, self.base_container_name):
            return []
        if failure is FailureClass.CONFIGURATION:
            # a worker that knew it was configuration ended its own attempt (and stopped the job);
            # one it left running died without saying (an unhandled error exits 1): a crash
            failure = FailureClass.DETERMINISTIC
        if remote is not None and remote.metadata is not None and labels is None:
            labels = remote.metadata.labels
        ended: list[str] = []
        try:
            store = self.store_hook().get_store()
            try:
                held = store.lease_holders(self.job_id, int(self.shard_index))
                for attempt in attempts_of_pod(held, name, labels):
                    why = f"pod {name} ended ({found.reason})"
                    if store.abandon_attempt(
                        self.job_id, int(self.shard_index), attempt.attempt_id, why, failure=failure
                    ):
                        ended.append(attempt.attempt_id)
            finally:
                store.close()
        except Exception:
            self.log.warning("could not end the attempts of pod %s", name, exc_info=True)
        for attempt_id in ended:
            self.log.warning(
                "shard %s of job %s: attempt %s of pod %s abandoned (%s): the next try claims at once",
                self.shard_index,
                self.job_id,
                attempt_id,
                name,
                failure.value,
            )
        return ended

    def get_or_create_pod(self, pod_request_obj: k8s.V1Pod, context: Any) -> k8s.V1Pod:
        if self.reattach_on_restart:
            pool = (pod_request_obj.metadata.labels or {}).get(f"{LABEL_PREFIX}/pool")
            self.retire_stale_pods(pod_request_obj.metadata.namespace, context, pool=pool)
        pod: k8s.V1Pod = super().get_or_create_pod(pod_request_obj, context)
        return pod

    def retire_stale_pods(self, namespace: str, context: Any, *, pool: str | None) -> None:
        """Retire the pods that earlier runs of this task left behind and this try must not
        reattach to, so that it launches its own pod: one that ended (marked ``already_checked``,
        deleted where ``on_finish_action`` says), and one still ``Pending`` on another pool than
        this try's decision (deleted: it never started a worker, so it holds no lease).

        The provider (10.25, ``get_or_create_pod``) reattaches a try to the pod whose identity it
        persisted in the task state store (``_get_pod_from_task_state_store``), else to one its
        labels find (``find_pod``), unless that pod is labelled checked, which only the try that
        awaited its end does (``cleanup``). Meant for a pod still running when its worker died, it
        also reattached a try to the pod of a run that never resumed (Airflow failed it, or the
        resume failed to start): an evicted pod, whose end it then read again in place of this
        try's own decision and pod; or a Spot pod still waiting for capacity after the decision
        had escalated to on-demand, so that the try waited for Spot past its last safe start. A pod
        running, or terminating under an eviction, is reattached as before: its worker holds the
        shard's lease, and a second pod's claim would be refused until it lets go.
        """
        pods: dict[str, k8s.V1Pod] = {}
        state = context.get("task_state_store") if context is not None else None
        stored = state.get(POD_IDENTIFIER_STATE_KEY) if state is not None else None
        if isinstance(stored, dict) and isinstance(stored.get("name"), str):
            try:
                pod = self.client.read_namespaced_pod(stored["name"], stored.get("namespace") or namespace)
                pods[pod.metadata.name] = pod
            except ApiException as exc:
                if exc.status != 404:
                    raise
        selector = self._build_find_pod_label_selector(context)
        for pod in self.client.list_namespaced_pod(namespace, label_selector=selector).items:
            pods[pod.metadata.name] = pod
        for pod in pods.values():
            labels = pod.metadata.labels or {}
            phase = pod.status.phase if pod.status is not None else None
            if labels.get(self.POD_CHECKED_KEY) == "True" or pod.metadata.deletion_timestamp is not None:
                continue
            if phase in FINISHED_PHASES:
                found = classify_pod(pod, self.base_container_name)
                why = f"ended ({found.outcome.value}: {found.reason})"
                self.end_pod_attempts(pod.metadata.name, pod, found)
            elif phase == "Pending" and pool is not None and labels.get(f"{LABEL_PREFIX}/pool") != pool:
                why = f"still pending on pool {labels.get(f'{LABEL_PREFIX}/pool')}, this try's is {pool}"
            else:
                continue
            self.log.info(
                "pod %s of try %s %s: not reattached, this try launches its own",
                pod.metadata.name,
                labels.get("try_number", "?"),
                why,
            )
            self.patch_already_checked(pod, reraise=False)
            if phase == "Pending":
                try:
                    self.delete_pod(pod, why="a stale pod of an earlier run of this try")
                except ApiException:  # labelled checked: never reattached; its worker would be refused
                    self.log.warning("could not delete pod %s", pod.metadata.name, exc_info=True)
            else:
                self.process_pod_deletion(pod, reraise=False)

    def record_capacity_wait(self, pod: k8s.V1Pod) -> None:
        """Record how long this try's Spot pod waited for capacity, as an ``unschedulable`` attempt.

        Still unschedulable (the try gives up), or scheduled after waiting: re-read from the API.
        Best effort: a pod or store that cannot be read or written loses this one observation of
        the pool's availability, not the try, whose own handling follows as before.
        """
        try:
            remote = self.pod_manager.read_pod(pod)
            reason = unschedulable_reason(remote)
            waited = None if reason is not None else scheduling_wait(remote)
            labels = remote.metadata.labels or {}
            pool, created = labels.get(f"{LABEL_PREFIX}/pool"), remote.metadata.creation_timestamp
            if pool is None or created is None or (reason is None and waited is None):
                return
            store = self.store_hook().get_job_store(
                self.job_id, plan_store_conn_id=self.plan_connections.get("store_conn_id")
            )
            store.record_unschedulable(
                self.job_id,
                int(self.shard_index),
                pool=pool,
                worker=remote.metadata.name,
                created_at=created,
                error=reason or f"pod {remote.metadata.name} waited to be scheduled",
                scheduled_at=waited[1] if waited is not None else None,
            )
        except Exception:
            self.log.warning("could not record the capacity wait of pod %s", pod.metadata.name, exc_info=True)
            return
        if reason is not None:
            self.log.warning(
                "shard %s of job %s: %s; recorded for the pool's availability",
                self.shard_index,
                self.job_id,
                reason,
            )

    def prepare_try(self, context: Any | None = None) -> TryDecision:
        """Decide and apply this try's placement; returns the decision."""
        decision = self.decide(context)
        if decision.action is TryAction.RUN:
            self.apply_decision(decision)
        return decision

    def execute(self, context: Any) -> Any:
        return self.run_try(context, lambda: self.execute_once(context))

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any) -> Any:
        resume = super().resume_execution
        event = (next_kwargs or {}).get("event")
        fired = finite_seconds(event.get(FIRED_AT_KEY)) if isinstance(event, dict) else None
        return self.run_try(context, lambda: resume(next_method, next_kwargs, context), fired_at=fired)

    def keep_slot(self) -> None:
        self.deferrable = False  # waits for its pod in this worker slot, as a synchronous try

    def execute_once(self, context: Any) -> Any:
        """One run of this try: decide, then launch and await the pod (or defer on it)."""
        decision = self.prepare_try(context)
        if self.settle_without_running(decision):
            self.log.info("%s", decision.reason)
            return None
        store = self.store_hook().get_store()
        try:
            if self.wait_out_racer(store):
                decision = self.prepare_try(context)
                if self.settle_without_running(decision):
                    self.log.info("%s", decision.reason)
                    return None
            self._race_from = decision if self.races(store, decision) else None
            self._race_pool = decision.pool.name if self._race_from and decision.pool else None
            self._race_store, self._raced = store, False
            if self.deferrable:  # the trigger carries the race's state (none: this try does not race)
                kept = {k: v for k, v in (self.trigger_kwargs or {}).items() if k != RACE_KEY}
                race = {RACE_KEY: {"pool": self._race_pool, "racer": None}} if self._race_pool else {}
                self.trigger_kwargs = {**kept, **race}
            try:
                return super().execute(context)
            except Exception:
                if not self._raced or not self.shard_done():
                    raise
                # the race's loser was deleted under the wait (or the Spot pod went): the shard is
                # done all the same, and that is what the try is for
                self.log.info("shard %s of job %s is done; the try succeeds", self.shard_index, self.job_id)
                return None
        finally:
            if self._race_stop is not None:
                self._race_stop.set()
            self.delete_racer()
            self._race_from, self._race_pool, self._race_store = None, None, None
            store.close()

    # -- the tail race (docs/kubernetes.md "The tail race") ----------------------------------------

    def races(self, store: Any, decision: TryDecision) -> bool:
        """Whether this try may race: a Spot try, with ``race`` not off and the pools for it."""
        if self.race is False or decision.pool is None or decision.pool.kind is not PoolKind.SPOT:
            return False
        kinds = {p.kind for p in parse_pools(self.pools, store.get_job(self.job_id).config)}
        if kinds != {PoolKind.SPOT, PoolKind.ON_DEMAND}:
            if self.race:
                raise AirflowFailException(
                    f"race=True needs a Spot and an on-demand pool among job {self.job_id}'s pools: "
                    "add an on-demand pool, or pass race=False"
                )
            return False
        return True

    def racer_holding(self, store: Any) -> float | None:
        """Seconds a live racer still holds this shard for (its racing lease, or the primary lease it
        was promoted to when its Spot try ended), or None when no racer holds it."""
        shard = store.get_shard(self.job_id, int(self.shard_index))
        if shard.state is not ShardState.LEASED:
            return None
        now = store.db_time()
        if shard.race_attempt_id is not None and (shard.race_expires_at or 0.0) > now:
            return float(shard.race_expires_at - now)
        if (shard.lease_expires_at or 0.0) <= now:
            return None
        holder = next(
            (a for a in store.list_attempts(self.job_id) if a.attempt_id == shard.lease_attempt_id), None
        )
        return float(shard.lease_expires_at - now) if holder is not None and holder.speculative else None

    def wait_out_racer(self, store: Any) -> bool:
        """A racer of an earlier try still holds the shard: reschedule (no retry spent, no pod
        launched: its claim would be refused), or without ``reschedule_retryable`` (or on the try
        that :meth:`holds_slot`) wait here until it lets go. Returns True when it waited (decide again)."""
        left = self.racer_holding(store)
        if left is None:
            return False
        where = f"shard {self.shard_index} of job {self.job_id}"
        if self.reschedules() and not self._holding:
            delay = max(self.resume_delay_s(), min(left, self.race_check_interval_s))
            self.log.info(
                "%s is held by a live racer for %.0f s more: rescheduled in %.0f s", where, left, delay
            )
            raise AirflowRescheduleException(dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=delay))
        self.log.info("%s is held by a live racer for %.0f s more: waiting for it", where, left)
        tick = threading.Event()
        while self.racer_holding(store) is not None:
            tick.wait(min(RACE_POLL_S, self.race_check_interval_s))
        return True

    def _build_find_pod_label_selector(
        self, context: Any | None = None, *, exclude_checked: bool = True
    ) -> str:
        # a try reattaches to its own shard pod, never to a racer (which has the same task labels)
        selector: str = super()._build_find_pod_label_selector(context, exclude_checked=exclude_checked)
        return f"{selector},{RACE_LABEL}!=true"

    def await_pod_completion(self, pod: k8s.V1Pod) -> Any:  # type: ignore[override]  # tenacity-wrapped there
        """Wait for this try's pod; a racing try watches the job's tail meanwhile (:meth:`watch_tail`)."""
        if self._race_from is None:
            return super().await_pod_completion(pod)
        stop = self._race_stop = threading.Event()
        watcher = threading.Thread(target=self.watch_tail, args=(pod, stop), name="tail-race", daemon=True)
        watcher.start()
        try:
            return super().await_pod_completion(pod)
        finally:
            stop.set()
            watcher.join()

    def watch_tail(self, pod: k8s.V1Pod, stop: threading.Event) -> None:
        """Launch the racer when :meth:`racer_decision` says so; once the shard is done, delete
        the Spot pod if it still runs (the race's loser: its attempt is over)."""
        while not stop.wait(self.race_check_interval_s if self._racer is None else RACE_POLL_S):
            try:
                if self._racer is None:
                    decision = self.racer_decision()
                    if decision is not None and not stop.is_set():
                        self.launch_racer(decision)
                elif self.shard_done():
                    self.delete_pod(pod, why="the shard is done; this Spot pod lost the race")
                    return
            except Exception:
                self.log.warning("tail race check of shard %s failed", self.shard_index, exc_info=True)

    def racer_decision(self) -> TryDecision | None:
        """The racer's decision when the job is at its tail and the race rule says so, else None."""
        assert self._race_pool is not None
        store = self._race_store
        view = self.job_view(store, (self.clock or SystemClock()).now())
        self.tenant = view.tenant  # the racer's Kueue queue, on a resumed (deferred) try too
        shards = store.list_shards(self.job_id)
        if not tail_has_room(shards, view.parallelism):
            return None
        shard = next(s for s in shards if s.shard_index == int(self.shard_index))
        return race_decision(view, shard, self._race_pool)

    def racer_pod(self, decision: TryDecision) -> k8s.V1Pod:
        """This try's pod as the racer: the racer's placement, ``worker --race``, a pod name of its own."""
        assert self.pod_request_obj is not None and self._race_from is not None and self._base is not None
        assert decision.pool is not None
        pod: k8s.V1Pod = copy.deepcopy(self.pod_request_obj)
        mine = pod_placement(self._race_from, capacity_label=self.capacity_label)
        placement = pod_placement(decision, capacity_label=self.capacity_label)
        node_selector, tolerations, _, _, _ = self._base
        labels = {k: v for k, v in (pod.metadata.labels or {}).items() if k not in mine.labels}
        pod.metadata.labels = {**labels, **placement.labels, RACE_LABEL: "true"}
        annotations = {k: v for k, v in (pod.metadata.annotations or {}).items() if k not in mine.annotations}
        pod.metadata.annotations = {**annotations, **placement.annotations}
        # named after this try's pod (a reattached one's name is not the request's)
        pod.metadata.name = f"{(self.pod or pod).metadata.name}-race"[:253]
        pod.spec.node_selector = {**node_selector, **placement.node_selector}
        pod.spec.tolerations = [*tolerations, *(k8s.V1Toleration(**t) for t in placement.tolerations)]
        pod.spec.termination_grace_period_seconds = placement.grace_period_s
        [container] = [c for c in pod.spec.containers if c.name == self.base_container_name]
        container.args = worker_arguments(
            self.job_id,
            int(self.shard_index),
            pool=decision.pool.name,
            lease_ttl_s=self.lease_ttl_s,
            grace_s=placement.grace_period_s,
            extra=[*self.worker_args, "--race"],
        )
        return pod

    def launch_racer(self, decision: TryDecision) -> None:
        """Create the racer pod (:meth:`racer_pod`); remembered first, so that a kill deletes it."""
        pod = self.racer_pod(decision)
        self._racer, self._raced = pod, True  # before it exists: a kill from now on deletes it
        pool = decision.pool.name if decision.pool else "?"
        self.log.warning(
            "shard %s of job %s: racing its Spot try with pod %s on %s (%s)",
            self.shard_index,
            self.job_id,
            pod.metadata.name,
            pool,
            decision.reason,
        )
        self.pod_manager.create_pod(pod)
        emit_race(self.job_id, pool, dag_id=self.dag_id if self.has_dag() else None)

    def shard_done(self) -> bool:
        """Whether this try's shard is committed (read from the store of the try's race)."""
        assert self._race_store is not None, "shard_done is called within execute only"
        shard = self._race_store.get_shard(self.job_id, int(self.shard_index))
        return bool(shard.state is ShardState.SUCCEEDED)

    def delete_pod(self, pod: k8s.V1Pod, *, why: str) -> None:
        """Delete a pod of the race (gone already: nothing to do)."""
        self.log.info("deleting pod %s: %s", pod.metadata.name, why)
        try:
            self.client.delete_namespaced_pod(
                pod.metadata.name, pod.metadata.namespace, grace_period_seconds=LOSER_GRACE_S
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def delete_racer(self) -> None:
        """Delete this try's racer pod, if it has one (best effort: a failure is logged)."""
        racer, self._racer = self._racer, None
        if racer is not None:
            try:
                self.delete_pod(racer, why="the race is over")
            except Exception:
                self.log.warning("could not delete racer pod %s", racer.metadata.name, exc_info=True)

    def await_racer(self) -> bool:
        """This try's pod ended; wait for its racer while it may still finish the shard.

        True once the shard is done (by either pod); False when the racer ended, or never started,
        without it being done. Either way the racer's pod is deleted.
        """
        if self._racer is None:
            return False
        tick = threading.Event()
        while not self.shard_done():
            try:
                racer = self.pod_manager.read_pod(self._racer)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                racer = None
            phase = racer.status.phase if racer is not None and racer.status else None
            if phase is None or phase in FINISHED_PHASES or phase == "Pending":
                done = self.shard_done()  # it may have completed the shard on its way out
                if not done:
                    found = classify_pod(racer, self.base_container_name)
                    self.end_pod_attempts(
                        self._racer.metadata.name, racer, found, self._racer.metadata.labels
                    )
                self.delete_racer()
                return done
            tick.wait(min(RACE_POLL_S, self.race_check_interval_s))
        self.delete_racer()
        return True

    def on_kill(self) -> None:
        if self._race_stop is not None:
            self._race_stop.set()
        try:
            super().on_kill()
        finally:
            self.delete_racer()

    def cleanup(
        self,
        pod: k8s.V1Pod,
        remote_pod: k8s.V1Pod,
        xcom_result: dict | None = None,
        context: Any | None = None,
    ) -> None:
        try:
            super().cleanup(pod, remote_pod, xcom_result=xcom_result, context=context)
        except AirflowSkipException:
            raise
        except AirflowException as exc:
            found = classify_pod(remote_pod, self.base_container_name)
            self.log.warning(
                "shard %s of job %s: pod %s (%s)",
                self.shard_index,
                self.job_id,
                found.outcome.value,
                found.reason,
            )
            self.end_pod_attempts(pod.metadata.name, remote_pod, found, pod.metadata.labels)
            if self.await_racer():
                self.log.info("shard %s of job %s: done by its racer", self.shard_index, self.job_id)
                return
            self.settle_pod(found, exc)
        else:
            if self._racer is not None and not self.await_racer():
                # this pod lost the race (exit 0, lost_race) and the racer ended before the shard was done
                self.settle_failure(FailureClass.TRANSIENT, "the racer ended before the shard was done")
            self.check_exit_0()


class LocalShardOperator(_ShardTryMixin, BaseOperator):
    """Run one shard's worker as a local subprocess: the embedded default of the shard task.

    Same contract as :class:`DeadlineShardPodOperator` (decision logged and pushed to XCom key
    ``placement``, committed shards skipped); exit 75 raises a retryable error, exit 1 fails the task.
    ``preempt_tries`` injects a Spot-style preemption (SIGTERM, then SIGKILL after ``grace_s``)
    ``preempt_after_s`` seconds into the listed try numbers, to exercise recovery on a laptop.
    ``aws_conn_id`` (default: the plan's, from ``plan_connections``) gives the worker subprocess its
    S3 credentials through that child's environment only.
    """

    template_fields: Sequence[str] = ("job_id", "store_url", "store_conn_id")
    operator_extra_links = (DeadlineBatchProgressLink(),)

    @classmethod
    def partial(cls, **kwargs: Any) -> ShardPartial:
        return ShardPartial.adopt(super().partial(**ShardPartial.default_retries(kwargs, SHARD_RETRIES)))

    def __init__(
        self,
        *,
        job_id: str,
        shard_index: int,
        store_url: str | None = None,
        store_conn_id: str | None = None,
        aws_conn_id: str | None = None,
        plan_connections: Mapping[str, str] | None = None,
        pools: Sequence[PoolSpec | Mapping[str, Any]] | None = None,
        lease_ttl_s: float = 60.0,
        grace_s: float | None = None,
        env: Mapping[str, str] | None = None,
        preempt_tries: Sequence[int] = (),
        preempt_after_s: float = 0.5,
        clock: Clock | None = None,
        reschedule_retryable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("retries", SHARD_RETRIES)
        super().__init__(**kwargs)
        # injected preemptions are keyed by try number, which a reschedule does not advance
        self.reschedule_retryable = (
            not preempt_tries if reschedule_retryable is None else reschedule_retryable
        )
        self.job_id = job_id
        self.shard_index = shard_index
        self.store_url = store_url
        self.store_conn_id = store_conn_id
        self.aws_conn_id = aws_conn_id
        self.plan_connections = dict(plan_connections or {})
        self.pools = checked_pools(pools)
        self.lease_ttl_s = lease_ttl_s
        self.grace_s = grace_s
        self.env = dict(env) if env else None
        self.preempt_tries = tuple(int(t) for t in preempt_tries)
        self.preempt_after_s = preempt_after_s
        self.clock = clock
        self._injected = False

    def execute(self, context: Any) -> Any:
        return self.run_try(context, lambda: self.execute_once(context))

    def execute_once(self, context: Any) -> Any:
        """One run of this try: decide, then run the worker subprocess and settle its exit."""
        decision = self.decide(context)
        if self.settle_without_running(decision):
            self.log.info("%s", decision.reason)
            return decision.to_dict()
        assert decision.pool is not None and decision.placement is not None
        grace = float(self.grace_s if self.grace_s is not None else decision.placement.grace_period_s)
        store_url = self.store_hook().get_store_url()
        # the worker's S3 credentials: the connection's, in the child's environment only (the local
        # stand-in for a pod's Secret or IRSA); without a connection the child inherits the ambient ones
        aws = worker_environment(self.aws_conn_id or self.plan_connections.get("aws_conn_id"))
        try_number = int(getattr(context["ti"], "try_number", 1) or 1)
        with tempfile.TemporaryDirectory(prefix="adb-try-") as tmp:
            message_path = os.path.join(tmp, "termination.json")
            env = {**aws, **(self.env or {}), "ADB_TERMINATION_LOG": message_path}
            # injected once per operator instance (Airflow builds one per run): a try that holds
            # its slot and runs again in-process is not preempted again
            preempted = try_number in self.preempt_tries and not self._injected
            self._injected = self._injected or preempted
            if preempted:
                code = self._run_with_preemption(store_url, decision.pool.name, grace, env)
            else:
                from airflow_deadline_batch.local.launcher import run_worker_subprocess

                code = run_worker_subprocess(
                    store_url,
                    self.job_id,
                    int(self.shard_index),
                    pool=decision.pool.name,
                    lease_ttl_s=self.lease_ttl_s,
                    grace_s=grace,
                    env=env,
                )
            said = None
            if os.path.exists(message_path):
                with open(message_path, "rb") as handle:
                    said = parse_termination_message(handle.read())
        return self._settle_exit(code, decision, said, injected=preempted)

    def _run_with_preemption(self, store_url: str, pool: str, grace: float, env: Mapping[str, str]) -> int:
        from airflow_deadline_batch.local.launcher import fence_dead_worker, start_worker
        from airflow_deadline_batch.store import ManifestStore

        proc = start_worker(
            store_url,
            self.job_id,
            int(self.shard_index),
            pool=pool,
            lease_ttl_s=self.lease_ttl_s,
            grace_s=grace,
            env=env,
        )
        try:
            return proc.popen.wait(timeout=self.preempt_after_s)
        except subprocess.TimeoutExpired:
            self.log.warning(
                "injecting a preemption into shard %s (SIGTERM, %.1f s notice)", self.shard_index, grace
            )
            proc.signal(signal.SIGTERM)
        try:
            code = proc.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.signal(signal.SIGKILL)
            code = proc.popen.wait()
        if code < 0:  # the kill this operator sent to inject the preemption
            fence_dead_worker(ManifestStore(store_url), proc, signalled=True)
            return EXIT_RETRYABLE
        return code

    def _settle_exit(
        self, code: int, decision: TryDecision, said: TryFailure | None = None, *, injected: bool = False
    ) -> dict[str, Any]:
        if code == EXIT_OK:
            self.check_exit_0()
            return decision.to_dict()
        if said is not None:  # the worker's own word (a SIGTERM it handled says preempted)
            failure, reason = said.failure, said.error
        else:
            guessed = classify_exit(code, signalled_by_launcher=injected)
            failure = FailureClass.PREEMPTED if injected else (guessed or FailureClass.TRANSIENT)
            reason = f"worker exit {code}"
        kind = "preempted" if failure is FailureClass.PREEMPTED else failure.value
        self.log.warning(
            "shard %s of job %s %s (worker exit %s): %s", self.shard_index, self.job_id, kind, code, reason
        )
        self.settle_failure(failure, reason, shard_failed=bool(said and said.shard_failed))
        raise AssertionError("settle_failure always raises")  # pragma: no cover
