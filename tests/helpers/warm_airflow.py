"""One Python process that runs a test module's Airflow scripts one after the other: Airflow
imported, its in-process execution API built and its metadata database migrated once, not per run.

Every run of a script in a fresh interpreter pays the same fixed cost before its first task starts
(measured: 20-25 s of a 23 s ``dag.test()`` of an input without records, on 2 cores): importing
Airflow, migrating the metadata database, and building the execution API ``dag.test()`` serves its
tasks in process (FastAPI and Cadwyn's versioned routes, on its first request). A module whose runs
share one environment (Airflow reads its configuration at import time) sends them to one
:class:`WarmAirflow` instead: each request executes a script's code as ``python -c CODE ARGS...``
would (``__name__ == "__main__"``, ``sys.argv``, ``SystemExit`` its exit status), with its output
(stdout and stderr together) cut out between two marker lines. A request that raises ends the
process after its answer, so no run inherits a broken interpreter; the next request starts a new one.
Closing its input ends it without Airflow's exit handlers, which take seconds and leave nothing a
test reads.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from typing import IO

#: read requests (``{"code", "argv"}`` JSON lines), run each, and frame its output with markers
SERVE = """
import json, os, sys, traceback
token = sys.argv[1]
for request in sys.stdin:
    request = json.loads(request)
    print(f"{token} BEGIN", flush=True)
    sys.argv = ["-c", *request["argv"]]
    broken = False
    try:
        exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code, broken = 1, True
    sys.stderr.flush()
    print(f"{token} END {code}", flush=True)
    if broken:
        break
os._exit(0)  # every answer is read: Airflow's exit handlers (seconds) would keep nothing
"""


class WarmAirflow:
    """Runs code in one long-lived interpreter started with ``env``; :meth:`close` ends it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.token = f"WARM-{uuid.uuid4().hex}"
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()

    def _start(self) -> subprocess.Popen[str]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.lines = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, self.token],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its process group: the shard workers go with it on a timeout
        )
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()
        return self.proc

    @staticmethod
    def _read(stream: IO[str] | None, lines: queue.Queue[str | None]) -> None:
        assert stream is not None
        for line in stream:
            lines.put(line)
        lines.put(None)  # the process closed its output: it ended

    def run(self, code: str, *args: str, timeout_s: float) -> tuple[int, str]:
        """Run ``code`` with ``args`` as ``python -c`` would: its exit status and its output."""
        proc = self._start()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"code": code, "argv": list(args)}) + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        output: list[str] = []
        begun = False
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close(kill=True)
                raise AssertionError(
                    f"no answer within {timeout_s:.0f} s; its output:\n" + "".join(output)[-5000:]
                ) from None
            if line is None:  # the interpreter ended before answering (killed, or crashed)
                return proc.wait(), "".join(output)
            if line.startswith(f"{self.token} BEGIN"):
                begun = True
            elif line.startswith(f"{self.token} END "):
                return int(line.split()[-1]), "".join(output)
            elif begun:
                output.append(line)

    def close(self, *, kill: bool = False) -> None:
        """End the interpreter: its input closed, then its process group killed if it lingers (at
        once with ``kill``: a run that overran its time is not waited for)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=0 if kill else 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
