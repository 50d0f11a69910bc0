"""Result records and the output manifest (docs/design.md §4.2, §4.3)."""

from __future__ import annotations

import datetime as dt

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from airflow_deadline_batch.core.records import ErrorCode, LineError
from airflow_deadline_batch.core.results import (
    RESULT_STATUSES,
    InputInfo,
    ManifestShard,
    ModelInfo,
    OutcomeCounts,
    OutputManifest,
    ResultError,
    ResultRecord,
    Usage,
    encode_line_error,
    encode_results,
)

SHA = "a" * 64
UTC = dt.timezone.utc


def test_result_record_round_trip_has_exactly_the_design_keys() -> None:
    usage = Usage(prompt_tokens=5, completion_tokens=2)
    rec = ResultRecord.succeeded(line=3, id="r1", output="ok", usage=usage, shard_id="00001", attempt_id="a")
    data = rec.to_json_bytes()
    assert list(orjson.loads(data)) == [
        "line",
        "id",
        "status",
        "output",
        "error",
        "usage",
        "shard_id",
        "attempt_id",
    ]
    # finish_reason and choices are written only when set (older records keep their bytes)
    assert orjson.loads(data) == rec.model_dump(exclude={"finish_reason", "choices"})
    assert ResultRecord.parse_line(data) == rec


def test_errored_from_line_error() -> None:
    rec = ResultRecord.from_line_error(LineError(7, None, ErrorCode.INVALID_JSON, "bad json; fix it"))
    assert (rec.line, rec.id, rec.status, rec.output) == (7, None, "errored", None)
    assert rec.error == ResultError(code="invalid_json", message="bad json; fix it")
    assert (rec.shard_id, rec.attempt_id) == ("validation", "plan")
    assert ResultRecord.parse_line(rec.to_json_bytes()) == rec


def test_encode_results_writes_one_line_per_record_each_ending_in_a_newline() -> None:
    recs = [
        ResultRecord.from_line_error(LineError(2, "x", ErrorCode.DUPLICATE_ID, "repeats line 1")),
        ResultRecord.succeeded(line=1, id="x", output="ok", usage=Usage(), shard_id="00000", attempt_id="a"),
    ]
    data = encode_results(iter(recs))
    assert data == recs[0].to_json_bytes() + b"\n" + recs[1].to_json_bytes() + b"\n"
    assert [ResultRecord.parse_line(raw) for raw in data.splitlines()] == recs
    assert encode_results([]) == b""


def test_result_statuses_are_the_design_statuses_in_order() -> None:
    assert RESULT_STATUSES == ("succeeded", "errored", "cancelled", "expired")
    assert tuple(OutcomeCounts().model_dump()) == RESULT_STATUSES


@pytest.mark.parametrize("status", ["cancelled", "expired"])
def test_cancelled_and_expired_need_an_error(status: str) -> None:
    rec = ResultRecord.failed(
        line=1,
        id="x",
        code=status,
        message="deadline passed",
        status=status,  # type: ignore[arg-type]
        shard_id="00000",
        attempt_id="a-1",
    )
    assert rec.status == status and rec.output is None


@pytest.mark.parametrize(
    "fields",
    [
        {"status": "succeeded", "output": None},
        {"status": "succeeded", "output": "x", "error": {"code": "c", "message": "m"}},
        {"status": "errored", "output": None, "error": None},
        {"status": "errored", "output": "x", "error": {"code": "c", "message": "m"}},
        {"status": "expired"},
        {"status": "unknown", "output": "x"},
        {"status": "succeeded", "output": "x", "line": 0},
        {"status": "succeeded", "output": "x", "extra": 1},
    ],
)
def test_result_record_rejects_inconsistent_outcomes(fields: dict[str, object]) -> None:
    base: dict[str, object] = {"line": 1, "id": "x", "shard_id": "00000", "attempt_id": "a-1"}
    with pytest.raises(ValidationError):
        ResultRecord.model_validate({**base, **fields})


def test_result_record_is_frozen() -> None:
    rec = ResultRecord.succeeded(line=1, id=None, output="", usage=Usage(), shard_id="s", attempt_id="a")
    with pytest.raises(ValidationError):
        rec.output = "changed"


def test_parse_line_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        ResultRecord.parse_line(b'{"line": 1')


def manifest(**overrides: object) -> OutputManifest:
    fields: dict[str, object] = {
        "job_id": "j-abc",
        "created_at": dt.datetime(2026, 1, 1, 1, 0, tzinfo=UTC),
        "deadline": dt.datetime(2026, 1, 1, 8, 0, tzinfo=dt.timezone(dt.timedelta(hours=2))),
        "model": ModelInfo(name="smollm2", digest="sha256:" + SHA),
        "prompt_template_version": "v1",
        "generation": {"temperature": 0.0, "max_tokens": 64},
        "input": InputInfo(uri="s3://b/in.jsonl", sha256=SHA, records=5),
        "outcomes": OutcomeCounts(succeeded=3, errored=2),
        "shards": (
            ManifestShard(
                shard_id="validation",
                seq=0,
                uri="file:///o/validation/errors.jsonl",
                sha256=SHA,
                records=1,
                attempt_id="plan",
            ),
            ManifestShard(
                shard_id="00000", seq=0, uri="file:///o/a/0", sha256=SHA, records=4, attempt_id="a-1"
            ),
        ),
        "completed_at": dt.datetime(2026, 1, 1, 5, 0, tzinfo=UTC),
    }
    fields.update(overrides)
    return OutputManifest.model_validate(fields)


def test_manifest_json_is_stable_sorted_and_round_trips() -> None:
    m = manifest()
    data = m.to_json_bytes()
    parsed = orjson.loads(data)
    assert set(parsed) == {
        "job_id",
        "manifest_version",
        "created_at",
        "deadline",
        "model",
        "prompt_template_version",
        "generation",
        "input",
        "outcomes",
        "shards",
        "completed_at",
    }
    assert list(parsed) == sorted(parsed)
    assert parsed["manifest_version"] == 1
    assert parsed["deadline"] == "2026-01-01T06:00:00Z"  # normalised to UTC
    assert set(parsed["shards"][0]) == {"shard_id", "seq", "uri", "sha256", "records", "attempt_id"}
    assert OutputManifest.from_json_bytes(data) == m
    assert OutputManifest.from_json_bytes(data).to_json_bytes() == data


@pytest.mark.parametrize(
    "overrides",
    [
        {"outcomes": OutcomeCounts(succeeded=3, errored=1)},
        {"input": InputInfo(uri="s3://b/in.jsonl", sha256=SHA, records=6)},
        {
            "shards": (
                ManifestShard(shard_id="00000", seq=0, uri="u1", sha256=SHA, records=2, attempt_id="a"),
                ManifestShard(shard_id="00000", seq=0, uri="u2", sha256=SHA, records=3, attempt_id="a"),
            )
        },
        {
            "shards": (
                ManifestShard(shard_id="00000", seq=0, uri="u", sha256=SHA, records=2, attempt_id="a"),
                ManifestShard(shard_id="00000", seq=1, uri="u", sha256=SHA, records=3, attempt_id="a"),
            )
        },
        {"created_at": dt.datetime(2026, 1, 1)},
        {"manifest_version": 2},
    ],
)
def test_manifest_rejects_inconsistencies(overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        manifest(**overrides)


def test_manifest_rejects_bad_checksum() -> None:
    with pytest.raises(ValidationError):
        ManifestShard(shard_id="00000", seq=0, uri="u", sha256="XYZ", records=1, attempt_id="a")


# text that orjson can encode (no lone surrogates), control characters and non-ASCII included
_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    line=st.integers(min_value=1, max_value=2**62),
    record_id=st.none() | _TEXT,
    code=st.sampled_from(list(ErrorCode)),
    message=_TEXT,
    shard_id=_TEXT.filter(bool),
    attempt_id=_TEXT.filter(bool),
)
def test_encode_line_error_is_the_pydantic_encoding_byte_for_byte(
    line: int, record_id: str | None, code: ErrorCode, message: str, shard_id: str, attempt_id: str
) -> None:
    error = LineError(line=line, id=record_id, code=code, message=message)
    assert encode_line_error(error) == encode_results([ResultRecord.from_line_error(error)])
    assert encode_line_error(error, shard_id=shard_id, attempt_id=attempt_id) == encode_results(
        [ResultRecord.from_line_error(error, shard_id=shard_id, attempt_id=attempt_id)]
    )


def test_encode_line_error_refuses_a_lone_surrogate_as_the_models_do() -> None:
    error = LineError(line=3, id="a\ud800", code=ErrorCode.INVALID_JSON, message="m")
    with pytest.raises(orjson.JSONEncodeError):
        encode_results([ResultRecord.from_line_error(error)])
    with pytest.raises(orjson.JSONEncodeError):
        encode_line_error(error)
