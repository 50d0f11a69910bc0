"""A hostile user against ``deadline-batch`` (docs/design.md §8): garbage arguments, files that are
not files, credentials in URLs, a reader that closes the pipe. Every case ends in the contract's
exit code and one line on stderr naming the fix; nothing is created for a refused command.

The cases run ``cli.main`` in this process (same code, streams and exit code as the console
script); the closed pipe needs a real process and a real pipe.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch import cli
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import CliResult, assert_usage_error, cli_argv, cli_env
from tests.helpers.inputs import mixed_input
from tests.helpers.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SECRET = "s3cr3t-pw"


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    return mixed_input(20, seed=3, bad_fraction=0.0).write(tmp_path / "in.jsonl")


def _trace(tmp_path: Path, name: str, content: object) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else orjson.dumps(content))
    return str(path)


def _simulate(trace: str, *options: str) -> list[str]:
    return ["simulate", "--trace", trace, "--work-hours", "1", "--deadline-hours", "2", *options]


def _good_trace(t: Path) -> str:
    return _trace(t, "good.json", {"metadata": {"gap_seconds": 300}, "data": [1, 0, 1]})


def _fifo(tmp_path: Path) -> str:
    """A named pipe no one writes to: reading it would block for ever."""
    path = tmp_path / "pools.fifo"
    os.mkfifo(path)
    return str(path)


#: each case: (arguments from the sample input and tmp_path, what the one stderr line must say)
CASES: dict[str, tuple[Callable[[Path, Path], list[str]], str]] = {
    # before: read whole into memory (killed for memory), blocked for ever, or exit 4 with the OS error
    "pools is /dev/zero": (
        lambda s, t: ["plan", str(s), "--deadline", "+1h", "--pools", "/dev/zero"],
        "not a regular file",
    ),
    "pools is a FIFO": (lambda s, t: ["plan", str(s), "--deadline", "+1h", "--pools", _fifo(t)], "FIFO"),
    "pools is a directory": (
        lambda s, t: ["plan", str(s), "--deadline", "+1h", "--pools", str(t)],
        "is a directory",
    ),
    # before: exit 4, OverflowError from deep in planning
    "max tokens past int64": (
        lambda s, t: ["plan", str(s), "--deadline", "+1h", "--max-tokens", str(2**70)],
        "--max-tokens",
    ),
    # before: an empty value was the default (an unset shell variable ran a job in another store)
    "empty store": (
        lambda s, t: ["run", str(s), "--deadline", "+1h", "--engine", "echo", "--store", ""],
        "--store is empty",
    ),
    "empty tenant": (lambda s, t: ["plan", str(s), "--deadline", "+1h", "--tenant", ""], "--tenant is empty"),
    "empty input": (lambda s, t: ["plan", "", "--deadline", "+1h"], "INPUT is empty"),
    # before: every attempt lost its microsecond lease between heartbeats and was relaunched until
    # the deadline
    "lease ttl of a microsecond": (
        lambda s, t: [
            "run",
            str(s),
            "--deadline",
            "+2m",
            "--engine",
            "echo",
            "--store",
            f"sqlite:///{t}/s.db",
            "--output",
            str(t / "out"),
            "--lease-ttl",
            "1e-6",
        ],
        "--lease-ttl must be a number of seconds >= 1",
    ),  # fmt: skip
    # before: "max_invalid_fraction must be between 0 and 1", the planner's field, not the option
    "invalid fraction above one": (
        lambda s, t: ["plan", str(s), "--deadline", "+1h", "--max-invalid-fraction", "7"],
        "--max-invalid-fraction must be between 0 and 1",
    ),
    # before: the job was recorded, then every worker refused its --grace past a day and the run
    # ended "configuration error: worker exited 1 without saying why"
    "preempt notice past a day": (
        lambda s, t: [
            "run",
            str(s),
            "--deadline",
            "+1h",
            "--engine",
            "echo",
            "--store",
            f"sqlite:///{t}/s.db",
            "--output",
            str(t / "out"),
            "--preempt-notice",
            "100000",
        ],
        "--preempt-notice must be a number of seconds",
    ),  # fmt: skip
    # before: exit 4 with the URL parser's ValueError, or SQLite's "unable to open database file"
    "status store port not a number": (
        lambda s, t: ["status", "j-x", "--store", f"postgresql://u:{SECRET}@localhost:abc/db"],
        "fix --store",
    ),
    # before: run's workers each opened an empty store of their own and every try failed until the
    # deadline (a transient failure each: "no such table"); quota set printed the quota and lost it
    "run store in memory": (
        lambda s, t: [
            "run",
            str(s),
            "--deadline",
            "+2m",
            "--engine",
            "echo",
            "--store",
            "sqlite://",
            "--output",
            str(t / "out"),
        ],
        "is in memory",
    ),  # fmt: skip
    "quota set store in memory": (
        lambda s, t: ["quota", "set", "night", "--spot-gpus", "1", "--store", "sqlite:///:memory:"],
        "is in memory",
    ),
    # before: "nothing settled", exit 0, from a store made empty for the command
    "usage store in memory": (lambda s, t: ["usage", "--store", "sqlite://"], "is in memory"),
    # before: argparse's line carried the escape sequence to the terminal as it was
    "unknown option holding an escape": (lambda s, t: ["status", "j-x", "--x\x1b[2J"], "--x\\u001b[2J"),
    "status store is a directory": (
        lambda s, t: ["status", "j-x", "--store", f"sqlite:///{t}"],
        "no manifest store",
    ),
    # before: the password was printed as given
    "input URL with a password": (
        lambda s, t: ["plan", f"https://u:{SECRET}@example.com/in.jsonl", "--deadline", "+1h"],
        "u:***@",
    ),
    "output URL with a password": (
        lambda s, t: [
            "run",
            str(s),
            "--deadline",
            "+1h",
            "--engine",
            "echo",
            "--output",
            f"https://u:{SECRET}@example.com/out",
        ],
        "u:***@",
    ),  # fmt: skip
    # before: exit 4 (NaN or infinity turned into a tick count) or exit 0 on a misread trace
    "simulate nan work": (lambda s, t: _simulate(_good_trace(t), "--work-hours", "nan"), "--work-hours nan"),
    "simulate inf shard": (
        lambda s, t: _simulate(_good_trace(t), "--shard-hours", "inf"),
        "--shard-hours inf",
    ),
    "trace gap nan": (
        lambda s, t: _simulate(_trace(t, "g.json", {"metadata": {"gap_seconds": "nan"}, "data": [1]})),
        "gap_seconds",
    ),
    "trace gap below a second": (
        lambda s, t: _simulate(_trace(t, "g.json", {"metadata": {"gap_seconds": 1e-300}, "data": [1]})),
        "gap_seconds",
    ),
    "trace data a string": (
        lambda s, t: _simulate(_trace(t, "d.json", {"metadata": {"gap_seconds": 300}, "data": "1011"})),
        "whole numbers",
    ),
    "trace data fractions": (
        lambda s, t: _simulate(_trace(t, "d.json", {"metadata": {"gap_seconds": 300}, "data": [1.5, True]})),
        "whole numbers",
    ),
    "trace is a directory": (lambda s, t: _simulate(str(t)), "directory"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_garbage_is_refused_with_exit_2_and_one_line_naming_the_fix(
    case: str, sample: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ADB_STORE_URL", raising=False)
    monkeypatch.delenv("ADB_OUTPUT_URI", raising=False)
    build, says = CASES[case]
    args = build(sample, tmp_path)
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse exits by itself
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    result = CliResult(tuple(args), code, captured.out, captured.err)
    assert_usage_error(result)
    assert says in captured.err, result.describe()
    assert SECRET not in captured.out + captured.err, "a password was printed"
    assert not (tmp_path / cli.DEFAULT_HOME).exists(), "a refused command created the default store"


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("postgresql://u:p@ss@db:5432/x: refused", "postgresql://u:***@db:5432/x: refused"),
        ("s3://bucket/key:1@2 and https://u:pw@h/p?q=a@b", "s3://bucket/key:1@2 and https://u:***@h/p?q=a@b"),
        # before: "sqlite://x.db):***@h/db", the password running on to the next URL's "@"
        ("sqlite://x.db): use postgresql://u:pw@h/db", "sqlite://x.db): use postgresql://u:***@h/db"),
    ],
)
def test_mask_url_hides_a_password_holding_an_at_sign(text: str, masked: str) -> None:
    # before: the mask stopped at the first "@", printing "ss@db" of the password "p@ss"
    assert cli.mask_url(text) == masked


def test_a_closed_stdout_ends_the_command_with_its_own_code_and_no_error(tmp_path: Path) -> None:
    """``deadline-batch ... | head -1``: the reader went away; the command still did its work."""
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    read, write = os.pipe()
    os.close(read)  # no reader at all: the command's first write to stdout fails with EPIPE
    try:
        proc = subprocess.run(
            cli_argv("quota", "set", "night", "--spot-gpus", "3", "--store", store_url),
            cwd=tmp_path, env=cli_env(), stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        os.close(write)
    # before: exit 4 and "deadline-batch: error: BrokenPipeError: [Errno 32] Broken pipe"
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)
    store = ManifestStore.open(store_url, migrate=True)
    try:
        assert [(q.tenant, q.spot_gpus) for q in store.list_quotas()] == [("night", 3)]
    finally:
        store.close()


@pytest.fixture(scope="module")
def completed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    """One small completed job: (job ID, store URL, folder)."""
    root = tmp_path_factory.mktemp("completed")
    path = mixed_input(12, seed=5, bad_fraction=0.0).write(root / "in.jsonl")
    store_url = f"sqlite:///{root / 'store.db'}"
    args = ["run", str(path), "--deadline", "+1h", "--engine", "echo", "--workers", "1", "--store", store_url,
            "--output", str(root / "out"), "--json"]  # fmt: skip
    proc = subprocess.run(
        cli_argv(*args), cwd=root, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return orjson.loads(proc.stdout.splitlines()[-1])["job_id"], store_url, root


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> CliResult:
    code = cli.main(args)
    captured = capsys.readouterr()
    return CliResult(tuple(args), code, captured.out, captured.err)


def test_cancel_of_a_completed_job_is_a_usage_error_that_keeps_it_completed(
    completed: tuple[str, str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    job_id, store_url, _ = completed
    # before: exit 4 ("cannot go from completed to cancelled"), the code of a job without its manifest
    result = _main(["cancel", job_id, "--store", store_url], capsys)
    assert_usage_error(result)
    assert "already ended completed" in result.stderr and "nothing to cancel" in result.stderr, (
        result.describe()
    )
    assert _main(["verify", job_id, "--store", store_url], capsys).code == 0


def test_a_cancel_reason_cannot_drive_the_terminal_of_whoever_reads_the_status(
    sample: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(store_url)
    try:
        request = PlanRequest(
            input_uri=str(sample), deadline=dt.datetime(2030, 1, 1, tzinfo=dt.UTC),
            output_uri=str(tmp_path / "out"), engine="echo", pools=default_local_pools("echo"), workers=1,
        )  # fmt: skip
        job_id = plan_job(store, request).job_id
    finally:
        store.close()
    reason = "oops\x1b]0;pwned\x07\x1b[2J\r\x9b"  # retitle the window, clear the screen
    cancel = _main(["cancel", job_id, "--no-publish", "--reason", reason, "--store", store_url], capsys)
    assert cancel.code == 0, cancel.describe()
    text = _main(["status", job_id, "--store", store_url], capsys)
    as_json = _main(["status", job_id, "--store", store_url, "--json"], capsys)
    # before: the reason's escape sequences reached the terminal as they are
    assert "oops\\u001b]0;pwned\\u0007\\u001b[2J\\u000d\\u009b" in text.stdout, text.describe()
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text.stdout + as_json.stdout), text.describe()
    assert orjson.loads(as_json.stdout)["error"] == reason, as_json.describe()


def test_a_sqlite_url_with_a_query_reaches_the_store_run_used(
    completed: tuple[str, str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    job_id, store_url, _ = completed
    # before: "no manifest store at sqlite:///.../store.db?timeout=5: pass --store with the URL the
    # job was run with", the query taken as part of the file name (run takes the same URL)
    result = _main(["verify", job_id, "--store", f"{store_url}?timeout=5"], capsys)
    assert result.code == 0, result.describe()


def test_export_to_an_output_that_is_a_file_is_a_usage_error(
    completed: tuple[str, str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    job_id, store_url, root = completed
    target = root / "a-file"
    target.write_bytes(b"keep me\n")
    # before: exit 4 ("cannot delete .../export.json: Not a directory"), as if the job no longer verified
    result = _main(["export", job_id, "--store", store_url, "--output", str(target)], capsys)
    assert_usage_error(result)
    assert "--output" in result.stderr, result.describe()
    assert target.read_bytes() == b"keep me\n"


def test_export_stopped_while_its_object_store_does_not_answer_says_what_is_left(
    completed: tuple[str, str, Path], tmp_path: Path
) -> None:
    """SIGINT to ``export`` held on an S3 endpoint that takes the request and never answers."""
    job_id, store_url, root = completed
    requested = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def hold() -> None:  # take one request, answer nothing until the test ends
            conn, _ = server.accept()
            with conn:
                if conn.recv(65536):
                    requested.set()
                conn.recv(65536)  # returns once the command's side closes

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
        proc = subprocess.Popen(
            cli_argv("export", job_id, "--store", store_url, "--output", "s3://bucket/exp"),
            cwd=tmp_path, env=cli_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_for(
                lambda: requested.is_set() or proc.poll() is not None,
                timeout_s=60,
                what="the export's request",
            )
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
        holder.join(timeout=10)
    # before: "no job was recorded; rerun the command to start it"
    assert proc.returncode == 130, stderr
    assert stderr == (
        "deadline-batch: export stopped by SIGINT; s3://bucket/exp holds a whole export only if its "
        "export.json is there; rerunning the command is safe: it writes the files again\n"
    )
