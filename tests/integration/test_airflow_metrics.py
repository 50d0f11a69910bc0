"""Metrics through Airflow's own ``Stats``, received by real listeners on loopback.

A child process with Airflow's metrics configured by environment (as a deployment would) runs
the emitting code paths against a real SQLite store: the sensor's poke, the trigger's poll,
a shard task's placement decision and a racer launch. The test then reads what arrived:

* OpenTelemetry: Airflow's OTLP/HTTP exporter posts to an HTTP server in this process; the
  protobuf request is decoded and each ``airflow.deadline_batch.*`` data point is checked (name,
  ``batch_job``/``dag_id`` attributes, value).
* StatsD: a UDP socket; Airflow's StatsD backend needs the ``statsd`` package, which is not a
  dependency of this project, so that case is skipped where it is not installed.

The store holds one job of three shards: one committed after a preempted Spot try, one
committed, one leased on on-demand; the deadline is too close for Spot, so the decision
escalates.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gzip
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_deadline_batch import metrics
from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.store import ManifestStore, NewJob, NewShard
from tests.helpers.commits import commit

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "metrics_dag"
TOTAL_RECORDS = 6
#: far enough for a slow child process, too close for 3 h of work on one worker: on-demand
DEADLINE_S = 900


def make_job(url: str) -> str:
    """Three shards of 2 records: 0 preempted on Spot then committed, 1 committed, 2 leased on-demand."""
    store = ManifestStore(url)
    store.migrate()
    pools = default_local_pools("echo")
    job, _ = store.create_job(
        NewJob(
            deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=DEADLINE_S),
            input_uri="/in.jsonl",
            input_sha256="0" * 64,
            input_lines=TOTAL_RECORDS,
            input_total_lines=TOTAL_RECORDS,
            output_uri="/out",
            config={"workers": 1, "pools": [p.to_dict() for p in pools]},
        ),
        [
            NewShard(
                shard_index=i,
                byte_start=i,
                byte_end=i + 1,
                first_line=2 * i + 1,
                line_count=2,
                records=2,
                num_microbatches=1,
                input_sha256="0" * 64,
                est_work_s=3600.0,
            )
            for i in range(3)
        ],
        None,
    )
    spot, on_demand = pools[0].name, pools[1].name

    preempted = store.claim_shard(job.job_id, 1, ttl_s=60, worker="w", pool=spot)
    store.fail_attempt(preempted, FailureClass.PREEMPTED, "spot reclaimed")
    lease = store.claim_shard(job.job_id, 1, ttl_s=60, worker="w", pool=spot)
    store.complete_shard(commit(store, lease, 0, records=2, prompt_tokens=10, completion_tokens=10))
    store.claim_shard(job.job_id, 2, ttl_s=600, worker="w", pool=on_demand)
    return job.job_id


def child(store_url: str, job_id: str) -> None:
    """Run in the child process: the sensor's poke, the trigger's poll, one shard decision, a racer's
    launch and a shard try's look back at a try lost to the resume race."""
    from airflow.sdk import DAG

    from airflow_deadline_batch.operators.shard import TRY_LEDGER_KEY, LocalShardOperator
    from airflow_deadline_batch.sensors.completeness import CompletenessSensor
    from airflow_deadline_batch.triggers.completeness import CompletenessTrigger

    with DAG(DAG_ID, schedule=None):
        sensor = CompletenessSensor(task_id="verify", job_id=job_id, store_url=store_url, deferrable=False)
        shard = LocalShardOperator(task_id="shard", job_id=job_id, shard_index=0, store_url=store_url)
    assert sensor.poke({}) is False
    past = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)).isoformat()
    trigger = CompletenessTrigger(job_id=job_id, store_url=store_url, timeout_at=past, dag_id=DAG_ID)

    async def run() -> list[Any]:
        return [event async for event in trigger.run()]

    events = asyncio.run(run())
    assert events[0].payload["status"] == "timeout", events
    ti = SimpleNamespace(dag_id=DAG_ID, xcom_push=lambda **_: None)
    decision = shard.decide({"ti": ti})
    metrics.emit_race(job_id, "local-on-demand", dag_id=DAG_ID)  # as a shard pod operator's racer launch
    # try 2 of the shard task finds try 1 resumed and ended by Airflow (the resume race)
    ledger: dict[str, Any] = {TRY_LEDGER_KEY: {"started": [1], "handed_back": [1]}}
    state = SimpleNamespace(get=ledger.get, set=ledger.__setitem__)
    shard.note_lost_tries({"ti": SimpleNamespace(dag_id=DAG_ID, try_number=2), "task_state_store": state}, 2)
    assert ledger[TRY_LEDGER_KEY]["lost"] == [1], ledger
    print(json.dumps({"pool": decision.pool.name if decision.pool else None}))


def run_child(tmp_path: Path, env: dict[str, str]) -> tuple[str, dict[str, Any]]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    job_id = make_job(url)
    full_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW__METRICS__", "OTEL_"))},
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **env,
    }
    code = f"from tests.integration.test_airflow_metrics import child; child({url!r}, {job_id!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], env=full_env, cwd=REPO, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return job_id, json.loads(done.stdout.strip().splitlines()[-1])


Points = dict[str, list[tuple[dict[str, str], float]]]


def check(points: Points, job_id: str, decided: dict[str, Any]) -> None:
    """Names, tags and plausible values of what one run sent (``points``: name → (tags, value)s)."""

    def last(name: str, **want: str) -> float:
        found = [v for tags, v in points.get(name, []) if all(tags.get(k) == w for k, w in want.items())]
        assert found, f"{name} with {want} not received; got {sorted(points)}"
        return found[-1]

    for name in metrics.GAUGES:
        last(name, batch_job=job_id, dag_id=DAG_ID)
    assert last(metrics.RECORDS_COMMITTED, batch_job=job_id) == 2
    assert last(metrics.RECORDS_REMAINING, batch_job=job_id) == TOTAL_RECORDS - 2
    assert last(metrics.LEASES_ACTIVE, batch_job=job_id) == 1
    assert last(metrics.LEASES_ON_DEMAND, batch_job=job_id) == 1
    assert last(metrics.PREEMPTIONS, batch_job=job_id) == 1
    assert 0 < last(metrics.DEADLINE_IN_S, batch_job=job_id) <= DEADLINE_S
    assert last(metrics.PREDICTED_FINISH_S, batch_job=job_id) > last(metrics.DEADLINE_IN_S, batch_job=job_id)
    assert last(metrics.SLACK_S, batch_job=job_id) < 0
    assert last(metrics.COST, batch_job=job_id) > 0
    assert last(metrics.REDONE_WORK_S, batch_job=job_id) >= 0
    # the decision: counted with its capacity, and an escalation (the deadline is too close for Spot)
    assert decided["pool"] == "local-on-demand"
    assert last(metrics.DECISIONS, batch_job=job_id, dag_id=DAG_ID, action="run", capacity="on_demand") == 1
    assert last(metrics.ESCALATIONS, batch_job=job_id, dag_id=DAG_ID) == 1
    assert last(metrics.RACES, batch_job=job_id, dag_id=DAG_ID, pool="local-on-demand") == 1
    assert last(metrics.RESUME_RACES, batch_job=job_id, dag_id=DAG_ID) == 1


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def otlp_receiver() -> Iterator[tuple[int, list[bytes]]]:
    bodies: list[bytes] = []
    handler = type("Collector", (_Collector,), {"bodies": bodies})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], bodies
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_reach_an_otlp_receiver_through_airflow_otel(tmp_path, otlp_receiver):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    port, bodies = otlp_receiver
    env = {
        "AIRFLOW__METRICS__OTEL_ON": "True",
        "AIRFLOW__METRICS__OTEL_HOST": "127.0.0.1",
        "AIRFLOW__METRICS__OTEL_PORT": str(port),
        # one export at exit (Airflow registers the flush), none on a timer during the run
        "AIRFLOW__METRICS__OTEL_INTERVAL_MILLISECONDS": "600000",
    }
    job_id, decided = run_child(tmp_path, env)
    # the child exported before it exited: its flush is synchronous
    assert bodies, "no OTLP request arrived"
    points: Points = {}
    for body in bodies:
        request = ExportMetricsServiceRequest.FromString(body)
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind not in ("gauge", "sum"):
                        continue  # Airflow's own timers (histograms)
                    for p in getattr(m, kind).data_points:
                        tags = {a.key: a.value.string_value for a in p.attributes}
                        value = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                        points.setdefault(m.name.removeprefix("airflow."), []).append((tags, float(value)))
    check(points, job_id, decided)


def test_metrics_reach_a_statsd_udp_listener_through_airflow_statsd(tmp_path):
    pytest.importorskip("statsd", reason="Airflow's StatsD backend needs the statsd package (not installed)")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    try:
        env = {
            "AIRFLOW__METRICS__STATSD_ON": "True",
            "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
            "AIRFLOW__METRICS__STATSD_PORT": str(sock.getsockname()[1]),
            "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
            "AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED": "True",
        }
        job_id, decided = run_child(tmp_path, env)
        # the child has exited, so every datagram it sent is queued on this socket
        sock.setblocking(False)
        points: Points = {}
        counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        while True:
            try:
                data = sock.recv(65535)
            except BlockingIOError:
                break
            for line in data.decode().splitlines():
                key, _, rest = line.partition(":")
                value, _, kind = rest.partition("|")
                name, *pairs = key.split(",")
                tags = dict(pair.split("=", 1) for pair in pairs)
                name = name.removeprefix("airflow.")
                if kind == "c":
                    ident = (name, tuple(sorted(tags.items())))
                    counters[ident] = counters.get(ident, 0.0) + float(value)
                    points.setdefault(name, []).append((tags, counters[ident]))
                else:
                    points.setdefault(name, []).append((tags, float(value)))
        check(points, job_id, decided)
    finally:
        sock.close()
