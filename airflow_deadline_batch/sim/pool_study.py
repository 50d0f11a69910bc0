"""Several Spot pools: slack_aware on each pool alone against all of them at once (docs/simulator.md).

``python -m airflow_deadline_batch.sim.pool_study --traces DIR`` runs the pool sets below (traces of
one tick length recorded over the same days, so one start offset is one instant in every pool) and
prints one Markdown row per (pool set, setting): on-demand only, slack_aware on each pool alone,
slack_aware on all pools, the ratio of the latter to the best single pool, the omniscient bound for
all the pools (:func:`~.omniscient.pools_bound`, a proven lower bound, so the ratio to it is
pessimistic), the ratio to it, and misses. Prices are
illustrative (per GPU-hour over the first pool's Spot price; on-demand ``k = 3``): the scarcer
zone is the cheaper one, so the choice is a trade-off.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from airflow_deadline_batch.sim.engine import SimConfig, SimPool, simulate, simulate_pools
from airflow_deadline_batch.sim.omniscient import pools_bound
from airflow_deadline_batch.sim.policies import OnDemand, slack_aware_at
from airflow_deadline_batch.sim.runner import start_ticks
from airflow_deadline_batch.sim.traces import gang, load_trace

#: (name, [(trace file under the traces folder, price)], settings as (N, W h, D h))
POOL_SETS: tuple[tuple[str, tuple[tuple[str, float], ...], tuple[tuple[int, float, float], ...]], ...] = (
    (
        "1-node 2023, 3 zones",
        (
            ("availability/1-node/aws-02-15-2023/us-east-1a_v100_1.json", 0.8),
            ("availability/1-node/aws-02-15-2023/us-east-2a_v100_1.json", 1.0),
            ("availability/1-node/aws-02-15-2023/us-west-2a_v100_1.json", 1.2),
        ),
        ((1, 16.0, 20.0), (1, 16.0, 30.0), (2, 16.0, 12.0)),
    ),
    (
        "16-node 2023, 2 zones",
        (
            ("availability/16-node/aws-08-27-2023/us-east-2b_v100_1.json", 1.0),
            ("availability/16-node/aws-08-27-2023/us-west-2a_v100_1.json", 0.8),
        ),
        ((1, 16.0, 20.0), (4, 32.0, 10.0)),
    ),
)


@dataclass(frozen=True)
class PoolRow:
    name: str
    workers: int
    work_h: float
    deadline_h: float
    on_demand: float
    single: tuple[float, ...]
    multi: float
    bound: float
    misses: int

    @property
    def over_best_single(self) -> float:
        return self.multi / min(self.single)

    @property
    def over_bound(self) -> float:
        return self.multi / self.bound


def run_set(name: str, pools: Sequence[SimPool], cfg: SimConfig, starts: int = 20, seed: int = 1) -> PoolRow:
    """Mean cost over seeded starts of slack_aware on each pool alone and on all of them, and the bound."""
    shortest = min(pools, key=lambda p: len(p.trace.capacity)).trace
    ticks = start_ticks(shortest, cfg, starts=starts, seed=seed)

    def mean(subset: Sequence[SimPool]) -> tuple[float, int]:
        traces = [p.trace for p in subset]
        runs = [simulate_pools(subset, t, cfg, slack_aware_at(traces, t, cfg.workers)) for t in ticks]
        return sum(r.cost for r in runs) / len(runs), sum(r.missed for r in runs)

    single = tuple(mean([p])[0] for p in pools)
    multi, misses = mean(pools)
    bound = sum(pools_bound(pools, t, cfg).cost for t in ticks) / len(ticks)
    on_demand = simulate(shortest, 0, cfg, OnDemand()).cost
    return PoolRow(name, cfg.workers, cfg.work_h, cfg.deadline_h, on_demand, single, multi, bound, misses)


def _job(args: tuple[str, tuple[SimPool, ...], SimConfig, int]) -> PoolRow:
    name, pools, cfg, starts = args
    return run_set(name, pools, cfg, starts)


def jobs(
    traces: Path | None, changeover_h: float = 0.2
) -> list[tuple[str, tuple[SimPool, ...], SimConfig, int]]:
    """The shared pool sets (with ``traces``) plus an unseen synthetic pair of 8-GPU pools."""
    out: list[tuple[str, tuple[SimPool, ...], SimConfig, int]] = []
    sets = list(POOL_SETS) if traces else []
    for name, files, grid in sets:
        assert traces is not None
        pools = tuple(SimPool(load_trace(traces / f), price=price) for f, price in files)
        for n, w, dl in grid:
            cfg = SimConfig(work_h=w, deadline_h=dl, workers=n, changeover_h=changeover_h)
            out.append((name, pools, cfg, 20))
    synthetic = (
        SimPool(gang(11, 8, mean_up_h=2.0, mean_down_h=2.0)),
        SimPool(gang(12, 8, mean_up_h=1.0, mean_down_h=3.0), price=0.8),
    )
    cfg = SimConfig(work_h=32, deadline_h=10, workers=4, changeover_h=changeover_h)
    out.append(("synthetic gang8-11 + gang8-12", synthetic, cfg, 20))
    return out


def markdown(rows: Sequence[PoolRow]) -> str:
    head = (
        "| pools | N | W h | D h | on_demand | slack_aware on each pool alone | on all pools | "
        "all / best single | omniscient bound | all / bound | misses |\n" + "|---" * 11 + "|\n"
    )
    lines = [
        f"| {r.name} | {r.workers} | {r.work_h:g} | {r.deadline_h:g} | {r.on_demand:.1f} | "
        + " / ".join(f"{c:.1f}" for c in r.single)
        + f" | {r.multi:.1f} | {r.over_best_single:.3f} | {r.bound:.1f} | {r.over_bound:.3f} | {r.misses} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_deadline_batch.sim.pool_study")
    parser.add_argument("--traces", type=Path, help="the spot-traces folder (without: synthetic only)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(_job, jobs(args.traces)))
    print(markdown(rows))
    ratios = [r.over_best_single for r in rows]
    bounds = [r.over_bound for r in rows]
    print(
        f"rows={len(rows)} mean_all_over_best_single={sum(ratios) / len(ratios):.3f} "
        f"max_all_over_best_single={max(ratios):.3f} mean_all_over_bound={sum(bounds) / len(bounds):.3f} "
        f"max_all_over_bound={max(bounds):.3f} misses={sum(r.misses for r in rows)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
