"""The ``deadline-batch simulate`` subcommand (flags and ``--json`` lines: docs/design.md §8)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.sim.engine import SimConfig
from airflow_deadline_batch.sim.policies import POLICY_NAMES
from airflow_deadline_batch.sim.traces import load_trace

if TYPE_CHECKING:
    from airflow_deadline_batch.sim.runner import Summary


def add_simulate_parser(subparsers: Any) -> None:
    """Add ``simulate`` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "simulate",
        help="compare placement policies on Spot capacity traces",
        description="Simulate one batch job on Spot traces under each policy.",
    )
    p.add_argument(
        "--trace", action="append", required=True, metavar="FILE", help="Spot trace JSON file (repeatable)"
    )
    p.add_argument("--work-hours", type=float, required=True, metavar="W", help="GPU-hours of work")
    p.add_argument(
        "--deadline-hours", type=float, required=True, metavar="D", help="deadline after the start"
    )
    p.add_argument("--workers", type=int, default=1, metavar="N", help="GPUs in parallel (default 1)")
    p.add_argument(
        "--changeover-hours",
        type=float,
        default=0.1,
        metavar="d",
        help="delay of every (re)start (default 0.1)",
    )
    p.add_argument(
        "--price-ratio",
        type=float,
        default=3.0,
        metavar="k",
        help="on-demand price over Spot price (default 3)",
    )
    p.add_argument(
        "--shard-hours",
        type=float,
        default=0.25,
        metavar="S",
        help="largest shard, the unit a preemption can destroy (default 0.25)",
    )
    p.add_argument("--starts", type=int, default=50, metavar="M", help="random start offsets per trace")
    p.add_argument("--seed", type=int, default=0, metavar="X", help="seed of the start offsets")
    p.add_argument(
        "--start-hours", metavar="H[,H...]", help="explicit start offsets in hours (not with --starts)"
    )
    p.add_argument(
        "--policy",
        default="all",
        metavar="NAME|all",
        help=f"one of {', '.join(POLICY_NAMES)}, or all (default)",
    )
    p.add_argument("--plot", metavar="PNG", help="write progress versus time for the first start")
    p.add_argument("--json", action="store_true", help="one JSON object per (trace, policy) line")
    p.set_defaults(func=run_simulate)


#: the largest simulation ``simulate`` runs (each bound a few minutes of CPU at most: beyond
#: them a mistyped value such as ``--starts 99999999999`` or ``--shard-hours 1e-12`` ran for ever)
MAX_STARTS = 10_000
MAX_WORKERS = 1_024
MAX_SHARDS = 100_000
MAX_DEADLINE_HOURS = 8_760.0  # a year


def _config(args: argparse.Namespace) -> SimConfig:
    if not 1 <= args.workers <= MAX_WORKERS:
        raise ConfigurationError(f"--workers must be 1 to {MAX_WORKERS}, got {args.workers}")
    if args.deadline_hours > MAX_DEADLINE_HOURS:
        raise ConfigurationError(
            f"--deadline-hours must be at most {MAX_DEADLINE_HOURS:g} (a year), got {args.deadline_hours:g}"
        )
    if args.shard_hours > 0 and args.work_hours / args.shard_hours > MAX_SHARDS:
        raise ConfigurationError(
            f"--work-hours / --shard-hours is {args.work_hours / args.shard_hours:.3g} shards, at most "
            f"{MAX_SHARDS}: raise --shard-hours"
        )
    try:
        return SimConfig(
            work_h=args.work_hours,
            deadline_h=args.deadline_hours,
            workers=args.workers,
            changeover_h=args.changeover_hours,
            price_ratio=args.price_ratio,
            shard_h=args.shard_hours,
        )
    except ValueError as exc:
        raise ConfigurationError(f"invalid simulation settings: {exc}; fix the flag") from None


def _start_hours(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        hours = [float(h) for h in text.split(",") if h.strip()]
    except ValueError:
        raise ConfigurationError(f"--start-hours {text!r} is not a comma-separated list of hours") from None
    if any(h < 0 for h in hours):
        raise ConfigurationError("--start-hours must be >= 0")
    return hours


def run_simulate(args: argparse.Namespace) -> int:
    """Run the comparison and print it; returns the exit code (0)."""
    config = _config(args)
    policies = list(POLICY_NAMES) if args.policy == "all" else [args.policy]
    if any(p not in POLICY_NAMES for p in policies):
        raise ConfigurationError(
            f"unknown --policy {args.policy!r}; use one of {', '.join(POLICY_NAMES)} or all"
        )
    if not 1 <= args.starts <= MAX_STARTS:
        raise ConfigurationError(f"--starts must be 1 to {MAX_STARTS}, got {args.starts}")
    if args.plot and Path(args.plot).is_dir():
        raise ConfigurationError(f"--plot {args.plot} is a directory: give the PNG file to write")
    hours = _start_hours(args.start_hours)
    # the runner brings NumPy (the omniscient bound): import it only when simulating
    from airflow_deadline_batch.sim.runner import compare, start_ticks

    traces = [load_trace(path) for path in args.trace]
    summaries: list[Summary] = []
    for trace in traces:
        ticks = start_ticks(trace, config, starts=args.starts, seed=args.seed, start_hours=hours)
        rows = compare(trace, config, ticks, policies)
        summaries.extend(rows)
        if args.json:
            for row in rows:
                sys.stdout.write(orjson.dumps(row.to_dict()).decode() + "\n")
        sys.stdout.flush()
    if not args.json:
        _print_table(summaries)
    if args.plot:
        from airflow_deadline_batch.sim.plot import plot_progress

        first = traces[0]
        tick = start_ticks(first, config, starts=1, seed=args.seed, start_hours=hours)[0]
        plot_progress(first, tick, config, [p for p in policies if p != "omniscient"], Path(args.plot))
    return 0


def _print_table(rows: list[Summary]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="simulate: mean over starts (cost in Spot GPU-hours)")
    for col in (
        "trace",
        "policy",
        "mean cost",
        "vs on-demand",
        "miss rate",
        "Spot h",
        "on-demand h",
        "preemptions",
        "redone h",
        "starts",
    ):
        table.add_column(col, justify="left" if col in ("trace", "policy") else "right")
    for r in rows:
        table.add_row(
            r.trace,
            r.policy,
            f"{r.mean_cost:.2f}",
            f"{r.cost_vs_on_demand:.3f}",
            f"{r.miss_rate:.3f}",
            f"{r.spot_hours:.2f}",
            f"{r.on_demand_hours:.2f}",
            f"{r.preemptions:.2f}",
            f"{r.redone_hours:.2f}",
            str(r.starts),
        )
    # Not a terminal (a pipe, a file): do not squeeze the columns into 80 characters.
    Console(width=None if sys.stdout.isatty() else 200).print(table)
