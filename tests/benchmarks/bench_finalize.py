"""Benchmark: finalize and verify a completed job of 1M-10M records, on local files and through S3.

The job is built quickly, without running an engine: ``plan_job`` plans the input of
``bench_plan.py`` (cached; about 500 bytes a record, 1% bad lines, so the plan commits a
validation object), then for every shard the builder does what a worker's commit path does
(``claim_shard``; per microbatch of 2000 records in line order: ``encode_results`` of
``succeeded`` records, ``put_bytes`` of the attempt object, ``commit_microbatch``; then
``complete_shard``). Each output is about 100 tokens (~450 characters). Then, each in its own
subprocess (peak RSS is the child's own ``VmHWM``), ``--repeat`` times:

* ``finalize``: ``service.finalize.finalize_job`` (verify every committed object, write and
  publish ``manifest.json``); the store (a sqlite copy) and the manifest are put back first;
* ``verify``: ``service.finalize.verify_job`` of the published job (re-verify the manifest).

    .venv/bin/python tests/benchmarks/bench_finalize.py --records 1000000 --backend local,s3

``--compare-with DIR`` runs the same children from another checkout too (say the code before a
change: ``git archive REV | tar -x -C DIR``), interleaved with this one's, on the same built job.

``--backend s3`` starts ``moto_server`` (tests/fixtures/s3.py) and writes the outputs to a bucket
there (built again on every run: moto holds objects in its memory); the input stays a local file
(only a job with unfinished shards reads it). The local build is cached in the temp folder by size
and seed (``--rebuild`` to build again).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan import ROOT, cache_dir, ensure_input, python_child, run_child  # noqa: E402

sys.path.insert(0, str(ROOT))

MICROBATCH = 2000
WORKERS = 2
BUCKET = "bench-finalize"
_WORDS = ("the", "answer", "is", "a", "summary", "of", "customer", "ticket", "invoice", "résumé")


def output_texts(n: int = 256) -> list[str]:
    """Outputs of about 100 tokens (~450 characters), from a small pool so generation is quick."""
    import random

    rng = random.Random(7)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(60, 100))) for _ in range(n)]


def commit_batch(store: Any, output: Any, lease: Any, batch: list[Any], seq: int) -> None:
    """Write one microbatch object and commit it under the lease, as the worker does."""
    from airflow_deadline_batch.core.results import encode_results
    from airflow_deadline_batch.storage import sha256_hex
    from airflow_deadline_batch.worker.worker import object_key

    data = encode_results(batch)
    uri = output.put_bytes(object_key(lease.attempt_id, lease.shard_index, seq), data)
    store.commit_microbatch(
        lease,
        seq=seq,
        uri=uri,
        sha256=sha256_hex(data),
        records=len(batch),
        counts={"succeeded": len(batch), "errored": 0},
        prompt_tokens=sum(r.usage.prompt_tokens for r in batch),
        completion_tokens=sum(r.usage.completion_tokens for r in batch),
        elapsed_s=1.0,
        model_digest="sha256:bench",
    )


def build_job(input_path: Path, workdir: Path, output_uri: str) -> dict[str, Any]:
    """Plan the input and commit every shard's outputs the way a worker does; no finalization."""
    from airflow_deadline_batch.core.ids import shard_id as display_shard_id
    from airflow_deadline_batch.core.pools import default_local_pools
    from airflow_deadline_batch.core.records import iter_line_tuples
    from airflow_deadline_batch.core.results import ResultRecord, Usage
    from airflow_deadline_batch.service.planning import PlanRequest, plan_job
    from airflow_deadline_batch.storage import open_storage, open_uri
    from airflow_deadline_batch.store import ManifestStore

    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    store = ManifestStore(f"sqlite:///{workdir}/store.db")
    store.migrate()
    started = time.perf_counter()
    plan = plan_job(
        store,
        PlanRequest(
            input_uri=str(input_path),
            deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=72),
            output_uri=output_uri,
            engine="echo",
            pools=default_local_pools("echo"),
            workers=WORKERS,
            microbatch_size=MICROBATCH,
            allow_infeasible=True,
        ),
    )
    plan_s = time.perf_counter() - started
    job = store.get_job(plan.job_id)
    output = open_storage(job.output_uri)
    source, key = open_uri(job.input_uri)
    texts = output_texts()
    objects = 0
    for shard in store.list_shards(job.job_id):
        lease = store.claim_shard(job.job_id, shard.shard_index, ttl_s=3600, worker="bench")
        excluded = set(shard.excluded_lines)
        batch: list[ResultRecord] = []
        seq = 0

        with source.open_read(key) as stream:
            stream.seek(shard.byte_start)
            lines = iter_line_tuples(
                stream, start_line=shard.first_line, start_offset=shard.byte_start, max_line_bytes=1 << 20
            )
            end = shard.first_line + shard.line_count
            for line, _, _, raw, _ in lines:
                if line >= end:
                    break
                if line in excluded or raw is None or not raw.strip():
                    continue
                doc = orjson.loads(raw)
                text = texts[line % len(texts)]
                batch.append(
                    ResultRecord.succeeded(
                        line=line,
                        id=doc.get("id") or doc.get("custom_id"),
                        output=text,
                        usage=Usage(prompt_tokens=len(raw) // 4, completion_tokens=len(text) // 4),
                        shard_id=display_shard_id(shard.shard_index),
                        attempt_id=lease.attempt_id,
                    )
                )
                if len(batch) == MICROBATCH:
                    commit_batch(store, output, lease, batch, seq)
                    seq, objects = seq + 1, objects + 1
                    batch = []
        if batch:
            commit_batch(store, output, lease, batch, seq)
            objects += 1
        store.complete_shard(lease)
    progress = store.progress(job.job_id)
    info = {
        "job_id": job.job_id,
        "store": f"sqlite:///{workdir}/store.db",
        "output_uri": job.output_uri,
        "plan_s": round(plan_s, 1),
        "build_s": round(time.perf_counter() - started, 1),
        "shards": plan.shards,
        "objects": objects,
        "invalid": plan.invalid,
        "committed_records": progress.committed_records,
        "total_records": progress.total_records,
    }
    if progress.committed_records != progress.total_records:
        raise SystemExit(f"the build did not commit every record: {info}")
    with (
        sqlite3.connect(workdir / "store.db") as src,
        sqlite3.connect(workdir / "store.unfinalized.db") as dst,
    ):
        src.backup(dst)
    (workdir / "job.json").write_text(json.dumps(info))
    return info


def restore(workdir: Path, info: dict[str, Any]) -> None:
    """Put the store and the output back as they were before finalization."""
    from airflow_deadline_batch.storage import open_storage

    shutil.copyfile(workdir / "store.unfinalized.db", workdir / "store.db")
    for name in ("store.db-wal", "store.db-shm"):
        (workdir / name).unlink(missing_ok=True)
    open_storage(info["output_uri"]).delete("manifest.json")


def set_read_ahead() -> None:
    """``--read-ahead N`` (passed as ``ADB_BENCH_READ_AHEAD``): objects on S3 read in parallel."""
    from airflow_deadline_batch.storage import read_ahead

    if os.environ.get("ADB_BENCH_READ_AHEAD"):
        read_ahead.READ_AHEAD = int(os.environ["ADB_BENCH_READ_AHEAD"])


def child_finalize(store_url: str, job_id: str) -> dict[str, Any]:
    from airflow_deadline_batch.service.finalize import finalize_job
    from airflow_deadline_batch.store import ManifestStore

    result = finalize_job(ManifestStore(store_url), job_id)
    return {"state": str(result.state.value), "manifest": result.manifest_uri, **result.report.to_dict()}


def child_verify(store_url: str, job_id: str) -> dict[str, Any]:
    from airflow_deadline_batch.service.finalize import verify_job
    from airflow_deadline_batch.store import ManifestStore

    return verify_job(ManifestStore(store_url), job_id).to_dict()


def bench_backend(backend: str, args: argparse.Namespace, input_path: Path) -> list[dict[str, Any]]:
    workdir = cache_dir() / f"finalize-{backend}-{args.records}-s{args.seed}-mb{MICROBATCH}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = None
    if backend == "s3":
        from tests.fixtures.s3 import s3_environment, start_moto_server

        server = start_moto_server(log_path=cache_dir() / "moto_server.log")
        env.update(s3_environment(server.endpoint_url))
        os.environ.update(s3_environment(server.endpoint_url))
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
    try:
        cached = backend == "local" and (workdir / "job.json").exists() and not args.rebuild
        if cached:
            info = json.loads((workdir / "job.json").read_text())
        else:
            out = f"s3://{BUCKET}/out" if backend == "s3" else str(workdir / "out")
            print(f"[{backend}] building the job in {workdir} ...", file=sys.stderr, flush=True)
            info = build_job(input_path, workdir, out)
        print(
            f"[{backend}] job {info['job_id']}: {info['committed_records']} records in {info['shards']} "
            f"shards, {info['objects']} objects + validation; built in {info['build_s']} s"
            f" (plan {info['plan_s']} s)" + (" (cached)" if cached else ""),
            file=sys.stderr,
            flush=True,
        )
        trees = {"": ROOT, **({"@other": Path(args.compare_with).resolve()} if args.compare_with else {})}
        runs = [
            (
                name + tag,
                python_child(
                    str(tree / "tests/benchmarks/bench_finalize.py"),
                    "--child",
                    name,
                    info["store"],
                    info["job_id"],
                ),
                {**env, "PYTHONPATH": str(tree)},
            )
            for tag, tree in trees.items()
            for name in ("finalize", "verify")
        ]
        rows = []
        for attempt in range(args.repeat):
            for name, command, child_env in runs:
                if name.startswith("finalize"):  # each finalize starts from the unfinalized job
                    restore(workdir, info)
                wall, cpu, rss, out = run_child(command, child_env)
                detail = json.loads(out.strip().splitlines()[-1])
                if not detail.get("complete"):
                    raise SystemExit(f"{name} did not find the job complete: {detail}")
                rows.append(
                    {
                        "backend": backend,
                        "records": args.records,
                        "name": name,
                        "run": attempt + 1,
                        "wall_s": round(wall, 2),
                        "cpu_s": round(cpu, 2),
                        "peak_rss_mb": round(rss, 1),
                    }
                )
                print(
                    f"  [{backend}] {name:<9} run {attempt + 1}: {wall:7.2f} s wall {cpu:7.2f} s CPU "
                    f"{rss:7.1f} MB",
                    file=sys.stderr,
                    flush=True,
                )
        return rows
    finally:
        if server is not None:
            from tests.fixtures.s3 import stop_moto_server

            stop_moto_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--backend", default="local", help="local, s3 or local,s3")
    parser.add_argument("--rebuild", action="store_true", help="build the local job again even if cached")
    parser.add_argument("--read-ahead", type=int, help="objects on S3 read in parallel (default: the code's)")
    parser.add_argument(
        "--compare-with",
        metavar="DIR",
        help="also run the measured children from this checkout (e.g. the code before a change), interleaved",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, store_url, job_id = args.child
        set_read_ahead()
        result = (child_finalize if name == "finalize" else child_verify)(store_url, job_id)
        sys.stdout.write(json.dumps(result) + "\n")
        return
    if args.read_ahead:
        os.environ["ADB_BENCH_READ_AHEAD"] = str(args.read_ahead)
    input_path = ensure_input(args.records, seed=args.seed)
    rows = []
    for backend in args.backend.split(","):
        rows.extend(bench_backend(backend, args, input_path))
    if args.json:
        print(json.dumps({"rows": rows, "python": sys.version.split()[0], "cpus": os.cpu_count()}))
        return
    head = ("backend", "records", "measurement", "run", "wall s", "CPU s", "RSS MB")
    print("{:<7} {:>10} {:<10} {:>3} {:>8} {:>8} {:>8}".format(*head))
    for r in rows:
        print(
            f"{r['backend']:<7} {r['records']:>10} {r['name']:<10} {r['run']:>3} {r['wall_s']:>8.2f} "
            f"{r['cpu_s']:>8.2f} {r['peak_rss_mb']:>8.1f}"
        )


if __name__ == "__main__":
    main()
