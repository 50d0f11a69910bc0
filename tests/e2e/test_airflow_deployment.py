"""The example DAGs on a real Airflow deployment (not ``dag.test()``), driven through the REST API.

``airflow api-server``, ``scheduler`` (LocalExecutor), ``triggerer`` and ``dag-processor`` run as
processes with a PostgreSQL metadata database (tests/fixtures/airflow_deployment.py); the run is
triggered and awaited through ``/api/v2``, and the deferrable ``CompletenessSensor`` resumes from
the real triggerer.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import datetime as dt
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from airflow_deadline_batch.service.finalize import verify_job
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.loopback_deployment import (
    CAPACITY_TYPE,
    S3_SECRET,
    connections,
    create_secrets,
    evict_first_running_pod,
    limit_spot,
    on_spot,
)
from tests.fixtures.airflow_deployment import (
    AirflowDeployment,
    airflow_environment,
    metadata_database,
    start_deployment,
    stop_deployment,
)
from tests.fixtures.postgres import PgServer, password_store
from tests.helpers.inputs import mixed_input
from tests.helpers.outcomes import read_manifest, read_outcomes
from tests.k8s.fixtures import NAMESPACE, LoopbackCluster, loopback_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LOCAL_DAG = REPO / "dags" / "example_deadline_batch_local.py"
SAMPLE = REPO / "dags" / "data" / "sample_reviews.jsonl"
RUN_TIMEOUT_S = 240.0
#: the Kubernetes run waits for Spot until the last safe Spot start, minutes away: a longer bound
K8S_RUN_TIMEOUT_S = 600.0
#: Airflow's turnaround between two tries of a shard task, as the placement counts it
#: (docs/airflow.md, *Resuming tasks*): the resume delay (5 s; the test DAG's retry delay is 1 s)
#: plus ``[deadline_batch] scheduler_latency_s`` (60 s), and for these deferrable, racing tries the
#: trigger's poll (1 s, held to the 5 s resume delay), the resume's latency and a race check's
K8S_TURNAROUND_S = 5 + 60 + 5 + 60 + 60
#: the Kubernetes run's deadline. The example's pools start a node in 240 s, so a Spot try needs
#: 2 x 240 s of time left (its own start, then an on-demand start if it is lost) plus Airflow's
#: turnaround between the two: the first tries, decided within the first 150 s, go to Spot; once
#: the one Spot node is reclaimed, the Spot pods still pending give up at their last safe start and
#: their next tries go on-demand.
K8S_DEADLINE_S = 2 * 240 + K8S_TURNAROUND_S + 150
K8S_DAG_ID = "example_deadline_batch_kubernetes"
K8S_TEST_DAG = Path(__file__).resolve().parent / "dags" / "example_deadline_batch_kubernetes_loopback.py"


@dataclass(frozen=True)
class Deployment:
    """One deployment for the module: both example DAGs parsed, the connections set, a bucket."""

    airflow: AirflowDeployment
    cluster: LoopbackCluster
    bucket: str
    store_url: str
    store_password: str


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, pg_server: PgServer, s3_endpoint: str, s3_client: Any
) -> Iterator[Deployment]:
    """Started once (about 30-40 s on two loaded cores) and shared by the two DAG tests."""
    root = tmp_path_factory.mktemp("deployment")
    dags = root / "dags"
    dags.mkdir()
    for dag_file in (LOCAL_DAG, K8S_TEST_DAG):  # each DAG resolves its own folder through the link
        (dags / dag_file.name).symlink_to(dag_file)
    bucket = f"e2e-{uuid.uuid4().hex[:20]}"
    s3_client.create_bucket(Bucket=bucket)
    with (
        metadata_database(pg_server) as db_url,
        password_store(pg_server) as store_url,
        loopback_cluster(root) as cluster,
    ):
        create_secrets(cluster, store_url, s3_endpoint)
        airflow = start_deployment(
            root / "airflow",
            db_url=db_url,
            dags_folder=dags,
            extra_env={
                # the local example's knobs (docs/airflow.md)
                "ADB_ENGINE": "echo",
                "ADB_EXAMPLE_DIR": str(root / "example"),
                "ADB_EXAMPLE_PREEMPT_TRIES": "1",
                # a task parses its DAG file at start (2 s idle, 12-30+ s on two overloaded cores);
                # past Airflow's 30 s default the try is rescheduled a minute later, or fails once
                # its try has been rescheduled 3 times ([workers] missing_dag_retries)
                "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
                "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "150",
                # each DAG file is parsed once: the files never change while the module runs, and
                # a parse costs ~2 s of CPU (Airflow's default parses every file every 30 s, about
                # 45 s of CPU over the module that the other test processes need); a failed first
                # parse still fails the test at once (wait_for_dag reads the import errors)
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
                # the Kubernetes example's connections: the only place credentials are given
                **connections(store_url, s3_endpoint, cluster.kubeconfig),
            },
        )
        setup = Deployment(airflow, cluster, bucket, store_url, str(make_url(store_url).password))
        try:
            yield setup
        finally:
            keep_post_mortem(setup, root / "post-mortem")
            stop_deployment(airflow)
            for pod in cluster.api.pods(NAMESPACE):  # a run cut short leaves pods running
                with contextlib.suppress(Exception):
                    cluster.core_v1().delete_namespaced_pod(pod["metadata"]["name"], NAMESPACE)


def keep_post_mortem(setup: Deployment, folder: Path) -> None:
    """Keep what a flaky run's post-mortem needs and teardown destroys: every pod the loopback API
    ran (its last status, its events, its output), every job (its state, error and manifest) and
    attempt in the store, written next to the Airflow logs (``--basetemp`` keeps them); the
    databases and the pods' output go at teardown.
    """
    folder.mkdir(exist_ok=True)
    api = setup.cluster.api
    with contextlib.suppress(Exception):
        with api.lock:
            runtimes = list(api.kubelet.pods.values())
            pods = {r.uid: copy.deepcopy(api.pod_object((r.namespace, r.name, r.uid))) for r in runtimes}
            output = {
                r.uid: {c.name: b"".join(line.data for line in c.log) for c in r.containers} for r in runtimes
            }
        for runtime in runtimes:
            name = f"{runtime.name}-{runtime.uid[:8]}"
            last = {"pod": pods[runtime.uid], "events": api.events(runtime.namespace, runtime.name)}
            (folder / f"{name}.json").write_text(json.dumps(last, indent=1, default=str))
            for container, data in output[runtime.uid].items():
                (folder / f"{name}.{container}.log").write_bytes(data)
    with contextlib.suppress(Exception):
        store = ManifestStore.open(setup.store_url)
        try:
            jobs = store.list_jobs(limit=10)
            rows = [dataclasses.asdict(a) for job in jobs for a in store.list_attempts(job.job_id)]
        finally:
            store.close()
        (folder / "jobs.json").write_text(
            json.dumps([dataclasses.asdict(j) for j in jobs], indent=1, default=str)
        )
        (folder / "attempts.json").write_text(json.dumps(rows, indent=1, default=str))


def by_task(tis: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for ti in tis:
        out.setdefault(ti["task_id"], []).append(ti)
    return out


def test_local_dag_on_a_real_deployment(deployment: Deployment, tmp_path: Path) -> None:
    af = deployment.airflow
    dag_id = "example_deadline_batch_local"
    af.wait_for_dag(dag_id)
    started = time.monotonic()
    run_id = af.trigger(dag_id, {"output_uri": str(tmp_path / "out"), "deadline": "+2h"})
    run = af.wait_for_run(dag_id, run_id, timeout_s=RUN_TIMEOUT_S)
    tis = by_task(af.task_instances(dag_id, run_id))
    summary = {t: [(ti["map_index"], ti["state"], ti["try_number"]) for ti in v] for t, v in tis.items()}
    assert run["state"] == "success", f"{summary}\n{af.log_tails()}"
    print(f"run took {time.monotonic() - started:.1f} s: {summary}")

    assert len(tis["shard"]) >= 2 and {ti["state"] for ti in tis["shard"]} == {"success"}
    # every shard's first try was preempted (injected) and Airflow's retry finished it
    assert {ti["try_number"] for ti in tis["shard"]} == {2}
    (verify,) = tis["verify"]
    (summarise,) = tis["summarise"]
    assert verify["state"] == summarise["state"] == "success"
    # the sensor runs after the shards: the job was over, so it published at once, without a
    # triggerer round trip (and without the Airflow 3.3 resume race: docs/airflow.md), first try
    log = af.task_log(dag_id, run_id, "verify", verify["try_number"])
    assert verify["try_number"] == 1 and "every shard succeeded" in log, log[-3000:]
    assert "deferring" not in log, log[-3000:]
    # downstream ran only after publication
    assert summarise["start_date"] >= verify["end_date"]

    manifest_uri = af.xcom(dag_id, run_id, "verify", "return_value")
    manifest = json.loads(Path(manifest_uri.removeprefix("file://")).read_text())
    records = [n for n, line in enumerate(SAMPLE.read_text().splitlines(), start=1) if line.strip()]
    seen = sorted(
        json.loads(row)["line"]
        for entry in manifest["shards"]
        for row in Path(entry["uri"].removeprefix("file://")).read_text().splitlines()
    )
    assert seen == records  # one outcome per non-blank input line, none twice
    assert af.xcom(dag_id, run_id, "summarise", "return_value")["outcomes"] == manifest["outcomes"]


# -- the Kubernetes example DAG on the loopback Kubernetes API ------------------------------------


def test_kubernetes_dag_on_a_real_deployment_with_an_eviction(deployment: Deployment, s3_client: Any) -> None:
    k8s_setup = deployment
    af, api = k8s_setup.airflow, k8s_setup.cluster.api
    for process in af.processes.values():  # no AWS_* variable in any Airflow process
        environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith(b"AWS_")]
    # ~7 % invalid lines (every kind; admission refuses over 10 %) and a few blank ones
    mixed = mixed_input(200, seed=8, bad_fraction=0.02, blank_fraction=0.02)
    assert mixed.blank_lines
    af.wait_for_dag(K8S_DAG_ID)

    day = dt.datetime.now(dt.timezone.utc).date().isoformat()  # {{ dag_run.run_after | ds }}
    s3_client.put_object(Bucket=k8s_setup.bucket, Key=f"batches/{day}/requests.jsonl", Body=mixed.data)
    limit_spot(api)  # one Spot node: the first Spot pod runs, the others wait for capacity
    evicted: list[str] = []
    evictor = threading.Thread(
        target=evict_first_running_pod,
        args=(api, evicted),
        kwargs={"timeout_s": K8S_RUN_TIMEOUT_S},
        daemon=True,
    )
    evictor.start()
    started = time.monotonic()
    conf = {"bucket": k8s_setup.bucket, "deadline_hours": K8S_DEADLINE_S / 3600}
    run_id = af.trigger(K8S_DAG_ID, conf)
    run = af.wait_for_run(K8S_DAG_ID, run_id, timeout_s=K8S_RUN_TIMEOUT_S)
    tis = by_task(af.task_instances(K8S_DAG_ID, run_id))
    summary = {t: [(ti["map_index"], ti["state"], ti["try_number"]) for ti in v] for t, v in tis.items()}
    assert run["state"] == "success", f"{summary}\n{af.log_tails()}"
    print(f"run took {time.monotonic() - started:.1f} s: {summary}; evicted {evicted}")
    evictor.join(timeout=10)

    # the Spot node was reclaimed from a running pod, and the shard's task saw a preemption
    assert evicted, "no pod was evicted"
    created = api.created_pods
    assert len(created) > len(tis["shard"]), [p["metadata"]["name"] for p in created]
    (evicted_pod,) = [p for p in created if p["metadata"]["name"] == evicted[0]]
    map_index = int(evicted_pod["metadata"]["labels"]["map_index"])
    # a try of the shard classified the evicted pod as preempted (which one: preemption_logged)
    (last_try,) = [ti["try_number"] for ti in tis["shard"] if ti["map_index"] == map_index]
    logs_of_shard: dict[int, str] = {}
    for n in range(1, last_try + 1):
        with contextlib.suppress(FileNotFoundError):  # a try number that never ran has no file
            logs_of_shard[n] = af.task_log_file(K8S_DAG_ID, run_id, "shard", n, map_index=map_index)
    assert preemption_logged(logs_of_shard, evicted[0]), "\n".join(logs_of_shard.values())[-3000:]
    # placements: both pools used; a shard that tried Spot first was re-decided onto on-demand
    kinds = [p["spec"]["nodeSelector"][CAPACITY_TYPE] for p in created]
    assert set(kinds) == {"spot", "on-demand"}, kinds
    tries: dict[int, list[str]] = {}
    for pod, kind in zip(created, kinds, strict=True):
        tries.setdefault(int(pod["metadata"]["labels"]["map_index"]), []).append(kind)
    escalated = [i for i, k in tries.items() if k[0] == "spot" and k[-1] == "on-demand"]
    assert escalated, tries
    assert all(k[-1] == "on-demand" for k in tries.values() if "on-demand" in k), tries
    # every Spot pod was created before its decision's last safe Spot start
    for pod in created:
        if on_spot(pod):
            # the API's second-precision time and the decision's ISO time, compared as times
            created_at = api_time(pod["metadata"]["creationTimestamp"])
            safe = dt.datetime.fromisoformat(
                pod["metadata"]["annotations"]["deadline-batch.io/last-safe-spot-start"]
            )
            assert created_at <= safe, pod["metadata"]

    (verify,) = tis["verify"]
    (announce,) = tis["announce"]
    assert verify["state"] == announce["state"] == "success"
    # the sensor waited beside the shards in the real triggerer, and resumed on its first try
    verify_log = af.task_log(K8S_DAG_ID, run_id, "verify", verify["try_number"])
    assert verify["try_number"] == 1 and "deferring until every shard is terminal" in verify_log
    assert announce["start_date"] >= verify["end_date"]  # downstream only after publication
    manifest_uri = af.xcom(K8S_DAG_ID, run_id, "verify", "return_value")
    assert af.xcom(K8S_DAG_ID, run_id, "announce", "return_value") == manifest_uri
    assert manifest_uri.startswith(f"s3://{k8s_setup.bucket}/batch-results/")
    outcomes = read_outcomes(read_manifest(manifest_uri))
    assert sorted(outcomes) == sorted(e.line for e in mixed.expected)  # one per non-blank line

    # the store DSN (and its password) never in a pod spec, XCom or log: pods get it by reference
    secret_bits = (k8s_setup.store_url, k8s_setup.store_password)
    pod_specs = json.dumps(created)
    assert not [s for s in secret_bits if s in pod_specs]
    for pod in created:
        (container,) = pod["spec"]["containers"]
        (store_env,) = [e for e in container["env"] if e["name"] == "ADB_STORE_URL"]
        assert store_env["valueFrom"]["secretKeyRef"]["name"] == "deadline-batch-store"
    xcoms = json.dumps(af.xcoms(K8S_DAG_ID, run_id))
    assert "plan_connections" in xcoms or "job_id" in xcoms  # the listing is not empty
    assert not [s for s in secret_bits if s in xcoms]
    logs = log_files(af.home / "logs", k8s_setup.cluster.api.root)
    assert len(logs) > len(tis["shard"])  # the task logs (with the pods' output) and the processes'
    leaked = [str(f) for f in logs if k8s_setup.store_password.encode() in f.read_bytes()]
    assert not leaked, leaked


def test_failing_the_kubernetes_run_cancels_the_job(deployment: Deployment, s3_client: Any) -> None:
    """Mark the DAG run failed mid-job: the sensor's trigger cancels the job (on_kill), the
    fenced workers stop, and the ``cancelled`` manifest has one outcome per line."""
    af, api = deployment.airflow, deployment.cluster.api
    api.set_capacity(CAPACITY_TYPE, "spot", 64)  # Spot is plentiful this time
    core = deployment.cluster.core_v1()
    slow = {"ADB_ECHO_DELAY_S": base64.b64encode(b"0.2").decode()}  # each record takes 0.2 s
    core.patch_namespaced_secret(S3_SECRET, NAMESPACE, {"data": slow})
    try:
        mixed = mixed_input(400, seed=21, bad_fraction=0.02, blank_fraction=0.01)
        day = dt.datetime.now(dt.timezone.utc).date().isoformat()
        s3_client.put_object(Bucket=deployment.bucket, Key=f"batches/{day}/requests.jsonl", Body=mixed.data)
        af.wait_for_dag(K8S_DAG_ID)
        run_id = af.trigger(K8S_DAG_ID, {"bucket": deployment.bucket, "deadline_hours": 6})
        xcom = f"/dags/{K8S_DAG_ID}/dagRuns/{run_id}/taskInstances/plan/xcomEntries/job_id?deserialize=true"
        job_id = str(
            af.wait(lambda: (af.try_api("GET", xcom) or {}).get("value"), timeout_s=120, what="a job")
        )
        store = ManifestStore.open(deployment.store_url)
        try:
            invalid = sum(1 for e in mixed.expected if e.status == "errored")  # committed by the plan
            af.wait(
                lambda: store.progress(job_id).committed_records > invalid + 20,
                timeout_s=180,
                what="the workers' first commits",
            )

            def sensor_state() -> str | None:
                tis = by_task(af.task_instances(K8S_DAG_ID, run_id)).get("verify") or [{}]
                return tis[0].get("state")

            af.wait(lambda: sensor_state() == "deferred", timeout_s=120, what="the sensor to defer")
            af.api("PATCH", f"/dags/{K8S_DAG_ID}/dagRuns/{run_id}", {"state": "failed"})
            job = af.wait(
                lambda: (j := store.get_job(job_id)).manifest_uri and j,
                timeout_s=120,
                what="the cancelled manifest",
            )
            assert job.state.value == "cancelled" and job.error == f"its DAG run {K8S_DAG_ID}/{run_id} failed"
            report = verify_job(store, job_id)
            assert report.complete, report.summary()
        finally:
            store.close()
        outcomes = read_outcomes(read_manifest(job.manifest_uri))
        assert sorted(outcomes) == sorted(e.line for e in mixed.expected)  # one per non-blank line
        statuses = [rec["status"] for rec in outcomes.values()]
        assert "cancelled" in statuses and "succeeded" in statuses, statuses
        # the fenced workers stop on their own (their heartbeat is refused): no pod keeps a GPU
        api.wait_until(lambda: not api.live_processes() or None, timeout_s=120, what="every pod to stop")
        tis = by_task(af.task_instances(K8S_DAG_ID, run_id))
        assert tis["verify"][0]["state"] == "failed" and tis["announce"][0]["state"] != "success"
    finally:
        core.patch_namespaced_secret(S3_SECRET, NAMESPACE, {"data": {"ADB_ECHO_DELAY_S": None}})


def preemption_logged(logs: dict[int, str], pod: str) -> bool:
    """Whether a try of the evicted pod's shard (``logs``: each try's log) classified ``pod`` as preempted.

    The evicted pod's own try, resumed with the pod's end by its trigger, settles it in ``cleanup``:
    ``pod preempted (pod Terminated: ...)``. Airflow 3.3 can fail that resume before the operator
    runs (the resume race, docs/airflow.md *Resuming tasks*: the trigger's event, held only
    ``min_resume_delay_s`` after the deferral, came back before a loaded scheduler had processed the
    deferring try's exit); the next try then logs that Airflow ended the try, and retires the ended
    pod instead of reattaching to it (``retire_stale_pods``): ``pod <pod> of try 1 ended
    (preempted: pod Terminated: ...)``.
    """
    if any("pod preempted (pod Terminated" in log for log in logs.values()):
        return True
    retired = re.compile(rf"pod {re.escape(pod)} of try (\d+) ended \(preempted: pod Terminated")
    return any(
        (found := retired.search(log)) is not None and f"try {found.group(1)} was ended by Airflow" in log
        for log in logs.values()
    )


def api_time(timestamp: str) -> dt.datetime:
    """A Kubernetes API timestamp (``2026-12-01T11:45:19Z``) as an aware datetime."""
    return dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))


def log_files(*roots: Path) -> list[Path]:
    """Every file the Airflow processes, the tasks and the pods wrote (logs, termination messages)."""
    return [f for root in roots for f in root.rglob("*") if f.is_file()]


def test_docs_export_exactly_the_deployment_environment(tmp_path: Path) -> None:
    """docs/kubernetes.md's by-hand steps set every variable the fixture gives the Airflow processes."""
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    env = airflow_environment(tmp_path, db_url="postgresql+psycopg://x@h/d", port=8080, dags_folder=tmp_path)
    documented = set(re.findall(r"^export (AIRFLOW\w+)=", docs, flags=re.M))
    assert {k for k in env if k.startswith("AIRFLOW")} == documented
    for name, _ in connections("postgresql+psycopg://u:p@h:1/d", "http://s3", tmp_path).items():
        assert name in docs
