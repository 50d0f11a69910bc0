"""Benchmark: verifying and publishing a completed one-million-record job, wall time and peak RSS.

The job is built through the real code paths: ``local.runner.run_job`` plans the input of
``bench_plan.py`` (cached, about 500 bytes a record, ~1% bad lines) and runs real ``echo``
worker subprocesses (2 workers, microbatches of 2000 records); only its last step, finalization,
is left out, so that it can be measured on its own. The build's wall time is reported too.
Then, each in its own subprocess (peak RSS via ``os.wait4``), alternating, ``--repeat`` times:

* ``bare``: read every committed output object and ``orjson.loads`` each line (the least any
  verifier must do), for scale;
* ``finalize``: ``service.finalize.finalize_job`` (verify every committed object's SHA-256 and
  every outcome line, one outcome per input line, then publish ``manifest.json``); the store and
  output are put back to their unfinalized state before each run;
* ``verify``: ``deadline-batch verify JOB --json`` (re-verify the published manifest's objects).

    .venv/bin/python tests/benchmarks/bench_verify.py --records 1000000 [--repeat 2] [--json]

The built job is cached in the temp folder by size and seed (``--rebuild`` to start over).
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
from bench_plan import ROOT, cache_dir, cli_path, ensure_input, python_child, run_child  # noqa: E402

sys.path.insert(0, str(ROOT))

MICROBATCH = 2000
WORKERS = 2


def job_dir(records: int, seed: int) -> Path:
    return cache_dir() / f"job-{records}-s{seed}-mb{MICROBATCH}-w{WORKERS}"


def build_job(path: Path, workdir: Path) -> dict[str, Any]:
    """Plan and run the job with real echo workers, stopping short of finalization."""
    from airflow_deadline_batch.core.pools import default_local_pools
    from airflow_deadline_batch.local import runner
    from airflow_deadline_batch.service.finalize import FinalizeResult, VerificationReport
    from airflow_deadline_batch.service.planning import PlanRequest
    from airflow_deadline_batch.store import ManifestStore

    def no_finalize(store: Any, job_id: str, clock: Any, deadline_passed: bool) -> FinalizeResult:
        job = store.get_job(job_id)
        return FinalizeResult(
            job_id, job.state, None, VerificationReport(job_id=job_id, expected=job.input_lines)
        )

    runner._finalize = no_finalize  # the one step measured separately below
    if workdir.exists():
        shutil.rmtree(workdir)
    (workdir / "out").mkdir(parents=True)
    store = ManifestStore(f"sqlite:///{workdir}/store.db")
    store.migrate()
    request = PlanRequest(
        input_uri=str(path),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=24),
        output_uri=str(workdir / "out"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=WORKERS,
        microbatch_size=MICROBATCH,
    )
    started = time.perf_counter()
    summary = runner.run_job(
        store, request, runner.RunOptions(workers=WORKERS, worker_log=str(workdir / "worker.log"))
    )
    elapsed = time.perf_counter() - started
    progress = store.progress(summary.job_id)
    info = {
        "job_id": summary.job_id,
        "store": f"sqlite:///{workdir}/store.db",
        "build_s": round(elapsed, 1),
        "shards": summary.shards,
        "attempts": summary.attempts,
        "committed_records": progress.committed_records,
        "total_records": progress.total_records,
        "output_mb": round(
            sum(f.stat().st_size for f in (workdir / "out").rglob("*") if f.is_file()) / 1e6, 1
        ),
    }
    if progress.committed_records != progress.total_records:
        raise SystemExit(f"the build did not commit every record: {info}; see {workdir / 'worker.log'}")
    snapshot(workdir)
    (workdir / "job.json").write_text(json.dumps(info))
    return info


def snapshot(workdir: Path) -> None:
    """Keep a consistent copy of the unfinalized store (sqlite's online backup)."""
    with (
        sqlite3.connect(workdir / "store.db") as src,
        sqlite3.connect(workdir / "store.unfinalized.db") as dst,
    ):
        src.backup(dst)


def restore(workdir: Path) -> None:
    """Put the store and the output back as they were before finalization."""
    shutil.copyfile(workdir / "store.unfinalized.db", workdir / "store.db")
    for name in ("store.db-wal", "store.db-shm"):
        (workdir / name).unlink(missing_ok=True)
    for manifest in (workdir / "out").glob("*/manifest.json"):
        manifest.unlink()


def child_bare(workdir: str) -> dict[str, Any]:
    """Read every outcome object of the job and parse each line (no checks at all).

    The build runs without preemptions, so every object under ``attempts/`` was committed.
    """
    files = sorted(Path(workdir, "out").glob("*/attempts/*/*.jsonl")) + sorted(
        Path(workdir, "out").glob("*/validation/*.jsonl")
    )
    lines = 0
    for file in files:
        with file.open("rb") as f:
            for line in f:
                orjson.loads(line)
                lines += 1
    return {"objects": len(files), "lines": lines}


def child_finalize(store_url: str, job_id: str) -> dict[str, Any]:
    from airflow_deadline_batch.service.finalize import finalize_job
    from airflow_deadline_batch.store import ManifestStore

    result = finalize_job(ManifestStore(store_url), job_id)
    return {"state": str(result.state.value), "manifest": result.manifest_uri, **result.report.to_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rebuild", action="store_true", help="build the job again even if one is cached")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, *rest = args.child
        result = child_bare(rest[0]) if name == "bare" else child_finalize(rest[0], rest[1])
        sys.stdout.write(json.dumps(result) + "\n")
        return
    path = ensure_input(args.records, seed=args.seed)
    workdir = job_dir(args.records, args.seed)
    cached = (workdir / "job.json").exists() and not args.rebuild
    if cached:
        info = json.loads((workdir / "job.json").read_text())
    else:
        print(
            f"building the job in {workdir} (plan + {WORKERS} echo workers) ...", file=sys.stderr, flush=True
        )
        info = build_job(path, workdir)
    print(
        f"job {info['job_id']}: {info['committed_records']} records committed by {info['shards']} shards "
        f"({info['attempts']} attempts), {info['output_mb']} MB of outputs; built in {info['build_s']} s"
        + (" (cached)" if cached else ""),
        file=sys.stderr,
        flush=True,
    )
    me = str(Path(__file__).resolve())
    store_url, job_id = info["store"], info["job_id"]
    commands = {
        "bare": python_child(me, "--child", "bare", str(workdir)),
        "finalize": python_child(me, "--child", "finalize", store_url, job_id),
        "verify": python_child(cli_path(), "verify", job_id, "--store", store_url, "--json"),
    }
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in commands}
    details: dict[str, Any] = {}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for attempt in range(args.repeat):
        restore(workdir)
        for name, argv in commands.items():
            wall, cpu, rss, out = run_child(argv, env)
            samples[name].append((wall, cpu, rss))
            details[name] = json.loads(out.strip().splitlines()[-1])
            print(
                f"  {name:<9} run {attempt + 1}: {wall:7.2f} s wall {cpu:7.2f} s CPU {rss:7.1f} MB",
                file=sys.stderr,
                flush=True,
            )
    for name in ("finalize", "verify"):
        if not details[name].get("complete"):
            raise SystemExit(f"{name} did not find the job complete: {details[name]}")
    rows = []
    best_bare = min(w for w, _, _ in samples["bare"])
    for name, runs in samples.items():
        walls = [w for w, _, _ in runs]
        rows.append(
            {
                "name": name,
                "runs": len(runs),
                "wall_best_s": round(min(walls), 2),
                "wall_spread_s": round(max(walls) - min(walls), 2),
                "cpu_best_s": round(min(c for _, c, _ in runs), 2),
                "peak_rss_mb": round(max(r for _, _, r in runs), 1),
                "ratio_vs_bare": round(min(walls) / best_bare, 2),
            }
        )
    result = {
        "records": args.records,
        "job": info,
        "rows": rows,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "finalize": {k: details["finalize"][k] for k in ("state", "expected", "seen", "outcomes")},
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'measurement':<10} {'wall s':>7} {'spread':>7} {'CPU s':>7} {'peak RSS MB':>12} {'x bare':>7}")
    for row in rows:
        print(
            f"{row['name']:<10} {row['wall_best_s']:>7.2f} {row['wall_spread_s']:>7.2f} "
            f"{row['cpu_best_s']:>7.2f} "
            f"{row['peak_rss_mb']:>12.1f} {row['ratio_vs_bare']:>7.2f}"
        )
    print(f"finalize: {result['finalize']}")


if __name__ == "__main__":
    main()
