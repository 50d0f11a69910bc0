"""Benchmark: time of one placement decision (``core.placement.choose_pool``), target under 1 ms.

The policy runs on every try and, in the simulator, for every worker at every tick. Measures the
decision alone and the decision with the :class:`JobSnapshot` built for it, over the branches of
the rule (Spot, waiting, on-demand at the safety net, storm, cost cap, the expected-cost rule,
three Spot pools), the tail race's rule, and the production path: ``operators.placement``'s
``decide_for_try`` over a job view of three Spot and two on-demand pools with learned rates and a
pool history (alone, and with the view built from the rows, as ``read_job_view`` does after its
queries). Never a timed assertion.

    .venv/bin/python tests/benchmarks/bench_placement.py [--decisions 20000] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from airflow_deadline_batch.core.calibration import PoolHistory  # noqa: E402
from airflow_deadline_batch.core.placement import (  # noqa: E402
    JobSnapshot,
    PolicyParams,
    SpotOption,
    choose_pool,
    should_speculate,  # noqa: E402
)
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec  # noqa: E402
from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState  # noqa: E402
from airflow_deadline_batch.operators.placement import decide_for_try, job_view_of  # noqa: E402

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


POOLS = (
    PoolSpec(name="spot-a", kind=PoolKind.SPOT, price_per_gpu_hour=1.0, preemptions_per_hour=0.5),
    PoolSpec(name="spot-b", kind=PoolKind.SPOT, price_per_gpu_hour=1.2, preemptions_per_hour=0.2),
    PoolSpec(name="spot-c", kind=PoolKind.SPOT, price_per_gpu_hour=0.9, decode_tokens_per_s=1200.0),
    PoolSpec(name="od-a", kind=PoolKind.ON_DEMAND, price_per_gpu_hour=3.0),
    PoolSpec(name="od-b", kind=PoolKind.ON_DEMAND, price_per_gpu_hour=2.8),
)


@dataclasses.dataclass(frozen=True)
class _Job:
    job_id: str = "j-bench"
    state: JobState = JobState.RUNNING
    deadline: dt.datetime = NOW + dt.timedelta(hours=10)
    created_at: dt.datetime = NOW - dt.timedelta(hours=2)
    completed_at: dt.datetime | None = None
    input_lines: int = 64_000
    tenant: str = "default"
    config: dict[str, object] = dataclasses.field(
        default_factory=lambda: {"workers": 8, "pools": [p.to_dict() for p in POOLS]}
    )


@dataclasses.dataclass(frozen=True)
class _Shard:
    shard_index: int
    est_work_s: float = 900.0
    num_microbatches: int = 10
    cursor: int = 0
    state: ShardState = ShardState.PENDING
    last_pool: str | None = None
    last_error: str | None = None


@dataclasses.dataclass(frozen=True)
class _Attempt:
    attempt_id: str
    shard_index: int
    pool: str
    started_at: dt.datetime
    ended_at: dt.datetime
    outcome: AttemptOutcome = AttemptOutcome.PREEMPTED


def production_rows() -> tuple[_Job, list[_Shard], list[_Attempt], dict[str, PoolHistory]]:
    """A running job: 64 shards, 24 finished Spot tries over the three Spot pools, their history."""
    shards = [_Shard(i, cursor=10 if i < 16 else 0) for i in range(64)]
    attempts = [
        _Attempt(
            f"a{n}",
            n % 64,
            POOLS[n % 3].name,
            NOW - dt.timedelta(minutes=30 + n),
            NOW - dt.timedelta(minutes=n),
        )
        for n in range(24)
    ]
    history = {
        p.name: PoolHistory(pool=p.name, tries=200, preemptions=40, spot_s=200 * 1800.0) for p in POOLS[:3]
    }
    return _Job(), shards, attempts, history


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
    race = best_of(
        lambda: should_speculate(
            remaining_s=600.0, price=1.0, mean_run_s=1800.0, duplicate_s=1500.0, duplicate_price=3.0
        ),
        args.decisions,
    )
    rows["tail race rule"] = {"decide_us": race * 1e6, "snapshot_and_decide_us": race * 1e6}
    job, shards, attempts, history = production_rows()
    view = job_view_of(job, shards, [], attempts, now=NOW, history=history)  # type: ignore[arg-type]
    shard = shards[20]
    alone = best_of(lambda: decide_for_try(view, shard), max(1, args.decisions // 10))  # type: ignore[arg-type]
    built = best_of(
        lambda: decide_for_try(
            job_view_of(job, shards, [], attempts, now=NOW, history=history),  # type: ignore[arg-type]
            shard,  # type: ignore[arg-type]
        ),
        max(1, args.decisions // 100),
    )
    rows["decide_for_try, 5 pools"] = {"decide_us": alone * 1e6, "snapshot_and_decide_us": built * 1e6}
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
