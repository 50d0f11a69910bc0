"""``deadline-batch export --format openai``: OpenAI Batch files from a published job, end to end.

A real job (the console script, echo workers, small microbatches so shards hold several objects in
length order) over an input with every kind of bad line, a line too long to load, native and
OpenAI lines, ``n``/``logprobs`` and ``response_format`` lines, is exported; every line of the
files is checked with the official ``openai`` package's own types, and the retry file is run as
a new job that must retry exactly the failed lines. Then the same from S3 (moto over HTTP), the
sorted-run spill path, and the refusals.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject
from pydantic import BaseModel, ConfigDict

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.exceptions import ConfigurationError, StoreError
from airflow_deadline_batch.service.export import export_job
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import CliResult, cli_argv, cli_env, run_cli, wait_for
from tests.helpers.inputs import ECHO_FAIL_MARKER, mixed_input
from tests.helpers.outcomes import read_manifest, read_outcomes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "label",
        "schema": {
            "type": "object",
            "properties": {"label": {"enum": ["spam", "ham"]}},
            "required": ["label"],
            "additionalProperties": False,
        },
    },
}


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchRequestOutput(BaseModel):
    """One line of an OpenAI Batch output or error file, as the Batch API reference defines it
    (the SDK has no type for the line itself; its parts are checked with the SDK's own types)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    custom_id: str | None
    response: _Response | None
    error: dict[str, Any] | None


def openai_line(custom_id: str, url: str, **body: Any) -> bytes:
    return orjson.dumps(
        {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}
    )


def chat_line(custom_id: str, text: str, **body: Any) -> bytes:
    return openai_line(
        custom_id, "/v1/chat/completions", messages=[{"role": "user", "content": text}], **body
    )


#: lines whose outcome the test knows: custom_id -> (status, error code)
SPECIAL = {
    "multi": ("succeeded", None),
    "chat-logprobs": ("succeeded", None),
    "schema-ok": ("succeeded", None),
    "schema-bad": ("errored", "invalid_structured_output"),
    "object-bad": ("errored", "invalid_structured_output"),
    "boom": ("errored", "engine_error"),
    "tools": ("errored", "unsupported_parameter"),
}


def special_lines() -> bytes:
    lines = [
        openai_line("multi", "/v1/completions", prompt="one two three", n=3, logprobs=2),
        chat_line("chat-logprobs", "tell me more", logprobs=True, top_logprobs=1),
        chat_line("schema-ok", '{"label": "spam"}', response_format=SCHEMA),
        chat_line("schema-bad", '{"label": "eggs"}', response_format=SCHEMA),
        chat_line("object-bad", "not json at all", response_format={"type": "json_object"}),
        chat_line("boom", f"please {ECHO_FAIL_MARKER}"),
        chat_line("tools", "x", tools=[{"type": "function", "function": {"name": "f"}}]),
    ]
    return b"".join(line + b"\n" for line in lines)


def run_job(
    tmp: Path, input_path: Path | str, store_url: str, output: str, *, max_invalid: str = "0.5"
) -> dict[str, Any]:
    result = run_cli(
        "run",
        str(input_path),
        "--deadline",
        "+1h",
        "--engine",
        "echo",
        "--workers",
        "2",
        "--microbatch-size",
        "4",
        "--max-invalid-fraction",
        max_invalid,
        "--store",
        store_url,
        "--output",
        output,
        "--new-job",
        "--json",
        cwd=tmp,
    )
    assert result.code == 0, result.describe()
    return result.json()


def export(tmp: Path, job_id: str, store_url: str, output: str) -> CliResult:
    return run_cli(
        "export", job_id, "--format", "openai", "--output", output, "--store", store_url, "--json", cwd=tmp
    )


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def line_number(out: dict[str, Any]) -> int:
    return int(out["id"].rsplit("_", 1)[1])


def check_openai_line(out: dict[str, Any]) -> None:
    """The line is a Batch request output whose parts parse with the SDK's types."""
    line = BatchRequestOutput.model_validate(out)
    if line.response is not None:
        assert line.error is None
        body = line.response.body
        if line.response.status_code == 200:
            if body["object"] == "chat.completion":
                parsed: ChatCompletion | Completion = ChatCompletion.model_validate(body)
            else:
                parsed = Completion.model_validate(body)
            assert parsed.usage is not None
            assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
        else:
            assert set(body) == {"error"}
            ErrorObject.model_validate(body["error"])
    else:
        assert line.error is not None
        assert BatchError.model_validate(line.error).code in ("batch_expired", "batch_cancelled")


@pytest.fixture(scope="module")
def local_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("export")
    data = mixed_input(240, seed=11, bad_fraction=0.1, huge_lines=True).data
    data = (data if data.endswith(b"\n") else data + b"\n") + special_lines()
    input_path = tmp / "input.jsonl"
    input_path.write_bytes(data)
    store_url = f"sqlite:///{tmp / 'store.db'}"
    summary = run_job(tmp, input_path, store_url, str(tmp / "out"))
    assert summary["state"] == "completed", summary
    return {"tmp": tmp, "input": input_path, "store_url": store_url, "summary": summary}


def test_every_exported_line_parses_with_the_openai_types_in_input_order(local_job: dict[str, Any]) -> None:
    tmp, store_url, summary = local_job["tmp"], local_job["store_url"], local_job["summary"]
    job_id = summary["job_id"]
    result = export(tmp, job_id, store_url, str(tmp / "exp"))
    assert result.code == 0, result.describe()
    exp = tmp / "exp"
    outcomes = dict(sorted(read_outcomes(read_manifest(summary["manifest"])).items()))

    output, errors = jsonl(exp / "output.jsonl"), jsonl(exp / "errors.jsonl")
    for out in output + errors:
        check_openai_line(out)
    # input order, one line per outcome, each in the file its status says
    for lines in (output, errors):
        numbers = [line_number(o) for o in lines]
        assert numbers == sorted(numbers)
    assert sorted(line_number(o) for o in output) == [
        n for n, r in outcomes.items() if r["status"] == "succeeded"
    ]
    assert sorted(line_number(o) for o in errors) == [
        n for n, r in outcomes.items() if r["status"] != "succeeded"
    ]
    for out in output + errors:
        assert out["custom_id"] == outcomes[line_number(out)]["id"]  # native lines: their "id"
    for out in output:
        rec = outcomes[line_number(out)]
        first = out["response"]["body"]["choices"][0]
        assert first.get("text", (first.get("message") or {}).get("content")) == rec["output"]  # exact text
        usage = out["response"]["body"]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            rec["usage"]["prompt_tokens"],
            rec["usage"]["completion_tokens"],
        )
    for out in errors:
        rec = outcomes[line_number(out)]
        assert out["response"]["body"]["error"]["code"] == rec["error"]["code"]

    # the lines with known outcomes, by custom_id
    by_id = {o["custom_id"]: o for o in output + errors if o["custom_id"] in SPECIAL}
    assert set(by_id) == set(SPECIAL)
    for custom_id, (status, code) in SPECIAL.items():
        out = by_id[custom_id]
        if status == "succeeded":
            assert out["response"]["status_code"] == 200
        else:
            assert out["response"]["body"]["error"]["code"] == code
    multi = Completion.model_validate(by_id["multi"]["response"]["body"])
    assert [c.index for c in multi.choices] == [0, 1, 2]
    assert multi.choices[0].logprobs is not None and multi.choices[0].logprobs.tokens == [
        "echo:",
        " one",
        " two",
        " three",
    ]
    chat = ChatCompletion.model_validate(by_id["chat-logprobs"]["response"]["body"])
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    assert "".join(t.token for t in chat.choices[0].logprobs.content) == chat.choices[0].message.content
    assert ChatCompletion.model_validate(by_id["schema-ok"]["response"]["body"]).choices[
        0
    ].message.content == ('{"label": "spam"}')
    assert by_id["tools"]["response"]["body"]["error"]["param"] == "tools"

    # the export's own manifest: counts and each file's SHA-256
    manifest = orjson.loads((exp / "export.json").read_bytes())
    assert manifest["job_id"] == job_id and manifest["format"] == "openai"
    for name, meta in manifest["files"].items():
        data = (exp / name).read_bytes()
        assert meta["sha256"] == hashlib.sha256(data).hexdigest()
        assert meta["lines"] == data.count(b"\n") and meta["bytes"] == len(data)
    assert manifest["files"]["output.jsonl"]["lines"] == summary["records"]["succeeded"]
    assert (
        manifest["files"]["errors.jsonl"]["lines"]
        == summary["records"]["total"] - summary["records"]["succeeded"]
    )
    assert result.json()["files"] == manifest["files"]


def test_the_retry_file_resubmitted_retries_exactly_the_failed_lines(local_job: dict[str, Any]) -> None:
    tmp, store_url, summary = local_job["tmp"], local_job["store_url"], local_job["summary"]
    exp = tmp / "exp-retry"
    assert export(tmp, summary["job_id"], store_url, str(exp)).code == 0
    errors = jsonl(exp / "errors.jsonl")
    retry = exp / "retry.jsonl"
    input_lines = local_job["input"].read_bytes().split(b"\n")
    expected = []
    for out in errors:  # each failed line, byte for byte (without its line ending and the BOM)
        raw = input_lines[line_number(out) - 1].removesuffix(b"\r")
        expected.append(raw.removeprefix(b"\xef\xbb\xbf"))
    assert retry.read_bytes().split(b"\n")[:-1] == expected

    # the retry file holds the input errors too (most of its lines here): admit them all
    again = run_job(tmp, retry, store_url, str(tmp / "out-retry"), max_invalid="1")
    assert again["records"]["total"] == len(errors)
    new = dict(sorted(read_outcomes(read_manifest(again["manifest"])).items()))
    # the same records, in the same order: what failed for good fails again with the same code
    assert [r["id"] for r in new.values()] == [o["custom_id"] for o in errors]
    old_codes = {o["custom_id"]: o["response"]["body"]["error"]["code"] for o in errors if o["custom_id"]}
    for rec in new.values():
        if rec["id"] in SPECIAL:
            assert rec["error"]["code"] == old_codes[rec["id"]]


def test_sorted_runs_that_spill_to_disk_give_the_same_files(local_job: dict[str, Any]) -> None:
    store = ManifestStore(local_job["store_url"])
    job_id = local_job["summary"]["job_id"]
    tmp = local_job["tmp"]
    small = export_job(store, job_id, str(tmp / "spill"), run_bytes=1)  # every outcome its own run
    large = export_job(store, job_id, str(tmp / "spill"))  # again, in place: replaces the files
    assert [f.sha256 for f in small.files] == [f.sha256 for f in large.files]
    assert [f.lines for f in small.files] == [f.lines for f in large.files]
    manifest = orjson.loads((tmp / "spill" / "export.json").read_bytes())
    assert manifest["files"] == {f.name: f.to_dict() for f in large.files}


def test_export_from_and_to_s3(tmp_path: Path, s3_base_uri: str, s3_client: Any) -> None:
    data = mixed_input(60, seed=5, bad_fraction=0.1).data
    data = (data if data.endswith(b"\n") else data + b"\n") + special_lines()
    bucket = s3_base_uri.removeprefix("s3://").split("/")[0]
    s3_client.put_object(Bucket=bucket, Key="in/input.jsonl", Body=data)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    summary = run_job(tmp_path, f"s3://{bucket}/in/input.jsonl", store_url, f"{s3_base_uri}/out")
    result = export(tmp_path, summary["job_id"], store_url, f"{s3_base_uri}/export")
    assert result.code == 0, result.describe()
    files = result.json()["files"]
    manifest = orjson.loads(
        s3_client.get_object(Bucket=bucket, Key="prefix/export/export.json")["Body"].read()
    )
    assert manifest["files"] == files
    lines = 0
    for name in ("output.jsonl", "errors.jsonl", "retry.jsonl"):
        body = s3_client.get_object(Bucket=bucket, Key=f"prefix/export/{name}")["Body"].read()
        assert hashlib.sha256(body).hexdigest() == files[name]["sha256"]
        if name != "retry.jsonl":
            for raw in body.splitlines():
                check_openai_line(orjson.loads(raw))
                lines += 1
    assert lines == summary["records"]["total"]


def test_export_refuses_a_job_without_a_published_manifest(tmp_path: Path) -> None:
    from airflow_deadline_batch.service.planning import PlanRequest, plan_job

    input_path = tmp_path / "input.jsonl"
    input_path.write_bytes(chat_line("a", "hello") + b"\n")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore(store_url)
    store.migrate()
    request = PlanRequest(
        input_uri=str(input_path),
        deadline=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        model=None,
        generation={},
        pools=default_local_pools("echo"),
        workers=1,
        idempotency_key="unpublished",
    )
    job_id = plan_job(store, request).job_id
    with pytest.raises(ConfigurationError, match="no published manifest"):
        export_job(store, job_id, str(tmp_path / "exp"))
    result = export(tmp_path, job_id, store_url, str(tmp_path / "exp"))
    assert result.code == 2, result.describe()
    assert len(result.stderr.strip().splitlines()) == 1 and "no published manifest" in result.stderr
    assert not (tmp_path / "exp").exists()


def test_a_cancelled_job_exports_batch_cancelled_errors_and_retries_them(tmp_path: Path) -> None:
    """A job cancelled mid-run: its unprocessed records are ``batch_cancelled`` errors (OpenAI's
    code, ``response`` null), and the retry file runs exactly them."""
    lines = [chat_line(f"r{i:02d}", f"hello {i}") for i in range(60)]
    (tmp_path / "in.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    argv = cli_argv(
        "run", str(tmp_path / "in.jsonl"), "--deadline", "+1h", "--engine", "echo", "--workers", "1",
        "--microbatch-size", "4", "--store", store_url, "--output", str(tmp_path / "out"), "--json",
    )  # fmt: skip
    # each record takes 0.3 s of simulated work, so the job is still running when it is cancelled
    env = cli_env({"ADB_ECHO_DELAY_S": "0.3"})
    with subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:

        def committed() -> str | None:
            """The job's ID once its first microbatch committed (the run creates the store)."""
            if not (tmp_path / "store.db").exists():
                return None
            store = ManifestStore(store_url)
            try:
                jobs = store.list_jobs()
                if jobs and store.progress(jobs[0].job_id).committed_records > 0:
                    return jobs[0].job_id
            except StoreError:  # the file exists before the run's migration created the schema
                return None
            finally:
                store.close()
            return None

        job_id = wait_for(committed, timeout_s=120, what="the first committed microbatch", interval_s=0.2)
        cancel = run_cli("cancel", job_id, "--store", store_url, cwd=tmp_path)
        assert cancel.code == 0, cancel.describe()
        proc.communicate(timeout=120)
    assert ManifestStore(store_url).get_job(job_id).manifest_uri is not None

    result = export(tmp_path, job_id, store_url, str(tmp_path / "exp"))
    assert result.code == 0, result.describe()
    errors = jsonl(tmp_path / "exp" / "errors.jsonl")
    output = jsonl(tmp_path / "exp" / "output.jsonl")
    assert errors and output and len(errors) + len(output) == 60
    for out in errors:
        check_openai_line(out)
        assert out["response"] is None and out["error"]["code"] == "batch_cancelled"
    retry = tmp_path / "exp" / "retry.jsonl"
    assert retry.read_bytes().splitlines() == [lines[line_number(o) - 1] for o in errors]
    again = run_job(tmp_path, retry, store_url, str(tmp_path / "out-retry"))
    assert (again["records"]["total"], again["records"]["succeeded"]) == (len(errors), len(errors))
