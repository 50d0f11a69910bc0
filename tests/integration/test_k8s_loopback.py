"""The loopback Kubernetes API through the real ``kubernetes`` client: pods really run, logs stream,
Secrets reach the environment, and an eviction is what a Spot reclaim looks like to a client."""

from __future__ import annotations

import base64
import json
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.k8s.fixtures import LoopbackCluster, loopback_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
WAIT_S = 60.0  # deadline for conditions on a loaded 2-core machine (nothing sleeps)


@pytest.fixture()
def loopback_k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        yield cluster


def read_log(v1: client.CoreV1Api, name: str, namespace: str, **options: object) -> str:
    """The pod's log as text. Read raw: kubernetes 36's preloaded ``read_namespaced_pod_log`` returns
    the repr of the bytes (``"b'...'"``, kubernetes-client/python#2596); the operator reads raw too."""
    return v1.read_namespaced_pod_log(name, namespace, _preload_content=False, **options).read().decode()


def python_pod(name: str, code: str, **spec: object) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={"app": "loopback-test", "case": name}),
        spec=client.V1PodSpec(
            restart_policy="Never",
            containers=[
                client.V1Container(
                    name="base", image="python:3.11-slim", command=["python3", "-c", textwrap.dedent(code)]
                )
            ],
            **spec,
        ),
    )


def test_a_pod_runs_its_command_streams_its_log_and_succeeds(loopback_k8s: LoopbackCluster) -> None:
    v1, ns = loopback_k8s.core_v1(), loopback_k8s.namespace
    created = v1.create_namespaced_pod(
        ns, python_pod("hello", 'import sys; print("hi"); print(sys.executable)')
    )
    assert created.status.phase == "Pending"
    # as from a kubelet, a log can be read once the container started (before: 400 ContainerCreating)
    loopback_k8s.api.wait_for_pod(
        ns,
        name="hello",
        predicate=lambda pod: pod["status"].get("phase") in ("Running", "Succeeded", "Failed"),
    )

    stream = v1.read_namespaced_pod_log("hello", ns, follow=True, _preload_content=False)
    lines = [line.decode().rstrip("\n") for line in stream]  # ends when the container ends
    assert lines == ["hi", sys.executable]

    pod = v1.read_namespaced_pod("hello", ns)
    assert pod.status.phase == "Succeeded"
    [status] = pod.status.container_statuses
    assert status.state.terminated.exit_code == 0 and status.state.terminated.reason == "Completed"
    conditions = {c.type: c.status for c in pod.status.conditions}
    assert conditions["PodScheduled"] == "True" and conditions["Ready"] == "False"
    assert pod.spec.node_name == "loopback-node"

    listed = v1.list_namespaced_pod(ns, label_selector="app=loopback-test,case in (hello),!airflow-worker")
    assert [p.metadata.name for p in listed.items] == ["hello"]
    assert v1.list_namespaced_pod(ns, label_selector="app=loopback-test,already_checked!=True").items
    assert not v1.list_namespaced_pod(ns, label_selector="app=other").items

    stamped = read_log(v1, "hello", ns, timestamps=True, tail_lines=1)
    assert stamped.split(" ", 1)[1] == sys.executable + "\n" and stamped[:4].isdigit()

    events = v1.list_namespaced_event(ns, field_selector="involvedObject.name=hello")
    assert {"Scheduled", "Created", "Started"} <= {e.reason for e in events.items}

    v1.patch_namespaced_pod("hello", ns, {"metadata": {"labels": {"already_checked": "True"}}})
    assert not v1.list_namespaced_pod(ns, label_selector="app=loopback-test,already_checked!=True").items
    v1.delete_namespaced_pod("hello", ns, body=client.V1DeleteOptions())
    with pytest.raises(ApiException) as gone:
        v1.read_namespaced_pod("hello", ns)
    assert gone.value.status == 404


def test_secret_key_refs_and_field_refs_reach_the_environment(loopback_k8s: LoopbackCluster) -> None:
    v1, ns = loopback_k8s.core_v1(), loopback_k8s.namespace
    v1.create_namespaced_secret(
        ns,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="store"),
            data={"url": base64.b64encode(b"sqlite:////tmp/x.db").decode()},
        ),
    )
    assert base64.b64decode(v1.read_namespaced_secret("store", ns).data["url"]) == b"sqlite:////tmp/x.db"
    pod = python_pod("env", 'import os; print(os.environ["STORE"], os.environ["POD"], os.environ["NS"])')
    pod.spec.containers[0].env = [
        client.V1EnvVar(
            name="STORE",
            value_from=client.V1EnvVarSource(
                secret_key_ref=client.V1SecretKeySelector(name="store", key="url")
            ),
        ),
        client.V1EnvVar(
            name="POD",
            value_from=client.V1EnvVarSource(
                field_ref=client.V1ObjectFieldSelector(field_path="metadata.name")
            ),
        ),
        client.V1EnvVar(
            name="NS",
            value_from=client.V1EnvVarSource(
                field_ref=client.V1ObjectFieldSelector(field_path="metadata.namespace")
            ),
        ),
    ]
    v1.create_namespaced_pod(ns, pod)
    done = loopback_k8s.api.wait_for_pod(ns, name="env", phase="Succeeded", timeout_s=WAIT_S)
    assert done["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert read_log(v1, "env", ns) == f"sqlite:////tmp/x.db env {ns}\n"


def test_a_missing_secret_keeps_the_container_waiting_until_it_exists(loopback_k8s: LoopbackCluster) -> None:
    v1, ns = loopback_k8s.core_v1(), loopback_k8s.namespace
    pod = python_pod("late", 'import os; print(os.environ["TOKEN"])')
    pod.spec.containers[0].env = [
        client.V1EnvVar(
            name="TOKEN",
            value_from=client.V1EnvVarSource(secret_key_ref=client.V1SecretKeySelector(name="late", key="t")),
        )
    ]
    v1.create_namespaced_pod(ns, pod)
    waiting = loopback_k8s.api.wait_for_pod(
        ns,
        name="late",
        predicate=lambda p: any(
            s["state"].get("waiting", {}).get("reason") == "CreateContainerConfigError"
            for s in p["status"].get("containerStatuses") or []
        ),
        timeout_s=WAIT_S,
    )
    assert waiting["status"]["phase"] == "Pending"
    assert (
        'secret "late" not found' in waiting["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
    )
    v1.create_namespaced_secret(
        ns, client.V1Secret(metadata=client.V1ObjectMeta(name="late"), string_data={"t": "x"})
    )
    loopback_k8s.api.wait_for_pod(ns, name="late", phase="Succeeded", timeout_s=WAIT_S)
    assert read_log(v1, "late", ns) == "x\n"


TRAPS_SIGTERM = """
    import signal, sys, time
    def stop(signum, frame):
        print("got SIGTERM", flush=True)
        sys.exit(75)
    signal.signal(signal.SIGTERM, stop)
    print("running", flush=True)
    while True:
        time.sleep(3600)
"""


def test_eviction_is_a_disruption_target_then_sigterm_then_failed(loopback_k8s: LoopbackCluster) -> None:
    v1, ns, api = loopback_k8s.core_v1(), loopback_k8s.namespace, loopback_k8s.api
    v1.create_namespaced_pod(ns, python_pod("spot", TRAPS_SIGTERM, termination_grace_period_seconds=120))
    api.wait_for_pod(ns, labels="case=spot", phase="Running", timeout_s=WAIT_S)
    api.wait_for_log(ns, "spot", "running\n", timeout_s=WAIT_S)

    api.evict(ns, "spot")
    pod = v1.read_namespaced_pod("spot", ns)
    disruption = next(c for c in pod.status.conditions if c.type == "DisruptionTarget")
    assert (disruption.status, disruption.reason) == ("True", "TerminationByKubelet")

    api.wait_for_pod(ns, name="spot", phase="Failed", timeout_s=WAIT_S)
    pod = v1.read_namespaced_pod("spot", ns)
    assert pod.status.reason == "Terminated"
    assert "node shutdown" in pod.status.message
    terminated = pod.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (75, "Error")
    assert read_log(v1, "spot", ns) == "running\ngot SIGTERM\n"


def unschedulable(pod: dict) -> bool:
    conditions = pod["status"].get("conditions") or []
    return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)


def test_a_full_node_pool_keeps_pods_pending_and_a_reclaim_takes_its_node(
    loopback_k8s: LoopbackCluster,
) -> None:
    """``set_capacity``: one Spot node; the second Spot pod waits; a reclaim removes the node."""
    v1, ns, api = loopback_k8s.core_v1(), loopback_k8s.namespace, loopback_k8s.api
    api.set_capacity("capacity-type", "spot", 1)
    spot, on_demand = {"capacity-type": "spot"}, {"capacity-type": "on-demand"}
    v1.create_namespaced_pod(ns, python_pod("first", TRAPS_SIGTERM, node_selector=spot))
    api.wait_for_log(ns, "first", "running\n", timeout_s=WAIT_S)
    v1.create_namespaced_pod(ns, python_pod("second", 'print("running")', node_selector=spot))
    v1.create_namespaced_pod(ns, python_pod("elsewhere", 'print("running")', node_selector=on_demand))
    waiting = api.wait_for_pod(ns, name="second", predicate=unschedulable, timeout_s=WAIT_S)
    assert waiting["status"]["phase"] == "Pending" and "nodeName" not in waiting["spec"]
    events = v1.list_namespaced_event(ns, field_selector="involvedObject.name=second").items
    assert [e.reason for e in events] == ["FailedScheduling"]
    assert "capacity-type=spot" in events[0].message
    api.wait_for_pod(ns, name="elsewhere", phase="Succeeded", timeout_s=WAIT_S)  # no limit there

    api.evict(ns, "first", reclaim_node=True)
    api.wait_for_pod(ns, name="first", phase="Failed", timeout_s=WAIT_S)
    assert api.capacity[("capacity-type", "spot")] == 0  # the node went with the pod
    assert v1.read_namespaced_pod("second", ns).status.phase == "Pending"
    api.set_capacity("capacity-type", "spot", 1)  # a new Spot node comes up
    api.wait_for_pod(ns, name="second", phase="Succeeded", timeout_s=WAIT_S)
    assert read_log(v1, "second", ns) == "running\n"


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(
    loopback_k8s: LoopbackCluster,
) -> None:
    v1, ns, api = loopback_k8s.core_v1(), loopback_k8s.namespace, loopback_k8s.api
    code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print("up"); time.sleep(3600)'
    v1.create_namespaced_pod(ns, python_pod("stubborn", code, termination_grace_period_seconds=1))
    api.wait_for_log(ns, "stubborn", "up\n", timeout_s=WAIT_S)
    api.evict(ns, "stubborn")
    done = api.wait_for_pod(ns, name="stubborn", phase="Failed", timeout_s=WAIT_S)
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 137 and terminated["signal"] == 9


def test_deleting_a_running_pod_stops_it_gracefully_then_removes_it(loopback_k8s: LoopbackCluster) -> None:
    v1, ns, api = loopback_k8s.core_v1(), loopback_k8s.namespace, loopback_k8s.api
    v1.create_namespaced_pod(ns, python_pod("deleted", TRAPS_SIGTERM))
    api.wait_for_log(ns, "deleted", "running\n", timeout_s=WAIT_S)
    answered = v1.delete_namespaced_pod("deleted", ns, grace_period_seconds=30)
    assert answered.metadata.deletion_timestamp is not None
    api.wait_for_deletion(ns, "deleted", timeout_s=WAIT_S)
    assert not v1.list_namespaced_pod(ns, field_selector="metadata.name=deleted").items


def test_the_api_refuses_what_a_real_server_refuses(loopback_k8s: LoopbackCluster) -> None:
    v1, ns = loopback_k8s.core_v1(), loopback_k8s.namespace
    with pytest.raises(ApiException) as missing_ns:
        v1.create_namespaced_pod("nope", python_pod("x", "pass"))
    assert missing_ns.value.status == 404
    bad = python_pod("Bad_Name", "pass")
    bad.metadata.labels = {"run_id": "x" * 64}
    with pytest.raises(ApiException) as refused:
        v1.create_namespaced_pod(ns, bad)
    assert refused.value.status == 422
    assert "must be no more than 63 characters" in refused.value.body
    v1.create_namespaced_pod(ns, python_pod("twice", "pass"))
    with pytest.raises(ApiException) as twice:
        v1.create_namespaced_pod(ns, python_pod("twice", "pass"))
    assert twice.value.status == 409
    # Go decodes int64 fields strictly: 120.0 is refused where 120 is accepted
    body = v1.api_client.sanitize_for_serialization(python_pod("f", "pass"))
    body["spec"]["terminationGracePeriodSeconds"] = 120.0
    request = urllib.request.Request(
        f"{loopback_k8s.api.url}/api/v1/namespaces/{ns}/pods",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {loopback_k8s.api.token}"},
    )
    with pytest.raises(urllib.error.HTTPError) as fractional:
        urllib.request.urlopen(request, timeout=WAIT_S)
    assert fractional.value.code == 400
    assert "cannot unmarshal number 120.0" in fractional.value.read().decode()
    unauthorized = client.CoreV1Api(client.ApiClient(client.Configuration(host=loopback_k8s.api.url)))
    with pytest.raises(ApiException) as denied:
        unauthorized.list_namespaced_pod(ns)
    assert denied.value.status == 401


def test_the_eviction_api_marks_the_pod_then_deletes_it_gracefully(
    loopback_k8s: LoopbackCluster, tmp_path: Path
) -> None:
    v1, ns, api = loopback_k8s.core_v1(), loopback_k8s.namespace, loopback_k8s.api
    release = tmp_path / "release"
    # the process holds on after SIGTERM until the test has looked at the marked pod
    wait = f"import os\n        while not os.path.exists({str(release)!r}): time.sleep(0.01)\n"
    holds = TRAPS_SIGTERM.replace("sys.exit(75)", wait + "        sys.exit(75)")
    v1.create_namespaced_pod(ns, python_pod("drained", holds, termination_grace_period_seconds=120))
    api.wait_for_log(ns, "drained", "running\n", timeout_s=WAIT_S)
    v1.create_namespaced_pod_eviction(
        "drained", ns, client.V1Eviction(metadata=client.V1ObjectMeta(name="drained", namespace=ns))
    )
    api.wait_for_log(ns, "drained", "got SIGTERM\n", timeout_s=WAIT_S)
    marked = v1.read_namespaced_pod("drained", ns)  # still there until its process has stopped
    release.write_text("")
    disruption = next(c for c in marked.status.conditions if c.type == "DisruptionTarget")
    assert disruption.reason == "EvictionByEvictionAPI" and marked.metadata.deletion_timestamp is not None
    api.wait_for_deletion(ns, "drained", timeout_s=WAIT_S)
    assert "Killing" in {e["reason"] for e in api.events(ns, "drained")}


def test_env_from_a_secret_and_a_command_that_cannot_start(loopback_k8s: LoopbackCluster) -> None:
    v1, ns, api = loopback_k8s.core_v1(), loopback_k8s.namespace, loopback_k8s.api
    v1.create_namespaced_secret(
        ns, client.V1Secret(metadata=client.V1ObjectMeta(name="aws"), string_data={"AWS_REGION": "eu-west-1"})
    )
    pod = python_pod(
        "from", 'import os; print(os.environ["S3_AWS_REGION"], "AWS_ACCESS_KEY_ID" in os.environ)'
    )
    pod.spec.containers[0].env_from = [
        client.V1EnvFromSource(prefix="S3_", secret_ref=client.V1SecretEnvSource(name="aws"))
    ]
    v1.create_namespaced_pod(ns, pod)
    api.wait_for_pod(ns, name="from", phase="Succeeded", timeout_s=WAIT_S)
    assert read_log(v1, "from", ns) == "eu-west-1 False\n"  # nothing of the test's own environment

    missing = python_pod("missing", "pass")
    missing.spec.containers[0].command = ["no-such-binary-anywhere"]
    v1.create_namespaced_pod(ns, missing)
    failed = api.wait_for_pod(ns, name="missing", phase="Failed", timeout_s=WAIT_S)
    terminated = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (128, "StartError")
