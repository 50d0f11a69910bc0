"""Process exit codes: the worker's (docs/design.md §6) and the ``deadline-batch`` CLI's (§8).

One table for both, so the worker, the local launcher, the shard operators and the CLI agree on
what a number means. The CLI's error codes are also carried by the exceptions (``exit_code``).
"""

from __future__ import annotations

import enum
import signal

__all__ = [
    "EXIT_INCOMPLETE",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_RETRYABLE",
    "EXIT_TERMINAL",
    "EXIT_USAGE",
    "WorkerExit",
    "worker_exit",
]

#: worker: shard done (or already committed); CLI: manifest published / command succeeded
EXIT_OK = 0
#: worker: no retry can help (bad config, unreadable input); the shard failed for good
EXIT_TERMINAL = 1
#: CLI: usage or configuration error
EXIT_USAGE = 2
#: CLI: rejected at admission, nothing ran
EXIT_REJECTED = 3
#: CLI: finished without a complete manifest
EXIT_INCOMPLETE = 4
#: worker: preempted, lost its lease or hit a transient error; another try resumes the shard
#: (75 is ``EX_TEMPFAIL`` of sysexits.h)
EXIT_RETRYABLE = 75


class WorkerExit(str, enum.Enum):
    """What a worker's exit status means for the shard."""

    SUCCEEDED = "succeeded"
    RETRYABLE = "retryable"
    TERMINAL = "terminal"


def worker_exit(returncode: int) -> WorkerExit:
    """Classify a worker's exit status: killed by a signal (as a process or a container) is retryable."""
    if returncode == EXIT_OK:
        return WorkerExit.SUCCEEDED
    if (
        returncode == EXIT_RETRYABLE
        or returncode < 0
        or returncode in (128 + signal.SIGKILL, 128 + signal.SIGTERM)
    ):
        return WorkerExit.RETRYABLE
    return WorkerExit.TERMINAL
