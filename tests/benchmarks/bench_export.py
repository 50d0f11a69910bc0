"""Benchmark: ``deadline-batch export --format openai`` memory and time against the job's size.

For each size, a completed job is built through the real code path (``deadline-batch run``: the
input of ``bench_plan.py``, about 500 bytes a record and ~1% bad lines, 2 echo worker
subprocesses, microbatches of 2000 records), cached by size and seed. Then, each in its own
subprocess (peak RSS is the process's own ``VmHWM``), ``--repeat`` times:

* ``bare``: read every outcome object of the manifest and ``orjson.loads`` each line, for scale;
* ``export``: ``deadline-batch export JOB --format openai --output DIR --json`` (verify the
  manifest, then stream every object, sort each shard's outcomes by line, merge with the input,
  write ``output.jsonl`` / ``errors.jsonl`` / ``retry.jsonl`` / ``export.json``);
* ``export-spill``: ``service.export.export_job`` with ``run_bytes`` of 1 MiB, so every shard's
  outcomes are sorted in spilled runs on disk (the path a shard too large for memory takes).

Bounded memory shows as a peak RSS that does not grow with the number of records.

    .venv/bin/python tests/benchmarks/bench_export.py --records 20000,200000 [--repeat 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan import ROOT, cache_dir, cli_path, ensure_input, python_child, run_child  # noqa: E402

sys.path.insert(0, str(ROOT))

MICROBATCH = 2000
WORKERS = 2
SPILL_RUN_BYTES = 1 << 20


def job_dir(records: int, seed: int) -> Path:
    return cache_dir() / f"export-job-{records}-s{seed}-mb{MICROBATCH}-w{WORKERS}"


def build_job(path: Path, workdir: Path) -> dict[str, Any]:
    """``deadline-batch run`` on the input: plan, echo workers, verification, publication."""
    import subprocess

    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    store = f"sqlite:///{workdir}/store.db"
    argv = [cli_path(), "run", str(path), "--deadline", "+24h", "--engine", "echo"]
    argv += ["--workers", str(WORKERS), "--microbatch-size", str(MICROBATCH), "--store", store]
    argv += ["--output", str(workdir / "out"), "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=workdir, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"building the job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    info = {"job_id": summary["job_id"], "store": store, "manifest": summary["manifest"]}
    info["build_s"] = summary.get("elapsed_s")
    info["records"] = summary["records"]
    (workdir / "job.json").write_text(json.dumps(info))
    return info


def ensure_job(records: int, seed: int, rebuild: bool) -> tuple[Path, dict[str, Any]]:
    workdir = job_dir(records, seed)
    info_file = workdir / "job.json"
    if rebuild or not info_file.exists():
        build_job(ensure_input(records, seed=seed), workdir)
    return workdir, json.loads(info_file.read_text())


def child_bare(manifest_uri: str) -> dict[str, Any]:
    """Read every outcome object the manifest lists and parse each line (no checks, no output)."""
    manifest = orjson.loads(Path(manifest_uri).read_bytes())
    lines = 0
    for entry in manifest["shards"]:
        with open(entry["uri"], "rb") as f:
            for line in f:
                orjson.loads(line)
                lines += 1
    return {"objects": len(manifest["shards"]), "lines": lines}


def child_export(store_url: str, job_id: str, output: str, run_bytes: str) -> dict[str, Any]:
    from airflow_deadline_batch.service.export import export_job
    from airflow_deadline_batch.store import ManifestStore

    result = export_job(ManifestStore(store_url), job_id, output, run_bytes=int(run_bytes))
    return {f.name: f.lines for f in result.files}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", default="20000,200000", help="comma-separated job sizes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rebuild", action="store_true", help="build the jobs again")
    parser.add_argument("--json", action="store_true", help="print one JSON line per measurement")
    args = parser.parse_args()
    rows = []
    for records in (int(r) for r in args.records.split(",")):
        workdir, info = ensure_job(records, args.seed, args.rebuild)
        out = workdir / "export"
        script = str(Path(__file__).resolve())
        commands = {
            "bare": python_child(script, "--child", "bare", info["manifest"]),
            "export": python_child(
                cli_path(),
                "export",
                info["job_id"],
                "--format",
                "openai",
                "--output",
                str(out),
                "--store",
                info["store"],
                "--json",
            ),  # fmt: skip
            "export-spill": python_child(
                script, "--child", "export", info["store"], info["job_id"], str(out), str(SPILL_RUN_BYTES)
            ),
        }
        samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in commands}
        for _ in range(args.repeat):
            for name, argv in commands.items():
                wall, cpu, rss, _ = run_child(argv)
                samples[name].append((wall, cpu, rss))
        bare_wall = min(s[0] for s in samples["bare"])
        for name, runs in samples.items():
            best = min(runs)
            row = {
                "records": records,
                "measurement": name,
                "wall_best_s": round(best[0], 2),
                "wall_spread_s": round(max(r[0] for r in runs) - best[0], 2),
                "cpu_best_s": round(min(r[1] for r in runs), 2),
                "peak_rss_mb": round(max(r[2] for r in runs)),
                "x_bare": round(best[0] / bare_wall, 2),
            }
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.json:
        print("| records | measurement | wall best s | spread s | CPU best s | peak RSS MB | × bare (wall) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['records']:,} | {r['measurement']} | {r['wall_best_s']} | {r['wall_spread_s']} | "
                f"{r['cpu_best_s']} | {r['peak_rss_mb']} | {r['x_bare']} |"
            )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        name, rest = sys.argv[2], sys.argv[3:]
        result = child_bare(*rest) if name == "bare" else child_export(*rest)
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        main()
