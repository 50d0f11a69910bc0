"""The results study of ``docs/simulator.md``: every shared trace × setting, and the target check.

``python -m airflow_deadline_batch.sim.study --traces DIR`` runs the 48 settings (each trace ×
``d`` ∈ {0.1, 0.2} h; ``N = 1, W = 16 h, D = 20/30 h``; ``N = 4, W = 32 h, D = 10 h``; ``k = 3``)
plus the paper-setting ordering check, prints the Markdown table and the target lines.
``--synthetic`` runs the same settings on :func:`~.traces.synthetic_suite` (the tuning set).
``--multi-gpu`` runs issue 13's multi-GPU setting (``W = 192 GPU-h, N = 8, d = 0.2 h, k = 3,
D = 30/40 h``, 40 starts) on unseen synthetic 8- and 16-GPU traces (:func:`multi_gpu_traces`).
The ``omniscient`` column is the exact optimum for ``N = 1`` rows and a proven lower bound,
:func:`~.omniscient.tightest_bound`, for ``N > 1`` rows (so their ``sa / omniscient`` is pessimistic).
``--extra-policy mdp`` adds the research policy of :mod:`.mdp` (with the persisted prior, as
slack_aware) and its target line; ``--n1-only`` keeps the ``N = 1`` rows; ``--params '<json>'``
(repeatable) adds slack_aware with those ``PolicyParams`` on the same starts, its line named
``candidate1``, ``candidate2`` ….
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from airflow_deadline_batch.core.placement import PolicyParams
from airflow_deadline_batch.sim.engine import SimConfig, simulate
from airflow_deadline_batch.sim.mdp import MarkovDecision
from airflow_deadline_batch.sim.policies import OnDemand, pool_priors, slack_aware_at
from airflow_deadline_batch.sim.runner import Summary, compare, start_ticks, summarise
from airflow_deadline_batch.sim.traces import Trace, load_trace, multi_gpu_suite, synthetic_suite

ORDER = ("on_demand", "greedy", "uniform_progress", "omniscient")
#: research policies a run may add (``--extra-policy``; docs/simulator.md, *Fourth round*)
EXTRA = ("mdp",)


@dataclass(frozen=True)
class Setting:
    workers: int
    work_h: float
    deadline_h: float
    changeover_h: float
    starts: int
    shard_h: float = 0.25

    def config(self) -> SimConfig:
        return SimConfig(
            work_h=self.work_h,
            deadline_h=self.deadline_h,
            workers=self.workers,
            changeover_h=self.changeover_h,
            price_ratio=3.0,
            shard_h=self.shard_h,
        )


def settings(starts_n1: int = 30, starts_n4: int = 20) -> list[Setting]:
    """The 6 settings of the results table (× every trace = the table's rows)."""
    out = [Setting(1, 16.0, dl, d, starts_n1) for d in (0.1, 0.2) for dl in (20.0, 30.0)]
    out += [Setting(4, 32.0, 10.0, d, starts_n4) for d in (0.1, 0.2)]
    return out


def multi_gpu_settings(starts: int = 40) -> list[Setting]:
    """Issue 13's multi-GPU setting: 192 GPU-hours on 8 workers, ``d = 0.2 h``, ``D = 30 / 40 h``."""
    return [Setting(8, 192.0, dl, 0.2, starts) for dl in (30.0, 40.0)]


def multi_gpu_traces(seed: int = 900) -> list[Trace]:
    """Unseen synthetic traces for the multi-GPU setting (never used for tuning): 8- and 16-GPU gangs."""
    return multi_gpu_suite(seed, capacity=8) + multi_gpu_suite(seed, capacity=16)


def run_row(
    trace: Trace,
    setting: Setting,
    seed: int = 1,
    extra: Sequence[str] = (),
    params: Sequence[PolicyParams] = (),
) -> dict[str, Summary]:
    cfg = setting.config()
    ticks = start_ticks(trace, cfg, starts=setting.starts, seed=seed)
    row = {s.policy: s for s in compare(trace, cfg, ticks)}
    for i, candidate in enumerate(params, 1):  # slack_aware with ``--params``, same starts
        runs = [simulate(trace, t, cfg, slack_aware_at([trace], t, cfg.workers, candidate)) for t in ticks]
        row[f"candidate{i}"] = summarise(trace, cfg, f"candidate{i}", runs)
    if "mdp" in extra:  # with the persisted prior, as slack_aware (and as sim.tuning scores it)
        runs = [
            simulate(trace, t, cfg, MarkovDecision(priors=pool_priors([trace], t, cfg.workers)))
            for t in ticks
        ]
        row["mdp"] = summarise(trace, cfg, "mdp", runs)
    return row


def worst_run(args: tuple[Trace, Setting]) -> float:
    """slack_aware's dearest single start of a row, over on-demand only's cost."""
    trace, setting = args
    cfg = setting.config()
    ticks = start_ticks(trace, cfg, starts=setting.starts, seed=1)
    on_demand = simulate(trace, ticks[0], cfg, OnDemand()).cost
    return (
        max(simulate(trace, t, cfg, slack_aware_at([trace], t, cfg.workers)).cost for t in ticks) / on_demand
    )


def _job(
    args: tuple[Trace, Setting, tuple[str, ...], tuple[PolicyParams, ...]],
) -> tuple[str, Setting, dict[str, Summary]]:
    trace, setting, extra, params = args
    return trace.name, setting, run_row(trace, setting, extra=extra, params=params)


def run_all(
    traces: Sequence[Trace],
    grid: Sequence[Setting],
    jobs: int = 2,
    extra: Sequence[str] = (),
    params: Sequence[PolicyParams] = (),
) -> list[tuple[str, Setting, dict[str, Summary]]]:
    work = [
        (t, s, tuple(extra), tuple(params))
        for s in grid
        for t in traces
        if s.workers <= max(t.capacity) or True
    ]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_job, work))


def targets(rows: Sequence[tuple[str, Setting, dict[str, Summary]]]) -> dict[str, float]:
    """The issue's targets over the rows: cost ratios, rows above 1.01 × UP, misses, ordering."""
    up = [r["slack_aware"].mean_cost / r["uniform_progress"].mean_cost for _, _, r in rows]
    od = [r["slack_aware"].mean_cost / r["on_demand"].mean_cost for _, _, r in rows]
    om = [r["slack_aware"].mean_cost / r["omniscient"].mean_cost for _, _, r in rows]
    om_exact = [r["slack_aware"].mean_cost / r["omniscient"].mean_cost for _, s, r in rows if s.workers == 1]
    misses = sum(1 for _, _, r in rows if r["slack_aware"].miss_rate > r["omniscient"].miss_rate + 1e-12)
    order = sum(
        1
        for _, _, r in rows
        if all(r[a].mean_cost > r[b].mean_cost for a, b in zip(ORDER, ORDER[1:], strict=False))
    )
    return {
        "rows": len(rows),
        "mean_sa_over_up": sum(up) / len(up),
        "max_sa_over_up": max(up),
        "rows_over_1.01_up": sum(1 for x in up if x > 1.01 + 1e-12),
        "mean_sa_over_omniscient": sum(om) / len(om),
        "mean_sa_over_exact_optimum_n1": sum(om_exact) / len(om_exact) if om_exact else math.nan,
        "max_sa_over_on_demand": max(od),
        "rows_over_1.01_on_demand": sum(1 for x in od if x > 1.01 + 1e-12),
        "sa_misses_where_omniscient_meets": misses,
        "paper_order_holds": order,
    }


def extra_targets(rows: Sequence[tuple[str, Setting, dict[str, Summary]]], name: str) -> dict[str, float]:
    """An added policy's line: its cost over UP, omniscient (the exact optimum for ``N = 1``) and
    slack_aware, rows above 1.01 × UP, and misses where omniscient meets the deadline."""
    up = [r[name].mean_cost / r["uniform_progress"].mean_cost for _, _, r in rows]
    om = [r[name].mean_cost / r["omniscient"].mean_cost for _, _, r in rows]
    om1 = [r[name].mean_cost / r["omniscient"].mean_cost for _, s, r in rows if s.workers == 1]
    sa = [r[name].mean_cost / r["slack_aware"].mean_cost for _, _, r in rows]
    return {
        "rows": len(rows),
        f"mean_{name}_over_up": sum(up) / len(up),
        f"max_{name}_over_up": max(up),
        "rows_over_1.01_up": sum(1 for x in up if x > 1.01 + 1e-12),
        f"mean_{name}_over_omniscient": sum(om) / len(om),
        f"mean_{name}_over_exact_optimum_n1": sum(om1) / len(om1) if om1 else math.nan,
        f"mean_{name}_over_sa": sum(sa) / len(sa),
        f"{name}_misses_where_omniscient_meets": sum(
            1 for _, _, r in rows if r[name].miss_rate > r["omniscient"].miss_rate + 1e-12
        ),
    }


def markdown(rows: Sequence[tuple[str, Setting, dict[str, Summary]]]) -> str:
    head = (
        "| trace | N | W h | D h | d h | on_demand | greedy | uniform_progress | omniscient | "
        "slack_aware | sa / UP | sa / omniscient | sa / on_demand | misses (sa) |\n" + "|---" * 14 + "|\n"
    )
    lines = []
    for name, s, r in rows:
        sa = r["slack_aware"]
        lines.append(
            f"| {name} | {s.workers} | {s.work_h:g} | {s.deadline_h:g} | {s.changeover_h:g} | "
            + " | ".join(f"{r[p].mean_cost:.1f}" for p in ORDER)
            + f" | {sa.mean_cost:.1f} | {sa.mean_cost / r['uniform_progress'].mean_cost:.3f} | "
            f"{sa.mean_cost / r['omniscient'].mean_cost:.3f} | "
            f"{sa.mean_cost / r['on_demand'].mean_cost:.3f} | {sa.miss_rate:.2f} |"
        )
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_deadline_batch.sim.study")
    parser.add_argument("--traces", type=Path, help="folder searched for *.json Spot traces")
    parser.add_argument("--synthetic", action="store_true", help="use the synthetic suite instead")
    parser.add_argument(
        "--multi-gpu", action="store_true", help="issue 13's N = 8 setting on synthetic 8/16-GPU traces"
    )
    parser.add_argument("--starts", type=int, default=40, help="starts per row with --multi-gpu")
    parser.add_argument("--shard-hours", type=float, default=0.25, help="0.0167 ≈ the paper's no-loss model")
    parser.add_argument("--starts-n1", type=int, default=30)
    parser.add_argument("--starts-n4", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--extra-policy", action="append", choices=EXTRA, default=[], help="add a research policy's line"
    )
    parser.add_argument("--n1-only", action="store_true", help="only the N = 1 settings")
    parser.add_argument(
        "--params",
        action="append",
        default=[],
        help="also slack_aware with these PolicyParams (JSON; repeatable), lines candidate1, candidate2 …",
    )
    parser.add_argument("--table", action="store_true", help="print the Markdown table")
    parser.add_argument(
        "--worst-run", action="store_true", help="also slack_aware's dearest start ÷ on-demand (reruns it)"
    )
    args = parser.parse_args(argv)
    try:
        params = [PolicyParams(**json.loads(text)) for text in args.params]
    except (ValueError, TypeError) as exc:
        parser.error(f"--params needs PolicyParams as JSON, e.g. '{{\"spell_age_wait\": true}}': {exc}")
    if args.multi_gpu:
        traces = multi_gpu_traces()
    elif args.synthetic:
        traces = synthetic_suite(100) + synthetic_suite(200, capacity=4)
    elif args.traces:
        traces = [load_trace(p) for p in sorted(args.traces.rglob("*.json"))]
    else:
        parser.error("pass --traces DIR or --synthetic")
    base = multi_gpu_settings(args.starts) if args.multi_gpu else settings(args.starts_n1, args.starts_n4)
    grid = [
        Setting(s.workers, s.work_h, s.deadline_h, s.changeover_h, s.starts, args.shard_hours)
        for s in base
        if s.workers == 1 or not args.n1_only
    ]
    if args.synthetic:  # N = 1 settings on 1-GPU traces, N = 4 on 4-GPU traces
        rows = [
            row
            for row in run_all(traces, grid, args.jobs, args.extra_policy, params)
            if (row[1].workers == 1) == ("-" in row[0] and max(_cap(traces, row[0])) == 1)
        ]
    else:
        rows = run_all(traces, grid, args.jobs, args.extra_policy, params)
    if args.table:
        print(markdown(rows))
    names = list(args.extra_policy) + [f"candidate{i}" for i in range(1, len(params) + 1)]
    lines = [targets(rows)] + [extra_targets(rows, name) for name in names]
    for line in lines:
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items()))
    if args.worst_run:
        by_name = {t.name: t for t in traces}
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            worst = list(pool.map(worst_run, [(by_name[name], s) for name, s, _ in rows]))
        print(
            f"worst_run_over_on_demand={max(worst):.3f} "
            f"rows_with_a_run_over_1.01_on_demand={sum(1 for x in worst if x > 1.01 + 1e-12)}"
        )
    for name, s, r in rows:
        ratio = r["slack_aware"].mean_cost / r["uniform_progress"].mean_cost
        if ratio > 1.01:
            print(
                f"over 1.01 x UP: {name} N={s.workers} D={s.deadline_h:g} d={s.changeover_h:g}: {ratio:.3f}"
            )
    return 0


def _cap(traces: Sequence[Trace], name: str) -> tuple[int, ...]:
    return next(t.capacity for t in traces if t.name == name)


if __name__ == "__main__":
    sys.exit(main())
