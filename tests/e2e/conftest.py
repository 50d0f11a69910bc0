"""Helpers for driving the real ``deadline-batch`` console script in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from tests.helpers.waiting import wait_for

__all__ = ["CLI", "CliResult", "assert_usage_error", "cli_argv", "cli_env", "run_cli", "wait_for"]

#: the console script installed with the package, next to the interpreter running the tests
CLI = Path(sys.executable).parent / "deadline-batch"


@dataclass(frozen=True)
class CliResult:
    """Exit code and captured output of one ``deadline-batch`` invocation."""

    args: tuple[str, ...]
    code: int
    stdout: str
    stderr: str

    def json(self) -> dict[str, Any]:
        """The last non-empty stdout line as a JSON object (the ``--json`` contract, docs/design.md §8)."""
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        assert lines, f"no stdout from {self.args}; stderr: {self.stderr[-2000:]}"
        return dict(orjson.loads(lines[-1]))

    def describe(self) -> str:
        command = f"deadline-batch {' '.join(self.args)} -> {self.code}"
        return f"{command}\nstdout: {self.stdout[-3000:]}\nstderr: {self.stderr[-3000:]}"


def cli_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment (S3 endpoint and credentials included) without store defaults."""
    env = {k: v for k, v in os.environ.items() if k not in ("ADB_STORE_URL", "ADB_OUTPUT_URI")}
    env.update(extra or {})
    return env


def cli_argv(*args: str) -> list[str]:
    return [str(CLI), *args] if CLI.exists() else [sys.executable, "-m", "airflow_deadline_batch.cli", *args]


def run_cli(*args: str, cwd: Path, env: Mapping[str, str] | None = None, timeout: float = 300) -> CliResult:
    """Run ``deadline-batch ARGS`` to its end and capture its output."""
    proc = subprocess.run(
        cli_argv(*args),
        cwd=cwd,
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return CliResult(tuple(args), proc.returncode, proc.stdout, proc.stderr)


def assert_usage_error(result: CliResult) -> None:
    """Exit 2, exactly one line on stderr that names the problem, and no traceback."""
    assert result.code == 2, result.describe()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    assert lines[0].startswith("deadline-batch"), result.describe()


def finish_runs(
    procs: Mapping[str, subprocess.Popen[str]], tmp_path: Path, *, timeout_s: float
) -> dict[str, Any]:
    """Wait for each ``deadline-batch run --json`` process (its stderr in ``tmp_path/<key>.err``),
    each must exit 0: their last JSON lines (the run summaries) by key. Any still running after a
    failure is killed."""
    summaries: dict[str, Any] = {}
    try:
        for key, proc in procs.items():
            out, _ = proc.communicate(timeout=timeout_s)
            err = (tmp_path / f"{key}.err").read_text()[-3000:]
            assert proc.returncode == 0, f"{key}: exit {proc.returncode}\n{out[-3000:]}\n{err}"
            summaries[key] = orjson.loads(out.splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return summaries
