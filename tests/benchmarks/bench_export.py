"""Benchmark: ``deadline-batch export --format openai`` at 1M-10M records, on local files and S3.

The job is ``bench_finalize.py``'s (built without an engine: ``plan_job`` on the input of
``bench_plan.py``, about 500 bytes a record and 1% bad lines, then the workers' commit calls, per
microbatch of 2000 ``succeeded`` records of about 100 tokens), finalized once when it is built.
``--backend s3`` starts ``moto_server`` and puts the job's outputs and the export in a bucket
there (built on every run: moto holds objects in its memory); the input stays a local file. The
local job is cached in the temp folder by size and seed (``--rebuild`` to build it again).
Then, each in its own subprocess (peak RSS is the child's own ``VmHWM``), ``--repeat`` times:

* ``bare``: read every outcome object the manifest lists and ``orjson.loads`` each line, for scale;
* ``export``: ``deadline-batch export JOB --format openai --output DIR --json`` (verify the
  manifest, stream every object, sort each shard's outcomes by line, merge with the input,
  write ``output.jsonl`` / ``errors.jsonl`` / ``retry.jsonl`` / ``export.json``);
* ``export-spill``: ``service.export.export_job`` with ``run_bytes`` of 1 MiB, so every shard's
  outcomes are sorted in spilled runs on disk (the path a shard too large for memory takes).

``--compare-with DIR`` runs the same exports from another checkout too (the code before a change:
``git archive REV | tar -x -C DIR``), interleaved with this one's, on the same built job (rows
``export@other``). The export's files are deleted after each run (``--keep`` keeps the last).
Bounded memory shows as a peak RSS that does not grow with the number of records.

    .venv/bin/python tests/benchmarks/bench_export.py --records 1000000 --backend local,s3
    nice -n 10 .venv/bin/python tests/benchmarks/bench_export.py --records 10000000 --measure export
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_finalize import MICROBATCH, build_job  # noqa: E402
from bench_plan import ROOT, cache_dir, cli_path, ensure_input, python_child, run_child  # noqa: E402

sys.path.insert(0, str(ROOT))

BUCKET = "bench-export"
SPILL_RUN_BYTES = 1 << 20
MEASUREMENTS = ("bare", "export", "export-spill")


def prepare_job(records: int, seed: int, backend: str, rebuild: bool) -> tuple[Path, dict[str, Any]]:
    """The published job of ``records`` (built and finalized unless a local one is cached)."""
    from airflow_deadline_batch.service.finalize import finalize_job
    from airflow_deadline_batch.store import ManifestStore

    workdir = cache_dir() / f"export-{backend}-{records}-s{seed}-mb{MICROBATCH}"
    info_file = workdir / "job.json"
    if backend == "local" and not rebuild and info_file.exists():
        info = json.loads(info_file.read_text())
        if info.get("manifest"):
            return workdir, info
    out = f"s3://{BUCKET}/out" if backend == "s3" else str(workdir / "out")
    print(f"[{backend}] building the {records:,}-record job in {workdir} ...", file=sys.stderr, flush=True)
    info = build_job(ensure_input(records, seed=seed), workdir, out)
    result = finalize_job(ManifestStore(info["store"]), info["job_id"])
    if result.manifest_uri is None:
        raise SystemExit(f"the built job did not publish: {result.report.summary()}")
    info["manifest"] = result.manifest_uri
    info_file.write_text(json.dumps(info))
    return workdir, info


def export_target(backend: str, workdir: Path) -> str:
    return f"s3://{BUCKET}/export" if backend == "s3" else str(workdir / "export")


def remove_export(target: str) -> None:
    """Delete an export's files (at 10M, 8.5 GB of ``output.jsonl``)."""
    from airflow_deadline_batch.storage import open_storage

    storage = open_storage(target)
    for key in list(storage.list_keys()):
        storage.delete(key)
    if not target.startswith("s3://"):
        shutil.rmtree(target, ignore_errors=True)


def child_bare(manifest_uri: str) -> dict[str, Any]:
    """Read every outcome object the manifest lists and parse each line (no checks, no output)."""
    from airflow_deadline_batch.storage import open_uri

    storage, key = open_uri(manifest_uri)
    manifest = orjson.loads(storage.get_bytes(key))
    lines = 0
    for entry in manifest["shards"]:
        source, name = open_uri(entry["uri"])
        with source.open_read(name) as f:
            for line in f:
                orjson.loads(line)
                lines += 1
    return {"objects": len(manifest["shards"]), "lines": lines}


def child_export(store_url: str, job_id: str, output: str, run_bytes: str) -> dict[str, Any]:
    from airflow_deadline_batch.service.export import export_job
    from airflow_deadline_batch.store import ManifestStore

    result = export_job(ManifestStore(store_url), job_id, output, run_bytes=int(run_bytes))
    return {f.name: f.lines for f in result.files}


def commands(info: dict[str, Any], target: str, tree: Path = ROOT) -> dict[str, list[str]]:
    script = str(tree / "tests" / "benchmarks" / "bench_export.py")
    cli = [cli_path(), "export", info["job_id"], "--format", "openai", "--output", target]
    return {
        "bare": python_child(script, "--child", "bare", info["manifest"]),
        "export": python_child(*cli, "--store", info["store"], "--json"),
        "export-spill": python_child(
            script, "--child", "export", info["store"], info["job_id"], target, str(SPILL_RUN_BYTES)
        ),
    }


def bench(records: int, backend: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = None
    if backend == "s3":
        from tests.fixtures.s3 import s3_environment, start_moto_server

        server = start_moto_server(log_path=cache_dir() / "moto_server_export.log")
        env.update(s3_environment(server.endpoint_url))
        os.environ.update(s3_environment(server.endpoint_url))
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
    try:
        workdir, info = prepare_job(records, args.seed, backend, args.rebuild)
        target = export_target(backend, workdir)
        wanted = args.measure.split(",")
        trees = {"": ROOT, **({"@other": Path(args.compare_with).resolve()} if args.compare_with else {})}
        runs = {
            name + tag: (argv, {**env, "PYTHONPATH": str(tree)})
            for tag, tree in trees.items()
            for name, argv in commands(info, target, tree).items()
            if name in wanted and (name != "bare" or not tag)
        }
        samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
        for attempt in range(args.repeat):
            for name, (argv, child_env) in runs.items():
                wall, cpu, rss, _ = run_child(argv, child_env)
                samples[name].append((wall, cpu, rss))
                print(
                    f"  [{backend} {records:,}] {name:<12} run {attempt + 1}: {wall:8.2f} s wall "
                    f"{cpu:8.2f} s CPU {rss:7.1f} MB",
                    file=sys.stderr,
                    flush=True,
                )
                last = attempt == args.repeat - 1 and name == list(runs)[-1]
                if name != "bare" and not (args.keep and last):
                    remove_export(target)
        return [summary(records, backend, name, runs) for name, runs in samples.items()]
    finally:
        if server is not None:
            from tests.fixtures.s3 import stop_moto_server

            stop_moto_server(server)


def summary(records: int, backend: str, name: str, runs: list[tuple[float, float, float]]) -> dict[str, Any]:
    best = min(runs)
    return {
        "records": records,
        "backend": backend,
        "measurement": name,
        "wall_best_s": round(best[0], 2),
        "wall_spread_s": round(max(r[0] for r in runs) - best[0], 2),
        "cpu_best_s": round(min(r[1] for r in runs), 2),
        "peak_rss_mb": round(max(r[2] for r in runs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", default="1000000", help="comma-separated job sizes")
    parser.add_argument("--backend", default="local", help="local, s3 or local,s3")
    parser.add_argument("--measure", default=",".join(MEASUREMENTS), help="of " + ", ".join(MEASUREMENTS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--rebuild", action="store_true", help="build the local job again even if cached")
    parser.add_argument("--keep", action="store_true", help="keep the last export's files")
    parser.add_argument(
        "--compare-with",
        metavar="DIR",
        help="also run the exports from this checkout (e.g. the code before a change), interleaved",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line per measurement")
    args = parser.parse_args()
    rows = []
    for records in (int(r) for r in args.records.split(",")):
        for backend in args.backend.split(","):
            for row in bench(records, backend, args):
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    if not args.json:
        print("| records | storage | measurement | wall best s | spread s | CPU best s | peak RSS MB |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['records']:,} | {r['backend']} | {r['measurement']} | {r['wall_best_s']} | "
                f"{r['wall_spread_s']} | {r['cpu_best_s']} | {r['peak_rss_mb']} |"
            )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        name, rest = sys.argv[2], sys.argv[3:]
        result = child_bare(*rest) if name == "bare" else child_export(*rest)
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        main()
