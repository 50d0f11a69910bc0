"""Which attempts ran in a shard pod that ended (``operators.shard``: ``pod_hostname``,
``attempts_of_pod``, ``pod_ended``): a worker names its attempts ``<hostname>:<pid>``, and a pod's
hostname is its name cut to 63 characters, so a racer pod named after a long Spot pod's name shares
its hostname and is told apart by its speculative attempts."""

from __future__ import annotations

import datetime as dt

import pytest
from kubernetes.client import models as k8s

from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.operators.shard import RACE_LABEL, attempts_of_pod, pod_ended, pod_hostname
from airflow_deadline_batch.store import AttemptRow

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
