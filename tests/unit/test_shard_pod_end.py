"""Which attempts ran in a shard pod that ended (``operators.shard``: ``pod_hostname``,
``attempts_of_pod``, ``pod_ended``): a worker names its attempts ``<pod name>:<pid>`` (the pod tells
it its name, ``ADB_POD_NAME``, whatever its hostname), a worker of the previous version
``<hostname>:<pid>``, a pod's hostname being its name cut to 63 characters; a racer pod named after
a long Spot pod's name shares its hostname and is told apart by its speculative attempts."""

from __future__ import annotations

import datetime as dt
import os
import socket

import pytest
from kubernetes.client import models as k8s

from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.operators.shard import RACE_LABEL, attempts_of_pod, pod_ended, pod_hostname
from airflow_deadline_batch.store import AttemptRow
from airflow_deadline_batch.worker.worker import WorkerConfig, default_worker_name

SPOT_LABELS = {"deadline-batch.io/pool": "local-spot"}
RACER_LABELS = {"deadline-batch.io/pool": "local-on-demand", RACE_LABEL: "true"}


def attempt(
    attempt_id: str, worker: str, *, pool: str = "local-spot", speculative: bool = False
) -> AttemptRow:
    return AttemptRow(
        attempt_id=attempt_id,
        job_id="j",
        shard_index=0,
        epoch=1,
        worker=worker,
        pool=pool,
        started_at=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
        ended_at=None,
        outcome=AttemptOutcome.RUNNING,
        error=None,
        heartbeat_at=None,
        speculative=speculative,
    )


def test_a_pods_hostname_is_its_name_cut_to_63_characters_without_a_trailing_dash() -> None:
    assert pod_hostname("deadline-batch-shard-5tba442a") == "deadline-batch-shard-5tba442a"
    assert pod_hostname("a" * 62 + "-b") == "a" * 62  # cut after the dash, which goes too
    assert len(pod_hostname("x" * 70)) == 63


def test_the_spot_pod_finds_its_own_attempt_never_the_racers_beside_it() -> None:
    spot, racer = "deadline-batch-shard-5tba442a", "deadline-batch-shard-5tba442a-race"
    held = [
        attempt("a-spot", f"{spot}:7"),
        attempt("a-race", f"{racer}:7", pool="local-on-demand", speculative=True),
    ]
    assert [a.attempt_id for a in attempts_of_pod(held, spot, SPOT_LABELS)] == ["a-spot"]
    assert [a.attempt_id for a in attempts_of_pod(held, racer, RACER_LABELS)] == ["a-race"]
    # a pod whose labels are unknown (gone): a racer by its name
    assert [a.attempt_id for a in attempts_of_pod(held, spot)] == ["a-spot"]
    assert [a.attempt_id for a in attempts_of_pod(held, racer)] == ["a-race"]
    # another pod's attempt, whose name merely starts like this one's
    assert attempts_of_pod([attempt("a-x", f"{spot}1:7")], spot, SPOT_LABELS) == []


def test_a_racer_sharing_a_long_spot_pods_hostname_is_still_told_apart() -> None:
    spot = "s" * 63
    racer = f"{spot}-race"
    assert pod_hostname(racer) == pod_hostname(spot)  # the kubelet cuts both to the same hostname
    held = [
        attempt("a-spot", f"{pod_hostname(spot)}:1"),
        attempt("a-race", f"{pod_hostname(racer)}:1", pool="local-on-demand", speculative=True),
    ]
    assert [a.attempt_id for a in attempts_of_pod(held, spot, SPOT_LABELS)] == ["a-spot"]
    assert [a.attempt_id for a in attempts_of_pod(held, racer, RACER_LABELS)] == ["a-race"]


def test_a_worker_names_its_attempts_after_its_pod_when_told_its_name_else_after_its_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ADB_POD_NAME", "deadline-batch-shard-5tba442a")
    pid = os.getpid()
    assert default_worker_name() == f"deadline-batch-shard-5tba442a:{pid}"
    assert WorkerConfig(store_url="sqlite://", job_id="j", shard_index=0).worker_name == default_worker_name()
    monkeypatch.delenv("ADB_POD_NAME")  # a local subprocess, a bare CLI run
    assert default_worker_name() == f"{socket.gethostname()}:{pid}"


def test_a_pod_finds_its_attempts_by_its_whole_name_and_an_older_workers_by_its_hostname() -> None:
    """A pod named past 63 characters (no random suffix): its worker names the attempt after the
    whole name; a worker of the previous version, during a rolling upgrade, after the hostname."""
    name = "deadline-batch-shard-" + "n" * 60
    held = [attempt("a-new", f"{name}:7"), attempt("a-old", f"{pod_hostname(name)}:8")]
    assert [a.attempt_id for a in attempts_of_pod(held, name, SPOT_LABELS)] == ["a-new", "a-old"]
    assert [a.attempt_id for a in attempts_of_pod(held, name)] == ["a-new", "a-old"]
    # a pod with hostNetwork sees the node's hostname: only its name traces the attempt
    assert attempts_of_pod([attempt("a-node", "ip-10-0-1-7.ec2.internal:7")], name, SPOT_LABELS) == []


@pytest.mark.parametrize(
    ("pod", "other"),
    [
        ("shard-5tba442a", "shard-5tba442a1"),
        ("shard-5tba442a", "shard-5tba442a-2"),
        ("s" * 70, "s" * 70 + "-2"),  # both past 63 characters, the same hostname
    ],
)
def test_a_pod_never_takes_the_attempts_of_a_pod_whose_name_starts_with_its_own(pod: str, other: str) -> None:
    held = [attempt("a-pod", f"{pod}:7"), attempt("a-other", f"{other}:7")]
    assert [a.attempt_id for a in attempts_of_pod(held, pod, SPOT_LABELS)] == ["a-pod"]
    assert [a.attempt_id for a in attempts_of_pod(held, other, SPOT_LABELS)] == ["a-other"]


def test_a_pod_named_as_a_longer_pods_hostname_is_told_from_that_pods_older_workers_by_the_pool() -> None:
    """The one name the previous version's ``<hostname>:<pid>`` cannot tell apart: a pod whose whole
    name is a longer pod's hostname (only pods named past 63 characters without the provider's
    random suffix have such a hostname). The shorter never takes the longer's attempts; the longer
    would take the shorter's as its own older workers', but for the pool and the racer rule."""
    short, long = "s" * 63, "s" * 70
    held = [attempt("a-short", f"{short}:7"), attempt("a-long", f"{long}:8", pool="local-on-demand")]
    assert [a.attempt_id for a in attempts_of_pod(held, short, SPOT_LABELS)] == ["a-short"]
    on_demand = {"deadline-batch.io/pool": "local-on-demand"}
    assert [a.attempt_id for a in attempts_of_pod(held, long, on_demand)] == ["a-long"]


def test_a_racer_named_after_a_long_spot_pod_is_told_apart_by_name_and_by_its_speculative_attempts() -> None:
    spot = "s" * 63  # the provider's longest pod name
    racer = f"{spot}-race"
    held = [
        attempt("a-spot", f"{spot}:1"),
        attempt("a-race", f"{racer}:1", pool="local-on-demand", speculative=True),
    ]
    assert [a.attempt_id for a in attempts_of_pod(held, spot, SPOT_LABELS)] == ["a-spot"]
    assert [a.attempt_id for a in attempts_of_pod(held, racer, RACER_LABELS)] == ["a-race"]
    assert [a.attempt_id for a in attempts_of_pod(held, spot)] == ["a-spot"]
    assert [a.attempt_id for a in attempts_of_pod(held, racer)] == ["a-race"]
    # mid-upgrade: a racer's worker of the previous version names its attempt after the shared hostname
    mixed = [held[0], attempt("a-old-race", f"{spot}:2", pool="local-on-demand", speculative=True)]
    assert [a.attempt_id for a in attempts_of_pod(mixed, spot, SPOT_LABELS)] == ["a-spot"]
    assert [a.attempt_id for a in attempts_of_pod(mixed, racer, RACER_LABELS)] == ["a-old-race"]


def _pod(phase: str | None, *, deleting: bool = False) -> k8s.V1Pod:
    meta = k8s.V1ObjectMeta(
        name="p", deletion_timestamp=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc) if deleting else None
    )
    return k8s.V1Pod(metadata=meta, status=k8s.V1PodStatus(phase=phase))


@pytest.mark.parametrize(
    ("pod", "ended"),
    [
        (None, True),  # gone
        (_pod("Succeeded"), True),
        (_pod("Failed"), True),
        (_pod("Running", deleting=True), False),  # terminating under an eviction: its worker may still commit
        (_pod("Running"), False),
        (_pod("Pending"), False),
        (k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="p")), False),  # no status yet
    ],
)
def test_a_pod_has_ended_only_when_no_container_can_still_run(pod: k8s.V1Pod | None, ended: bool) -> None:
    assert pod_ended(pod) is ended
