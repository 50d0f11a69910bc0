"""``python -m airflow_deadline_batch.sim simulate ...``: the simulator without the main CLI."""

from __future__ import annotations

import argparse
import sys

from airflow_deadline_batch.exceptions import DeadlineBatchError
from airflow_deadline_batch.sim.cli import add_simulate_parser, run_simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_deadline_batch.sim")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return run_simulate(args)
    except DeadlineBatchError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
