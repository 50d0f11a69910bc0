"""Planning attacked as a hostile user and a bad day would: a full disk under the spill files,
scan processes (and the planner) killed, the input changed under the plan, garbage inputs, absurd
memory budgets. Each either plans correctly or fails with one line naming the fix, leaving no
job, no process and no spill file behind (but what a SIGKILLed planner cannot clean: its spill
directory, said where it is asserted).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

import airflow_deadline_batch.service.planning as planning
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.records import ValidationLimits
from airflow_deadline_batch.exceptions import ConfigurationError, InputError
from airflow_deadline_batch.service.planning import PlanRequest, analyze_input, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "dags" / "data" / "sample_reviews.jsonl"

pytestmark = pytest.mark.timeout(300)

#: a planner in a process of its own (so it can be killed, or given a file size limit): plans
#: the input with a SQLite store and prints the error's type and message on its last line
DRIVER = """
import datetime as dt, json, resource, sys
from airflow_deadline_batch.service import planning
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.store import ManifestStore

args = json.loads(sys.argv[1])
planning.PARALLEL_MIN_BYTES = 1  # as many scan processes as asked, whatever the input's size
store = ManifestStore.open(args["store"])
store.list_jobs()  # the database file written before the file size limit, which would stop it
if args.get("fsize"):
    resource.setrlimit(resource.RLIMIT_FSIZE, (args["fsize"], args["fsize"]))
request = planning.PlanRequest(
    input_uri=args["input"],
    deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=100),
    output_uri=args["output"],
    engine="echo",
    pools=default_local_pools("echo"),
    scan_processes=args["processes"],
    max_invalid_fraction=1.0,
)
try:
    result = planning.plan_job(store, request)
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    sys.exit(1)
print(json.dumps({"job_id": result.job_id}))
"""

#: a valid line that the fast paths decline (a content part): the reference validator's pace,
#: so a scan of many takes seconds, long enough to be interrupted
SLOW_LINE = b'{"id": "r%d", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}\n'


def _request(path: Path, **overrides: Any) -> PlanRequest:
    values: dict[str, Any] = {
        "input_uri": str(path),
        "deadline": dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=100),
        "output_uri": str(path.parent / "out"),
        "engine": "echo",
        "pools": default_local_pools("echo"),
        "max_invalid_fraction": 1.0,
    }
    values.update(overrides)
    return PlanRequest(**values)


def _start_driver(tmp_path: Path, spill: Path, input_path: Path, **args: Any) -> subprocess.Popen[str]:
    spill.mkdir(exist_ok=True)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    args = {
        "store": f"sqlite:///{tmp_path / 'store.db'}",
        "input": str(input_path),
        "output": str(tmp_path / "out"),
        "processes": 1,
        **args,
    }
    return subprocess.Popen(
        [sys.executable, str(script), json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(spill)},
    )


def _start_plan_cli(input_path: Path, spill: Path, **popen: Any) -> subprocess.Popen[str]:
    """``deadline-batch plan`` of ``input_path`` in a process of its own, spilling under ``spill``,
    with a scan process per core whatever the input's size."""
    boot = (
        "import sys; from airflow_deadline_batch.service import planning; "
        "planning.PARALLEL_MIN_BYTES = 1; "
        "from airflow_deadline_batch.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", boot, "plan", str(input_path), "--deadline", "+100h"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(spill)},
        **popen,
    )


def _driver_error(driver: subprocess.Popen[str]) -> tuple[dict[str, Any], str]:
    stdout, stderr = driver.communicate(timeout=120)
    assert driver.returncode == 1, (stdout, stderr)
    return json.loads(stdout.strip().splitlines()[-1]), stderr


def _scan_processes_of(pid: int) -> list[psutil.Process]:
    """Planning's live scan processes started by ``pid`` (``python -c ... _child(...)``)."""
    found = []
    for proc in psutil.Process(pid).children():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and "_child(" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def _scanning(spill: Path) -> bool:
    """Every scan process has begun writing its range's files."""
    parts = list(spill.glob("deadline-batch-plan-*/part-*/errors"))
    return len(parts) == 2


def _jobs(tmp_path: Path) -> list[Any]:
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        return store.list_jobs()
    finally:
        store.close()


# -- 1. a full disk under the spill files -----------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2])
def test_spill_files_past_the_file_size_limit_fail_in_one_line_naming_the_fix(
    tmp_path: Path, processes: int
) -> None:
    """Bug: an ``OSError`` (one process) or "a planning process (_scan_part) exited 1" and a child's
    traceback (several); now one ``ConfigurationError`` saying where the spill goes, what it takes
    and the fix. Nothing recorded, no spill file left."""
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"".join(b'{"id": "r%d", "prompt": "x"}\n' % i for i in range(60_000)))
    spill = tmp_path / "spill"
    # a column of 60,000 int64s is 480 kB: past a 200 kB limit, below the store's own file
    driver = _start_driver(tmp_path, spill, path, processes=processes, fsize=200_000)
    error, _ = _driver_error(driver)
    assert error["error"] == "ConfigurationError"
    message = error["message"]
    assert "\n" not in message
    assert f"temporary files in {spill} ran out of room" in message
    assert "ulimit -f" in message and "60,000 lines" in message
    assert list(spill.iterdir()) == []
    assert _jobs(tmp_path) == []


def test_the_cli_says_a_full_spill_in_one_line_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"".join(b'{"id": "r%d", "prompt": "x"}\n' % i for i in range(60_000)))
    spill = tmp_path / "spill"
    spill.mkdir()
    limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)); "
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            limit + "import sys; from airflow_deadline_batch.cli import main; sys.exit(main(sys.argv[1:]))",
            "plan",
            str(path),
            "--deadline",
            "+100h",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(spill)},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("deadline-batch: error: planning ")
    assert "raise the limit (ulimit -f)" in done.stderr
    assert list(spill.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """A tmpfs of the given size in MB (read-only with ``read_only``): a disk that really fills up
    (skipped where mounting is not allowed, as for a user without root); unmounted after the test."""
    mounted: list[Path] = []

    def mount(megabytes: int, *, read_only: bool = False) -> Path:
        target = tmp_path / f"disk-{len(mounted)}"
        target.mkdir()
        options = f"size={megabytes}m" + (",ro" if read_only else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_full_disk_under_the_spill_fails_in_one_line_and_leaves_it_empty(
    tmp_path: Path, small_disk: Callable[..., Path], processes: int
) -> None:
    """Bug: ``OSError: [Errno 28] No space left on device`` (one process) or "a planning process
    (_scan_part) exited 1" with no cause at all (several: the child's traceback could not be
    written either, its stderr's file being on the full disk)."""
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"".join(b'{"id": "r%d", "prompt": "x"}\n' % i for i in range(200_000)))
    disk = small_disk(4)  # the spill takes about 13 MB
    error, _ = _driver_error(_start_driver(tmp_path, disk, path, processes=processes))
    assert error["error"] == "ConfigurationError"
    message = error["message"]
    assert "\n" not in message
    assert f"temporary files in {disk} ran out of room (No space left on device)" in message
    assert "200,000 lines: about 20 MB" in message
    assert message.endswith("free space there or set TMPDIR to a directory on a larger disk")
    assert list(disk.iterdir()) == []
    assert _jobs(tmp_path) == []


def test_a_read_only_spill_directory_fails_in_one_line_naming_tmpdir(
    tmp_path: Path, small_disk: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: a raw ``OSError: [Errno 30] Read-only file system``. (An unwritable TMPDIR set before
    the first temporary file is passed over by Python for /tmp; one that turns read-only later,
    as a remount does, is what planning meets.)"""
    path = tmp_path / "input.jsonl"
    path.write_bytes(SAMPLE.read_bytes())
    disk = small_disk(1, read_only=True)
    monkeypatch.setattr(tempfile, "tempdir", str(disk))
    with pytest.raises(ConfigurationError) as raised:
        analyze_input(_request(path))
    assert str(raised.value) == (
        f"planning cannot write its temporary files in {disk} (Read-only file system): "
        "set TMPDIR to a writable directory with room for them"
    )


def test_each_outcome_of_an_invalid_line_is_on_disk_at_most_twice(
    tmp_path: Path, small_disk: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: the scan's provisional outcomes, the rewritten ones and the joined ones were all on
    disk at the end (about 880 bytes an invalid line); each file is now deleted once copied
    (about 600), so 200,000 invalid lines plan in 145 MB."""
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"".join(b'{"id": "r%d"}\n' % i for i in range(200_000)))  # no prompt: invalid
    disk = small_disk(145)
    monkeypatch.setattr(tempfile, "tempdir", str(disk))
    analysis = analyze_input(_request(path))
    try:
        assert (analysis.work.records, analysis.work.invalid) == (0, 200_000)
        assert dict(analysis.errors_by_code) == {"invalid_record": 200_000}
    finally:
        analysis.close()
    assert list(disk.iterdir()) == []


# -- 2. processes killed ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1.6M valid lines on the reference validator's path: 800,000 a range, over 12 s of scanning
    each at 62,000 lines a second (the pace of an idle core)."""
    path = tmp_path_factory.mktemp("slow") / "input.jsonl"
    with path.open("wb") as file:
        for start in range(0, 1_600_000, 100_000):
            file.write(b"".join(SLOW_LINE % i for i in range(start, start + 100_000)))
    return path


def test_a_scan_process_killed_mid_scan_fails_the_plan_naming_the_signal(
    tmp_path: Path, slow_input: Path
) -> None:
    """Bugs: "a planning process (_scan_part) exited -9:" and nothing else, once the first range
    was scanned (results were read in order: the plan failed only after the other range's scan);
    now it names SIGKILL, who sends it and what to do, at once. The other scan process is ended,
    the spill deleted, no job."""
    spill = tmp_path / "spill"
    driver = _start_driver(tmp_path, spill, slow_input, processes=2)
    try:
        wait_for(lambda: _scanning(spill), timeout_s=60, what="both ranges being scanned")
        children = _scan_processes_of(driver.pid)
        assert len(children) == 2
        children[1].send_signal(signal.SIGKILL)
        stdout, _ = driver.communicate(timeout=8)  # the first range alone takes longer to scan
        assert driver.returncode == 1
        error = json.loads(stdout.strip().splitlines()[-1])
    finally:
        driver.kill()
        driver.wait()
    assert error["error"] == "RuntimeError"
    first_line = error["message"].splitlines()[0]
    assert first_line.startswith("a planning process (_scan_part) was killed by SIGKILL")
    assert "memory runs out" in first_line and first_line.endswith("plan again")
    assert not children[0].is_running() or children[0].status() == psutil.STATUS_ZOMBIE
    assert list(spill.iterdir()) == []
    assert _jobs(tmp_path) == []


def test_a_killed_planner_takes_its_scan_processes_with_it_and_the_next_deletes_its_spill(
    tmp_path: Path, slow_input: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bugs: a planner SIGKILLed mid-scan left its scan processes scanning on, orphaned, for the
    rest of their ranges (here tens of seconds; hours of CPU for a large input), and its spill
    directory for good. Now they die with it, and the next plan in that TMPDIR deletes the
    directory (nothing can before: the planner that owned it is gone)."""
    spill = tmp_path / "spill"
    driver = _start_driver(tmp_path, spill, slow_input, processes=2)
    try:
        wait_for(lambda: _scanning(spill), timeout_s=60, what="both ranges being scanned")
        children = _scan_processes_of(driver.pid)
        assert len(children) == 2
    finally:
        driver.kill()
        driver.communicate()

    def all_gone() -> bool:
        return not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)

    wait_for(all_gone, timeout_s=5, what="the orphaned scan processes to end")
    [abandoned] = spill.iterdir()
    assert abandoned.name.startswith("deadline-batch-plan-") and any(abandoned.glob("part-*/*"))
    monkeypatch.setattr(tempfile, "tempdir", str(spill))
    path = tmp_path / "next.jsonl"
    path.write_bytes(SAMPLE.read_bytes())
    analyze_input(_request(path)).close()
    assert list(spill.iterdir()) == []


def test_a_live_planner_s_spill_is_left_alone_by_the_next(
    tmp_path: Path, slow_input: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards the sweep: only a directory whose owner's lock is free is deleted, never a live one."""
    spill = tmp_path / "spill"
    driver = _start_driver(tmp_path, spill, slow_input, processes=2)
    try:
        wait_for(lambda: _scanning(spill), timeout_s=60, what="both ranges being scanned")
        [live] = spill.iterdir()
        monkeypatch.setattr(tempfile, "tempdir", str(spill))
        path = tmp_path / "next.jsonl"
        path.write_bytes(SAMPLE.read_bytes())
        analyze_input(_request(path)).close()
        assert list(spill.iterdir()) == [live]
        assert (live / "owner.lock").exists() and any(live.glob("part-*/*"))
        assert driver.poll() is None
    finally:
        driver.kill()
        driver.communicate()


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_the_cli_stopped_mid_scan_ends_its_scan_processes_and_deletes_its_spill(
    tmp_path: Path, slow_input: Path, name: str, code: int
) -> None:
    """Held: ``deadline-batch plan`` stopped by SIGTERM or SIGINT while its processes scan says
    so in one line, with its exit code; no process and no spill file stay."""
    spill = tmp_path / "spill"
    spill.mkdir()
    cli = _start_plan_cli(slow_input, spill)
    try:
        wait_for(lambda: any(spill.glob("*/part-*/errors")), timeout_s=60, what="the scan to begin")
        children = _scan_processes_of(cli.pid)
        cli.send_signal(signal.Signals[name])
        _, stderr = cli.communicate(timeout=60)
    finally:
        cli.kill()
        cli.wait()
    assert cli.returncode == code
    assert stderr == f"deadline-batch: plan stopped by {name}; it changes nothing; rerun it\n"
    # one process per core: none on a one-core machine
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    assert list(spill.iterdir()) == []


def test_a_scan_process_killed_between_rounds_fails_the_plan_naming_the_signal(tmp_path: Path) -> None:
    """Bug: a scan process gone when the next round (the duplicate check) is sent to it raised a
    bare ``BrokenPipeError``; now the same error as a death mid-call."""
    from airflow_deadline_batch.service.processes import Processes

    with Processes(2) as workers:
        pids = workers.map(os.getpid, [(), ()])
        os.kill(pids[1], signal.SIGKILL)
        dead = psutil.Process(pids[1])  # not reaped here: the pool must see how it ended
        wait_for(lambda: dead.status() == psutil.STATUS_ZOMBIE, timeout_s=30, what="the child to die")
        with pytest.raises(RuntimeError, match=r"^a planning process \(getpid\) was killed by SIGKILL"):
            workers.map(os.getpid, [(), ()])


def _stopped(proc: psutil.Process) -> bool:
    return proc.status() == psutil.STATUS_STOPPED


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_scan_process_stopped_mid_scan_fails_the_plan_naming_it(tmp_path: Path, slow_input: Path) -> None:
    """Bug: a scan process stopped with SIGSTOP neither answered nor died, and the plan waited for
    it for ever. Now the plan fails in one line naming its PID and the fix, within a couple of
    the wait's looks (a second each) of the stop; both scan processes are ended, the spill deleted,
    no job."""
    spill = tmp_path / "spill"
    driver = _start_driver(tmp_path, spill, slow_input, processes=2)
    try:
        wait_for(lambda: _scanning(spill), timeout_s=60, what="both ranges being scanned")
        children = _scan_processes_of(driver.pid)
        assert len(children) == 2
        children[1].send_signal(signal.SIGSTOP)
        stdout, _ = driver.communicate(timeout=60)  # before: no end
        assert driver.returncode == 1
        error = json.loads(stdout.strip().splitlines()[-1])
    finally:
        driver.kill()
        driver.wait()
    assert error == {
        "error": "RuntimeError",
        "message": f"a planning process (_scan_part, PID {children[1].pid}) was stopped by a signal "
        "(SIGSTOP or SIGTSTP) and would never finish, so the plan was ended: plan again and let its "
        "processes run (kill -CONT resumes a stopped one)",
    }
    assert all(_gone(c.pid) for c in children)
    assert list(spill.iterdir()) == []
    assert _jobs(tmp_path) == []


@pytest.mark.timeout(60)
def test_a_scan_process_stopped_between_rounds_fails_the_next_round(tmp_path: Path) -> None:
    """Bug: as above, for a process stopped while idle (between the scan and the duplicate check)."""
    from airflow_deadline_batch.service.processes import Processes

    with Processes(2) as workers:
        pids = workers.map(os.getpid, [(), ()])
        os.kill(pids[1], signal.SIGSTOP)
        wait_for(lambda: _stopped(psutil.Process(pids[1])), timeout_s=30, what="the child to stop")
        with pytest.raises(RuntimeError, match=rf"^a planning process \(getpid, PID {pids[1]}\) was stopped"):
            workers.map(os.getpid, [(), ()])
    assert _gone(pids[1]) and _gone(pids[0])


def test_the_cli_suspended_and_resumed_with_its_scan_processes_plans_on(
    tmp_path: Path, slow_input: Path
) -> None:
    """Held: the stop check fails only a child left stopped, not a job stopped and continued as a
    whole (Ctrl-Z, then ``fg``: a stop, then SIGCONT, to the CLI's process group, the planner and its
    scan processes) while they scan: the plan goes on to its report. SIGSTOP stands for a terminal's
    SIGTSTP, which the kernel drops for a process group without one."""
    spill = tmp_path / "spill"
    spill.mkdir()
    cli = _start_plan_cli(slow_input, spill, cwd=tmp_path, start_new_session=True)  # a shell's job
    try:
        wait_for(lambda: any(spill.glob("*/part-*/errors")), timeout_s=60, what="the scan to begin")
        group = [psutil.Process(cli.pid), *_scan_processes_of(cli.pid)]
        os.killpg(cli.pid, signal.SIGSTOP)
        wait_for(lambda: all(_stopped(p) for p in group), timeout_s=30, what="the job to stop")
        time.sleep(3)  # the case itself, not a wait: a job left stopped for longer than two looks
        os.killpg(cli.pid, signal.SIGCONT)
        stdout, stderr = cli.communicate(timeout=240)
    finally:
        cli.kill()
        cli.wait()
    assert cli.returncode == 0, stderr
    assert "work: 1,600,000 valid records" in stdout
    assert list(spill.iterdir()) == []


# -- 3. the input changed under the plan ------------------------------------------------------------


def _plan_changing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: Any,
    *,
    after: str = "analyze_input",
    **overrides: Any,
) -> Any:
    """Plan a copy of the sample, ``change(path)`` once planning's step ``after`` is done (by
    default the validation, before the hashing)."""
    path = tmp_path / "input.jsonl"
    path.write_bytes(SAMPLE.read_bytes())
    step = getattr(planning, after)

    def step_then_change(*args: Any, **kwargs: Any) -> Any:
        done = step(*args, **kwargs)
        change(path)
        return done

    monkeypatch.setattr(planning, after, step_then_change)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        with pytest.raises(InputError, match="changed while it was being planned"):
            plan_job(store, _request(path, **overrides))
        assert store.list_jobs() == []
    finally:
        store.close()


def test_a_same_size_rewrite_that_sets_the_mtime_back_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: size, inode and mtime were all the change check read, so a rewrite in place that set
    the mtime back (``touch -r``, ``rsync --times --inplace``) planned a job whose shard hashes
    were of bytes never validated; the ctime, which nobody can set, now catches it."""

    def rewrite_keeping_mtime(path: Path) -> None:
        before = path.stat()
        data = path.read_bytes().replace(b"review-0003", b"review-0004", 1)  # a new duplicate
        with path.open("r+b") as file:
            file.write(data)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = path.stat()
        assert (after.st_size, after.st_ino, after.st_mtime_ns) == (
            before.st_size,
            before.st_ino,
            before.st_mtime_ns,
        )

    _plan_changing(tmp_path, monkeypatch, rewrite_keeping_mtime)


def _append(path: Path) -> None:
    with path.open("ab") as file:
        file.write(b'{"id": "late", "prompt": "appended after validation"}\n')


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _replace(path: Path) -> None:
    fresh = path.with_suffix(".new")
    fresh.write_bytes(path.read_bytes())
    os.replace(fresh, path)


@pytest.mark.parametrize("change", [_append, _truncate, _replace], ids=["append", "truncate", "replace"])
@pytest.mark.parametrize("processes", [1, 3])
def test_an_input_appended_truncated_or_replaced_after_validation_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any, processes: int
) -> None:
    """Held: size and inode changes were caught, also with several scan processes."""
    monkeypatch.setattr(planning, "PARALLEL_MIN_BYTES", 1)
    _plan_changing(tmp_path, monkeypatch, change, scan_processes=processes)


@pytest.mark.parametrize("change", [_append, _truncate, _replace], ids=["append", "truncate", "replace"])
def test_an_input_changed_between_cutting_its_ranges_and_scanning_them_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any
) -> None:
    """Held: ranges cut from the old file and scanned in the new (a range past the end of a
    truncated file reads nothing) plan nothing, and end in the same one-line refusal."""
    monkeypatch.setattr(planning, "PARALLEL_MIN_BYTES", 1)
    _plan_changing(tmp_path, monkeypatch, change, after="_line_ranges", scan_processes=3)


# -- 4. garbage -------------------------------------------------------------------------------------


def _a_directory(tmp_path: Path) -> Path:
    (tmp_path / "in").mkdir()
    return tmp_path / "in"


def _a_symlink_loop(tmp_path: Path) -> Path:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    return tmp_path / "a"


@pytest.mark.parametrize(
    ("make", "said"),
    [
        # Bug: "input ... does not exist" for a directory that exists
        (_a_directory, r"is a directory: give the path of a JSON Lines file in it$"),
        # Bug: a raw ``OSError: [Errno 40] Too many levels of symbolic links`` (exit 4 from the CLI)
        (_a_symlink_loop, r"is a loop of symbolic links: give the path of a JSON Lines file$"),
    ],
    ids=["directory", "symlink loop"],
)
def test_what_is_no_file_is_refused_as_what_it_is(
    tmp_path: Path, make: Callable[[Path], Path], said: str
) -> None:
    path = make(tmp_path)
    with pytest.raises(InputError, match=said):
        analyze_input(_request(path))
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    with pytest.raises(InputError, match=said):
        plan_job(store, _request(path))
    assert store.list_jobs() == []
    store.close()


def test_the_cli_refuses_a_symlink_loop_in_one_line(tmp_path: Path) -> None:
    """Bug: ``deadline-batch plan`` resolved the path first, and ``Path.resolve`` raised
    ``RuntimeError: Symlink loop`` (exit 4) before planning could say what it is."""
    loop = _a_symlink_loop(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "airflow_deadline_batch.cli",
            "plan",
            str(loop),
            "--deadline",
            "+1h",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,  # its default store and output go here
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "is a loop of symbolic links" in done.stderr


@pytest.mark.timeout(60)
def test_a_fifo_and_a_device_are_refused_without_blocking(tmp_path: Path) -> None:
    """Held: never opened for a blocking read (a FIFO without a writer would hang it)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(ConfigurationError, match="is not a regular file"):
            analyze_input(_request(path))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("processes", [1, 3])
def test_a_fifo_swapped_in_after_the_check_is_refused_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int
) -> None:
    """Bug (several processes): the ranges, the newline counts and the scans open the path anew
    with a plain ``open``; a FIFO put in the input's place once it was checked blocked the plan
    for ever. Now every open refuses what is not a regular file, without blocking."""
    monkeypatch.setattr(planning, "PARALLEL_MIN_BYTES", 1)
    path = tmp_path / "input.jsonl"
    path.write_bytes(SAMPLE.read_bytes())
    count = planning._scan_processes

    def count_then_swap(*args: Any) -> int:
        wanted = count(*args)
        path.unlink()
        os.mkfifo(path)
        return wanted

    monkeypatch.setattr(planning, "_scan_processes", count_then_swap)
    with pytest.raises(ConfigurationError, match="is not a regular file"):
        analyze_input(_request(path, scan_processes=processes))


@pytest.mark.parametrize("data", [b"", b"\n\n\r\n  \n"], ids=["empty", "blank-lines"])
def test_an_input_without_records_plans_an_empty_job(tmp_path: Path, data: bytes) -> None:
    """Held (a choice, not an accident): nothing to validate, nothing to run, no shard; `run`
    then publishes an empty manifest."""
    path = tmp_path / "input.jsonl"
    path.write_bytes(data)
    analysis = analyze_input(_request(path))
    try:
        assert (analysis.work.records, analysis.work.invalid, analysis.cuts) == (0, 0, ())
        assert analysis.total_lines == data.count(b"\n")
    finally:
        analysis.close()


#: one block of garbage: (line bytes, the error code its line must get; None: a record, "" blank)
def _garbage_block(k: int) -> list[tuple[bytes, str | None]]:
    return [
        (b'\xef\xbb\xbf{"id": "bom-%d", "prompt": "a BOM"}\r\n' % k, None if k == 0 else "invalid_json"),
        (b'{"id": "ok-%d", "prompt": "plain"}\n' % k, None),
        (b"\x00\x00\x00\n", "invalid_json"),
        (b'{"id": "nul-%d", "prompt": "x\x00y"}\n' % k, "invalid_json"),
        (b'{"id": "utf-%d", "prompt": "\xff\xfe"}\n' % k, "invalid_encoding"),
        (b'{"id": "long-%d", "prompt": "' % k + b"z" * 400 + b'"}\n', "line_too_long"),
        (b"\n", ""),
        (b"\r\n", ""),
        (b'{"id": "crlf-%d", "prompt": "windows"}\r\n' % k, None),
        (b'{"id": "ok-%d", "prompt": "again"}\n' % k, "duplicate_id"),
        (b'{"id": "cr-%d", "prompt": "a \\r inside"}\r\n' % k, None),
    ]


@pytest.mark.parametrize("processes", [1, 3])
def test_garbage_lines_each_get_their_line_and_code_and_the_rest_is_planned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int
) -> None:
    """Held: BOM (first line only), NULs, invalid UTF-8, a line over the limit, CRLF and LF
    mixed, blank lines, a repeated ID and a last line without a newline, cut into ranges anywhere."""
    monkeypatch.setattr(planning, "PARALLEL_MIN_BYTES", 1)
    rows = [row for k in range(40) for row in _garbage_block(k)]
    rows.append((b'{"id": "last", "prompt": "no newline"}', None))
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"".join(data for data, _ in rows))
    expected = {line: code for line, (_, code) in enumerate(rows, start=1) if code}
    analysis = analyze_input(
        _request(path, limits=ValidationLimits(max_line_bytes=200), scan_processes=processes)
    )
    try:
        outcomes = [orjson.loads(line) for line in analysis.error_spool.read().splitlines()]
        assert {o["line"]: o["error"]["code"] for o in outcomes} == expected
        assert [o["line"] for o in outcomes] == sorted(expected)
        assert analysis.work.records == sum(code is None for _, code in rows)
        assert analysis.total_lines == len(rows)
        assert analysis.cuts[-1].byte_end == path.stat().st_size
        excluded = [line for cut in analysis.cuts for line in cut.excluded_lines]
        assert excluded == sorted(expected)
    finally:
        analysis.close()


@pytest.mark.parametrize("processes", [1, 3])
def test_a_huge_line_is_skipped_as_too_long_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int
) -> None:
    """Held: a 6 MB line (of NULs, no newline in it) under a 1 kB limit is one ``line_too_long``,
    wherever the ranges fall; the lines around it are planned."""
    monkeypatch.setattr(planning, "PARALLEL_MIN_BYTES", 1)
    path = tmp_path / "input.jsonl"
    path.write_bytes(
        b'{"id": "before", "prompt": "x"}\n' + b"\x00" * 6_000_000 + b'\n{"id": "after", "prompt": "y"}'
    )
    analysis = analyze_input(
        _request(path, limits=ValidationLimits(max_line_bytes=1000), scan_processes=processes)
    )
    try:
        outcomes = [orjson.loads(line) for line in analysis.error_spool.read().splitlines()]
        assert [(o["line"], o["error"]["code"]) for o in outcomes] == [(2, "line_too_long")]
        assert (analysis.work.records, analysis.total_lines) == (2, 3)
    finally:
        analysis.close()


# -- 5. the memory budget's edges -------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, -1, 1.5, True, "512", None])
def test_a_memory_budget_that_is_no_positive_integer_is_refused(tmp_path: Path, budget: Any) -> None:
    """Held."""
    with pytest.raises(ConfigurationError, match=r"^memory_budget_mb must be a positive integer"):
        _request(tmp_path / "input.jsonl", memory_budget_mb=budget)


def test_a_memory_budget_above_the_machine_s_memory_is_refused(tmp_path: Path) -> None:
    """Bug: accepted, and then no budget at all (the duplicate check never splits a partition):
    a typo of a few zeros is now refused, naming the bound (the machine's memory, or a smaller
    cgroup limit where this runs in one: the tests below give each its own files)."""
    bound_mb, bound = planning.memory_bound_mb()
    _request(tmp_path / "input.jsonl", memory_budget_mb=bound_mb)
    with pytest.raises(ConfigurationError, match=rf"is more than {re.escape(bound)} \({bound_mb} MB\)"):
        _request(tmp_path / "input.jsonl", memory_budget_mb=bound_mb + 1)
    with pytest.raises(ConfigurationError, match="is more than"):
        _request(tmp_path / "input.jsonl", memory_budget_mb=10**30)


#: the machine's physical memory in MB, the bound where no cgroup limit is smaller
MACHINE_MB = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20


def _fake_root(tmp_path: Path, membership: str, limits: dict[str, str]) -> Path:
    """A file system root with ``/proc/self/cgroup`` and each of ``limits`` (path: content)."""
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(membership)
    for name, value in limits.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(value + "\n")
    return root


@pytest.mark.parametrize(
    ("membership", "limits", "bound_mb", "bound"),
    [
        pytest.param(  # a Kubernetes pod with its own cgroup namespace: "/" is its cgroup
            "0::/\n",
            {"sys/fs/cgroup/memory.max": str(512 << 20)},
            512,
            "the memory limit of this process's cgroup (/sys/fs/cgroup/memory.max)",
            id="v2",
        ),
        pytest.param(  # the tightest of the process's cgroup and those above it; "max" is none
            "0::/kubepods/pod-a/ctr\n",
            {
                "sys/fs/cgroup/memory.max": "max",
                "sys/fs/cgroup/kubepods/pod-a/memory.max": str(300 << 20),
                "sys/fs/cgroup/kubepods/pod-a/ctr/memory.max": "max",
            },
            300,
            "the memory limit of this process's cgroup (/sys/fs/cgroup/kubepods/pod-a/memory.max)",
            id="v2-nested",
        ),
        pytest.param(  # v1 without a cgroup namespace: the path is not under the mount, its top is
            "12:pids:/docker/c1\n4:memory:/docker/c1\n0::/\n",
            {"sys/fs/cgroup/memory/memory.limit_in_bytes": str(256 << 20)},
            256,
            "the memory limit of this process's cgroup (/sys/fs/cgroup/memory/memory.limit_in_bytes)",
            id="v1",
        ),
        pytest.param(  # v1 beside another controller; v1's "no limit" is a huge number
            "4:cpu,memory:/batch\n",
            {
                "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
                "sys/fs/cgroup/memory/batch/memory.limit_in_bytes": str(200 << 20),
            },
            200,
            "the memory limit of this process's cgroup (/sys/fs/cgroup/memory/batch/memory.limit_in_bytes)",
            id="v1-nested",
        ),
        pytest.param(  # a path outside the namespace's view reads nothing above the mount
            "0::/../../escape\n",
            {"sys/fs/cgroup/memory.max": str(400 << 20), "sys/escape/memory.max": str(100 << 20)},
            400,
            "the memory limit of this process's cgroup (/sys/fs/cgroup/memory.max)",
            id="v2-outside-namespace",
        ),
        pytest.param(
            "0::/\n", {"sys/fs/cgroup/memory.max": "max"}, MACHINE_MB, "this machine's memory", id="v2-none"
        ),
        pytest.param(
            "4:memory:/\n",
            {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"},
            MACHINE_MB,
            "this machine's memory",
            id="v1-none",
        ),
        pytest.param(  # a limit above the machine's memory: the machine's is the bound
            "0::/\n",
            {"sys/fs/cgroup/memory.max": str((MACHINE_MB + 1024) << 20)},
            MACHINE_MB,
            "this machine's memory",
            id="limit-above-ram",
        ),
        pytest.param("", {}, MACHINE_MB, "this machine's memory", id="no-cgroup"),
    ],
)
def test_a_memory_budget_above_the_cgroup_limit_is_refused_naming_it(
    tmp_path: Path, membership: str, limits: dict[str, str], bound_mb: int, bound: str
) -> None:
    """Bug: only physical memory was read, so in a Kubernetes pod a budget above the pod's limit
    was accepted and the out-of-memory killer ended the plan. Now the smaller of the two bounds,
    named in the one line."""
    root = _fake_root(tmp_path, membership, limits)
    assert planning.memory_bound_mb(root) == (bound_mb, bound)
    planning.check_memory_budget(bound_mb, root)
    with pytest.raises(ConfigurationError) as refused:
        planning.check_memory_budget(bound_mb + 1, root)
    assert str(refused.value) == (
        f"memory_budget_mb {bound_mb + 1} is more than {bound} ({bound_mb} MB): give at most that "
        "(default 512)"
    )


@pytest.mark.parametrize("processes", [1, 3])
def test_the_smallest_budget_still_finds_every_duplicate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int
) -> None:
    """Held: 1 MB (split for three processes) checks 60,000 IDs, a third of them repeated, exactly."""
    monkeypatch.setattr(planning, "PARALLEL_MIN_BYTES", 1)
    path = tmp_path / "input.jsonl"
    path.write_bytes(
        b"".join(b'{"id": "id-%d", "prompt": "x"}\n' % (i if i % 3 else i // 3) for i in range(60_000))
    )
    analysis = analyze_input(_request(path, memory_budget_mb=1, scan_processes=processes))
    try:
        seen: set[int] = set()
        expected = []
        for line, i in enumerate(range(60_000), start=1):
            key = i if i % 3 else i // 3
            if key in seen:
                expected.append(line)
            seen.add(key)
        outcomes = [orjson.loads(line) for line in analysis.error_spool.read().splitlines()]
        assert [o["line"] for o in outcomes] == expected
        assert {o["error"]["code"] for o in outcomes} == {"duplicate_id"}
    finally:
        analysis.close()
