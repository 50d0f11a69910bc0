"""Export a published job as OpenAI Batch output files (``deadline-batch export --format openai``).

Reads only what the published, verified manifest lists, and writes, in input order:

* ``output.jsonl``: one OpenAI Batch request output per ``succeeded`` line, its
  ``response.body`` a ``chat.completion`` or ``text_completion`` object with ``usage``;
* ``errors.jsonl``: one per other line, OpenAI's error shape (``errored``: ``response`` with
  status 400/500 and an ``error`` body; ``expired``/``cancelled``: ``response`` null and ``error``
  ``batch_expired``/``batch_cancelled``);
* ``retry.jsonl``: the input lines of exactly those failed records, byte for byte, a valid
  input that retries only them (OpenAI's error file holds errors, not requests, so it cannot be
  resubmitted; this one can);
* ``export.json`` last: counts and the SHA-256 of each file (its presence means the export is whole).

Memory stays bounded whatever the job's size: outcomes are read object by object (on S3 eight
at a time, ahead of the sort: ``storage.read_ahead``, as verification does), a shard's put in line
order with sorted runs that spill to temporary files past ``run_bytes`` (its microbatches are
written in length order), the validation object (in line order, spanning the whole input) streamed
beside them, merged with the input read as a stream; the files are spooled on local disk and then
published with ``storage.put_file`` (a chunked copy and rename, or a multipart upload).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import heapq
import itertools
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import IO, Any, BinaryIO, Final, cast

import orjson

from airflow_deadline_batch.core.clock import Clock, SystemClock
from airflow_deadline_batch.core.records import (
    RawLine,
    Record,
    ValidationLimits,
    iter_raw_lines,
    parse_line,
    quick_parse,
)
from airflow_deadline_batch.core.results import (
    VALIDATION_SHARD_ID,
    Choice,
    ManifestShard,
    OutputManifest,
    ResultRecord,
)
from airflow_deadline_batch.core.shard_input import limits_from_config
from airflow_deadline_batch.exceptions import ConfigurationError, VerificationError
from airflow_deadline_batch.storage import ObjectStorage, open_storage, open_uri, put_file, sha256_hex
from airflow_deadline_batch.storage.read_ahead import Fetched, ObjectReader, read_ahead, stream_lines
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.worker.engines.base import DEFAULT_MAX_TOKENS

__all__ = [
    "ERRORS_FILE",
    "EXPORT_MANIFEST",
    "FORMATS",
    "OUTPUT_FILE",
    "RETRY_FILE",
    "ExportResult",
    "ExportedFile",
    "export_job",
]

FORMATS: Final = ("openai",)
OUTPUT_FILE: Final = "output.jsonl"
ERRORS_FILE: Final = "errors.jsonl"
RETRY_FILE: Final = "retry.jsonl"
EXPORT_MANIFEST: Final = "export.json"
#: bytes of outcome lines sorted in memory before a run spills to a temporary file
DEFAULT_RUN_BYTES: Final = 64 << 20
#: error codes of the provider's side (HTTP 500 in the error body); every other code is the request's (400)
SERVER_ERROR_CODES: Final = frozenset({"engine_error", "shard_failed", "invalid_structured_output"})
#: ``error.code`` of outcomes that never ran, as OpenAI names them
_NOT_RUN_CODES: Final[Mapping[str, str]] = {"expired": "batch_expired", "cancelled": "batch_cancelled"}
_PARAM = re.compile(r"body\.([A-Za-z_]+)")


@dataclass(frozen=True)
class ExportedFile:
    """One written file: where, its SHA-256, its lines and bytes."""

    name: str
    uri: str
    sha256: str
    lines: int
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "sha256": self.sha256, "lines": self.lines, "bytes": self.bytes}


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote; ``manifest_uri`` is its ``export.json``."""

    job_id: str
    format: str
    manifest_uri: str
    files: tuple[ExportedFile, ...]
    outcomes: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "format": self.format,
            "manifest": self.manifest_uri,
            "outcomes": dict(self.outcomes),
            "files": {f.name: f.to_dict() for f in self.files},
        }


def export_job(
    store: ManifestStore,
    job_id: str,
    output: str,
    *,
    fmt: str = "openai",
    run_bytes: int = DEFAULT_RUN_BYTES,
    clock: Clock | None = None,
) -> ExportResult:
    """Write the job's outcomes as OpenAI Batch files under ``output`` (a directory or ``s3://``).

    Refuses (``ConfigurationError``) a job without a published manifest and
    (``VerificationError``) one whose manifest or objects do not verify; nothing is written then.
    Re-running replaces an earlier export in the same place.
    """
    if fmt not in FORMATS:
        raise ConfigurationError(f"unknown export format {fmt!r}; use {', '.join(FORMATS)}")
    if run_bytes < 1:
        raise ConfigurationError(f"run_bytes must be >= 1, got {run_bytes}")
    job = store.get_job(job_id)
    manifest, manifest_sha256 = _verified_manifest(store, job_id)
    target = open_storage(output)
    # an earlier export's manifest would vouch for files about to be replaced: it goes first
    target.delete(EXPORT_MANIFEST)
    written = _write_files(manifest, limits_from_config(job.config), target, run_bytes)
    export = {
        "format": fmt,
        "job_id": job_id,
        "created_at": (clock or SystemClock()).now().astimezone(dt.UTC).isoformat(),
        "source": {
            "manifest_uri": job.manifest_uri,
            "manifest_sha256": manifest_sha256,
            "input": manifest.input.model_dump(mode="json"),
        },
        "outcomes": manifest.outcomes.model_dump(),
        "files": {f.name: f.to_dict() for f in written},
    }
    data = orjson.dumps(export, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
    uri = target.put_bytes(EXPORT_MANIFEST, data)
    return ExportResult(job_id, fmt, uri, written, manifest.outcomes.model_dump())


def _write_files(
    manifest: OutputManifest, limits: ValidationLimits, target: ObjectStorage, run_bytes: int
) -> tuple[ExportedFile, ...]:
    """Spool the three files locally from the ordered outcomes and the input, then publish them."""
    reader = ObjectReader()
    with tempfile.TemporaryDirectory(prefix="adb-export-") as tmp:
        spool = Path(tmp)
        files = _OpenAIFiles(spool, manifest, limits)
        try:
            outcomes = _ordered_outcomes(manifest, reader, run_bytes, spool)
            for record, raw, line_bytes in _with_input(outcomes, manifest, limits, reader):
                files.add(record, raw, line_bytes)
        finally:
            files.close()
        spooled = ((OUTPUT_FILE, files.output), (ERRORS_FILE, files.errors), (RETRY_FILE, files.retry))
        return tuple(_publish(target, spool / name, name, meta) for name, meta in spooled)


# ------------------------------------------------------------------------------------- the source


def _verified_manifest(store: ManifestStore, job_id: str) -> tuple[OutputManifest, str]:
    """The job's published manifest, after the verifier re-checked it and every object it lists."""
    from airflow_deadline_batch.service.finalize import verify_manifest

    job = store.get_job(job_id)
    if job.manifest_uri is None:
        raise ConfigurationError(
            f"job {job_id} has no published manifest (state {job.state.value}); export runs once the job "
            "is completed or partial: let `deadline-batch run` or the completeness sensor finish it",
            job_id=job_id,
        )
    report = verify_manifest(store, job_id)
    if not report.complete:
        first = report.problems[0] if report.problems else report.summary().splitlines()[0]
        raise VerificationError(
            f"job {job_id}: the published manifest does not verify ({first}); run "
            f"`deadline-batch verify {job_id}` and restore the outputs before exporting",
            job_id=job_id,
        )
    storage, key = open_uri(job.manifest_uri)
    data = storage.get_bytes(key)
    digest = sha256_hex(data)
    if job.manifest_sha256 and digest != job.manifest_sha256:
        raise VerificationError(
            f"job {job_id}: manifest {job.manifest_uri} changed after publication; "
            "restore it before exporting",
            job_id=job_id,
        )
    return OutputManifest.from_json_bytes(data), digest


def _ordered_outcomes(
    manifest: OutputManifest, reader: ObjectReader, run_bytes: int, spool: Path
) -> Iterator[tuple[int, bytes]]:
    """Every outcome line of the manifest's objects as ``(line, bytes)``, in line order.

    Shards are contiguous line ranges in index order, so the shards' sorted outcomes, one shard
    after the other, are in order; the validation object's lines fall anywhere and are merged in.
    The shards' objects are read ahead in that order (on S3 several at a time, :func:`read_ahead`).
    """
    validation: list[ManifestShard] = []
    shards: list[ManifestShard] = []
    for obj in manifest.shards:
        if obj.shard_id == VALIDATION_SHARD_ID:
            validation.append(obj)
        elif obj.shard_id.isdigit():
            shards.append(obj)
        else:
            raise VerificationError(
                f"manifest of job {manifest.job_id} lists an unknown shard {obj.shard_id!r}"
            )
    shards.sort(key=lambda s: (int(s.shard_id), s.seq))

    def by_shard() -> Iterator[tuple[int, bytes]]:
        fetched = read_ahead(shards, reader)
        for _, objects in itertools.groupby(fetched, key=lambda item: int(item[0].shard_id)):
            yield from _sorted_lines(objects, reader, run_bytes, spool)

    return heapq.merge(_validation_lines(validation, reader, run_bytes, spool), by_shard(), key=itemgetter(0))


def _validation_lines(
    objects: list[ManifestShard], reader: ObjectReader, run_bytes: int, spool: Path
) -> Iterator[tuple[int, bytes]]:
    """The validation object's lines in line order, as ``(line, bytes)``.

    The planner writes them in line order, so after a first pass that finds them so they are
    streamed as they are (checked again as they come: the object may not change in between);
    otherwise they are sorted like a shard's. Either way memory does not grow with the object
    (28 MB at 10M lines), which is merged beside the shard being sorted.
    """
    if not _in_line_order(objects, reader):
        yield from _sorted_lines(read_ahead(objects, reader), reader, run_bytes, spool)
        return
    last = 0
    for obj in objects:
        for raw in _object_lines(obj, Fetched(), reader):
            line = _line_of(raw, obj.uri)
            if line <= last:
                raise _changed(obj)
            last = line
            yield line, raw


def _in_line_order(objects: list[ManifestShard], reader: ObjectReader) -> bool:
    """Whether the objects' lines, one object after the other, have ascending line numbers."""
    last = 0
    for obj in objects:
        with reader.open_read(obj.uri) as stream:
            for raw in stream_lines(stream, hashlib.sha256()):
                if raw.strip():
                    line = _line_of(raw, obj.uri)
                    if line <= last:
                        return False
                    last = line
    return True


def _sorted_lines(
    objects: Iterable[tuple[ManifestShard, Fetched]], reader: ObjectReader, run_bytes: int, spool: Path
) -> Iterator[tuple[int, bytes]]:
    """The outcome lines of ``objects`` in line order: sorted in memory up to ``run_bytes``,
    beyond that as sorted runs in temporary files merged lazily (an external merge sort)."""
    runs: list[Path] = []
    buffer: list[tuple[int, bytes]] = []
    held = 0
    for obj, fetched in objects:
        for raw in _object_lines(obj, fetched, reader):
            buffer.append((_line_of(raw, obj.uri), raw))
            held += len(raw) + 80  # the tuple and the int beside the bytes
            if held >= run_bytes:
                runs.append(_spill(buffer, spool))
                buffer, held = [], 0
    buffer.sort(key=itemgetter(0))
    if not runs:
        yield from buffer
        return
    if buffer:
        runs.append(_spill(buffer, spool))
    del buffer
    try:
        yield from heapq.merge(*(_read_run(path) for path in runs), key=itemgetter(0))
    finally:
        for path in runs:
            path.unlink(missing_ok=True)


def _object_lines(obj: ManifestShard, fetched: Fetched, reader: ObjectReader) -> Iterator[bytes]:
    """The non-blank lines of one committed object (read ahead whole, or else streamed); its
    SHA-256 and record count checked."""
    if fetched.error is not None:
        raise fetched.error
    if fetched.data is not None:
        if fetched.sha256 != obj.sha256:
            raise _changed(obj)
        lines = [raw.rstrip(b"\r") for raw in fetched.data.split(b"\n")]
        lines = [raw for raw in lines if raw.strip()]
        if len(lines) != obj.records:
            raise _changed(obj)
        yield from lines
        return
    digest = hashlib.sha256()
    count = 0
    with reader.open_read(obj.uri) as stream:
        for line in stream_lines(stream, digest):
            raw = line.rstrip(b"\r")
            if raw.strip():
                count += 1
                yield raw
    if digest.hexdigest() != obj.sha256 or count != obj.records:
        raise _changed(obj)


def _changed(obj: ManifestShard) -> VerificationError:
    return VerificationError(
        f"object {obj.uri} changed after verification (SHA-256 or record count); "
        "export again once it is restored",
        uri=obj.uri,
    )


def _line_of(raw: bytes, uri: str) -> int:
    try:
        line = orjson.loads(raw)["line"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        line = None
    if not isinstance(line, int) or isinstance(line, bool):
        raise VerificationError(f"object {uri} holds a line that is not a result record", uri=uri)
    return line


def _spill(buffer: list[tuple[int, bytes]], spool: Path) -> Path:
    buffer.sort(key=itemgetter(0))
    fd, name = tempfile.mkstemp(prefix="run-", suffix=".txt", dir=spool)
    with os.fdopen(fd, "wb") as out:
        for line, raw in buffer:
            out.write(b"%d %s\n" % (line, raw))  # orjson output never holds a raw newline
    return Path(name)


def _read_run(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as stream:
        for item in stream:
            line, _, raw = item.rstrip(b"\n").partition(b" ")
            yield int(line), raw


class _HashingStream:
    """``readline`` over a binary stream, hashing every byte read (the input's SHA-256 check)."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self.digest = hashlib.sha256()

    def readline(self, limit: int = -1) -> bytes:
        data = self._stream.readline(limit)
        self.digest.update(data)
        return data


def _with_input(
    outcomes: Iterator[tuple[int, bytes]],
    manifest: OutputManifest,
    limits: ValidationLimits,
    reader: ObjectReader,
) -> Iterator[tuple[ResultRecord, RawLine, bytes]]:
    """Each outcome with its input line (and that line's bytes for the retry file), in order.

    The input is read once as a stream beside the outcomes; every non-blank line must have
    exactly one outcome, and the input must still hash to the manifest's SHA-256.
    """
    source, key = reader.storage(manifest.input.uri)
    with source.open_read(key) as raw_stream:
        stream = _HashingStream(raw_stream)
        lines = iter_raw_lines(cast(BinaryIO, stream), max_line_bytes=limits.max_line_bytes)
        last = 0
        for number, data in outcomes:
            if number <= last:
                raise VerificationError(f"line {number} of job {manifest.job_id} has more than one outcome")
            last = number
            raw = _advance(lines, number, limits, manifest)
            yield ResultRecord.parse_line(data), raw, _line_bytes(raw, source, key)
        for raw in lines:
            _no_outcome(raw, limits, manifest)
    if stream.digest.hexdigest() != manifest.input.sha256:
        raise VerificationError(
            f"input {manifest.input.uri} changed since job {manifest.job_id} was planned (SHA-256 differs); "
            "the export needs the input the job ran on",
        )


def _advance(
    lines: Iterator[RawLine], number: int, limits: ValidationLimits, manifest: OutputManifest
) -> RawLine:
    for raw in lines:
        if raw.line == number:
            return raw
        _no_outcome(raw, limits, manifest)
    raise VerificationError(
        f"job {manifest.job_id} has an outcome for line {number}, past the end of its input"
    )


def _no_outcome(raw: RawLine, limits: ValidationLimits, manifest: OutputManifest) -> None:
    """A line without an outcome must be blank."""
    if raw.data is None or parse_line(raw, limits) is not None:
        raise VerificationError(f"line {raw.line} of job {manifest.job_id}'s input has no outcome")


def _line_bytes(raw: RawLine, source: ObjectStorage, key: str) -> bytes:
    """The line as the input holds it (without its line ending or a leading BOM), for ``retry.jsonl``.

    A line too long to load is re-read from its byte range.
    """
    if raw.data is not None:
        data = raw.data
    else:
        data = source.read_range(key, raw.offset, raw.end_offset).rstrip(b"\r\n")
    return data[3:] if raw.line == 1 and data[:3] == b"\xef\xbb\xbf" else data


# ------------------------------------------------------------------------------------- the files


class _HashedFile:
    """A spooled output file: counts lines and bytes and hashes them as it writes."""

    def __init__(self, path: Path) -> None:
        self._out: IO[bytes] = path.open("wb")
        self.digest = hashlib.sha256()
        self.lines = 0
        self.bytes = 0

    def write(self, data: bytes) -> None:
        line = data + b"\n"
        self._out.write(line)
        self.digest.update(line)
        self.lines += 1
        self.bytes += len(line)

    def close(self) -> None:
        self._out.close()


class _OpenAIFiles:
    """Turns outcomes into OpenAI Batch request-output lines (``output``/``errors``) and retry lines."""

    def __init__(self, spool: Path, manifest: OutputManifest, limits: ValidationLimits) -> None:
        self.output = _HashedFile(spool / OUTPUT_FILE)
        self.errors = _HashedFile(spool / ERRORS_FILE)
        self.retry = _HashedFile(spool / RETRY_FILE)
        self._job = manifest.job_id
        self._model = manifest.model.name
        self._created = int(manifest.completed_at.timestamp())
        digest = manifest.model.digest
        self._fingerprint = f"fp_{digest[:12]}" if digest else None
        generation = manifest.generation
        self._max_tokens = int(
            generation.get("max_completion_tokens") or generation.get("max_tokens") or DEFAULT_MAX_TOKENS
        )
        self._limits = limits

    def add(self, record: ResultRecord, raw: RawLine, line_bytes: bytes) -> None:
        common = {"id": f"batch_req_{self._job}_{record.line}", "custom_id": record.id}
        request_id = f"req_{self._job}_{record.line}"
        if record.status == "succeeded":
            request = self._request(raw)
            body = self._body(record, request)
            line = {
                **common,
                "response": {"status_code": 200, "request_id": request_id, "body": body},
                "error": None,
            }
            self.output.write(orjson.dumps(line))
            return
        error = record.error
        assert error is not None  # a failed record has one (ResultRecord checks)
        if record.status in _NOT_RUN_CODES:
            line = {
                **common,
                "response": None,
                "error": {
                    "code": _NOT_RUN_CODES[record.status],
                    "message": error.message,
                    "line": record.line,
                },
            }
        else:
            server = error.code in SERVER_ERROR_CODES
            param = _PARAM.search(error.message) if error.code == "unsupported_parameter" else None
            body = {
                "error": {
                    "message": error.message,
                    "type": "server_error" if server else "invalid_request_error",
                    "param": param.group(1) if param else None,
                    "code": error.code,
                }
            }
            status = 500 if server else 400
            line = {
                **common,
                "response": {"status_code": status, "request_id": request_id, "body": body},
                "error": None,
            }
        self.errors.write(orjson.dumps(line))
        self.retry.write(line_bytes)

    def close(self) -> None:
        for f in (self.output, self.errors, self.retry):
            f.close()

    def _request(self, raw: RawLine) -> tuple[bool, int | None]:
        """Whether the succeeded line is a chat, and its own ``max_tokens``, re-read as the planner
        read it (``quick_parse`` for the ordinary shapes, which is the planner's shortcut too)."""
        data = raw.data
        if data is not None and raw.line == 1 and data[:3] == b"\xef\xbb\xbf":
            data = data[3:]
        quick = quick_parse(data, self._limits) if data is not None else None
        if quick is not None:
            return not isinstance(quick[1], str), quick[2]
        parsed = parse_line(raw, self._limits) if raw.data is not None else None
        if not isinstance(parsed, Record):
            raise VerificationError(
                f"line {raw.line} of job {self._job} succeeded but its input line does not parse"
            )
        return parsed.request.kind == "chat", parsed.request.max_tokens

    def _body(self, record: ResultRecord, request: tuple[bool, int | None]) -> dict[str, Any]:
        chat, own_limit = request
        limit = own_limit or self._max_tokens
        fallback = record.finish_reason or (
            "length" if record.usage.completion_tokens >= limit else "stop"
        )  # records written before finish_reason existed
        assert record.output is not None
        choices = record.choices or (Choice(index=0, text=record.output, finish_reason=fallback),)
        usage = record.usage
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{self._job}-{record.line}",
            "object": "chat.completion" if chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [
                _chat_choice(c, fallback) if chat else _completion_choice(c, fallback) for c in choices
            ],
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            },
            "system_fingerprint": self._fingerprint,
        }


def _chat_choice(choice: Choice, fallback: str) -> dict[str, Any]:
    logprobs = None
    if choice.logprobs is not None:
        logprobs = {
            "content": [
                {
                    "token": t.token,
                    "logprob": t.logprob,
                    "bytes": list(t.token.encode()),
                    "top_logprobs": [
                        {"token": a.token, "logprob": a.logprob, "bytes": list(a.token.encode())}
                        for a in t.top_logprobs
                    ],
                }
                for t in choice.logprobs
            ],
            "refusal": None,
        }
    return {
        "index": choice.index,
        "message": {"role": "assistant", "content": choice.text, "refusal": None},
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason or fallback,
    }


def _completion_choice(choice: Choice, fallback: str) -> dict[str, Any]:
    logprobs = None
    if choice.logprobs is not None:
        offsets, at = [], 0
        for t in choice.logprobs:
            offsets.append(at)
            at += len(t.token)
        logprobs = {
            "tokens": [t.token for t in choice.logprobs],
            "token_logprobs": [t.logprob for t in choice.logprobs],
            "top_logprobs": [{a.token: a.logprob for a in t.top_logprobs} for t in choice.logprobs],
            "text_offset": offsets,
        }
    return {
        "index": choice.index,
        "text": choice.text,
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason or fallback,
    }


# ------------------------------------------------------------------------------------- publication


def _publish(target: ObjectStorage, path: Path, name: str, meta: _HashedFile) -> ExportedFile:
    """Copy a spooled file to ``target`` without loading it (``put_file``: a chunked copy and an
    atomic rename locally, a managed multipart upload on S3)."""
    uri = put_file(target, name, path)
    return ExportedFile(name, uri, meta.digest.hexdigest(), meta.lines, meta.bytes)
