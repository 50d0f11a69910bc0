#!/usr/bin/env python
"""Run the local example DAG end to end through Airflow's real ``dag.test()``, then summarise it.

Usage: ``.venv/bin/python scripts/run_example_dag.py [--conf JSON] [--samples N] [--json]``.
Airflow reads its configuration at import time, so this script sets the environment first:
``AIRFLOW_HOME`` (default ``<repo>/.deadline-batch/airflow``), ``AIRFLOW__CORE__LOAD_EXAMPLES=False``
and ``AIRFLOW__CORE__DAGS_FOLDER`` (default ``<repo>/dags``; ``dag.test()`` only runs a DAG its
bundle holds), each only when not already set. Then it migrates Airflow's metadata database, runs
``dags/example_deadline_batch_local.py`` with ``dag.test()`` and prints the run's state, the job,
the published manifest, its outcome counts and a few outputs. The DAG's own knobs pass through the
environment (``ADB_ENGINE=transformers``, ``ADB_EXAMPLE_INPUT``, ``ADB_EXAMPLE_DEADLINE``,
``ADB_EXAMPLE_PREEMPT_TRIES``, ``ADB_EXAMPLE_DIR``, ``ADB_STORE_URL``).

Exit status: 0 when the run succeeded and its manifest is published, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import sys
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DAG_FILE = REPO / "dags" / "example_deadline_batch_local.py"
PLAN_TASK = "plan"
SAMPLE_WIDTH = 100


def configure_environment(env: MutableMapping[str, str]) -> Path:
    """Set Airflow's environment defaults (before Airflow is imported); return ``AIRFLOW_HOME``."""
    env.setdefault("AIRFLOW_HOME", str(REPO / ".deadline-batch" / "airflow"))
    env.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    env.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(REPO / "dags"))
    home = Path(env["AIRFLOW_HOME"]).expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    env["AIRFLOW_HOME"] = str(home)
    return home


def migrate_metadata_db() -> None:
    """``airflow db migrate`` in process: creates a fresh database, upgrades an old one."""
    from airflow.utils.db import upgradedb

    upgradedb()


@contextlib.contextmanager
def deadline_alerts_resolvable_in_dag_test() -> Iterator[None]:
    """Work around ``dag.test()`` crashing at the end of a successful run of a DAG with a ``DeadlineAlert``.

    Airflow 3.3.2's ``dag.test()`` schedules from a DAG deserialised in memory, whose ``deadline``
    holds the encoded alert definitions instead of the ids of their database rows, and
    ``DagRun.update_state`` then looks each one up by id (``'dict' object has no attribute 'hex'``).
    For the duration of the block an encoded definition resolves to an unsaved row built from it,
    which is all that code reads (its reference type); a real id is looked up as before.
    """
    from airflow.models.deadline_alert import DeadlineAlert as DeadlineAlertModel
    from airflow.serialization.definitions.deadline import DeadlineAlertFields

    original = DeadlineAlertModel.__dict__["get_by_id"]
    lookup = original.__func__

    def get_by_id(cls: type[DeadlineAlertModel], deadline_alert_id: Any, **kwargs: Any) -> Any:
        if isinstance(deadline_alert_id, Mapping):
            data = deadline_alert_id.get("__var", deadline_alert_id)
            return cls(
                name=data.get(DeadlineAlertFields.NAME),
                reference=data[DeadlineAlertFields.REFERENCE],
                interval=data[DeadlineAlertFields.INTERVAL],
                callback_def=data[DeadlineAlertFields.CALLBACK],
            )
        return lookup(cls, deadline_alert_id, **kwargs)

    DeadlineAlertModel.get_by_id = classmethod(get_by_id)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        DeadlineAlertModel.get_by_id = original  # type: ignore[method-assign]


def task_states(run: Any) -> dict[str, list[list[Any]]]:
    """``{task_id: [[map_index, state, try_number], ...]}`` of a finished DAG run."""
    states: dict[str, list[list[Any]]] = {}
    for ti in sorted(run.get_task_instances(), key=lambda t: (t.task_id, t.map_index)):
        states.setdefault(ti.task_id, []).append([ti.map_index, str(ti.state), ti.try_number])
    return states


def asset_events(run: Any) -> list[dict[str, Any]]:
    """The Asset events the run's tasks emitted: ``{task_id, uri, extra}`` each."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(AssetEvent.source_task_id, AssetModel.uri, AssetEvent.extra)
            .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
            .where(AssetEvent.source_dag_id == run.dag_id, AssetEvent.source_run_id == run.run_id)
            .order_by(AssetEvent.id)
        ).all()
    return [{"task_id": task_id, "uri": uri, "extra": dict(extra or {})} for task_id, uri, extra in rows]


def read_json_lines(uri: str) -> list[dict[str, Any]]:
    from airflow_deadline_batch.storage import open_uri

    storage, key = open_uri(uri)
    return [json.loads(line) for line in storage.get_bytes(key).splitlines() if line.strip()]


def read_manifest(uri: str) -> dict[str, Any]:
    from airflow_deadline_batch.storage import open_uri

    storage, key = open_uri(uri)
    return dict(json.loads(storage.get_bytes(key)))


def sample_outputs(manifest: Mapping[str, Any], limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` succeeded outcomes by input line, read back from the manifest's objects."""
    if limit <= 0:
        return []
    records = [row for entry in manifest["shards"] for row in read_json_lines(str(entry["uri"]))]
    succeeded = sorted((r for r in records if r.get("status") == "succeeded"), key=lambda r: r["line"])
    return [
        {"line": r["line"], "id": r.get("id"), "output": r.get("output") or ""} for r in succeeded[:limit]
    ]


def one_line(text: str, width: int = SAMPLE_WIDTH) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def summarise(run: Any, store_url: str, *, samples: int, seconds: float) -> tuple[dict[str, Any], bool]:
    """The run's summary as plain values, and whether it counts as a success."""
    from airflow_deadline_batch.store import ManifestStore

    state = str(getattr(run.state, "value", run.state))
    summary: dict[str, Any] = {
        "dag_id": run.dag_id,
        "run_id": run.run_id,
        "state": state,
        "seconds": round(seconds, 1),
        "tasks": task_states(run),
        "asset_events": asset_events(run),
        "job_id": None,
        "job_state": None,
        "manifest": None,
        "outcomes": None,
        "samples": [],
    }
    store = ManifestStore(store_url)
    try:
        job = store.get_job_by_idempotency_key(f"{run.dag_id}/{run.run_id}/{PLAN_TASK}")
        if job is not None:
            summary["job_id"] = job.job_id
            summary["job_state"] = str(getattr(job.state, "value", job.state))
            summary["manifest"] = job.manifest_uri
    finally:
        store.close()
    if summary["manifest"]:
        manifest = read_manifest(summary["manifest"])
        summary["outcomes"] = manifest["outcomes"]
        summary["samples"] = sample_outputs(manifest, samples)
    return summary, state == "success" and bool(summary["manifest"])


def print_summary(summary: Mapping[str, Any], ok: bool) -> None:
    print()
    run = f"{summary['dag_id']} / {summary['run_id']}"
    print(f"DAG run     {run}: {summary['state']} in {summary['seconds']} s")
    for task_id, tis in summary["tasks"].items():
        states = sorted({state for _, state, _ in tis})
        tries = max(t for _, _, t in tis)
        print(f"  {task_id:<10} {len(tis)} instance(s), {', '.join(states)}, up to try {tries}")
    print(
        f"job         {summary['job_id'] or '(none: the plan task did not create one)'}"
        + (f" ({summary['job_state']})" if summary["job_state"] else "")
    )
    print(f"manifest    {summary['manifest'] or '(not published)'}")
    for event in summary["asset_events"]:
        print(f"asset event {event['uri']} (from {event['task_id']})")
    if summary["outcomes"]:
        print("outcomes    " + ", ".join(f"{k} {v}" for k, v in summary["outcomes"].items()))
    for sample in summary["samples"]:
        print(f"  {sample['id'] or '#' + str(sample['line'])} → {one_line(sample['output'])}")
    print("OK: manifest published" if ok else "FAILED: no published manifest (see the task logs above)")


def run_example(conf: Mapping[str, Any], samples: int) -> tuple[dict[str, Any], bool]:
    """Migrate, load the DAG file, ``dag.test()`` it, and summarise the run."""
    migrate_metadata_db()
    namespace = runpy.run_path(str(DAG_FILE))
    dag, store_url = namespace["dag"], str(namespace["STORE_URL"])
    started = time.monotonic()
    with deadline_alerts_resolvable_in_dag_test():
        run = dag.test(run_conf=dict(conf) or None)
    return summarise(run, store_url, samples=samples, seconds=time.monotonic() - started)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conf", default="{}", help='run conf as JSON, e.g. \'{"deadline": "+1h"}\'')
    parser.add_argument("--samples", type=int, default=5, help="outputs to show (default 5)")
    parser.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        conf = json.loads(args.conf)
    except ValueError as exc:
        print(f"error: --conf is not valid JSON ({exc}); pass an object such as '{{}}'", file=sys.stderr)
        return 2
    home = configure_environment(os.environ)
    print(f"AIRFLOW_HOME={home}", file=sys.stderr)
    summary, ok = run_example(conf, args.samples)
    print_summary(summary, ok)
    if args.json:
        print("RESULT " + json.dumps(summary, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
