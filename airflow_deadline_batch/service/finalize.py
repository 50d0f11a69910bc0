"""Verification and publication: prove one terminal outcome per input line, then publish once.

The manifest store's commits are the truth (an object in storage means nothing until committed:
docs/design.md §4.5 invariant 3). Verification reads every committed object, checks its SHA-256
and every line in it, and counts each input line exactly once. Publication is a conditional
create of ``manifest.json`` (docs/design.md §4.3): a second publisher loses cleanly and returns
the first one's manifest.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import tempfile
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal

import orjson

from airflow_deadline_batch.core.clock import Clock, SystemClock
from airflow_deadline_batch.core.ids import shard_id as display_shard_id
from airflow_deadline_batch.core.results import (
    FINALIZE_ATTEMPT_ID,
    RESULT_STATUSES,
    VALIDATION_SHARD_ID,
    InputInfo,
    ManifestShard,
    ModelInfo,
    OutcomeCounts,
    OutputManifest,
    ResultRecord,
    SettledUsage,
)
from airflow_deadline_batch.core.shard_input import iter_shard, limits_from_config
from airflow_deadline_batch.core.states import JobState, ShardState
from airflow_deadline_batch.exceptions import (
    ChecksumMismatch,
    InputError,
    InvalidTransition,
    ObjectExists,
    ObjectNotFound,
    StorageError,
    VerificationError,
)
from airflow_deadline_batch.service.settlement import settle_job
from airflow_deadline_batch.storage import open_storage, open_uri, put_stream, sha256_hex
from airflow_deadline_batch.storage.base import CHUNK_SIZE
from airflow_deadline_batch.storage.read_ahead import ObjectReader, read_ahead, stream_lines
from airflow_deadline_batch.store import ManifestStore

MANIFEST_KEY = "manifest.json"
#: where the finalizer writes the outcomes of records that never committed
FINALIZE_PREFIX = "finalize/"
STATUSES = RESULT_STATUSES
_MAX_PROBLEMS = 20


@dataclass(frozen=True)
class OutcomeObject:
    """One object that holds outcomes, as listed in the store's commits or the manifest."""

    shard_index: int
    seq: int
    uri: str
    sha256: str
    records: int
    attempt_id: str


@dataclass
class VerificationReport:
    """What verification found; ``complete`` only when every expected line has exactly one outcome."""

    job_id: str
    expected: int
    seen: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATUSES, 0))
    duplicates: int = 0
    unknown: int = 0
    checksum_failures: int = 0
    #: of those, objects storage could not serve for a reason other than their absence (an
    #: outage, lost credentials): they may well be intact, so the job is not failed for them
    unreadable: int = 0
    pending_shards: list[int] = field(default_factory=list)
    failed_shards: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    model_digests: set[str] = field(default_factory=set)

    @property
    def missing(self) -> int:
        return max(0, self.expected - self.seen)

    @property
    def complete(self) -> bool:
        return (
            self.seen == self.expected
            and not self.duplicates
            and not self.unknown
            and not self.checksum_failures
            and not self.pending_shards
            and not self.failed_shards
            and not self.problems
        )

    def problem(self, text: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(text)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "complete": self.complete,
            "expected": self.expected,
            "seen": self.seen,
            "missing": self.missing,
            "duplicates": self.duplicates,
            "unknown": self.unknown,
            "checksum_failures": self.checksum_failures,
            "outcomes": dict(self.outcomes),
            "pending_shards": list(self.pending_shards),
            "failed_shards": list(self.failed_shards),
            "problems": list(self.problems),
        }

    def summary(self) -> str:
        head = "complete" if self.complete else "INCOMPLETE"
        lines = [
            f"job {self.job_id}: {head}: {self.seen}/{self.expected} lines have an outcome "
            f"(succeeded {self.outcomes['succeeded']}, errored {self.outcomes['errored']}, "
            f"cancelled {self.outcomes['cancelled']}, expired {self.outcomes['expired']})",
        ]
        if self.missing:
            lines.append(f"  missing outcomes: {self.missing}")
        if self.duplicates or self.unknown:
            lines.append(f"  duplicated: {self.duplicates}, unknown lines: {self.unknown}")
        if self.checksum_failures:
            lines.append(f"  objects failing their checksum: {self.checksum_failures}")
        if self.unreadable:
            lines.append(
                f"  objects storage could not serve: {self.unreadable} (finalize again once storage is back)"
            )
        if self.pending_shards:
            lines.append(f"  shards not finished: {_fmt_list(self.pending_shards)}")
        if self.failed_shards:
            lines.append(f"  shards failed for good: {_fmt_list(self.failed_shards)}")
        lines.extend(f"  - {p}" for p in self.problems)
        return "\n".join(lines)


@dataclass(frozen=True)
class FinalizeResult:
    """The job's state after finalization and, when published, its manifest."""

    job_id: str
    state: JobState
    manifest_uri: str | None
    report: VerificationReport
    manifest: dict[str, Any] | None = None


def _fmt_list(values: list[int], limit: int = 10) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f" … (+{len(values) - limit})" if len(values) > limit else "")


def committed_objects(store: ManifestStore, job_id: str) -> list[OutcomeObject]:
    return [_outcome_object(c) for c in store.list_commits(job_id)]


def _outcome_object(commit: Any) -> OutcomeObject:
    return OutcomeObject(
        commit.shard_index, commit.seq, commit.uri, commit.sha256, commit.records, commit.attempt_id
    )


class _LineLedger:
    """One byte per input line: 0 = no outcome yet. Bounded memory for millions of lines."""

    def __init__(self, total_lines: int) -> None:
        self.total = total_lines
        self.seen = bytearray(total_lines + 1)

    def add(self, line: int) -> str:
        if not isinstance(line, int) or isinstance(line, bool) or not 1 <= line <= self.total:
            return "unknown"
        if self.seen[line]:
            return "duplicate"
        self.seen[line] = 1
        return "ok"

    def forget(self, lines: Iterable[int]) -> None:
        """Undo :meth:`add` of ``lines`` (an object whose checksum failed after its lines counted)."""
        for line in lines:
            self.seen[line] = 0


def _unreadable(obj: OutcomeObject, report: VerificationReport, exc: StorageError) -> None:
    report.checksum_failures += 1
    if not isinstance(exc, ObjectNotFound):
        report.unreadable += 1
    report.problem(f"shard {display_shard_id(obj.shard_index)} object {obj.uri} unreadable: {exc}")


def _bad_checksum(obj: OutcomeObject, report: VerificationReport) -> None:
    report.checksum_failures += 1
    report.problem(f"shard {display_shard_id(obj.shard_index)} object {obj.uri} fails its SHA-256")


class _ObjectCheck:
    """The findings of one object's lines, kept apart until its checksum is known to hold."""

    def __init__(
        self, obj: OutcomeObject, ledger: _LineLedger, statuses: Iterable[str], span: tuple[int, int]
    ):
        self.obj = obj
        self.ledger = ledger
        self.lo, self.hi = span
        self.count = 0
        self.seen = 0
        self.outcomes = dict.fromkeys(statuses, 0)
        self.duplicates = 0
        self.unknown = 0
        self.problems: list[str] = []
        self.added = array("q")  # the lines this object counted, to forget if its checksum fails

    def problem(self, text: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(text)

    def lines(self, raws: Iterable[bytes], *, track: bool) -> None:
        """Count ``raws`` (the object's lines); with ``track``, remember the lines counted."""
        obj, ledger, outcomes = self.obj, self.ledger, self.outcomes
        lo, hi = self.lo, self.hi
        remember = self.added.append if track else None
        loads = orjson.loads
        for raw in raws:
            if not raw.strip():
                continue
            self.count += 1
            try:
                rec = loads(raw)
                line = rec["line"]
                status = rec["status"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                self.unknown += 1
                self.problem(f"object {obj.uri} holds a line that is not a result record")
                continue
            if status not in outcomes or rec.get("attempt_id") != obj.attempt_id:
                self.unknown += 1
                self.problem(f"object {obj.uri} holds a record with a bad status or attempt ID")
                continue
            verdict = ledger.add(line) if lo <= line <= hi else "unknown"
            if verdict == "ok":
                if remember is not None:
                    remember(line)
                self.seen += 1
                outcomes[status] += 1
            elif verdict == "duplicate":
                self.duplicates += 1
                self.problem(f"line {line} has more than one outcome (again in {obj.uri})")
            else:
                self.unknown += 1
                self.problem(f"object {obj.uri} holds line {line!r}, outside its shard")

    def merge_into(self, report: VerificationReport) -> None:
        report.seen += self.seen
        for status, n in self.outcomes.items():
            report.outcomes[status] += n
        report.duplicates += self.duplicates
        report.unknown += self.unknown
        for text in self.problems:
            report.problem(text)
        if self.count != self.obj.records:
            report.problem(
                f"object {self.obj.uri} holds {self.count} records, its commit says {self.obj.records}"
            )


def _check_objects(
    objects: Iterable[OutcomeObject],
    ledger: _LineLedger,
    report: VerificationReport,
    ranges: dict[int, tuple[int, int]],
) -> None:
    """Check every object's SHA-256 and count its lines into ``ledger`` and ``report``.

    Objects are read ahead in parallel (:func:`read_ahead`) and checked in order; a large one is
    streamed, its lines counted as they come and forgotten again should its checksum fail.
    """
    reader = ObjectReader()
    for obj, fetched in read_ahead(objects, reader):
        check = _ObjectCheck(obj, ledger, report.outcomes, ranges.get(obj.shard_index, (1, ledger.total)))
        if fetched.error is not None:
            _unreadable(obj, report, fetched.error)
            continue
        if fetched.data is not None:
            if fetched.sha256 != obj.sha256:
                _bad_checksum(obj, report)
                continue
            check.lines(fetched.data.splitlines(), track=False)
            check.merge_into(report)
            continue
        digest = hashlib.sha256()
        try:
            with reader.open_read(obj.uri) as stream:
                check.lines(stream_lines(stream, digest), track=True)
        except StorageError as exc:
            ledger.forget(check.added)
            _unreadable(obj, report, exc)
            continue
        if digest.hexdigest() != obj.sha256:
            ledger.forget(check.added)
            _bad_checksum(obj, report)
            continue
        check.merge_into(report)


def _shard_ranges(store: ManifestStore, job_id: str) -> dict[int, tuple[int, int]]:
    return {s.shard_index: (s.first_line, s.first_line + s.line_count - 1) for s in store.list_shards(job_id)}


def verify_job(store: ManifestStore, job_id: str) -> VerificationReport:
    """Verify the job's committed outcomes (or, once published, the manifest's objects)."""
    job = store.get_job(job_id)
    if job.manifest_uri:
        return verify_manifest(store, job_id)
    report = VerificationReport(job_id=job_id, expected=job.input_lines)
    for shard in store.list_shards(job_id):
        if shard.state == ShardState.TERMINAL_FAILURE:
            report.failed_shards.append(shard.shard_index)
        elif shard.state != ShardState.SUCCEEDED:
            report.pending_shards.append(shard.shard_index)
    return _verify_outcomes(store, job, report, store.list_commits(job_id), [])


def _verify_outcomes(
    store: ManifestStore,
    job: Any,
    report: VerificationReport,
    commits: list[Any],
    extra: list[OutcomeObject],
) -> VerificationReport:
    """Count the outcomes of the committed objects (and ``extra`` ones) into ``report``."""
    report.model_digests = {c.model_digest for c in commits if c.shard_index >= 0 and c.model_digest}
    objects = [_outcome_object(c) for c in commits] + extra
    _check_objects(objects, _LineLedger(job.input_total_lines), report, _shard_ranges(store, job.job_id))
    if len(report.model_digests) > 1:
        report.problem(f"shards ran on {len(report.model_digests)} different model digests")
    return report


def verify_manifest(store: ManifestStore, job_id: str) -> VerificationReport:
    """Re-verify a published manifest: its checksum-listed objects give one outcome per line."""
    job = store.get_job(job_id)
    report = VerificationReport(job_id=job_id, expected=job.input_lines)
    if job.manifest_uri is None:
        report.problem(f"job {job_id} has no published manifest yet")
        return report
    storage, key = open_uri(job.manifest_uri)
    data = storage.get_bytes(key)
    if job.manifest_sha256 and sha256_hex(data) != job.manifest_sha256:
        report.checksum_failures += 1
        report.problem(f"manifest {job.manifest_uri} does not match the SHA-256 recorded at publication")
        return report
    try:
        manifest = OutputManifest.from_json_bytes(data)
    except ValueError as exc:
        report.problem(f"manifest {job.manifest_uri} does not follow the manifest format: {exc}")
        return report
    objects = [
        OutcomeObject(_shard_index(s.shard_id), s.seq, s.uri, s.sha256, s.records, s.attempt_id)
        for s in manifest.shards
    ]
    _check_objects(objects, _LineLedger(job.input_total_lines), report, _shard_ranges(store, job_id))
    counted = manifest.outcomes.model_dump()
    if counted != report.outcomes:
        report.problem(f"manifest outcome counts {counted} differ from the objects' {report.outcomes}")
    return report


def _shard_index(shard_id: str) -> int:
    """The shard index behind a manifest's ``shard_id`` (-1: the validation object; -2: unknown)."""
    if shard_id == VALIDATION_SHARD_ID:
        return -1
    return int(shard_id) if shard_id.isdigit() else -2


class _RangeHasher(io.RawIOBase):
    """Bytes ``[start, end)`` of a stream, hashed as they are read (a shard's input range)."""

    def __init__(self, stream: BinaryIO, length: int) -> None:
        self._stream = stream
        self._left = length
        self.digest = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._left)
        if want <= 0:
            return 0
        chunk = self._stream.read(want)
        n = len(chunk)
        view[:n] = chunk
        self._left -= n
        self.digest.update(chunk)
        return n


def _shard_records(job: Any, shard: Any) -> Iterator[Any]:
    """The shard's records in line order, streamed from its input range (as ``parse_shard`` reads them).

    The range's SHA-256 and record count are checked once it is read: the caller publishes
    nothing before this generator is exhausted, so a changed input still publishes nothing.
    """
    storage, key = open_uri(job.input_uri)
    limits = limits_from_config(job.config)
    count = 0
    with storage.open_read(key) as source:
        source.seek(shard.byte_start)
        ranged = _RangeHasher(source, shard.byte_end - shard.byte_start)
        with io.BufferedReader(ranged, buffer_size=CHUNK_SIZE) as stream:
            for record in iter_shard(stream, shard, limits):
                count += 1
                yield record
    if ranged.digest.hexdigest() != shard.input_sha256:
        raise ChecksumMismatch(
            f"input range of shard {shard.shard_index} changed since planning: restore {job.input_uri}",
            job_id=job.job_id,
            shard_index=shard.shard_index,
        )
    if count != shard.records:
        raise InputError(
            f"shard {shard.shard_id} has {count} records, the plan says {shard.records}; "
            "the input changed after planning: re-plan the job"
        )


def _unfinished_outcomes(
    job: Any,
    shard: Any,
    committed_lines: bytearray,
    status: Literal["cancelled", "expired", "errored"],
) -> Iterator[ResultRecord]:
    """Outcomes for a shard's records that never committed (``committed_lines[line - first_line]``
    is set for those that did).

    ``expired`` (the deadline passed), ``cancelled`` (the job was), or ``errored`` with code
    ``shard_failed`` (the shard failed for good: attempts exhausted or a terminal error).
    """
    if status == "expired":
        code, message = "expired", "the job's deadline passed before this record was processed"
    elif status == "cancelled":
        code, message = "cancelled", "the job was cancelled before this record was processed"
    else:
        code = "shard_failed"
        reason = shard.last_error or "see the worker's log"
        message = f"shard {display_shard_id(shard.shard_index)} failed for good: {reason}"[:500]
    first = shard.first_line
    for record in _shard_records(job, shard):
        if committed_lines[record.line - first]:
            continue
        yield ResultRecord.failed(
            line=record.line,
            id=record.id,
            status=status,
            code=code,
            message=message,
            shard_id=display_shard_id(shard.shard_index),
            attempt_id=FINALIZE_ATTEMPT_ID,
        )


def _mark_lines(raws: Iterable[bytes], lines: bytearray, first: int) -> None:
    for raw in raws:
        if raw.strip():
            line = orjson.loads(raw)["line"]
            if first <= line < first + len(lines):
                lines[line - first] = 1


def _committed_lines(commits: list[Any], shard: Any, reader: ObjectReader) -> bytearray:
    """One byte per line of the shard: set for each line a committed object of the shard holds."""
    first, count = shard.first_line, shard.line_count
    lines = bytearray(count)
    mine = (_outcome_object(c) for c in commits if c.shard_index == shard.shard_index)
    for obj, fetched in read_ahead(mine, reader):
        if fetched.error is not None:
            raise fetched.error
        if fetched.data is not None:
            _mark_lines(fetched.data.splitlines(), lines, first)
        else:
            with reader.open_read(obj.uri) as stream:
                _mark_lines(stream_lines(stream, hashlib.sha256()), lines, first)
    return lines


def finalize_job(
    store: ManifestStore,
    job_id: str,
    *,
    clock: Clock | None = None,
    expire_unfinished: bool = False,
) -> FinalizeResult:
    """Verify the job and publish its manifest once every input line has a terminal outcome.

    With ``expire_unfinished`` (the deadline passed) or for a cancelled job, the shards that did not
    finish are fenced (the job leaves the running state, so no lease can commit any more) and
    their uncommitted records get ``expired`` / ``cancelled`` outcomes: the manifest is then
    published as ``partial`` / ``cancelled``. Shards that failed for good (attempts exhausted,
    terminal errors) give their uncommitted records ``errored`` outcomes with code
    ``shard_failed`` once no other shard can still run, and the job is published as ``partial``:
    every line still gets exactly one terminal outcome. Otherwise an unfinished job is left as it
    is and the report says what is missing. Idempotent: a published job returns its manifest.

    The steps: return a published job's manifest; leave a job with live shards alone (unless it
    expires or is cancelled); move it to ``finalizing`` (which fences its unfinished shards);
    write the outcomes of the records that never committed; verify every outcome object; publish
    the manifest with a conditional create; record it; delete uncommitted attempt objects
    and the ``finalize/`` objects of an earlier, failed try that the manifest does not list.
    """
    clock = clock or SystemClock()
    job = store.get_job(job_id)
    if job.manifest_uri:
        return _published(store, job)
    cancelled = job.state == JobState.CANCELLED
    if _has_live_shards(store.list_shards(job_id)) and not (expire_unfinished or cancelled):
        return FinalizeResult(job_id, JobState(job.state), None, verify_job(store, job_id))
    if not cancelled:
        job = _enter_finalizing(store, job)
        if job.manifest_uri:  # lost the race to a finalizer that has already published
            return _published(store, job)
    commits = store.list_commits(job_id)
    output = open_storage(job.output_uri)
    extra = _write_unfinished_outcomes(store, job, commits, output, cancelled)
    # the job is fenced: every attempt has ended, and its uncommitted objects are not yet collected
    usage = settle_job(store, job, output)
    report = _verify_or_fail(store, job, commits, extra, cancelled=cancelled)
    final_state = JobState.CANCELLED if cancelled else (JobState.PARTIAL if extra else JobState.COMPLETED)
    objects = [_outcome_object(c) for c in commits] + extra
    manifest = build_manifest(job, objects, report, clock.now(), usage=usage)
    uri, body = _publish(output, manifest)
    store.record_manifest(job_id, uri=uri, sha256=sha256_hex(body), state=final_state)
    published = orjson.loads(body)
    collect_garbage(store, job_id)
    remove_leftovers(output, published)
    return FinalizeResult(job_id, final_state, uri, report, published)


def _published(store: ManifestStore, job: Any) -> FinalizeResult:
    """The result of a job whose manifest is already published (re-verified, not rewritten).

    The leftovers of a finalizer killed between publication and clean-up are removed here.
    """
    storage, key = open_uri(job.manifest_uri)
    remove_leftovers(open_storage(job.output_uri), orjson.loads(storage.get_bytes(key)))
    return FinalizeResult(
        job.job_id, JobState(job.state), job.manifest_uri, verify_manifest(store, job.job_id)
    )


def remove_leftovers(output: Any, manifest: dict[str, Any]) -> int:
    """Delete the ``finalize/`` objects the published ``manifest`` does not list; return how many.

    A finalizer that fails part-way (a storage error, a killed process) leaves the objects it had
    written. A re-run rewrites those it still needs in place: an object's key is its shard and
    status and its bytes follow from the input and the commits, which no longer change once the
    job is fenced, so the same job gives the same objects and manifest. What it no longer needs
    (the job was cancelled in between: ``cancelled`` objects replace ``expired`` ones) is
    deleted here, once the manifest that decides it is published.
    """
    listed = {entry["uri"] for entry in manifest["shards"]}
    removed = 0
    for key in list(output.list_keys(FINALIZE_PREFIX)):
        if output.uri(key) not in listed:
            output.delete(key)
            removed += 1
    return removed


def _has_live_shards(shards: list[Any]) -> bool:
    """Whether a shard may still commit: neither succeeded nor failed for good."""
    return any(s.state not in (ShardState.SUCCEEDED, ShardState.TERMINAL_FAILURE) for s in shards)


def _enter_finalizing(store: ManifestStore, job: Any) -> Any:
    """Move the job to ``finalizing`` (fencing its unfinished shards); the job as it is then.

    Another finalizer may have moved it first: then it is either still ``finalizing`` (carry on;
    the manifest's conditional create decides which of us publishes, and the loser adopts the
    winner's manifest) or already published (the caller returns that manifest).
    """
    if job.state == JobState.FINALIZING:
        return job
    try:
        store.set_job_state(job.job_id, JobState.FINALIZING)
    except InvalidTransition:
        job = store.get_job(job.job_id)
        if not job.manifest_uri and job.state != JobState.FINALIZING:
            raise
    return job


def _write_unfinished_outcomes(
    store: ManifestStore, job: Any, commits: list[Any], output: Any, cancelled: bool
) -> list[OutcomeObject]:
    """Write one object of terminal outcomes per unfinished shard, for its uncommitted records.

    ``cancelled`` for a cancelled job, ``errored`` (``shard_failed``) for a shard that failed for
    good, ``expired`` otherwise. Each object's ``seq`` is one past the shard's microbatches:
    unique in the manifest, which requires ``seq >= 0``. The outcomes are written to a temporary
    file as the shard's input range streams by, then uploaded: memory does not grow with the shard.
    """
    extra: list[OutcomeObject] = []
    reader = ObjectReader()
    for shard in store.list_shards(job.job_id):
        if shard.state == ShardState.SUCCEEDED:
            continue
        status: Literal["cancelled", "expired", "errored"] = (
            "cancelled"
            if cancelled
            else "errored"
            if shard.state == ShardState.TERMINAL_FAILURE
            else "expired"
        )
        committed = _committed_lines(commits, shard, reader)
        digest = hashlib.sha256()
        records = 0
        with tempfile.TemporaryFile(prefix="adb-finalize-") as spool:
            for record in _unfinished_outcomes(job, shard, committed, status):
                line = record.to_json_bytes() + b"\n"
                digest.update(line)
                spool.write(line)
                records += 1
            if not records:
                continue
            spool.seek(0)
            key = f"{FINALIZE_PREFIX}shard-{shard.shard_index:05d}-{status}.jsonl"
            uri = put_stream(output, key, spool)
        extra.append(
            OutcomeObject(
                shard.shard_index,
                shard.num_microbatches,
                uri,
                digest.hexdigest(),
                records,
                FINALIZE_ATTEMPT_ID,
            )
        )
    return extra


def _verify_or_fail(
    store: ManifestStore, job: Any, commits: list[Any], extra: list[OutcomeObject], *, cancelled: bool
) -> VerificationReport:
    """The report of a job whose every line has exactly one outcome; otherwise fail the job.

    An incomplete job moves to ``failed`` (a cancelled one stays ``cancelled``) and
    :class:`VerificationError` carries the report. When storage could not serve an object (an
    outage rather than a missing or corrupt object), the job stays ``finalizing`` instead, so
    finalizing again once storage is back can still publish it (docs/design.md §10).
    """
    report = VerificationReport(job_id=job.job_id, expected=job.input_lines)
    _verify_outcomes(store, job, report, commits, extra)
    if not report.complete:
        if not cancelled and not report.unreadable:
            store.set_job_state(job.job_id, JobState.FAILED, error=report.summary().splitlines()[0])
        raise VerificationError(report.summary(), report=report, job_id=job.job_id)
    return report


def _publish(output: Any, manifest: OutputManifest) -> tuple[str, bytes]:
    """Create ``manifest.json`` once; a loser of the race adopts the winner's (URI, bytes)."""
    body = manifest.to_json_bytes()
    try:
        return output.create_bytes(MANIFEST_KEY, body), body
    except ObjectExists:
        # another finalizer published first: its manifest stands, ours is discarded
        return output.uri(MANIFEST_KEY), output.get_bytes(MANIFEST_KEY)


def build_manifest(
    job: Any,
    objects: list[OutcomeObject],
    report: VerificationReport,
    now: dt.datetime,
    *,
    usage: SettledUsage | None = None,
) -> OutputManifest:
    """The output manifest of a verified job (docs/design.md §4.3)."""
    config = job.config
    digests = sorted(report.model_digests)
    return OutputManifest(
        job_id=job.job_id,
        created_at=job.created_at,
        deadline=job.deadline,
        model=ModelInfo(
            name=config.get("model") or config.get("engine"), digest=digests[0] if digests else None
        ),
        prompt_template_version=config.get("prompt_template_version"),
        generation=config.get("generation", {}),
        input=InputInfo(uri=job.input_uri, sha256=job.input_sha256, records=job.input_lines),
        outcomes=OutcomeCounts(**report.outcomes),
        shards=tuple(
            ManifestShard(
                shard_id=display_shard_id(o.shard_index),
                seq=o.seq,
                uri=o.uri,
                sha256=o.sha256,
                records=o.records,
                attempt_id=o.attempt_id,
            )
            for o in objects
        ),
        completed_at=now,
        usage=usage,
    )


def collect_garbage(store: ManifestStore, job_id: str) -> int:
    """Delete attempt objects that never committed (fenced, killed or late attempts).

    docs/design.md §4.5 invariant 2: a late or fenced attempt's output is garbage-collected.
    """
    job = store.get_job(job_id)
    committed = {c.uri for c in store.list_commits(job_id)}
    storage = open_storage(job.output_uri)
    removed = 0
    for key in list(storage.list_keys("attempts/")):
        if storage.uri(key) not in committed:
            storage.delete(key)
            removed += 1
    return removed
