"""Run planning's CPU-bound steps on several cores, in fresh Python processes.

Not ``multiprocessing``: its ``spawn`` start method runs the caller's ``__main__`` script again in
every child (a script without an ``if __name__ == "__main__"`` guard plans again there and fails;
Airflow's entry point imports Airflow in each), and ``fork`` copies a process that may have other
threads running (the planner hashes the input on one). Each child here is ``python -c`` that,
for each call, imports only the function's module, reads its arguments as a pickle on stdin and
writes the result as a pickle on stdout, until its stdin ends (:class:`Processes` keeps children
for several rounds); the parent's ``sys.path`` goes first, so what imports here imports there.
The function's module is imported before the arguments are read, so arguments that take a
while to compute (a callable in ``calls``) are computed while the children start.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import IO, Any

__all__ = ["Processes", "run_in_processes"]

_BOOT = (
    "import pickle, sys; sys.path[:0] = pickle.load(sys.stdin.buffer); "
    "from airflow_deadline_batch.service.processes import _child; _child()"
)

#: a call's arguments, or a callable that returns them (computed once every child has started)
Call = tuple[Any, ...] | Callable[[], tuple[Any, ...]]


class Processes:
    """``count`` fresh Python processes that stay alive for several rounds of calls (:meth:`map`).

    Planning scans the input's byte ranges in them, then checks the spilled IDs' partitions and
    rewrites each range without its duplicates in the same processes, so the later rounds cost
    no start-up. Use as a context manager: leaving
    it ends the children (killing any still running after a failure).
    """

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self._children: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []
        try:
            for _ in range(count):
                stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close(); a file, so no pipe fills up
                child = subprocess.Popen(
                    [sys.executable, "-c", _BOOT],
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
        ``RuntimeError`` with the end of its stderr (its traceback); the pool is then closed.
        """
        if len(calls) > len(self._children):
            raise ValueError(f"{len(calls)} calls for {len(self._children)} processes: at most one each")
        target = (function.__module__, function.__qualname__)
        children = self._children[: len(calls)]
        try:
            for child, _ in children:
                assert child.stdin is not None
                child.stdin.write(pickle.dumps(target))
                child.stdin.flush()
            for (child, _), args in zip(children, calls, strict=True):
                assert child.stdin is not None
                child.stdin.write(pickle.dumps(args() if callable(args) else args))
                child.stdin.flush()
            return [self._result(child, errors, target[1]) for child, errors in children]
        except BaseException:
            self.close(kill=True)
            raise

    @staticmethod
    def _result(child: subprocess.Popen[bytes], errors: IO[bytes], name: str) -> Any:
        assert child.stdout is not None
        try:
            return pickle.load(child.stdout)
        except EOFError:
            child.wait()
            errors.seek(0)
            tail = errors.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"a planning process ({name}) exited {child.returncode}:\n{tail}") from None

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


def _child() -> None:
    """The child's side: for each function named on stdin, read its arguments, write its result
    to stdout; until stdin ends."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            module, name = pickle.load(stdin)
        except EOFError:
            return
        function = getattr(importlib.import_module(module), name)
        args = pickle.load(stdin)
        stdout.write(pickle.dumps(function(*args)))
        stdout.flush()
