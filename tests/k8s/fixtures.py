"""The loopback Kubernetes API as a test resource. A test module declares its fixture with it:

@pytest.fixture()
def k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        yield cluster
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client, config

from tests.helpers.waiting import wait_for
from tests.k8s.server import LoopbackKubernetes

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "deadline-batch"
#: the worker image's ENV (worker_image/Dockerfile), plus the package on PYTHONPATH as the image installs it
IMAGE_ENV = {
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": str(REPO_ROOT),
    "LANG": "C.UTF-8",
}
#: how a container learns its termination-message file (the worker honours it; see tests/k8s/kubelet.py)
TERMINATION_MESSAGE_ENV = "ADB_TERMINATION_LOG"


@dataclass(frozen=True)
class LoopbackCluster:
    """The server, its kubeconfig (current context's namespace: ``namespace``) and a client factory."""

    api: LoopbackKubernetes
    kubeconfig: Path
    namespace: str

    def core_v1(self) -> client.CoreV1Api:
        """A ``CoreV1Api`` configured from the kubeconfig, as a user's code would build it."""
        return client.CoreV1Api(api_client=config.new_client_from_config(config_file=str(self.kubeconfig)))


@contextlib.contextmanager
def loopback_cluster(tmp_path: Path) -> Iterator[LoopbackCluster]:
    """A running loopback API (namespaces ``default`` and ``deadline-batch``); all its pods killed after."""
    api = LoopbackKubernetes(
        tmp_path / "k8s",
        namespaces=("default", NAMESPACE),
        image_env=IMAGE_ENV,
        termination_message_env=TERMINATION_MESSAGE_ENV,
    )
    with api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)
        yield LoopbackCluster(api, kubeconfig, NAMESPACE)
    assert api.live_processes() == [], "a container process outlived the loopback API"


def no_pod_left(api: LoopbackKubernetes, namespace: str, *, timeout_s: float = 60.0) -> bool:
    """Every pod of ``namespace`` gone: waits for deletions the operator asked for to finish (a pod
    deleted while its process still runs is listed until its grace period ends, as in a cluster)."""
    wait_for(lambda: not api.pods(namespace), timeout_s=timeout_s, what=f"every pod of {namespace} deleted")
    return True
