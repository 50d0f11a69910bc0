"""Benchmark: one shared-capacity admission (``core.admission.edf_test``), admitted and refused.

The test runs inside the admission transaction, under the lock that serializes admissions, so its
time is the time other submissions wait. Held jobs get random deadlines (30 min to 12 h) and one
to three of the managed pools; the new job uses two of them. An admission or a refusal solves one
max flow under the lock; a refusal's report then searches the earliest feasible deadline and the
GPUs that would admit it (about 20 to 40 flows, ``refused_explained_s``) after the lock is
released. Never a timed assertion.

    .venv/bin/python tests/benchmarks/bench_admission.py [--sizes 20x2,50x3,100x4,300x8] [--json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from airflow_deadline_batch.core.admission import Demand, SharedPool, edf_test  # noqa: E402

NOW = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)


def measure(jobs: int, pools: int, seed: int = 1) -> dict[str, object]:
    rng = random.Random(seed)
    names = [f"pool-{i}" for i in range(pools)]
    shared = [SharedPool(name=n, gpus=8, lead_s=120.0) for n in names]
    held = [
        Demand(
            job_id=f"held-{i}",
            tenant="t",
            deadline=NOW + dt.timedelta(minutes=rng.randint(30, 720)),
            gpu_seconds=rng.uniform(1e3, 4e4) * pools * 2 / jobs,
            pools=frozenset(rng.sample(names, rng.randint(1, min(3, pools)))),
        )
        for i in range(jobs)
    ]
    out: dict[str, object] = {"held_jobs": jobs, "pools": pools}
    for label, work in (("admitted", 1e4), ("refused", 1e6)):
        new = Demand(
            job_id="new",
            tenant="t",
            deadline=NOW + dt.timedelta(hours=6),
            gpu_seconds=work,
            pools=frozenset(names[:2]),
        )
        start = time.perf_counter()
        result = edf_test(new, held, pools=shared, now=NOW, explain=False)  # under the lock
        out[f"{label}_s"] = round(time.perf_counter() - start, 4)
        out[f"{label}_feasible"] = result.feasible
        if not result.feasible:  # what would admit it: searched after the lock is released
            start = time.perf_counter()
            edf_test(new, held, pools=shared, now=NOW)
            out[f"{label}_explained_s"] = round(time.perf_counter() - start, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20x2,50x3,100x4,300x8", help="held jobs x pools, comma-separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [measure(*map(int, size.split("x"))) for size in args.sizes.split(",")]
    if args.json:
        print(json.dumps(rows))
        return
    for row in rows:
        print(
            f"{row['held_jobs']:>4} held jobs on {row['pools']} pools: admitted in {row['admitted_s']:.4f} s "
            f"(feasible={row['admitted_feasible']}), refused in {row['refused_s']:.4f} s "
            f"(feasible={row['refused_feasible']}), its report searched after the lock in "
            f"{row.get('refused_explained_s', 0.0):.4f} s"
        )


if __name__ == "__main__":
    main()
