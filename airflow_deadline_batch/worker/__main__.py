"""``python -m airflow_deadline_batch.worker``: run one attempt at one shard (docs/design.md §6).

Exit codes (``core.exit_codes``): 0 done, 75 retryable, 1 terminal. ``--store`` defaults to env
``ADB_STORE_URL`` so a Kubernetes Secret can carry the DSN without it appearing in the pod spec's
command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from airflow_deadline_batch.core.exit_codes import EXIT_TERMINAL
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.worker.worker import (
    WorkerConfig,
    configure_logging,
    log,
    run_worker,
)


def parse_engine_options(items: Sequence[str]) -> dict[str, str]:
    """``["k=v", ...]`` to a dict; a malformed item is a ConfigurationError naming it."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(f"--engine-option {item!r} is not KEY=VALUE")
        options[key.strip()] = value
    return options


class _Parser(argparse.ArgumentParser):
    """Bad arguments are a configuration error: one line and exit 1, the worker's exit codes
    (argparse's own exit 2 is none of them, so a launcher would take it for a crash)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_TERMINAL, f"{self.prog}: {message}; see --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m airflow_deadline_batch.worker",
        description="Run one attempt at one shard of a deadline-batch job.",
    )
    parser.add_argument(
        "--store",
        default=os.environ.get("ADB_STORE_URL"),
        help="manifest store URL (default: env ADB_STORE_URL)",
    )
    parser.add_argument("--job", required=True, help="job ID")
    parser.add_argument("--shard", required=True, type=int, help="shard index (0-based)")
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=None,
        help="lease TTL in seconds (default: the job's, 60 s unless configured)",
    )
    parser.add_argument(
        "--grace", type=float, default=30.0, help="seconds between SIGTERM and the hard kill (default 30)"
    )
    parser.add_argument("--pool", default=None, help="pool this attempt runs on (recorded with its commits)")
    parser.add_argument(
        "--worker-name",
        default=None,
        help="name recorded with the attempt (default: $ADB_POD_NAME:pid, else host:pid)",
    )
    parser.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine-specific option, repeatable (e.g. delay_s_per_record=0.1)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        help="seconds an engine call (the load, one microbatch) may run before the try ends as a hang "
        "(default: the load is not watched, a microbatch 10 times its expected time, at least 1800)",
    )
    parser.add_argument(
        "--race",
        action="store_true",
        help="run as a speculative duplicate beside the shard's running attempt (the tail race)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.job, args.shard)
    try:
        extra = {"worker_name": args.worker_name} if args.worker_name else {}
        config = WorkerConfig(
            store_url=args.store or "",
            job_id=args.job,
            shard_index=args.shard,
            lease_ttl_s=args.lease_ttl,
            grace_s=args.grace,
            pool=args.pool,
            engine_options=parse_engine_options(args.engine_option),
            race=args.race,
            stall_timeout_s=args.stall_timeout,
            **extra,
        )
    except ConfigurationError as exc:
        log.error("%s", exc)
        return EXIT_TERMINAL
    return run_worker(config)


if __name__ == "__main__":
    sys.exit(main())
