"""What the Kubernetes end-to-end test sets up around Airflow, usable by hand as well.

``python -m tests.e2e.loopback_deployment --dir DIR --store-url URL --s3-endpoint URL`` starts the
loopback Kubernetes API (tests/k8s/) in this process, writes ``DIR/kubeconfig``, creates the two
Secrets the example DAG's pods read, prints the ``AIRFLOW_CONN_*`` connections to export for the
Airflow processes, gives the cluster one Spot node, reclaims it from the first Spot shard pod that
runs (``--no-evict`` to skip) and serves until Ctrl-C. tests/e2e/test_airflow_deployment.py uses
the same functions.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import shlex
import signal
import threading
from pathlib import Path

from kubernetes import client
from sqlalchemy.engine import make_url

from tests.fixtures.s3 import FAKE_CREDENTIALS, s3_environment
from tests.k8s.fixtures import NAMESPACE, LoopbackCluster, loopback_cluster
from tests.k8s.server import LoopbackKubernetes

STORE_SECRET = "deadline-batch-store"
S3_SECRET = "deadline-batch-s3"


def connections(store_url: str, s3_endpoint: str, kubeconfig: Path) -> dict[str, str]:
    """The three connections, as ``AIRFLOW_CONN_*`` JSON: the only place credentials are given."""
    store = make_url(store_url)
    store_conn = {
        "conn_type": "postgres",
        "host": store.host,
        "port": store.port,
        "login": store.username,
        "password": store.password,
        "schema": store.database,
        "extra": {k: v for k, v in store.query.items() if k == "options"},  # search_path, if any
    }
    aws = {
        "conn_type": "aws",
        "login": FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "password": FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "extra": {"endpoint_url": s3_endpoint, "region_name": FAKE_CREDENTIALS["AWS_DEFAULT_REGION"]},
    }
    kube = {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kubeconfig), "namespace": NAMESPACE}}
    return {
        "AIRFLOW_CONN_DEADLINE_BATCH_STORE": json.dumps(store_conn),
        "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(aws),
        "AIRFLOW_CONN_KUBERNETES_DEFAULT": json.dumps(kube),
    }


def create_secrets(cluster: LoopbackCluster, store_url: str, s3_endpoint: str) -> None:
    """What an operator creates with kubectl: the store DSN, and S3 for the pods (IRSA's stand-in)."""

    def secret(name: str, data: dict[str, str]) -> client.V1Secret:
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        return client.V1Secret(metadata=client.V1ObjectMeta(name=name), data=encoded)

    core = cluster.core_v1()
    core.create_namespaced_secret(NAMESPACE, secret(STORE_SECRET, {"url": store_url}))
    core.create_namespaced_secret(NAMESPACE, secret(S3_SECRET, s3_environment(s3_endpoint)))


#: the example's node label that tells Spot from on-demand nodes (Karpenter's)
CAPACITY_TYPE = "karpenter.sh/capacity-type"
#: Spot nodes the cluster has at first; the eviction reclaims one of them for good
SPOT_NODES = 1


def on_spot(pod: dict) -> bool:
    return (pod["spec"].get("nodeSelector") or {}).get(CAPACITY_TYPE) == "spot"


def limit_spot(api: LoopbackKubernetes, nodes: int = SPOT_NODES) -> None:
    """Spot capacity is scarce: at most ``nodes`` Spot pods run at once, the others stay Pending."""
    api.set_capacity(CAPACITY_TYPE, "spot", nodes)


def evict_first_running_pod(api: LoopbackKubernetes, evicted: list[str], *, timeout_s: float) -> None:
    """Wait (on the API's condition variable) for a Running Spot pod; reclaim its node as Spot does.

    The pod gets a Spot interruption (DisruptionTarget, SIGTERM, grace, SIGKILL) and its node is
    gone for good, so with :func:`limit_spot` no Spot pod runs afterwards: the shards still to
    run wait for Spot until their decision's last safe Spot start, then go on-demand.
    """
    with contextlib.suppress(Exception):  # a run that fails before any pod is reported by the caller
        pod = api.wait_for_pod(NAMESPACE, phase="Running", predicate=on_spot, timeout_s=timeout_s)
        api.evict(NAMESPACE, pod["metadata"]["name"], reclaim_node=True)
        evicted.append(pod["metadata"]["name"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--store-url", required=True, help="the store DSN (with its password)")
    parser.add_argument("--s3-endpoint", required=True)
    parser.add_argument("--no-evict", action="store_true")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    with loopback_cluster(args.dir) as cluster:
        create_secrets(cluster, args.store_url, args.s3_endpoint)
        for name, value in connections(args.store_url, args.s3_endpoint, cluster.kubeconfig).items():
            print(f"export {name}={shlex.quote(value)}", flush=True)
        limit_spot(cluster.api)
        evicted: list[str] = []
        if not args.no_evict:
            threading.Thread(
                target=evict_first_running_pod,
                args=(cluster.api, evicted),
                kwargs={"timeout_s": 3600},
                daemon=True,
            ).start()
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        stop.wait()
        print(
            f"evicted: {evicted}; pods created: {[p['metadata']['name'] for p in cluster.api.created_pods]}"
        )
        for pod in cluster.api.pods(NAMESPACE):
            with contextlib.suppress(Exception):
                cluster.core_v1().delete_namespaced_pod(pod["metadata"]["name"], NAMESPACE)


if __name__ == "__main__":
    main()
