"""The worker's command line and exit codes, defined once for the pod, the subprocess and the CLI."""

from __future__ import annotations

import signal

from airflow_deadline_batch.core.exit_codes import (
    EXIT_OK,
    EXIT_RETRYABLE,
    EXIT_TERMINAL,
    WorkerExit,
    worker_exit,
)
from airflow_deadline_batch.core.worker_command import WORKER_MODULE, worker_arguments, worker_command
from airflow_deadline_batch.worker.__main__ import build_parser


def test_the_arguments_parse_back_into_what_was_asked() -> None:
    argv = worker_arguments(
        "job-1",
        3,
        pool="gpu-spot",
        lease_ttl_s=45,
        grace_s=2.5,
        worker_name="w",
        engine_options=["delay_s_per_record=0.1"],
        extra=["--store", "sqlite:///x.db"],
    )
    args = build_parser().parse_args(argv)
    assert (args.job, args.shard, args.pool, args.lease_ttl, args.grace) == (
        "job-1",
        3,
        "gpu-spot",
        45.0,
        2.5,
    )
    assert args.worker_name == "w" and args.engine_option == ["delay_s_per_record=0.1"]
    assert args.store == "sqlite:///x.db"
    assert worker_command("python3", argv)[:3] == ["python3", "-m", WORKER_MODULE]


def test_the_store_url_stays_out_of_the_command_line_unless_asked() -> None:
    assert "--store" not in worker_arguments("job-1", 0, pool="p")


def test_exit_classification() -> None:
    assert worker_exit(EXIT_OK) is WorkerExit.SUCCEEDED
    assert worker_exit(EXIT_RETRYABLE) is WorkerExit.RETRYABLE
    assert worker_exit(-signal.SIGKILL) is WorkerExit.RETRYABLE
    assert worker_exit(128 + signal.SIGTERM) is WorkerExit.RETRYABLE
    assert worker_exit(EXIT_TERMINAL) is WorkerExit.TERMINAL
