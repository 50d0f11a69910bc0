"""Planning's worker processes: results in order, a child's failure named, no re-run of ``__main__``."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_deadline_batch.service.processes import Processes, run_in_processes

ROOT = Path(__file__).resolve().parents[2]


def test_results_come_back_in_call_order() -> None:
    assert run_in_processes(math.factorial, [(5,), (6,), (1,)]) == [120, 720, 1]


def test_a_failing_child_raises_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match="(?s)factorial.*ValueError"):
        run_in_processes(math.factorial, [(3,), (-1,)])


def test_a_script_without_a_main_guard_is_not_run_again(tmp_path: Path) -> None:
    # multiprocessing's spawn would import this script in every child, which would start children again
    script = tmp_path / "unguarded.py"
    marker = tmp_path / "runs"
    script.write_text(
        "import math\n"
        f"open({str(marker)!r}, 'a').write('x')\n"
        "from airflow_deadline_batch.service.processes import run_in_processes\n"
        "print(run_in_processes(math.factorial, [(4,), (3,)]))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[24, 6]"
    assert marker.read_text() == "x"


def test_arguments_may_be_computed_while_the_children_start() -> None:
    called: list[int] = []

    def late(n: int) -> tuple[int]:
        called.append(n)
        return (n,)

    assert run_in_processes(math.factorial, [(3,), lambda: late(5), lambda: late(4)]) == [6, 120, 24]
    assert called == [5, 4]


def test_a_failure_computing_arguments_stops_the_children() -> None:
    def broken() -> tuple[int]:
        raise OSError("input vanished")

    with pytest.raises(OSError, match="input vanished"):
        run_in_processes(math.factorial, [(3,), broken])


def write_half_a_result_and_stop() -> None:
    """In a child: write the start of a result frame (a 100-byte pickle announced, 10 bytes sent),
    then stop as ``kill -STOP`` would stop it there."""
    sys.stdout.buffer.write((100).to_bytes(8, "big") + b"\x80" * 10)
    sys.stdout.buffer.flush()
    os.kill(os.getpid(), signal.SIGSTOP)


@pytest.mark.timeout(120)
def test_a_child_stopped_halfway_through_writing_its_result_fails_the_call() -> None:
    """Bug: the result was read with a blocking ``pickle.load`` once its first bytes came, so a
    child stopped in the middle of writing it hung the plan for ever (the stop check never ran).
    Now the frame is read as it arrives and the stopped child is named; the others are ended."""
    with Processes(2) as workers:
        pids = workers.map(os.getpid, [(), ()])
        stopped = r"^a planning process \(write_half_a_result_and_stop, PID \d+\) was stopped by a signal"
        with pytest.raises(RuntimeError, match=stopped):
            workers.map(write_half_a_result_and_stop, [(), ()])
    for pid in pids:  # killed, not left stopped
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_a_result_larger_than_a_pipe_comes_back_whole() -> None:
    """A result of several megabytes is read in pieces, and comes back equal."""
    assert run_in_processes(bytes, [(3_000_000,), (5,)]) == [bytes(3_000_000), bytes(5)]
