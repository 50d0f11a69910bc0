"""No password fragment in anything ``deadline-batch`` prints, whatever a driver says (docs/design.md §8),
and errors caused by ``ADB_STORE_URL`` / ``ADB_OUTPUT_URI`` name the variable, not the option.

A password holding an unescaped ``@`` (``u:first@second@host``) is split by the URL parser at its
first ``@``: psycopg is then asked to resolve the host ``second@host`` and says so in its error,
which the command printed. Real drivers throughout: psycopg against the PostgreSQL fixture (a role
that refuses a wrong password), botocore's own validation of an S3 URL, SQLite files; the cases
run ``cli.main`` in this process (same code, streams and exit code as the console script).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from pathlib import Path

import pytest

from airflow_deadline_batch import cli
from tests.e2e.conftest import CliResult
from tests.helpers.inputs import mixed_input

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

#: the two halves of a password holding an unescaped "@": neither may be printed
FIRST, SECOND = "first-half-7q", "second-half-9z"
PASSWORD = f"{FIRST}@{SECOND}"


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    return mixed_input(4, seed=3, bad_fraction=0.0).write(tmp_path / "in.jsonl")


@pytest.fixture(autouse=True)
def _hermetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ADB_STORE_URL", raising=False)
    monkeypatch.delenv("ADB_OUTPUT_URI", raising=False)
    # boto3 refuses the S3 URLs below before any request; were one sent, it would go nowhere
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> CliResult:
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse exits by itself
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return CliResult(tuple(args), code, captured.out, captured.err)


def _assert_one_line_without_the_password(result: CliResult, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.code in (2, 4) and len(lines) == 1 and "Traceback" not in result.stderr, result.describe()
    for fragment in fragments:
        assert fragment not in result.stdout + result.stderr, f"{fragment!r} printed:\n{result.describe()}"


def _run(sample: Path, t: Path, *options: str) -> list[str]:
    return ["run", str(sample), "--deadline", "+1h", "--engine", "echo", "--json", *options]


def _pg(host: str = "127.0.0.1:5432", password: str = PASSWORD, user: str = "adb") -> str:
    return f"postgresql+psycopg://{user}:{password}@{host}/db"


#: each case: the arguments (from the sample input and tmp_path), what the line must still say
CASES: dict[str, tuple[Callable[[Path, Path], list[str]], str]] = {
    # before: "failed to resolve host 'second-half-9z@127.0.0.1'" (psycopg, via the store's error)
    "status, store password with an @": (lambda s, t: ["status", "j-x", "--store", _pg()], "resolve host"),
    "quota set, store password with an @": (
        lambda s, t: ["quota", "set", "night", "--spot-gpus", "1", "--store", _pg()],
        "fix --store",
    ),
    "run, store password with an @": (lambda s, t: _run(s, t, "--store", _pg()), "fix --store"),
    # before: the whole password, the URL mask stopping at the "@" of the user name u@corp
    "status, user name with an @": (
        lambda s, t: ["status", "j-x", "--store", _pg("127.0.0.1:abc", user="u@corp")],
        "fix --store",
    ),
    # before: "names host 'AKIA:first-half-7q@second-half-9z@bucket'"
    "plan, file URL with credentials": (
        lambda s, t: ["plan", f"file://AKIA:{PASSWORD}@bucket/in.jsonl", "--deadline", "+1h"],
        "file:///absolute/path",
    ),
    # botocore's "Invalid bucket name" repeats the bucket (here holding the credentials)
    "run, S3 output with credentials": (
        lambda s, t: _run(s, t, "--store", f"sqlite:///{t}/s.db", "--output", f"s3://AKIA:{PASSWORD}@b/p"),
        "fix --output",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_fragment_of_a_password_is_printed(
    case: str, sample: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build, says = CASES[case]
    result = _main(build(sample, tmp_path), capsys)
    _assert_one_line_without_the_password(result, PASSWORD, FIRST, SECOND)
    assert says in result.stderr, result.describe()


@pytest.mark.parametrize("escaped", [False, True], ids=["as typed", "percent-encoded"])
def test_a_wrong_password_refused_by_postgresql_is_not_printed(
    escaped: bool, pg_password_store_url: str, sample: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    real = pg_password_store_url.split(":", 2)[2].split("@", 1)[0]
    wrong = urllib.parse.quote(PASSWORD, safe="") if escaped else PASSWORD
    url = pg_password_store_url.replace(f":{real}@", f":{wrong}@", 1)
    for args in (["status", "j-x", "--store", url], _run(sample, tmp_path, "--store", url)):
        result = _main(args, capsys)
        _assert_one_line_without_the_password(result, PASSWORD, FIRST, SECOND, real)
        # percent-encoded, the password reaches the server, which refuses it
        assert ("password authentication failed" in result.stderr) is escaped, result.describe()


def test_the_mask_and_the_fragments_of_a_password(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.mask_url("postgresql://u@corp:pw@db/x") == "postgresql://u@corp:***@db/x"
    fragments = cli.secret_fragments(_pg())
    assert {PASSWORD, FIRST, SECOND} <= fragments and "adb" not in fragments
    monkeypatch.setattr(cli, "_secrets", fragments)
    # short text that only looks like a fragment stays: "pw" of another password, the word "db"
    assert cli.redact(f"host '{SECOND}@127.0.0.1' and {FIRST}") == "host '***@127.0.0.1' and ***"


def _store_env(url: str) -> dict[str, str]:
    return {"ADB_STORE_URL": url}


#: each case: the arguments, the environment, what the line must say; it must not say the option
ENV_CASES: dict[str, tuple[Callable[[Path, Path], list[str]], Callable[[Path], dict[str, str]], str]] = {
    # before: "pass --store with the URL the job was run with"
    "status, no store file": (
        lambda s, t: ["status", "j-x"],
        lambda t: _store_env(f"sqlite:///{t}/none.db"),
        "set ADB_STORE_URL",
    ),
    # before: "fix --store (...) or ADB_STORE_URL"
    "run, store folder a file": (
        lambda s, t: _run(s, t, "--output", str(t / "out")),
        lambda t: _store_env(f"sqlite:///{t}/in.jsonl/store.db"),
        "fix ADB_STORE_URL",
    ),
    # before: "fix --store (sqlite:///path/store.db or ...)"
    "usage, port not a number": (
        lambda s, t: ["usage"],
        lambda t: _store_env(_pg("127.0.0.1:abc")),
        "fix ADB_STORE_URL",
    ),
    # before: "check the --store URL and that the database is reachable" (exit 4)
    "status, host unknown": (
        lambda s, t: ["status", "j-x"],
        lambda t: _store_env(_pg()),
        "check ADB_STORE_URL",
    ),
    # before: "--output .../in.jsonl is an existing file"
    "run, output a file": (
        lambda s, t: _run(s, t, "--store", f"sqlite:///{t}/s.db"),
        lambda t: {"ADB_OUTPUT_URI": str(t / "in.jsonl")},
        "ADB_OUTPUT_URI",
    ),
}


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_an_error_caused_by_the_environment_names_the_variable(
    case: str, sample: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    build, env, says = ENV_CASES[case]
    for name, value in env(tmp_path).items():
        monkeypatch.setenv(name, value)
    result = _main(build(sample, tmp_path), capsys)
    _assert_one_line_without_the_password(result, PASSWORD, FIRST, SECOND)
    assert says in result.stderr, result.describe()
    option = "--output" if "ADB_OUTPUT_URI" in env(tmp_path) else "--store"
    for wrong in (f"fix {option}", f"the {option} URL", f"error: {option}"):
        assert wrong not in result.stderr, result.describe()
