"""Benchmark: time of one placement decision (``core.placement.choose_pool``), target under 1 ms.

The policy runs on every try and, in the simulator, for every worker at every tick. Measures the
decision alone and the decision with the :class:`JobSnapshot` built for it, over the branches of
the rule (Spot, waiting, on-demand at the safety net, storm, cost cap, the expected-cost rule,
three Spot pools). Never a timed assertion.

    .venv/bin/python tests/benchmarks/bench_placement.py [--decisions 20000] [--json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from airflow_deadline_batch.core.placement import (  # noqa: E402
    JobSnapshot,
    PolicyParams,
    SpotOption,
    choose_pool,
)
from airflow_deadline_batch.core.pools import PoolKind  # noqa: E402

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
H = 3600.0


def snapshot(**overrides: object) -> JobSnapshot:
    values: dict[str, object] = dict(
        now=NOW,
        deadline=NOW + dt.timedelta(hours=10),
        remaining_work_s=16 * H,
        shard_work_s=0.25 * H,
        parallelism=4,
        changeover_s=0.2 * H,
        started_at=NOW - dt.timedelta(hours=2),
        total_work_s=24 * H,
        spot_availability=0.6,
        spot_mean_run_s=2 * H,
    )
    values.update(overrides)
    return JobSnapshot(**values)  # type: ignore[arg-type]


CASES: dict[str, dict[str, object]] = {
    "spot": {},
    "keep running spot": {"previous_pool": PoolKind.SPOT, "running": True, "changeover_left_s": 300.0},
    "wait for spot": {"spot_available": False},
    "safety net": {"deadline": NOW + dt.timedelta(hours=4.3)},
    "storm": {"spot_fruitless_tries": 12, "spot_fruitless_age_s": 60.0},
    "cost cap": {"price_ratio": 3.0, "cost_excess_s": 100.0},
    "expected cost": {"price_ratio": 3.0, "spot_mean_run_s": 0.2 * H},
    "three spot pools": {
        "price_ratio": 3.0,
        "spot_pools": (
            SpotOption(name="a", price=0.8, availability=0.2, mean_run_s=0.5 * H),
            SpotOption(name="b", price=1.0, availability=0.8, mean_run_s=3 * H),
            SpotOption(name="c", price=1.2, speed=1.5, available=False, availability=0.9),
        ),
    },
}


def best_of(fn: object, n: int, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()  # type: ignore[operator]
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decisions", type=int, default=20000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    policy = PolicyParams(decision_interval_s=600, cost_cap=0.01)
    rows = {}
    for name, overrides in CASES.items():
        snap = snapshot(**overrides)
        decide = best_of(lambda snap=snap: choose_pool(snap, policy), args.decisions)
        both = best_of(lambda o=overrides: choose_pool(snapshot(**o), policy), args.decisions)
        rows[name] = {"decide_us": decide * 1e6, "snapshot_and_decide_us": both * 1e6}
    if args.json:
        print(json.dumps(rows))
    else:
        for name, row in rows.items():
            print(
                f"{name:18} decide {row['decide_us']:7.1f} us   "
                f"snapshot + decide {row['snapshot_and_decide_us']:7.1f} us"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
