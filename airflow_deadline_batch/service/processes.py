"""Run planning's CPU-bound steps on several cores, in fresh Python processes.

Not ``multiprocessing``: its ``spawn`` start method runs the caller's ``__main__`` script again in
every child (a script without an ``if __name__ == "__main__"`` guard plans again there and fails;
Airflow's entry point imports Airflow in each), and ``fork`` copies a process that may have other
threads running (the planner hashes the input on one). Each child here is ``python -c`` that
imports only the function's module, reads its arguments as a pickle on stdin and writes the
result as a pickle on stdout; the parent's ``sys.path`` goes first, so what imports here
imports there. The function's module is imported before the arguments are read, so arguments
that take a while to compute (a callable in ``calls``) are computed while the children start.
"""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import IO, Any

__all__ = ["run_in_processes"]

_BOOT = (
    "import pickle, sys; sys.path[:0] = pickle.load(sys.stdin.buffer); "
    "from airflow_deadline_batch.service.processes import _child; _child()"
)


def run_in_processes(
    function: Callable[..., Any], calls: Sequence[tuple[Any, ...] | Callable[[], tuple[Any, ...]]]
) -> list[Any]:
    """``[function(*args) for args in calls]``, each call in a process of its own, all at once.

    ``function`` must be a module-level function; arguments and results must pickle. An item of
    ``calls`` may be a callable returning the arguments: the callables are called in order once
    every child has started (while they import), each child then gets its arguments. A child
    that fails raises ``RuntimeError`` with the end of its stderr (its traceback); the other
    children are then stopped.
    """
    target = (function.__module__, function.__qualname__)
    children: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []
    try:
        for _ in calls:
            stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed below; a file, so no pipe fills up
            child = subprocess.Popen(
                [sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
            )
            children.append((child, stderr))
            assert child.stdin is not None
            child.stdin.write(pickle.dumps(list(sys.path)) + pickle.dumps(target))
            child.stdin.flush()
        for (child, _), args in zip(children, calls, strict=True):
            assert child.stdin is not None
            with child.stdin:
                child.stdin.write(pickle.dumps(args() if callable(args) else args))
        results = []
        for child, errors in children:
            assert child.stdout is not None
            with child.stdout:
                out = child.stdout.read()
            if child.wait() != 0:
                errors.seek(0)
                tail = errors.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"a planning process ({target[1]}) exited {child.returncode}:\n{tail}")
            results.append(pickle.loads(out))
        return results
    finally:
        for child, errors in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            errors.close()


def _child() -> None:
    """The child's side: call the function named on stdin, write its result to stdout."""
    module, name = pickle.load(sys.stdin.buffer)
    function = getattr(importlib.import_module(module), name)
    args = pickle.load(sys.stdin.buffer)
    sys.stdout.buffer.write(pickle.dumps(function(*args)))
    sys.stdout.buffer.flush()
