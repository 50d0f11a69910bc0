"""Run planning's CPU-bound steps on several cores, in fresh Python processes.

Not ``multiprocessing``: its ``spawn`` start method runs the caller's ``__main__`` script again in
every child (a script without an ``if __name__ == "__main__"`` guard plans again there and fails;
Airflow's entry point imports Airflow in each), and ``fork`` copies a process that may have other
threads running (the planner hashes the input on one). Each child here is ``python -c`` that,
for each call, imports only the function's module, reads its arguments as a pickle on stdin and
writes the result on stdout (its pickle's length, then the pickle), until its stdin ends
(:class:`Processes` keeps children for several rounds); the parent's ``sys.path`` goes first,
so what imports here imports there.
The function's module is imported before the arguments are read, so arguments that take a
while to compute (a callable in ``calls``) are computed while the children start.

A child's ``OSError`` (a full disk, say) or deliberate error (:class:`DeadlineBatchError`) is raised
again in the parent as itself, so the caller handles it as if the call had run there. On Linux a
child dies with the thread that started it (``PR_SET_PDEATHSIG``): a parent killed outright
(SIGKILL, the OOM killer) leaves no child scanning on for minutes with nobody to read its result.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import selectors
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import IO, Any

from airflow_deadline_batch.exceptions import DeadlineBatchError

__all__ = ["Processes", "run_in_processes"]

#: the child's program, with the parent's process ID (``{parent}``) to watch
_BOOT = (
    "import pickle, sys; sys.path[:0] = pickle.load(sys.stdin.buffer); "
    "from airflow_deadline_batch.service.processes import _child; _child({parent})"
)
_PR_SET_PDEATHSIG = 1

#: seconds without a result after which the children owed one are checked for a stop (a look in
#: ``/proc`` each): the pace of the check, not a time limit
STOP_CHECK_S = 1.0

#: a call's arguments, or a callable that returns them (computed once every child has started)
Call = tuple[Any, ...] | Callable[[], tuple[Any, ...]]


class Processes:
    """``count`` fresh Python processes that stay alive for several rounds of calls (:meth:`map`).

    Planning scans the input's byte ranges in them, then checks the spilled IDs' partitions and
    rewrites each range without its duplicates in the same processes, so the later rounds cost
    no start-up. Use as a context manager: leaving
    it ends the children (killing any still running after a failure). Use it on the thread that
    made it: on Linux the children die when that thread ends.
    """

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self._children: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []
        try:
            for _ in range(count):
                stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close(); a file, so no pipe fills up
                child = subprocess.Popen(
                    [sys.executable, "-c", _BOOT.format(parent=os.getpid())],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                )
                self._children.append((child, stderr))
                assert child.stdin is not None
                child.stdin.write(pickle.dumps(list(sys.path)))
                child.stdin.flush()
        except BaseException:
            self.close(kill=True)
            raise

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(kill=kind is not None)

    def __len__(self) -> int:
        return len(self._children)

    def map(self, function: Callable[..., Any], calls: Sequence[Call]) -> list[Any]:
        """``[function(*args) for args in calls]``, call ``k`` in child ``k``, all at once.

        ``function`` must be a module-level function; arguments and results must pickle. The
        function's module is imported in every child before any argument is computed: an item
        of ``calls`` that is a callable is called then, in order. A child that fails raises
        ``RuntimeError`` with the end of its stderr (its traceback), or its ``OSError`` or
        ``DeadlineBatchError``, as soon as it fails; the pool is then closed (the others killed).
        """
        if len(calls) > len(self._children):
            raise ValueError(f"{len(calls)} calls for {len(self._children)} processes: at most one each")
        target = (function.__module__, function.__qualname__)
        children = self._children[: len(calls)]
        try:
            for child, errors in children:
                _send(child, errors, target[1], pickle.dumps(target))
            for (child, errors), args in zip(children, calls, strict=True):
                _send(child, errors, target[1], pickle.dumps(args() if callable(args) else args))
            return self._results(children, target[1])
        except BaseException:
            self.close(kill=True)
            raise

    def _results(self, children: list[tuple[subprocess.Popen[bytes], IO[bytes]]], name: str) -> list[Any]:
        """The children's results, read as each comes: a child that dies (or fails) is known at
        once, not after the children before it have finished their calls.

        A child stopped by a signal (``kill -STOP``) neither answers nor dies, so the wait would
        last for ever: when nothing has come for :data:`STOP_CHECK_S`, the children still owed a
        result are looked up in ``/proc``, and one seen stopped at two such looks in a row fails
        the call (:func:`_stopped`). No time limit: a child that runs is waited on however long.
        A result is read as it arrives, without blocking (a frame: its length, then its pickle), so
        a child stopped halfway through writing one is caught by the same looks."""
        results: list[Any] = [None] * len(children)
        frames = [bytearray() for _ in children]  # what has come of each child's frame so far
        stopped: set[int] = set()  # children seen stopped at the last look
        with selectors.DefaultSelector() as waiting:  # not select(): descriptors may pass 1024
            for k, (child, _) in enumerate(children):
                assert child.stdout is not None
                waiting.register(child.stdout.fileno(), selectors.EVENT_READ, k)
            while waiting.get_map():
                ready = waiting.select(STOP_CHECK_S)  # a result's bytes, or the output's end
                for key, _ in ready:
                    k, frame = key.data, frames[key.data]
                    child, errors = children[k]
                    chunk = os.read(key.fd, _frame_missing(frame))
                    if not chunk:
                        raise _ended(child, errors, name)
                    frame += chunk
                    if _frame_missing(frame) == 0:
                        waiting.unregister(key.fd)
                        results[k] = _unframe(frame)
                if not ready:
                    owed = [key.data for key in waiting.get_map().values()]
                    seen = {k for k in owed if _state(children[k][0].pid) == "T"}
                    if held := seen & stopped:
                        raise _stopped(children[min(held)][0], name)
                    stopped = seen
        return results

    def close(self, *, kill: bool = False) -> None:
        """End the children: stdin closed, so they exit once idle (``kill``: at once, after a failure)."""
        for child, _ in self._children:
            if kill and child.poll() is None:
                child.kill()
            if child.stdin is not None and not child.stdin.closed:
                with contextlib.suppress(OSError):  # a child that died: its pipe is broken
                    child.stdin.close()
        for child, errors in self._children:
            try:
                child.wait(timeout=10)  # an idle child exits at once on end of input
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()
            errors.close()
        self._children = []


def run_in_processes(function: Callable[..., Any], calls: Sequence[Call]) -> list[Any]:
    """``[function(*args) for args in calls]``, each call in a process of its own, all at once
    (one round of :class:`Processes`, with its rules)."""
    with Processes(len(calls)) as processes:
        return processes.map(function, calls)


def _send(child: subprocess.Popen[bytes], errors: IO[bytes], name: str, data: bytes) -> None:
    """Write ``data`` to a child's stdin; a child that is gone raises as one that ends without a result."""
    assert child.stdin is not None
    try:
        child.stdin.write(data)
        child.stdin.flush()
    except BrokenPipeError:
        raise _ended(child, errors, name) from None


def _ended(child: subprocess.Popen[bytes], errors: IO[bytes], name: str) -> RuntimeError:
    """The error for a child that ended without a result: how it ended, then its stderr's end."""
    child.wait()
    errors.seek(0)
    tail = errors.read().decode(errors="replace")[-2000:]
    code = child.returncode
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:  # a real-time signal: no name
            how = f"was killed by signal {-code}"
        if -code == signal.SIGKILL:  # nobody here sends it: an operator, or the kernel out of memory
            how += (
                " (as the kernel does when memory runs out: give planning more memory or fewer"
                " scan_processes)"
            )
        how += "; plan again"
    else:
        how = f"exited {code}"
    return RuntimeError(f"a planning process ({name}) {how}\n{tail}".rstrip("\n"))


def _state(pid: int) -> str | None:
    """A process's state letter from ``/proc/<pid>/stat`` (``T``: stopped by a signal; ``t``:
    stopped by a debugger that traces it), or None where that cannot be read (not Linux, gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()  # after "<pid> (<name>)": a name may hold ") "
    except OSError:
        return None
    return fields[0].decode() if fields else None


def _stopped(child: subprocess.Popen[bytes], name: str) -> RuntimeError:
    """The error for a child stopped by a signal: it would never answer, so the call ends.

    Only ``T``: a stop by ``SIGSTOP`` (or ``SIGTSTP``, ``SIGTTIN``, ``SIGTTOU``) that nobody has
    ended. A stop seen once may be a ``kill -CONT`` (the shell's ``fg`` after Ctrl-Z stopped the
    planner with its children) on its way, so it takes two looks in a row; a debugger's stop
    (``t``) is the debugger's to end, and is waited on."""
    return RuntimeError(
        f"a planning process ({name}, PID {child.pid}) was stopped by a signal (SIGSTOP or SIGTSTP) "
        "and would never finish, so the plan was ended: plan again and let its processes run (kill "
        "-CONT resumes a stopped one)"
    )


#: a result frame's header: the length of the pickle that follows
_LENGTH_BYTES = 8
#: the most bytes read from a child's output at once
_READ_BYTES = 1 << 20


def _frame_missing(frame: bytearray) -> int:
    """How many more bytes a result frame needs (at most :data:`_READ_BYTES`); 0 once complete."""
    if len(frame) < _LENGTH_BYTES:
        return _LENGTH_BYTES - len(frame)
    size = _LENGTH_BYTES + int.from_bytes(frame[:_LENGTH_BYTES], "big")
    return min(size - len(frame), _READ_BYTES)


def _unframe(frame: bytearray) -> Any:
    """A complete frame's result; a child's error (:class:`_Raised`) is raised as itself."""
    result = pickle.loads(memoryview(frame)[_LENGTH_BYTES:])
    if isinstance(result, _Raised):
        raise result.error
    return result


class _Raised:
    """A child's error to raise again in the parent (:func:`_child`)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when the thread that started it ends (Linux only)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request took effect, its call perhaps in the pipe
        os._exit(1)


def _child(parent: int) -> None:
    """The child's side: for each function named on stdin, read its arguments, write its result
    to stdout; until stdin ends. An ``OSError`` or :class:`DeadlineBatchError` goes back as the
    result (:class:`_Raised`), its traceback to stderr."""
    _die_with_parent(parent)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            module, name = pickle.load(stdin)
        except EOFError:
            return
        function = getattr(importlib.import_module(module), name)
        args = pickle.load(stdin)
        try:
            result = function(*args)
        except (OSError, DeadlineBatchError) as exc:
            with contextlib.suppress(OSError):  # stderr's file may be on the disk that is full
                traceback.print_exc()
            result = _Raised(exc)
        data = pickle.dumps(result)
        stdout.write(len(data).to_bytes(_LENGTH_BYTES, "big"))
        stdout.write(data)
        stdout.flush()
