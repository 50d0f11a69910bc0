"""The ``deadline-batch`` command end to end (docs/design.md §8), through the installed console script.

The main test runs a few thousand lines holding every kind of bad line with four subprocess
workers and frequent injected preemptions, once on SQLite and a local directory and once on
PostgreSQL and S3 (moto over HTTP, input in S3 too), and then checks every line's outcome in
the published objects. The others pin the rest of the contract: admission rejections (exit 3),
usage errors (exit 2, one line, no traceback), ``status``, ``cancel``, ``verify`` and
idempotent resubmission.
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch import cli
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.core.records import LineError, Record, ValidationLimits, Validator, iter_raw_lines
from airflow_deadline_batch.local.runner import PreemptionInjector
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import CliResult, assert_usage_error, cli_argv, cli_env, run_cli, wait_for
from tests.helpers.inputs import BAD_KINDS, mixed_input
from tests.helpers.outcomes import (
    assert_outcomes_match,
    assert_store_invariants,
    read_manifest,
    read_outcomes,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SUMMARY_KEYS = {"job_id", "state", "manifest", "records", "attempts", "preemptions", "deadline_met"}


def early_preemption_seed(rate_per_hour: float, within_s: float, launches: int = 4) -> int:
    """A seed whose injector preempts one of the first ``launches`` workers within ``within_s``
    of its claim.

    No worker can read its range and finish a shard that fast after claiming it, so a run with
    this seed has at least one preemption whatever the machine's speed.
    """
    for seed in range(10_000):
        injector = PreemptionInjector(rate_per_hour, seed)
        if min(injector.exposure_s(PoolKind.SPOT) for _ in range(launches)) < within_s:
            return seed
    raise AssertionError("no seed preempts early enough; raise the rate")


@dataclass(frozen=True)
class Backend:
    """Where a CLI run keeps its manifest store, input and outputs."""

    name: str
    store_url: str
    output: str
    put_input: Callable[[bytes], str]
    #: input size: every S3 call and PostgreSQL commit is a network round trip, so that run is smaller
    lines: int
    microbatch_size: int
    #: Spot preemptions per worker-hour of claimed work: S3 and PostgreSQL make each commit slower
    preempt_rate: float


@pytest.fixture(params=["sqlite-local", "postgresql-s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite-local":

        def put_local(data: bytes) -> str:
            path = tmp_path / "input.jsonl"
            path.write_bytes(data)
            return str(path)

        return Backend(
            request.param,
            f"sqlite:///{tmp_path / 'store.db'}",
            str(tmp_path / "out"),
            put_local,
            3000,
            16,
            2400.0,
        )
    store_url = str(request.getfixturevalue("pg_store_url"))
    bucket = str(request.getfixturevalue("s3_bucket"))
    client = request.getfixturevalue("s3_client")

    def put_s3(data: bytes) -> str:
        client.put_object(Bucket=bucket, Key="in/input.jsonl", Body=data)
        return f"s3://{bucket}/in/input.jsonl"

    return Backend(request.param, store_url, f"s3://{bucket}/out", put_s3, 1500, 32, 900.0)


def test_generated_input_agrees_with_the_validator() -> None:
    """The expectations of the input generator are what core.records decides, line by line."""
    mixed = mixed_input(600, seed=5, huge_lines=True)
    limits = ValidationLimits()
    validator = Validator(limits)
    expected = mixed.by_line
    seen_codes = set()
    for raw in iter_raw_lines(io.BytesIO(mixed.data), max_line_bytes=limits.max_line_bytes):
        outcome = validator.feed(raw)
        if outcome is None:
            assert raw.line in mixed.blank_lines
            continue
        want = expected[raw.line]
        assert outcome.id == want.id, (raw.line, outcome, want)
        if isinstance(outcome, LineError):
            assert (want.status, want.code) == ("errored", outcome.code.value), (raw.line, outcome, want)
            seen_codes.add(outcome.code.value)
        else:
            assert isinstance(outcome, Record)
            assert want.status == "succeeded" or want.code == "engine_error", (raw.line, want)
    assert seen_codes >= {*BAD_KINDS, "prompt_too_long", "line_too_long"}
    assert validator.lines == len(mixed.expected) + len(mixed.blank_lines)


def test_run_with_every_kind_of_bad_line_and_preemptions(backend: Backend, tmp_path: Path) -> None:
    mixed = mixed_input(backend.lines, seed=11, huge_lines=True, bad_fraction=0.04)
    input_uri = backend.put_input(mixed.data)
    seed = early_preemption_seed(backend.preempt_rate, within_s=0.15)
    result = run_cli(
        "run", input_uri, "--deadline", "+30m", "--engine", "echo", "--workers", "4",
        "--preempt-rate", str(backend.preempt_rate), "--preempt-notice", "0.3", "--seed", str(seed),
        "--store", backend.store_url, "--output", backend.output, "--lease-ttl", "10",
        "--microbatch-size", str(backend.microbatch_size), "--json",
        cwd=tmp_path, env={"ADB_ECHO_DELAY_S": "0.0005"},
    )  # fmt: skip
    assert result.code == 0, result.describe()
    summary = result.json()
    assert set(summary) >= SUMMARY_KEYS, summary
    job_id = summary["job_id"]
    assert summary["state"] == "completed"
    assert summary["deadline_met"] is True
    assert summary["preemptions"] > 0
    assert summary["attempts"] >= summary["shards"] >= 1
    assert summary["records"] == {"total": len(mixed.expected), **mixed.counts()}

    verify = run_cli("verify", job_id, "--store", backend.store_url, "--json", cwd=tmp_path)
    assert verify.code == 0, verify.describe()
    assert verify.json()["complete"] is True and verify.json()["published"] is True

    manifest = read_manifest(summary["manifest"])
    assert manifest["job_id"] == job_id
    assert manifest["input"] == {
        "uri": input_uri, "sha256": hashlib.sha256(mixed.data).hexdigest(), "records": len(mixed.expected),
    }  # fmt: skip
    assert manifest["outcomes"] == mixed.counts()
    outcomes = read_outcomes(manifest)
    assert_outcomes_match(outcomes, mixed)
    store = ManifestStore(backend.store_url)
    try:
        assert_store_invariants(store, job_id, manifest)
    finally:
        store.close()


# ---------------------------------------------------------------------------------- admission (3)


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    return mixed_input(60, seed=2, bad_fraction=0.0).write(tmp_path / "sample.jsonl")


def test_plan_infeasible_deadline_exits_3_with_reasons(sample: Path, tmp_path: Path) -> None:
    text = run_cli("plan", str(sample), "--deadline", "+1s", cwd=tmp_path)
    assert text.code == 3, text.describe()
    assert "rejected" in text.stderr and "deadline" in text.stderr, text.describe()
    assert "Traceback" not in text.stderr

    as_json = run_cli("plan", str(sample), "--deadline", "+1s", "--json", cwd=tmp_path)
    assert as_json.code == 3, as_json.describe()
    payload = as_json.json()
    assert payload["feasible"] is False
    assert payload["verdict"] == "infeasible"
    assert payload["report"]["reasons"], payload
    assert "rejected" in as_json.stderr


def test_plan_feasible_deadline_exits_0(sample: Path, tmp_path: Path) -> None:
    result = run_cli("plan", str(sample), "--deadline", "+2h", "--json", cwd=tmp_path)
    assert result.code == 0, result.describe()
    payload = result.json()
    assert payload["feasible"] is True
    mixed = mixed_input(60, seed=2, bad_fraction=0.0)  # what the ``sample`` fixture wrote
    assert payload["records"] == len(mixed.expected) and payload["invalid"] == 0
    assert payload["lines"] == len(mixed.expected) + len(mixed.blank_lines)
    assert payload["shards"] >= 1


def test_plan_text_counts_invalid_lines_by_code_and_says_when_nothing_is_left(tmp_path: Path) -> None:
    mixed = mixed_input(40, seed=5, bad_fraction=0.2)
    codes: dict[str, int] = {}
    for outcome in mixed.expected:
        if outcome.status == "errored":
            codes[outcome.code] = codes.get(outcome.code, 0) + 1
    result = run_cli("plan", str(mixed.write(tmp_path / "mixed.jsonl")), "--deadline", "+2h", cwd=tmp_path)
    assert result.code == 3, result.describe()  # rejected for its invalid fraction: still counted
    by_code = ", ".join(f"{code} {n}" for code, n in sorted(codes.items()))
    assert f"invalid lines: {sum(codes.values())} ({by_code}), shards: " in result.stdout, result.describe()
    assert "holds no record" not in result.stdout

    (tmp_path / "blank.jsonl").write_bytes(b"\n \n")
    empty = run_cli("plan", str(tmp_path / "blank.jsonl"), "--deadline", "+2h", cwd=tmp_path)
    assert empty.code == 0, empty.describe()  # an empty night is a job: its manifest is empty
    assert "records: 0, invalid lines: 0, shards: 0" in empty.stdout, empty.describe()
    assert "note: the input holds no record" in empty.stdout


def _assert_rejected_and_nothing_ran(result_code: int, payload: dict, store_url: str, output: Path) -> str:
    assert result_code == 3
    assert payload["state"] == "rejected"
    job_id = payload["job_id"]
    store = ManifestStore(store_url)
    try:
        assert store.get_job(job_id).state.value == "rejected"
        assert store.list_shards(job_id) == []
        assert store.list_attempts(job_id) == []
        assert [c for c in store.list_commits(job_id) if c.shard_index >= 0] == []
    finally:
        store.close()
    assert not list(output.rglob("attempts/*")), "a worker wrote output for a rejected job"
    assert not list(output.rglob("manifest.json"))
    return str(job_id)


def test_run_infeasible_exits_3_and_no_shard_runs(sample: Path, tmp_path: Path) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    out = tmp_path / "out"
    result = run_cli(
        "run", str(sample), "--deadline", "+1s", "--engine", "echo", "--store", store_url,
        "--output", str(out), "--json", cwd=tmp_path,
    )  # fmt: skip
    assert result.code == 3, result.describe()
    assert "rejected" in result.stderr and "Traceback" not in result.stderr
    payload = result.json()
    assert payload["report"]["verdict"] == "infeasible"
    _assert_rejected_and_nothing_ran(result.code, payload, store_url, out)


def test_run_with_too_many_invalid_lines_exits_3(tmp_path: Path) -> None:
    mixed = mixed_input(200, seed=4, bad_fraction=0.3)
    path = mixed.write(tmp_path / "bad.jsonl")
    assert mixed.invalid / len(mixed.expected) > 0.2
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    out = tmp_path / "out"
    result = run_cli(
        "run", str(path), "--deadline", "+1h", "--engine", "echo", "--max-invalid-fraction", "0.05",
        "--store", store_url, "--output", str(out), "--json", cwd=tmp_path,
    )  # fmt: skip
    assert result.code == 3, result.describe()
    payload = result.json()
    assert payload["report"]["verdict"] == "rejected_invalid"
    assert "max_invalid_fraction" in result.stderr or "invalid" in result.stderr
    _assert_rejected_and_nothing_ran(result.code, payload, store_url, out)
    # the same input passes admission with a limit above its invalid fraction
    plan = run_cli(
        "plan", str(path), "--deadline", "+1h", "--max-invalid-fraction", "0.5", "--json", cwd=tmp_path
    )
    assert plan.code == 0, plan.describe()


# ------------------------------------------------------------------------------- usage errors (2)


def _pools(tmp_path: Path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


USAGE_ERRORS: dict[str, Callable[[Path, Path], list[str]]] = {
    "bad deadline": lambda s, t: ["run", str(s), "--deadline", "tomorrow", "--engine", "echo"],
    "naive deadline": lambda s, t: ["plan", str(s), "--deadline", "2030-01-01T06:00:00"],
    "missing input": lambda s, t: ["run", str(t / "nope.jsonl"), "--deadline", "+1h", "--engine", "echo"],
    "missing input (plan)": lambda s, t: ["plan", str(t / "nope.jsonl"), "--deadline", "+1h"],
    "pools not json": lambda s, t: ["plan", str(s), "--deadline", "+1h", "--pools", _pools(t, "p.json", "{")],
    "pools missing": lambda s, t: ["plan", str(s), "--deadline", "+1h", "--pools", str(t / "none.json")],
    "pools wrong shape": lambda s, t: [
        "plan",
        str(s),
        "--deadline",
        "+1h",
        "--pools",
        _pools(t, "q.json", "[{}]"),
    ],
    "pools empty": lambda s, t: ["plan", str(s), "--deadline", "+1h", "--pools", _pools(t, "r.json", "[]")],
    "zero workers": lambda s, t: ["run", str(s), "--deadline", "+1h", "--engine", "echo", "--workers", "0"],
    "unknown engine": lambda s, t: ["run", str(s), "--deadline", "+1h", "--engine", "gpt-17"],
    "no deadline": lambda s, t: ["plan", str(s)],
    "no command": lambda s, t: [],
    "unknown job (status)": lambda s, t: ["status", "j-nosuchjob", "--store", f"sqlite:///{t / 'store.db'}"],
    "unknown job (verify)": lambda s, t: ["verify", "j-nosuchjob", "--store", f"sqlite:///{t / 'store.db'}"],
    "unknown job (cancel)": lambda s, t: ["cancel", "j-nosuchjob", "--store", f"sqlite:///{t / 'store.db'}"],
    "no store file": lambda s, t: ["status", "j-x", "--store", f"sqlite:///{t / 'missing' / 'store.db'}"],
    "deadline past year 9999": lambda s, t: _echo_run(s, "--deadline", "+999999999h"),
    "store port not a number": lambda s, t: _echo_run(s, "--store", "postgresql://u:pw@localhost:abc/db"),
    "store unreachable": lambda s, t: _echo_run(s, "--store", "postgresql://u:pw@127.0.0.1:1/db"),
    "output is a file": lambda s, t: _echo_run(s, "--output", str(s)),
    "input is a device": lambda s, t: _echo_run(Path("/dev/null")),
    "input is a FIFO": lambda s, t: _echo_run(Path(_fifo(t))),
    "input is a FIFO (plan)": lambda s, t: ["plan", _fifo(t), "--deadline", "+1h"],
    "model missing": lambda s, t: _echo_run(s, "--engine", "transformers", "--model", str(t / "no-model")),
    "new job with a key": lambda s, t: _echo_run(s, "--new-job", "--idempotency-key", "k"),
    "lease ttl zero": lambda s, t: _echo_run(s, "--lease-ttl", "0"),
    "preempt rate nan": lambda s, t: _echo_run(s, "--preempt-rate", "nan"),
}


def _echo_run(input_path: Path, *options: str) -> list[str]:
    """``run INPUT --deadline +1h --engine echo`` with ``options`` (later ones win)."""
    return ["run", str(input_path), "--deadline", "+1h", "--engine", "echo", *options]


def _fifo(tmp_path: Path) -> str:
    """A named pipe no one writes to: reading it would block for ever."""
    path = tmp_path / "input.fifo"
    if not path.exists():
        os.mkfifo(path)
    return str(path)


@pytest.fixture
def migrated_store(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    ManifestStore.open(url, migrate=True).close()
    return url


#: the cases also run through the console script; the rest run ``cli.main`` in this process
#: (same code, same streams and exit code, without a 1-2 s interpreter start per case)
USAGE_ERRORS_VIA_SCRIPT = (
    "bad deadline",
    "missing input",
    "pools not json",
    "unknown engine",
    "deadline past year 9999",
    "store port not a number",
    "output is a file",
    "input is a FIFO",
    "no deadline",
)


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS_VIA_SCRIPT))
def test_usage_errors_exit_2_with_one_line(
    case: str, sample: Path, tmp_path: Path, migrated_store: str
) -> None:
    args = USAGE_ERRORS[case](sample, tmp_path)
    result = run_cli(*args, cwd=tmp_path)
    assert_usage_error(result)
    assert not (tmp_path / "out").exists()
    if args and args[0] in ("run", "plan"):  # with --json, the last stdout line says so too
        as_json = run_cli(*args, "--json", cwd=tmp_path)
        assert_usage_error(as_json)
        payload = as_json.json()
        assert payload["state"] == "error" and payload["error"], payload
        assert "pw@" not in as_json.stdout + as_json.stderr, "a password was printed"


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_errors_in_process_exit_2_with_one_line(
    case: str, sample: Path, tmp_path: Path, migrated_store: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ADB_STORE_URL", raising=False)
    monkeypatch.delenv("ADB_OUTPUT_URI", raising=False)
    args = USAGE_ERRORS[case](sample, tmp_path)
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse exits by itself
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    assert_usage_error(CliResult(tuple(args), code, captured.out, captured.err))
    assert not (tmp_path / "out").exists()


def test_missing_output_bucket_is_refused_at_admission(s3_bucket: str, sample: Path, tmp_path: Path) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    result = run_cli(
        "run", str(sample), "--deadline", "+1h", "--engine", "echo", "--store", store_url,
        "--output", f"s3://adb-missing-{uuid.uuid4().hex[:12]}/out", "--json", cwd=tmp_path,
    )  # fmt: skip
    assert_usage_error(result)
    assert "not writable" in result.stderr and "--output" in result.stderr
    store = ManifestStore.open(store_url, migrate=True)
    try:
        assert store.list_jobs() == [], "a job was created for an output that cannot be written"
    finally:
        store.close()


# ---------------------------------------------------------------- status, verify, idempotency


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One small completed job, submitted with an idempotency key; shared by the tests below."""
    root = tmp_path_factory.mktemp("finished")
    mixed = mixed_input(120, seed=8)
    path = mixed.write(root / "input.jsonl")
    store_url = f"sqlite:///{root / 'store.db'}"
    args = [
        "run", str(path), "--deadline", "+1h", "--engine", "echo", "--workers", "2", "--store", store_url,
        "--output", str(root / "out"), "--idempotency-key", "nightly-2026-11-30",
        "--max-invalid-fraction", "0.5", "--json",
    ]  # fmt: skip
    result = run_cli(*args, cwd=root)
    assert result.code == 0, result.describe()
    return {"root": root, "args": args, "summary": result.json(), "store_url": store_url, "mixed": mixed}


def test_status_reports_committed_progress(finished_job: dict) -> None:
    job_id = finished_job["summary"]["job_id"]
    result = run_cli(
        "status", job_id, "--store", finished_job["store_url"], "--json", cwd=finished_job["root"]
    )
    assert result.code == 0, result.describe()
    status = result.json()
    total = len(finished_job["mixed"].expected)
    assert status["job_id"] == job_id
    assert status["state"] == "completed"
    assert status["manifest"] == finished_job["summary"]["manifest"]
    assert status["records"]["total"] == status["records"]["committed"] == total
    assert status["records"]["succeeded"] == finished_job["summary"]["records"]["succeeded"]
    text = run_cli("status", job_id, "--store", finished_job["store_url"], cwd=finished_job["root"])
    assert text.code == 0 and job_id in text.stdout and "completed" in text.stdout


def test_same_idempotency_key_returns_the_same_job_without_running_again(finished_job: dict) -> None:
    store = ManifestStore(finished_job["store_url"])
    try:
        job_id = finished_job["summary"]["job_id"]
        attempts_before = store.list_attempts(job_id)
        commits_before = store.list_commits(job_id)
        again = run_cli(*finished_job["args"], cwd=finished_job["root"])
        assert again.code == 0, again.describe()
        summary = again.json()
        assert summary["job_id"] == job_id
        assert summary["state"] == "completed"
        assert summary["manifest"] == finished_job["summary"]["manifest"]
        assert summary["records"] == finished_job["summary"]["records"]
        assert store.list_attempts(job_id) == attempts_before
        assert store.list_commits(job_id) == commits_before
        assert len(store.list_jobs()) == 1
    finally:
        store.close()


def test_verify_detects_a_tampered_object(finished_job: dict, tmp_path: Path) -> None:
    """verify exits 0 on the intact job and 4 once an object no longer matches its SHA-256."""
    root = finished_job["root"]
    job_id = finished_job["summary"]["job_id"]
    ok = run_cli("verify", job_id, "--store", finished_job["store_url"], cwd=root)
    assert ok.code == 0, ok.describe()
    manifest = read_manifest(finished_job["summary"]["manifest"])
    victim = Path(manifest["shards"][-1]["uri"])
    original = victim.read_bytes()
    try:
        victim.write_bytes(original.replace(b'"succeeded"', b'"errored"  ', 1) + b"\n")
        bad = run_cli("verify", job_id, "--store", finished_job["store_url"], "--json", cwd=root)
        assert bad.code == 4, bad.describe()
        assert bad.json()["checksum_failures"] >= 1
    finally:
        victim.write_bytes(original)


def test_rerun_after_tampering_exits_4_and_says_why(finished_job: dict) -> None:
    """A rerun with the same idempotency key re-verifies the published job: a tampered object
    makes it exit 4 with ``verified: false``, ``deadline_met: false`` and the cause (docs/design.md §8)."""
    root = finished_job["root"]
    manifest = read_manifest(finished_job["summary"]["manifest"])
    victim = Path(manifest["shards"][-1]["uri"])
    original = victim.read_bytes()
    try:
        victim.write_bytes(original.replace(b'"succeeded"', b'"errored"  ', 1) + b"\n")
        again = run_cli(*finished_job["args"], cwd=root)
        assert again.code == 4, again.describe()
        summary = again.json()
        assert summary["job_id"] == finished_job["summary"]["job_id"]
        assert summary["verified"] is False and summary["deadline_met"] is False, summary
        assert "SHA-256" in summary["error"], summary
        lines = again.stderr.strip().splitlines()
        assert len(lines) == 1 and "verify" in lines[0] and "Traceback" not in again.stderr, again.describe()
    finally:
        victim.write_bytes(original)
    intact = run_cli(*finished_job["args"], cwd=root)
    assert intact.code == 0 and intact.json()["verified"] is True, intact.describe()


def test_default_key_resumes_the_same_job_and_new_job_forces_another(sample: Path, tmp_path: Path) -> None:
    """Without --idempotency-key, the same input and options are the same job (so the rerun hint
    is true); a rejected job is not what a rerun with a looser deadline gets; --new-job is fresh."""
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    base = ["run", str(sample), "--engine", "echo", "--store", store_url, "--output", str(tmp_path / "out")]
    rejected = run_cli(*base, "--deadline", "+1s", "--json", cwd=tmp_path)
    assert rejected.code == 3, rejected.describe()
    first = run_cli(*base, "--deadline", "+1h", "--json", cwd=tmp_path)
    assert first.code == 0, first.describe()
    job_id = first.json()["job_id"]
    assert job_id != rejected.json()["job_id"]
    again = run_cli(*base, "--deadline", "+2h", "--json", cwd=tmp_path)
    assert again.code == 0 and again.json()["job_id"] == job_id, again.describe()
    fresh = run_cli(*base, "--deadline", "+1h", "--new-job", "--json", cwd=tmp_path)
    assert fresh.code == 0 and fresh.json()["job_id"] not in (job_id, rejected.json()["job_id"]), (
        fresh.describe()
    )
    # a rejected job does not keep an explicit key either: the same command, later or looser, runs
    keyed = [*base, "--idempotency-key", "nightly"]
    refused = run_cli(*keyed, "--deadline", "+1s", "--json", cwd=tmp_path)
    assert refused.code == 3, refused.describe()
    admitted = run_cli(*keyed, "--deadline", "+1h", "--json", cwd=tmp_path)
    assert admitted.code == 0 and admitted.json()["job_id"] != refused.json()["job_id"], admitted.describe()
    store = ManifestStore(store_url)
    try:
        assert len(store.list_jobs()) == 5
        assert store.get_job_by_idempotency_key("nightly").job_id == admitted.json()["job_id"]  # type: ignore[union-attr]
    finally:
        store.close()


# ------------------------------------------------------------------------------------- cancel


def test_cancel_stops_a_running_job_and_publishes_cancelled_outcomes(tmp_path: Path) -> None:
    mixed = mixed_input(300, seed=9)
    path = mixed.write(tmp_path / "input.jsonl")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    key = "cancel-me"
    argv = cli_argv(
        "run", str(path), "--deadline", "+1h", "--engine", "echo", "--workers", "2", "--store", store_url,
        "--output", str(tmp_path / "out"), "--idempotency-key", key, "--max-invalid-fraction", "0.5",
        "--json",
    )  # fmt: skip
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=cli_env({"ADB_ECHO_DELAY_S": "0.05"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        store = ManifestStore.open(store_url, migrate=True)

        def some_progress() -> str | None:
            job = store.get_job_by_idempotency_key(key)
            return job.job_id if job and store.progress(job.job_id).committed_records > 20 else None

        job_id = wait_for(some_progress, timeout_s=120, what="the first commits")
        cancel = run_cli("cancel", job_id, "--store", store_url, "--json", cwd=tmp_path)
        assert cancel.code == 0, cancel.describe()
        assert cancel.json()["state"] == "cancelled" and cancel.json()["outcomes"]["cancelled"] > 0
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 4, (stdout, stderr)
    summary = orjson.loads(stdout.strip().splitlines()[-1])
    assert summary["state"] == "cancelled"
    # the runner and the cancel command published one manifest (whoever came first)
    assert summary["manifest"] and summary["manifest"] == cancel.json()["manifest"]
    outcomes = read_outcomes(read_manifest(summary["manifest"]))
    assert set(outcomes) == set(mixed.by_line)
    statuses = {rec["status"] for rec in outcomes.values()}
    assert "cancelled" in statuses and "expired" not in statuses
    for line, rec in outcomes.items():
        if rec["status"] != "cancelled":
            assert rec["status"] == mixed.by_line[line].status
    status = run_cli("status", job_id, "--store", store_url, "--json", cwd=tmp_path)
    assert status.json()["state"] == "cancelled"
    store.close()


def test_cancel_of_an_orphaned_job_publishes_its_cancelled_manifest(tmp_path: Path) -> None:
    """Nobody finalizes a job whose runner was SIGKILLed: ``cancel`` publishes, ``verify`` agrees."""
    mixed = mixed_input(200, seed=12)
    path = mixed.write(tmp_path / "input.jsonl")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    key = "orphan"
    argv = cli_argv(
        "run", str(path), "--deadline", "+1h", "--engine", "echo", "--workers", "2", "--store", store_url,
        "--output", str(tmp_path / "out"), "--idempotency-key", key, "--max-invalid-fraction", "0.5",
    )  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=cli_env({"ADB_ECHO_DELAY_S": "0.05"}), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    store = ManifestStore.open(store_url, migrate=True)
    try:

        def some_progress() -> str | None:
            job = store.get_job_by_idempotency_key(key)
            return job.job_id if job and store.progress(job.job_id).committed_records > 10 else None

        job_id = wait_for(some_progress, timeout_s=120, what="the first commits")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and its workers: nobody will finalize
        proc.wait()
    assert store.get_job(job_id).manifest_uri is None

    cancel = run_cli("cancel", job_id, "--store", store_url, "--json", cwd=tmp_path)
    assert cancel.code == 0, cancel.describe()
    result = cancel.json()
    assert result["state"] == "cancelled" and result["manifest"]
    outcomes = read_outcomes(read_manifest(result["manifest"]))
    assert set(outcomes) == set(mixed.by_line)  # one outcome per non-blank line
    for line, rec in outcomes.items():
        assert rec["status"] in ("cancelled", mixed.by_line[line].status)
    assert sum(1 for r in outcomes.values() if r["status"] == "cancelled") == result["outcomes"]["cancelled"]
    verify = run_cli("verify", job_id, "--store", store_url, "--json", cwd=tmp_path)
    assert verify.json()["published"] is True and verify.json()["manifest"] == result["manifest"]
    # who cancelled it is the job's error, which status shows
    status = run_cli("status", job_id, "--store", store_url, cwd=tmp_path)
    assert "stopped because: cancelled with deadline-batch cancel by " in status.stdout, status.describe()
    # cancelling again is a no-op that answers the same manifest
    again = run_cli("cancel", job_id, "--store", store_url, "--json", cwd=tmp_path)
    assert again.code == 0 and again.json()["manifest"] == result["manifest"]
    store.close()
