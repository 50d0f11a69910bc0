"""Planning a job: validate the input, estimate the work, decide admission, cut shards, record the job.

One streaming pass parses and validates every line (a large local input in byte ranges, one
process per core; a few numbers and the ID of each line are spilled to temporary files, so memory
stays within a budget whatever the input's size), duplicate IDs are found from the spilled IDs,
the shards are cut as contiguous byte ranges by cumulative estimated work, and a second pass of
large reads hashes each range and the whole input so workers can prove they read the same
snapshot.
Shared by the ``deadline-batch`` CLI and ``DeadlineBatchOperator``.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime as dt
import errno
import functools
import hashlib
import io
import itertools
import math
import operator
import os
import shutil
import stat
import tempfile
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import numpy as np

from airflow_deadline_batch.core.calibration import prior_tokens_per_s
from airflow_deadline_batch.core.clock import MAX_SECONDS, Clock, SystemClock, ensure_aware
from airflow_deadline_batch.core.estimate import (
    CHAT_PRIMING_TOKENS,
    COMPLETION_OVERHEAD_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    WorkModel,
    WorkSummary,
    estimate_prompt_tokens,
    expected_output_tokens,
)
from airflow_deadline_batch.core.feasibility import AdmissionPolicy, AdmissionReport, assess
from airflow_deadline_batch.core.ids import check_idempotency_key, new_job_id
from airflow_deadline_batch.core.packing import cut_contiguous_chunks, microbatch_count, target_shard_seconds
from airflow_deadline_batch.core.params import check_generation_defaults
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec, default_local_pools
from airflow_deadline_batch.core.records import (
    ErrorCode,
    LineError,
    QuickRecord,
    RawLine,
    Record,
    ValidationLimits,
    Validator,
    duplicate_error,
    fast_parse_many,
    iter_line_blocks,
    quick_parse_many,
)
from airflow_deadline_batch.core.results import encode_line_error
from airflow_deadline_batch.core.states import JobState
from airflow_deadline_batch.core.tenants import DEFAULT_TENANT, check_tenant
from airflow_deadline_batch.exceptions import (
    AdmissionRejected,
    ConfigurationError,
    InputError,
    ObjectNotFound,
)
from airflow_deadline_batch.service.admission import shared_admission
from airflow_deadline_batch.service.processes import Processes
from airflow_deadline_batch.service.spill import (
    CHUNK_ROWS,
    DEFAULT_MEMORY_BUDGET,
    Column,
    DuplicateFinder,
    IdSpill,
    PartitionFiles,
    SpillDirectory,
    check_partitions,
    combine,
    read_duplicates,
)
from airflow_deadline_batch.storage import (
    LocalStorage,
    join_uri,
    open_storage,
    open_uri,
    put_stream,
    sha256_of_stream,
)

if TYPE_CHECKING:  # the store pulls in SQLAlchemy (half a second): `deadline-batch plan` never needs it
    from airflow_deadline_batch.store import ManifestStore
    from airflow_deadline_batch.store.throughput import MeasuredRate

#: key of the validation-errors object, relative to the job's output base
VALIDATION_KEY = "validation/errors.jsonl"
_NO_LINE = 1 << 62  # past every line number: the end of the provisional errors
#: a local input is validated on several cores from this size on, one range per core at most
#: every PARALLEL_MIN_BYTES (a process costs about a third of a second to start)
PARALLEL_MIN_BYTES = 32 * 1024 * 1024
_READ_CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """Everything needed to plan one job. Deadlines must be timezone-aware."""

    input_uri: str
    deadline: dt.datetime
    output_uri: str
    engine: str = "echo"
    model: str | None = None
    model_digest: str | None = None
    generation: Mapping[str, Any] = field(default_factory=dict)
    pools: tuple[PoolSpec, ...] = field(default_factory=default_local_pools)
    workers: int = 4
    idempotency_key: str | None = None
    microbatch_size: int = 16
    max_invalid_fraction: float = 0.1
    max_attempts: int = 10
    lease_ttl_s: float = 60.0
    checkpoint_cost_s: float = 2.0
    max_shards: int = 1024
    prompt_template_version: str = "v1"
    limits: ValidationLimits = field(default_factory=ValidationLimits)
    #: admit a job whose deadline looks infeasible (alone or on shared capacity); its tenant's GPU
    #: quota and budget still hold, and invalid input is still refused
    allow_infeasible: bool = False
    tenant: str = DEFAULT_TENANT
    #: planning's memory budget for the duplicate-ID check (its spill files take the rest)
    memory_budget_mb: int = DEFAULT_MEMORY_BUDGET // (1024 * 1024)
    #: processes that validate a large local input (None: one per core)
    scan_processes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "deadline", ensure_aware(self.deadline, "deadline"))
        try:
            object.__setattr__(self, "tenant", check_tenant(self.tenant))
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        if self.idempotency_key:
            try:
                check_idempotency_key(self.idempotency_key)
            except ValueError as exc:
                raise ConfigurationError(str(exc)) from None
        if not self.pools:
            raise ConfigurationError("no pools given: define at least one Spot or on-demand pool")
        if self.workers < 1:
            raise ConfigurationError(f"workers must be >= 1, got {self.workers}")
        if self.microbatch_size < 1:
            raise ConfigurationError(f"microbatch_size must be >= 1, got {self.microbatch_size}")
        if not 0 <= self.max_invalid_fraction <= 1:
            raise ConfigurationError("max_invalid_fraction must be between 0 and 1")
        if not 0 < self.lease_ttl_s <= MAX_SECONDS:
            raise ConfigurationError(
                f"lease_ttl_s must be a number of seconds > 0 and <= {MAX_SECONDS:g}, got {self.lease_ttl_s}"
            )
        if self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if (
            isinstance(self.memory_budget_mb, bool)
            or not isinstance(self.memory_budget_mb, int)
            or (self.memory_budget_mb < 1)
        ):
            raise ConfigurationError(
                f"memory_budget_mb must be a positive integer, got {self.memory_budget_mb!r}"
            )
        check_memory_budget(self.memory_budget_mb)
        if self.scan_processes is not None and self.scan_processes < 1:
            raise ConfigurationError(f"scan_processes must be >= 1 or None, got {self.scan_processes}")
        if not 1 <= self.max_shards <= 100_000:
            raise ConfigurationError(f"max_shards must be between 1 and 100000, got {self.max_shards}")
        max_tokens = self.generation.get("max_tokens", 256)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigurationError(f"generation max_tokens must be a positive integer, got {max_tokens!r}")
        problem = check_generation_defaults(self.generation, self.engine)
        if problem is not None:
            raise ConfigurationError(problem.message)

    @property
    def default_max_tokens(self) -> int:
        return int(self.generation.get("max_tokens", 256))

    def reference_pool(self) -> PoolSpec:
        """The pool whose measured rates convert tokens to GPU-seconds (Spot first)."""
        spot = [p for p in self.pools if p.kind is PoolKind.SPOT]
        return (spot or list(self.pools))[0]


def check_memory_budget(budget_mb: int, root: Path = Path("/")) -> None:
    """Refuse a memory budget above what this process may use (:func:`memory_bound_mb`), in one
    line naming the bound that refused it. ``root``: as for :func:`memory_bound_mb`."""
    bound_mb, bound = memory_bound_mb(root)
    if budget_mb > bound_mb:
        raise ConfigurationError(
            f"memory_budget_mb {budget_mb} is more than {bound} ({bound_mb} MB): give at most that "
            f"(default {DEFAULT_MEMORY_BUDGET >> 20})"
        )


def memory_bound_mb(root: Path = Path("/")) -> tuple[int, str]:
    """The memory this process may use, in MB, and what bounds it, in words: the machine's physical
    memory, or the tightest cgroup limit on the process where that is smaller (the one the kernel's
    out-of-memory killer enforces in a container, a Kubernetes pod's ``resources.limits.memory``).

    The limits read are those of the process's own cgroup (``/proc/self/cgroup``) and of each cgroup
    above it: v2's ``memory.max`` (``max``: none) under ``/sys/fs/cgroup``, v1's
    ``memory.limit_in_bytes`` (a huge value: none) under ``/sys/fs/cgroup/memory``. In a container
    that sees only its own cgroup (a cgroup namespace) its path is ``/`` and the mount's top files
    are its limits. ``root`` is the file system's root: a test's directory of fake files.
    """
    try:
        bound_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    except (AttributeError, ValueError, OSError):  # the platform does not say
        bound_mb = 1 << 62
    bound = "this machine's memory"
    for path in _cgroup_memory_limit_files(root):
        try:
            value = path.read_text().strip()
        except OSError:  # no such cgroup here (another namespace's path), or no v1/v2 controller
            continue
        if not value.isdigit():  # "max"
            continue
        if (limit_mb := int(value) >> 20) < bound_mb:
            where = f"/{path.relative_to(root)}"
            bound_mb, bound = limit_mb, f"the memory limit of this process's cgroup ({where})"
    return bound_mb, bound


def _cgroup_memory_limit_files(root: Path) -> Iterator[Path]:
    """The memory-limit files of this process's cgroups and their ancestors (v2 and v1), whether or
    not they exist."""
    try:
        membership = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:  # not Linux
        return
    for line in membership:  # "<id>:<controllers>:<path>"; v2's is "0::<path>"
        _, _, rest = line.partition(":")
        controllers, _, own = rest.partition(":")
        if controllers == "":
            top, name = root / "sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            top, name = root / "sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [part for part in own.strip().split("/") if part]
        if ".." in parts:  # a cgroup outside this namespace's view: only the mount's top is read
            parts = []
        for depth in range(len(parts), -1, -1):
            yield top.joinpath(*parts[:depth], name)


@dataclass(frozen=True)
class ShardCut:
    """One planned shard: a contiguous byte range of the input, cut on line boundaries."""

    index: int
    byte_start: int
    byte_end: int
    first_line: int
    line_count: int
    records: int
    excluded_lines: tuple[int, ...]
    est_work_s: float


@dataclass(frozen=True)
class InputAnalysis:
    """The result of the validating pass: work, admission verdict and shard cuts (nothing written)."""

    request: PlanRequest
    report: AdmissionReport
    work: WorkSummary
    total_lines: int
    outcome_lines: int
    errors_by_code: Mapping[str, int]
    cuts: tuple[ShardCut, ...]
    target_shard_s: float
    error_spool: Any  # a binary temporary file of errored ResultRecord lines, rewound

    def close(self) -> None:
        self.error_spool.close()


@dataclass(frozen=True)
class PlanResult:
    """What the planner hands to the launcher: the job, its verdict and literal shard specs."""

    job_id: str
    created: bool
    report: AdmissionReport | Mapping[str, Any]
    shard_specs: list[dict[str, Any]]
    shards: int
    records: int
    invalid: int


def analyze_input(
    request: PlanRequest, *, clock: Clock | None = None, on_scanned: Callable[[], object] | None = None
) -> InputAnalysis:
    """Validate and estimate every line of the input, decide admission, cut shards.

    ``on_scanned`` is called once every line has been read, before the duplicate-ID check (which
    runs on one core: a second one is free for, say, hashing the input).

    Memory stays within ``request.memory_budget_mb`` whatever the input's size: what is kept per
    line (numbers, IDs) is spilled to temporary files, deleted before this returns; invalid lines'
    outcomes are spooled to a temporary file that :meth:`InputAnalysis.close` deletes.
    """
    now = (clock or SystemClock()).now()
    pool = request.reference_pool()
    scan = _scan_input(request, WorkModel.from_pool(pool), on_scanned)
    try:
        work = scan.summary()
        report = assess(
            work,
            request.pools,
            deadline=request.deadline,
            now=now,
            policy=AdmissionPolicy(max_invalid_fraction=request.max_invalid_fraction),
            max_parallel=request.workers,
        )
        target = _shard_target(request, pool, work.gpu_seconds, work.records)
        cuts = _cut_shards(scan, target, request.max_shards)
    except BaseException:
        scan.spool.close()
        raise
    finally:
        scan.close()
    return InputAnalysis(
        request=request,
        report=report,
        work=work,
        total_lines=scan.total_lines,
        outcome_lines=work.lines,
        errors_by_code=dict(scan.errors),
        cuts=cuts,
        target_shard_s=target,
        error_spool=scan.spool,
    )


_COLUMNS = (("line", "q"), ("end", "q"), ("work", "d"), ("prompt", "q"), ("output", "q"))


@dataclass(frozen=True)
class _PartJob:
    """Scan one byte range of the input (whole lines) into files under ``directory``.

    ``path`` is the local file to read (None: the caller hands the stream over).
    """

    path: str | None
    byte_start: int
    byte_end: int | None
    first_line: int
    directory: str
    limits: ValidationLimits
    default_max_tokens: int
    work_model: WorkModel


@dataclass(frozen=True)
class _ScanPart:
    """What scanning one byte range wrote, and where its lines end."""

    directory: str
    records: int
    partitions: list[PartitionFiles]
    last_line: int
    end_offset: int


def _append_ints(target: array[int], values: Sequence[int]) -> None:
    """``target.extend(values)``, at C speed for a list or a range (``extend`` converts item by
    item through the iterator protocol, about four times slower)."""
    if type(values) is list:
        target.fromlist(values)
    elif type(values) is range and values.step == 1:
        target.frombytes(np.arange(values.start, values.stop, dtype=np.int64).tobytes())
    else:
        target.extend(values)


class _PartWriter:
    """The files of one scanned range: valid-looking records' numbers as columns, IDs to an
    :class:`~airflow_deadline_batch.service.spill.IdSpill`, invalid lines' provisional outcomes
    (``"<line> <code> <outcome JSON>\\n"``), all in line order. Memory: one chunk of each."""

    def __init__(self, directory: Path, work_model: WorkModel) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.work_model = work_model
        self.ids = IdSpill(directory / "ids")
        self.rec_line: array[int] = array("q")
        self.rec_end: array[int] = array("q")
        self.rec_prompt: array[int] = array("q")
        self.rec_output: array[int] = array("q")
        self._columns = [Column(directory / name, code) for name, code in _COLUMNS]
        self._errors = (directory / "errors").open("wb")

    def add_records(
        self, lines: Sequence[int], ends: Sequence[int], prompts: Sequence[int], outputs: Sequence[int]
    ) -> None:
        """Count valid-looking records: their lines, where they end, their estimated tokens (the
        GPU-seconds are computed per chunk when it is spilled)."""
        _append_ints(self.rec_line, lines)
        _append_ints(self.rec_end, ends)
        _append_ints(self.rec_prompt, prompts)
        _append_ints(self.rec_output, outputs)
        if len(self.rec_line) >= CHUNK_ROWS:
            self._spill_records()

    def _spill_records(self) -> None:
        # WorkModel.seconds() per record, vectorised: the same IEEE operations in the same order
        model = self.work_model
        prompt = np.frombuffer(self.rec_prompt, dtype=np.int64) if self.rec_prompt else np.zeros(0, np.int64)
        output = np.frombuffer(self.rec_output, dtype=np.int64) if self.rec_output else np.zeros(0, np.int64)
        work = (
            prompt / model.prefill_tokens_per_s + output / model.decode_tokens_per_s
        ) + model.per_record_overhead_s
        arrays: tuple[array[Any] | np.ndarray, ...] = (
            self.rec_line,
            self.rec_end,
            work,
            self.rec_prompt,
            self.rec_output,
        )
        for column, values in zip(self._columns, arrays, strict=True):
            column.extend(values)
        del prompt, output
        for values in (self.rec_line, self.rec_end, self.rec_prompt, self.rec_output):
            del values[:]

    def add_error(self, error: LineError) -> None:
        """Spool one invalid line's provisional ``errored`` outcome."""
        self._errors.write(b"%d %s " % (error.line, error.code.value.encode()) + encode_line_error(error))

    def close(self, last_line: int, end_offset: int) -> _ScanPart:
        self._spill_records()
        for column in self._columns:
            column.close()
        self._errors.close()
        return _ScanPart(
            directory=str(self.directory),
            records=len(self._columns[0]),
            partitions=self.ids.close(),
            last_line=last_line,
            end_offset=end_offset,
        )


def _texts_tokens(all_texts: Sequence[str | tuple[str, ...]]) -> list[int]:
    """:func:`~airflow_deadline_batch.core.estimate.estimate_texts_tokens` of each item, in one loop:
    each text's estimate inlined (ceil(ASCII chars / 4) + one per non-ASCII char, as
    :func:`~airflow_deadline_batch.core.estimate.estimate_text_tokens`)."""
    tokens: list[int] = []
    append = tokens.append
    for texts in all_texts:
        if type(texts) is str:
            if texts.isascii():
                append((len(texts) + 3) // 4 + COMPLETION_OVERHEAD_TOKENS)
            else:
                ascii_chars = len(texts.encode("ascii", "ignore"))
                append((ascii_chars + 3) // 4 + (len(texts) - ascii_chars) + COMPLETION_OVERHEAD_TOKENS)
        else:
            total = MESSAGE_OVERHEAD_TOKENS * len(texts) + CHAT_PRIMING_TOKENS
            for text in texts:  # estimate_text_tokens, inlined
                if text.isascii():
                    total += (len(text) + 3) // 4
                else:
                    ascii_chars = len(text.encode("ascii", "ignore"))
                    total += (ascii_chars + 3) // 4 + (len(text) - ascii_chars)
            append(total)
    return tokens


#: bytes the scan reads and splits at a time (about 500 lines of the reference input): the steps
#: paid once a block (the columns, the ID spill, the list building) spread over more lines
SCAN_BLOCK_BYTES = 1 << 18
#: a line the fast paths declined, in a block's tuples while the reference judges it: no ID, no record
_NOT_QUICK: tuple[None, None, None] = (None, None, None)


def _scan_lines(stream: BinaryIO, job: _PartJob) -> _ScanPart:
    """The validating pass over one range: every line once, in order, judged on its own.

    Lines come in blocks (:func:`iter_line_blocks`); a block's ordinary lines are checked by one
    :func:`fast_parse_many` call (what it declines by :func:`quick_parse_many`), the rest one by
    one by :meth:`Validator.feed` (the reference); the block's records, IDs and errors are then
    written in line order. Only the reference's lines take a Python step each: the ordinary
    records become columns through ``zip``, ``compress`` and ``map``.
    """
    limits = job.limits
    default_max = job.default_max_tokens
    # every line is judged on its own; the IDs go to disk and duplicates are found afterwards
    validator = Validator(limits, check_duplicates=False)
    out = _PartWriter(Path(job.directory), job.work_model)
    add_ids = out.ids.add_many
    first_item = operator.itemgetter(0)
    line, end_offset = job.first_line - 1, job.byte_start
    for first, start, datas, ends, heads in iter_line_blocks(
        stream,
        start_line=job.first_line,
        start_offset=job.byte_start,
        max_line_bytes=limits.max_line_bytes,
        block_bytes=SCAN_BLOCK_BYTES,
    ):
        count = len(datas)
        line, end_offset = first + count - 1, ends[-1]
        quicks = fast_parse_many(datas, limits)
        slow_lines: list[int] = []
        if None in quicks:  # unusual shapes and invalid lines: the orjson path, then the reference
            declined = list(
                itertools.compress(range(count), map(operator.is_, quicks, itertools.repeat(None)))
            )
            for i, quick in zip(
                declined, quick_parse_many([datas[i] for i in declined], limits), strict=True
            ):
                quicks[i] = quick
            slow_lines = [i for i in declined if quicks[i] is None]
        if not slow_lines:  # every line an ordinary record: columns by transposing, no step per line
            ids_all, texts_all, limits_all = zip(*quicks, strict=True)
            add_ids(first, ids_all)
            # a valid max_tokens is >= 1, as expected_output_tokens says
            outputs_all = [limit or default_max for limit in limits_all]
            out.add_records(range(first, line + 1), ends, _texts_tokens(texts_all), outputs_all)
            validator.lines += count
            validator.records += count
            continue
        # the common case skips building Record objects (same numbers: see quick_parse)
        keep = [True] * count
        rows = cast("list[QuickRecord | tuple[None, None, None]]", quicks)  # once the Nones are replaced
        for i in slow_lines:
            keep[i] = False
            rows[i] = _NOT_QUICK
        ids: list[str | None] = list(map(first_item, rows))
        fast = list(itertools.compress(rows, keep))
        rec_lines = list(itertools.compress(range(first, line + 1), keep))
        rec_ends = list(itertools.compress(ends, keep))
        prompts: list[int] = []
        outputs: list[int] = []
        if fast:
            _, texts_fast, limits_fast = zip(*fast, strict=True)
            prompts = _texts_tokens(texts_fast)
            outputs = [limit or default_max for limit in limits_fast]
        slow: list[tuple[int, int, int, int]] = []
        for i in slow_lines:
            outcome = validator.feed(
                RawLine(
                    first + i, ends[i - 1] if i else start, ends[i], datas[i], heads[i] if heads else None
                )
            )
            if outcome is None:
                continue
            ids[i] = outcome.id  # the first line of an ID owns it, even an invalid one
            if isinstance(outcome, Record):
                slow.append(
                    (
                        first + i,
                        ends[i],
                        estimate_prompt_tokens(outcome.request),
                        expected_output_tokens(outcome.request, default_max_tokens=default_max),
                    )
                )
            else:
                out.add_error(outcome)
        if slow:  # records of unusual shapes: back into line order
            merged = sorted([*zip(rec_lines, rec_ends, prompts, outputs, strict=True), *slow])
            rec_lines, rec_ends, prompts, outputs = (list(column) for column in zip(*merged, strict=True))
        validator.lines += len(fast)
        validator.records += len(fast)
        add_ids(first, ids)
        out.add_records(rec_lines, rec_ends, prompts, outputs)
    return out.close(line, end_offset)


class _RangeReader(io.RawIOBase):
    """At most ``length`` bytes of a file from its current position."""

    def __init__(self, file: BinaryIO, length: int) -> None:
        self._file = file
        self._left = length

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            return 0
        view = memoryview(buffer)
        got = self._file.readinto(view[: min(len(view), self._left)])  # type: ignore[attr-defined]
        self._left -= got or 0
        return got or 0

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_local(path: str, buffering: int = -1) -> BinaryIO:
    """A local input, opened for reading; refused unless it is a regular file. Each range, count
    and hash opens the path anew: a FIFO put in its place after it was checked would block the
    open, and the plan, for ever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigurationError(
                f"{path} is not a regular file (a FIFO, device or socket): give a file's path", uri=path
            )
        os.set_blocking(fd, True)
        return cast("BinaryIO", os.fdopen(fd, "rb", buffering=buffering))
    except BaseException:
        os.close(fd)
        raise


def _scan_part(job: _PartJob) -> _ScanPart:
    """Scan one byte range of a local file (run in a worker process)."""
    assert job.path is not None and job.byte_end is not None
    raw = _open_local(job.path, buffering=0)
    raw.seek(job.byte_start)
    with io.BufferedReader(_RangeReader(raw, job.byte_end - job.byte_start), buffer_size=1 << 20) as stream:
        return _scan_lines(stream, job)


def _count_newlines(path: str, start: int, end: int) -> int:
    """Newlines in ``[start, end)`` of a local file."""
    count = 0
    with _open_local(path) as file:
        file.seek(start)
        left = end - start
        while left > 0 and (chunk := file.read(min(_READ_CHUNK, left))):
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count


def _line_ranges(path: str, size: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` byte ranges of about equal size, each starting right after a newline (or at 0)."""
    starts = [0]
    with _open_local(path) as file:
        for k in range(1, parts):
            position = max(k * size // parts, starts[-1])
            file.seek(position)
            while True:  # to the byte after the next newline: a range begins a line
                chunk = file.read(65_536)
                if not chunk:
                    position = size
                    break
                newline = chunk.find(b"\n")
                if newline >= 0:
                    position += newline + 1
                    break
                position += len(chunk)
            starts.append(position)
    bounds = sorted(set(starts)) + [size]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a] or [(0, size)]


class _InputScan:
    """What the validating pass kept, on disk, and (after :meth:`finish`) the duplicate-ID rule applied.

    The scanned ranges (one, or one per process) each wrote their records' numbers, IDs and
    invalid lines' provisional outcomes to files (:class:`_PartWriter`). :meth:`finish` then
    finds the later lines of every ID (:class:`~airflow_deadline_batch.service.spill.DuplicateFinder`):
    each becomes a ``duplicate_id`` error, whatever it was, each range's records and outcomes are
    written again without them (:func:`_rewrite_part`, in the range's own process when there are
    several), and the ranges' files are joined and the totals summed in line order, as the
    in-memory pass summed them.
    Memory stays within the budget whatever the input's size. :meth:`close` deletes every file
    but ``spool`` (the ``errored`` outcomes in line order, rewound), which whoever takes the
    scan closes (through :meth:`InputAnalysis.close`).
    """

    def __init__(self, *, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        self._tmp = SpillDirectory()  # a killed planner's is deleted by the next one
        self.directory = self._tmp.path
        self._memory_budget = memory_budget
        # the records and invalid lines that stand, and the totals
        self.lines = Column(self.directory / "line", "q")
        self.ends = Column(self.directory / "end", "q")
        self.works = Column(self.directory / "work", "d")
        self.invalid_lines = Column(self.directory / "invalid", "q")
        self.records = 0
        self.errors: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.gpu_seconds = 0.0
        self.total_lines = 0
        self.file_size = 0
        self.spool: Any = tempfile.SpooledTemporaryFile(max_size=8 * 1024 * 1024)  # noqa: SIM115 - closed by InputAnalysis.close
        #: the scan's worker processes while they run (:meth:`finish` checks the IDs in them)
        self.workers: Processes | None = None

    def finish(self, parts: Sequence[_ScanPart]) -> None:
        """Apply the duplicate-ID rule to the scanned ranges (in input order); write the results.

        With :attr:`workers` set (the scan's processes, still running), the ID partitions are
        checked in them, a share each (the memory budget too), and each range is then rewritten
        without its duplicates in the process that scanned it (:func:`_rewrite_part`); here the
        later lines are only sorted by range and the ranges' files joined.
        """
        processes = self.workers
        parallel = processes is not None and len(processes) > 1
        self.total_lines, self.file_size = parts[-1].last_line, parts[-1].end_offset
        finder = DuplicateFinder(self.directory / "duplicates", memory_budget=self._memory_budget)
        partitions = combine([part.partitions for part in parts])
        if processes is not None and parallel:
            count = len(processes)
            groups = [
                (partitions[k::count], str(self.directory / f"duplicates-{k}"), self._memory_budget // count)
                for k in range(count)
            ]
            runs = [run for group in processes.map(check_partitions, groups) for run in group]
        else:
            runs = finder.check(partitions)
        by_range = finder.merged_by_range(runs, [part.last_line for part in parts])
        calls = [(part, str(path)) for part, path in zip(parts, by_range, strict=True)]
        if processes is not None and parallel:
            kept: list[_KeptPart] = processes.map(_rewrite_part, calls)
        else:
            kept = [_rewrite_part(*call) for call in calls]
        self._join(kept)
        for column in (self.lines, self.ends, self.works, self.invalid_lines):
            column.seal()
        self.spool.seek(0)

    def _join(self, kept: Sequence[_KeptPart]) -> None:
        """Append the rewritten ranges' files in input order; sum the totals (GPU-seconds in line
        order, as ``total += work`` record by record would)."""
        gpu_seconds = 0.0
        for part in kept:
            directory = Path(part.directory)
            self.records += part.records
            self.prompt_tokens += part.prompt_tokens
            self.output_tokens += part.output_tokens
            self.errors.update(part.errors)  # codes first seen in an earlier range stay first
            self.lines.extend_from_file(directory / "kept-line")
            self.ends.extend_from_file(directory / "kept-end")
            self.invalid_lines.extend_from_file(directory / "kept-invalid")
            works = Column(directory / "kept-work", "d", written=part.records)
            for work in works.chunks():
                self.works.extend(work)
                # np.add.accumulate adds sequentially; a plain sum would add pairwise
                work = work.copy()
                work[0] += gpu_seconds
                gpu_seconds = float(np.add.accumulate(work)[-1])
            works.close()
            with (directory / "kept-spool").open("rb") as spool:
                shutil.copyfileobj(spool, self.spool)
            for name in ("kept-line", "kept-end", "kept-invalid", "kept-work", "kept-spool"):
                (directory / name).unlink()  # copied: the disk holds one copy, not two, from here
        self.gpu_seconds = gpu_seconds

    def summary(self) -> WorkSummary:
        invalid = len(self.invalid_lines)
        return WorkSummary(
            records=self.records,
            invalid=invalid,
            lines=self.records + invalid,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            gpu_seconds=self.gpu_seconds,
        )

    def close(self) -> None:
        """Delete the spill files (``spool`` stays open for its taker)."""
        for column in (self.lines, self.ends, self.works, self.invalid_lines):
            column.close()
        self._tmp.cleanup()


@dataclass(frozen=True)
class _KeptPart:
    """One scanned range without its duplicates (:func:`_rewrite_part`): its totals; its files
    ``kept-line``, ``kept-end``, ``kept-work``, ``kept-invalid`` and ``kept-spool`` are in ``directory``."""

    directory: str
    records: int
    errors: Counter[str]
    prompt_tokens: int
    output_tokens: int


def _rewrite_part(part: _ScanPart, duplicates: str) -> _KeptPart:
    """Rewrite one scanned range with the duplicate-ID rule applied: ``duplicates`` holds the
    range's later lines of an ID (from :meth:`DuplicateFinder.merged_by_range`). Run in the process
    that scanned the range, so the ranges are rewritten at once."""
    directory = Path(part.directory)
    lines, ends, works, invalid = kept = [
        Column(directory / f"kept-{name}", code) for name, code in (*_COLUMNS[:3], ("invalid", "q"))
    ]
    dup_records = Column(directory / "duplicate-records", "q")
    with (directory / "kept-spool").open("wb") as spool:
        errors = _merge_errors(part, read_duplicates(Path(duplicates)), spool, invalid, dup_records)
    (directory / "errors").unlink()  # each file deleted once rewritten: the spill's peak is lower
    records, prompt_tokens, output_tokens = _keep_records(part, dup_records.seal(), lines, ends, works)
    for column in (*kept, dup_records):
        column.close()
    for name, _ in _COLUMNS:
        (directory / name).unlink()
    dup_records.path.unlink()
    return _KeptPart(str(directory), records, errors, prompt_tokens, output_tokens)


def _provisional_errors(part: _ScanPart) -> Iterator[tuple[int, bytes, bytes]]:
    with (Path(part.directory) / "errors").open("rb") as file:
        for entry in file:
            line, code, outcome = entry.split(b" ", 2)
            yield int(line), code, outcome
    yield _NO_LINE, b"", b""


def _merge_errors(
    part: _ScanPart,
    duplicates: Iterator[tuple[int, str]],
    spool: BinaryIO,
    invalid_lines: Column,
    duplicate_records: Column,
) -> Counter[str]:
    """A range's final outcomes, in line order, to ``spool``: provisional ones, duplicates
    replacing them; their lines to ``invalid_lines``, the records that are duplicates to
    ``duplicate_records``. The errors by code."""
    provisional = _provisional_errors(part)
    invalid: array[int] = array("q")
    dup_records: array[int] = array("q")
    write = spool.write
    errors: Counter[str] = Counter()

    def stand(line: int, code: bytes, outcome: bytes) -> None:
        invalid.append(line)
        errors[code.decode()] += 1
        write(outcome)
        if len(invalid) >= CHUNK_ROWS:
            invalid_lines.extend(invalid)
            del invalid[:]

    err_line, err_code, err_outcome = next(provisional)
    for dup_line, dup_id in duplicates:
        while err_line < dup_line:  # invalid lines before the duplicate stand as they are
            stand(err_line, err_code, err_outcome)
            err_line, err_code, err_outcome = next(provisional)
        if err_line == dup_line:  # an invalid line repeating an ID: a duplicate_id instead
            err_line, err_code, err_outcome = next(provisional)
        else:
            dup_records.append(dup_line)
            if len(dup_records) >= CHUNK_ROWS:
                duplicate_records.extend(dup_records)
                del dup_records[:]
        outcome = encode_line_error(duplicate_error(dup_line, dup_id))
        stand(dup_line, ErrorCode.DUPLICATE_ID.value.encode(), outcome)
    while err_line != _NO_LINE:
        stand(err_line, err_code, err_outcome)
        err_line, err_code, err_outcome = next(provisional)
    invalid_lines.extend(invalid)
    duplicate_records.extend(dup_records)
    return errors


def _keep_records(
    part: _ScanPart, duplicates: Column, lines_out: Column, ends_out: Column, works_out: Column
) -> tuple[int, int, int]:
    """Copy a range's records that are no duplicate to the ``*_out`` columns; their count and
    estimated prompt and output tokens."""
    dup_chunks = duplicates.chunks()
    pending = np.empty(0, dtype=np.int64)
    records = prompt_tokens = output_tokens = 0
    lines, ends, works, prompts, outputs = columns = [
        Column(Path(part.directory) / name, code, written=part.records) for name, code in _COLUMNS
    ]
    start = 0
    for line_chunk in lines.chunks():
        stop = start + len(line_chunk)
        last_line = int(line_chunk[-1])
        while not len(pending) or pending[-1] <= last_line:
            more = next(dup_chunks, None)
            if more is None:
                break
            pending = np.concatenate((pending, more))
        cut = int(np.searchsorted(pending, last_line, side="right"))
        here, pending = pending[:cut], pending[cut:]
        keep = ~np.isin(line_chunk, here, assume_unique=True) if len(here) else slice(None)
        work = next(works.chunks(start, stop))[keep]
        lines_out.extend(line_chunk[keep])
        ends_out.extend(next(ends.chunks(start, stop))[keep])
        works_out.extend(work)
        records += len(work)
        prompt_tokens += int(next(prompts.chunks(start, stop))[keep].sum())
        output_tokens += int(next(outputs.chunks(start, stop))[keep].sum())
        start = stop
    for column in columns:
        column.close()
    return records, prompt_tokens, output_tokens


def _open_input(input_uri: str) -> BinaryIO:
    try:
        storage, key = open_uri(input_uri)
        return storage.open_read(key)
    except ObjectNotFound:
        raise InputError(f"input {input_uri} does not exist: check the path or URI") from None


def _local_path(input_uri: str) -> str | None:
    storage, key = open_uri(input_uri)
    return str(storage.root / key) if isinstance(storage, LocalStorage) else None


def _cores() -> int:
    """The cores this process may run on (the CPU count where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _scan_processes(request: PlanRequest, path: str | None) -> int:
    """How many processes validate the input: one for a small or remote input, else one per core."""
    if path is None:
        return 1
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return 1  # _open_input says so
    wanted = request.scan_processes or _cores()
    return max(1, min(wanted, size // PARALLEL_MIN_BYTES))


def _scan_input(
    request: PlanRequest, work_model: WorkModel, on_scanned: Callable[[], object] | None = None
) -> _InputScan:
    """The validating pass over the input (in byte ranges on several cores when it is large and
    local), ``on_scanned()``, then the duplicate-ID rule (:meth:`_InputScan.finish`). The caller
    closes the scan; on an error it is closed here."""
    # lines whose body asks for what the job's engine cannot honour are refused here, per line
    limits = dataclasses.replace(request.limits, engine=request.engine)
    path = _local_path(request.input_uri)
    if path is not None:
        _stat_input(request.input_uri, path)
    try:
        scan = _InputScan(memory_budget=request.memory_budget_mb * 1024 * 1024)
    except OSError as exc:
        raise _spill_error(exc, request.input_uri, path) from None
    try:
        processes = _scan_processes(request, path)

        def job(index: int, start: int, end: int | None, first_line: int) -> _PartJob:
            directory = str(scan.directory / f"part-{index:04d}")
            return _PartJob(
                path, start, end, first_line, directory, limits, request.default_max_tokens, work_model
            )

        if processes > 1 and path is not None:
            with Processes(processes) as workers:  # kept for the duplicate check
                parts = _scan_parallel(path, workers, job)
                if on_scanned is not None:
                    on_scanned()
                scan.workers = workers
                try:
                    scan.finish(parts)
                finally:
                    scan.workers = None
        else:
            with _open_input(request.input_uri) as stream:
                parts = [_scan_lines(stream, job(0, 0, None, 1))]
            if on_scanned is not None:
                on_scanned()
            scan.finish(parts)
    except BaseException as exc:
        scan.close()
        scan.spool.close()
        if isinstance(exc, OSError) and (
            exc.errno in _NO_ROOM or str(exc.filename or "").startswith(str(scan.directory))
        ):
            raise _spill_error(exc, request.input_uri, path) from None
        raise
    return scan


#: what a write says when its disk (or quota, or ``ulimit -f``) has no room left: only the spill
#: files are written while the input is scanned, so these are theirs
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: bytes of spill files per line at their peak, about (measured on a full tmpfs: docs/benchmarks.md
#: "Hostile planning"): a record's numbers and ID; an invalid line's outcome twice over
_SPILL_BYTES_PER_LINE = 100
_SPILL_BYTES_PER_INVALID_LINE = 700


def _spill_error(exc: OSError, input_uri: str, path: str | None) -> ConfigurationError:
    """The one-line error for spill files that could not be written: where they go, what they
    need, and the fix (the setting that moves them is ``TMPDIR``)."""
    where = tempfile.gettempdir()
    if exc.errno not in _NO_ROOM:
        return ConfigurationError(
            f"planning cannot write its temporary files in {where} ({exc.strerror}): "
            "set TMPDIR to a writable directory with room for them"
        )
    need = ""
    if path is not None:  # the error path only: a count at about a second a gigabyte
        with contextlib.suppress(OSError):
            lines = _count_newlines(path, 0, os.stat(path).st_size)
            need = f" ({lines:,} lines: about {math.ceil(lines * _SPILL_BYTES_PER_LINE / 2**20):,} MB)"
    if exc.errno == errno.EFBIG:
        cause, fix = f"{exc.strerror}: the file size limit", "raise the limit (ulimit -f)"
    else:
        cause, fix = str(exc.strerror), "free space there or set TMPDIR to a directory on a larger disk"
    return ConfigurationError(
        f"planning {input_uri}: its temporary files in {where} ran out of room ({cause}); they take "
        f"about {_SPILL_BYTES_PER_LINE} bytes a line{need}, {_SPILL_BYTES_PER_INVALID_LINE} an "
        f"invalid one: {fix}",
        uri=input_uri,
    )


def _scan_parallel(
    path: str, processes: Processes, job: Callable[[int, int, int | None, int], _PartJob]
) -> list[_ScanPart]:
    """Scan as many byte ranges of a local file as ``processes``, one in each (line numbers first)."""
    ranges = _line_ranges(path, os.stat(path).st_size, len(processes))
    # each range's first line number: the newlines before it, counted (C speed: about a second a
    # GB) while the processes start, range by range, in order
    first_lines = [1]

    def part(k: int) -> tuple[_PartJob]:
        if k:
            first_lines.append(first_lines[-1] + _count_newlines(path, *ranges[k - 1]))
        return (job(k, ranges[k][0], ranges[k][1], first_lines[k]),)

    parts: list[_ScanPart] = processes.map(
        _scan_part, [functools.partial(part, k) for k in range(len(ranges))]
    )
    return parts


def _cut_shards(scan: _InputScan, target_s: float, max_shards: int) -> tuple[ShardCut, ...]:
    """Contiguous byte ranges by cumulative work; the last one runs to the end of the input."""
    records = scan.records
    works = scan.works
    ranges = (
        cut_contiguous_chunks(works.chunks, target_seconds=target_s, max_shards=max_shards) if records else []
    )
    invalid_lines = scan.invalid_lines
    cuts: list[ShardCut] = []
    prev_end_offset = 0
    prev_last_line = 0
    for index, (a, b) in enumerate(ranges):
        last = index == len(ranges) - 1
        end_offset = scan.file_size if last else int(scan.ends[b - 1])
        last_line = scan.total_lines if last else int(scan.lines[b - 1])
        lo = bisect.bisect_left(invalid_lines, prev_last_line + 1)
        hi = bisect.bisect_right(invalid_lines, last_line)
        cuts.append(
            ShardCut(
                index=index,
                byte_start=prev_end_offset,
                byte_end=end_offset,
                first_line=prev_last_line + 1,
                line_count=last_line - prev_last_line,
                records=b - a,
                excluded_lines=tuple(invalid_lines.read_list(lo, hi)),
                est_work_s=math.fsum(itertools.chain.from_iterable(c.tolist() for c in works.chunks(a, b))),
            )
        )
        prev_end_offset, prev_last_line = end_offset, last_line
    return tuple(cuts)


def _shard_target(request: PlanRequest, pool: PoolSpec, gpu_seconds: float, records: int) -> float:
    """Shard duration near sqrt(2·C·M), capped by the recovery reserve and sized for parallelism."""
    spot = [p for p in request.pools if p.kind is PoolKind.SPOT]
    rate = max((p.preemptions_per_hour for p in spot), default=0.0)
    mtbi = 3600.0 / rate if rate > 0 else math.inf
    per_worker = gpu_seconds / max(1, min(request.workers, pool.gpus * len(request.pools)))
    reserve = max(60.0, 0.1 * per_worker)
    target = target_shard_seconds(
        checkpoint_cost_s=request.checkpoint_cost_s, mtbi_s=mtbi, recovery_reserve_s=reserve
    )
    if records and gpu_seconds > 0:
        # two shards per worker, so a slow or preempted shard does not idle the rest ...
        target = min(target, gpu_seconds / (2 * request.workers))
        # ... but a shard must be worth its start-up (pod scheduling, model load) ...
        target = max(target, 2.0 * pool.startup_seconds)
        # ... and every worker still gets a shard
        target = min(target, gpu_seconds / request.workers)
    return max(target, 1e-6)


#: local inputs already hashed whole in this process, by path and (size, inode, mtime): ``run``
#: hashes its input for the default idempotency key before planning, which then need not read
#: it again (the same test of "unchanged" as planning's own, ``_input_version``)
_WHOLE_HASHES: dict[tuple[Any, ...], str] = {}
_WHOLE_HASHES_KEPT = 8


def hash_input(input_uri: str) -> str:
    """SHA-256 of the whole input, in large reads (a local file unchanged since it was hashed: remembered)."""
    storage, key = open_uri(input_uri)
    version = None
    if isinstance(storage, LocalStorage):
        version = (str(storage.root / key), *_input_version(storage, key))
    if version is not None and (known := _WHOLE_HASHES.get(version)) is not None:
        return known
    whole = hashlib.sha256()
    with _open_input(input_uri) as stream:
        while chunk := stream.read(_READ_CHUNK):
            whole.update(chunk)
    digest = whole.hexdigest()
    if version is not None and _input_version(storage, key) == version[1:]:
        while len(_WHOLE_HASHES) >= _WHOLE_HASHES_KEPT:
            del _WHOLE_HASHES[next(iter(_WHOLE_HASHES))]
        _WHOLE_HASHES[version] = digest
    return digest


def hash_ranges(
    input_uri: str, cuts: tuple[ShardCut, ...], *, include_whole: bool = True
) -> tuple[str, list[str]]:
    """SHA-256 of the whole input and of each shard's byte range, in one pass of large reads.

    The whole-input digest is updated on a second thread: hashlib releases the GIL on large
    buffers, so the two digests of each chunk are computed side by side on two cores. With
    ``include_whole=False`` (the caller hashes the whole input itself) the first item is "".
    Then a large local input's ranges are hashed on parallel threads, one group of consecutive
    shards each.
    """
    path = _local_path(input_uri)
    if not include_whole and path is not None and len(cuts) > 1:
        threads = min(_cores(), len(cuts), cuts[-1].byte_end // PARALLEL_MIN_BYTES)
        if threads > 1:
            return "", _hash_parallel(path, cuts, threads)
    storage, key = open_uri(input_uri)
    whole = hashlib.sha256()
    digests: list[str] = []
    boundaries = [c.byte_end for c in cuts]
    current = hashlib.sha256()
    offset = 0
    shard = 0
    with storage.open_read(key) as stream, ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher:
        pending: Future[None] | None = None
        while True:
            chunk = stream.read(_READ_CHUNK)
            if not chunk:
                break
            if include_whole:
                if pending is not None:
                    pending.result()  # one chunk in flight at a time: in order, and bounded memory
                pending = hasher.submit(whole.update, chunk)
            view = memoryview(chunk)
            while len(view):
                if shard < len(boundaries) and offset + len(view) >= boundaries[shard]:
                    take = boundaries[shard] - offset
                    current.update(view[:take])
                    view = view[take:]
                    offset += take
                    digests.append(current.hexdigest())
                    current = hashlib.sha256()
                    shard += 1
                    continue
                current.update(view)
                offset += len(view)
                view = view[len(view) :]
        if pending is not None:
            pending.result()
    while shard < len(boundaries):  # empty trailing ranges
        digests.append(current.hexdigest())
        current = hashlib.sha256()
        shard += 1
    return (whole.hexdigest() if include_whole else ""), digests


def _hash_parallel(path: str, cuts: tuple[ShardCut, ...], threads: int) -> list[str]:
    """SHA-256 of each shard's byte range, consecutive shards grouped by bytes over ``threads`` threads.

    Threads, not processes: file reads and hashlib release the GIL on large buffers, so each
    thread has a core, without a Python process to start (two of those cost more than hashing
    half a gigabyte).
    """
    size = max(1, cuts[-1].byte_end)
    groups: list[list[tuple[int, int]]] = [[] for _ in range(threads)]
    for cut in cuts:
        middle = (cut.byte_start + cut.byte_end) / 2
        groups[min(threads - 1, int(middle * threads / size))].append((cut.byte_start, cut.byte_end))
    calls = [group for group in groups if group]
    with ThreadPoolExecutor(len(calls), thread_name_prefix="sha256") as pool:
        parts = list(pool.map(functools.partial(_hash_spans, path), calls))
    return [digest for part in parts for digest in part]


def _hash_spans(path: str, spans: list[tuple[int, int]]) -> list[str]:
    """SHA-256 of each ``[start, end)`` of a local file (run on a thread of its own)."""
    digests = []
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    with _open_local(path, buffering=0) as file:
        for start, end in spans:
            file.seek(start)
            digest = hashlib.sha256()
            left = end - start
            while left > 0 and (got := file.readinto(view[: min(_READ_CHUNK, left)])):  # type: ignore[attr-defined]
                digest.update(view[:got])
                left -= got
            digests.append(digest.hexdigest())
    return digests


def job_config(request: PlanRequest, target_shard_s: float) -> dict[str, Any]:
    """The immutable configuration every worker of the job verifies and follows."""
    return {
        "engine": request.engine,
        "model": request.model,
        "model_digest": request.model_digest,
        "generation": dict(request.generation),
        "microbatch_size": request.microbatch_size,
        "prompt_template_version": request.prompt_template_version,
        "max_attempts": request.max_attempts,
        "lease_ttl_s": request.lease_ttl_s,
        "workers": request.workers,
        "max_line_bytes": request.limits.max_line_bytes,
        "max_prompt_chars": request.limits.max_prompt_chars,
        "max_tokens_limit": request.limits.max_tokens_limit,
        "target_shard_s": target_shard_s,
        "pools": [p.to_dict() for p in request.pools],
    }


# -- a new job's pool rates: declared, or measured by earlier jobs of the model ----------------------

#: earlier commits (or busy GPU-seconds) of the model on a pool at which its measured rate replaces
#: the declared one outright; below, the two are blended in proportion to the evidence
MIN_RATE_COMMITS = 8
MIN_RATE_BUSY_S = 60.0


@dataclass(frozen=True, kw_only=True)
class PoolRating:
    """The rate a new job's pool was priced at, and where it came from (the admission report's ``rates``).

    Rates are tokens (prompt + completion) per GPU-second at the measured share of completion
    tokens (:func:`core.calibration.prior_tokens_per_s`), the unit the job's own calibration uses.
    ``weight`` is the measured rate's share of the blend (0: declared, 1: measured).
    """

    pool: str
    model: str
    declared_tokens_per_s: float
    measured_tokens_per_s: float | None
    tokens_per_s: float
    weight: float
    commits: int
    jobs: int
    busy_s: float

    @property
    def source(self) -> str:
        return "declared" if self.weight <= 0 else "measured" if self.weight >= 1 else "blended"

    @property
    def factor(self) -> float:
        """The pool's declared prefill and decode rates are multiplied by this."""
        return self.tokens_per_s / self.declared_tokens_per_s

    def summary(self) -> str:
        return (
            f"pool {self.pool} rated {self.tokens_per_s:,.0f} tokens/s per GPU for {self.model} "
            f"({self.source}: declared {self.declared_tokens_per_s:,.0f}, measured "
            + ("none" if self.measured_tokens_per_s is None else f"{self.measured_tokens_per_s:,.0f}")
            + f" over {self.commits} commit(s) of {self.jobs} earlier job(s))"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "model": self.model,
            "source": self.source,
            "tokens_per_s": self.tokens_per_s,
            "declared_tokens_per_s": self.declared_tokens_per_s,
            "measured_tokens_per_s": self.measured_tokens_per_s,
            "weight": self.weight,
            "factor": self.factor,
            "commits": self.commits,
            "jobs": self.jobs,
            "busy_s": self.busy_s,
        }


def rate_pool(spec: PoolSpec, measured: MeasuredRate | None, model: str) -> tuple[PoolSpec, PoolRating]:
    """``spec`` with its rates moved to what earlier jobs measured, by how much they measured.

    The measured rate's weight is ``min(1, max(commits / MIN_RATE_COMMITS, busy_s /
    MIN_RATE_BUSY_S))``; the blend averages seconds per token (as calibration does), and both the
    prefill and the decode rate are scaled by the same factor, so the pool's rate at the measured
    mix of tokens is the blend.
    """
    share = measured.completion_share if measured is not None else None
    declared = prior_tokens_per_s(spec) if share is None else prior_tokens_per_s(spec, share)
    rate = measured.tokens_per_s if measured is not None else None
    weight = 0.0
    blended = declared
    if measured is not None and rate is not None:
        weight = min(1.0, max(measured.commits / MIN_RATE_COMMITS, measured.busy_s / MIN_RATE_BUSY_S))
        blended = 1.0 / ((1.0 - weight) / declared + weight / rate)
    rating = PoolRating(
        pool=spec.name,
        model=model,
        declared_tokens_per_s=declared,
        measured_tokens_per_s=rate,
        tokens_per_s=blended,
        weight=weight,
        commits=measured.commits if measured is not None else 0,
        jobs=measured.jobs if measured is not None else 0,
        busy_s=measured.busy_s if measured is not None else 0.0,
    )
    if weight <= 0:
        return spec, rating
    factor = rating.factor
    rated = dataclasses.replace(
        spec,
        prefill_tokens_per_s=spec.prefill_tokens_per_s * factor,
        decode_tokens_per_s=spec.decode_tokens_per_s * factor,
    )
    return rated, rating


def rate_pools(store: ManifestStore, request: PlanRequest) -> tuple[PlanRequest, list[PoolRating]]:
    """``request`` with each pool rated at what earlier jobs of its model measured there.

    Feasibility, the plan's run time and cost, shared admission's demand and the job's config
    (the prior of its own calibration, so slack and placement too) all start from these rates.
    """
    from airflow_deadline_batch.store.throughput import model_key

    measured = store.measured_rates(
        [p.name for p in request.pools], engine=request.engine, model=request.model
    )
    key = model_key(request.engine, request.model)
    rated = [rate_pool(spec, measured.get(spec.name), key) for spec in request.pools]
    pools = tuple(spec for spec, _ in rated)
    return dataclasses.replace(request, pools=pools), [rating for _, rating in rated]


def plan_job(store: ManifestStore, request: PlanRequest, *, clock: Clock | None = None) -> PlanResult:
    """Plan and record a job; return literal shard specs for the launcher or ``expand_kwargs``.

    A repeated submission with the same idempotency key returns the first job unchanged, unless
    that job was rejected: then admission runs afresh (an Airflow retry of the plan task, or the
    same command once capacity freed) and may admit a new job. An infeasible job (or one with too
    many invalid lines) is recorded as ``rejected`` with its report, and :class:`AdmissionRejected`
    is raised: nothing runs.
    """
    clock = clock or SystemClock()
    if request.idempotency_key:
        existing = store.get_job_by_idempotency_key(request.idempotency_key)
        if existing is not None and existing.state is not JobState.REJECTED:
            return _existing_result(store, existing)
    with ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher:
        # A local input is hashed whole on a thread once the validating pass has read it (file
        # reads and hashlib release the GIL): the pass keeps every core busy, the duplicate-ID
        # check after it one. An S3 input is not downloaded a third time for it.
        storage, key = open_uri(request.input_uri)
        before = _input_version(storage, key)
        hashing: list[Future[str]] = []
        local = isinstance(storage, LocalStorage)

        def hash_whole() -> None:
            hashing.append(hasher.submit(hash_input, request.input_uri))

        request, rates = rate_pools(store, request)
        analysis = analyze_input(request, clock=clock, on_scanned=hash_whole if local else None)
        whole = hashing[0] if hashing else None
        try:
            return _record(
                store, analysis, clock, whole, lambda: _input_version(storage, key) == before, rates=rates
            )
        finally:
            analysis.close()


def _input_version(storage: Any, key: str) -> tuple[Any, ...]:
    """What changes when the input is rewritten (the storage's ``version``: a local file's size,
    inode, mtime and ctime; an S3 object's size, ETag and version ID).

    Planning reads the input more than once (validation, then range hashes); a rewrite between
    the reads would give shards checksums of bytes that were never validated.
    """
    try:
        if isinstance(storage, LocalStorage):  # what cannot be planned at all, refused by name
            _stat_input(storage.uri(key), str(storage.root / key))
        return tuple(storage.version(key))
    except ObjectNotFound:
        raise InputError(f"input {storage.uri(key)} does not exist: check the path or URI") from None


def _stat_input(input_uri: str, path: str) -> os.stat_result:
    """A local input's status; what cannot be planned at all (missing, a directory, a loop of
    symbolic links, unreadable) refused with one line naming the fix. A FIFO or device is
    refused by the storage when it is opened, without blocking."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"input {input_uri} does not exist: check the path or URI") from None
    except OSError as exc:
        loop = exc.errno == errno.ELOOP
        what = "is a loop of symbolic links" if loop else f"cannot be read ({exc.strerror})"
        raise InputError(f"input {input_uri} {what}: give the path of a JSON Lines file") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"input {input_uri} is a directory: give the path of a JSON Lines file in it")
    return st


def _record(
    store: ManifestStore,
    analysis: InputAnalysis,
    clock: Clock,
    whole: Future[str] | None,
    unchanged: Callable[[], bool],
    *,
    rates: Sequence[PoolRating] = (),
) -> PlanResult:
    from airflow_deadline_batch.store import NewCommit, NewJob, NewShard

    request = analysis.request
    report = analysis.report
    job_id = new_job_id()
    output_base = join_uri(request.output_uri, job_id)
    admitted = report.feasible or (request.allow_infeasible and report.verdict.value != "rejected_invalid")
    input_sha, range_shas = hash_ranges(request.input_uri, analysis.cuts, include_whole=whole is None)
    if whole is not None:
        input_sha = whole.result()
    if not unchanged():
        raise InputError(
            f"input {request.input_uri} changed while it was being planned: "
            "plan again once it is no longer being written"
        )
    new_job = NewJob(
        job_id=job_id,
        idempotency_key=request.idempotency_key,
        state=JobState.ADMITTED if admitted else JobState.REJECTED,
        deadline=request.deadline,
        input_uri=request.input_uri,
        input_sha256=input_sha,
        input_lines=analysis.outcome_lines,
        input_total_lines=analysis.total_lines,
        output_uri=output_base,
        config=job_config(request, analysis.target_shard_s),
        admission={**report.to_dict(), "rates": [r.to_dict() for r in rates]},
        tenant=request.tenant,
    )
    if not admitted:
        job, _ = store.create_job(new_job, [], None)
        if job.state is not JobState.REJECTED:  # a concurrent submission of the key was admitted
            return _existing_result(store, job)
        raise AdmissionRejected(
            f"job {job.job_id} rejected at admission ({report.verdict.value}): "
            + "; ".join([*report.reasons, *(r.summary() for r in rates if r.source != "declared")]),
            report=report,
            job_id=job.job_id,
        )
    shards = [
        NewShard(
            shard_index=c.index,
            byte_start=c.byte_start,
            byte_end=c.byte_end,
            first_line=c.first_line,
            line_count=c.line_count,
            records=c.records,
            excluded_lines=c.excluded_lines,
            input_sha256=range_shas[c.index],
            est_work_s=c.est_work_s,
            num_microbatches=microbatch_count(c.records, request.microbatch_size),
        )
        for c in analysis.cuts
    ]
    validation = None
    storage = open_storage(output_base)
    if analysis.work.invalid:
        # streamed from the spool (about 280 bytes an invalid line: 28 MB at 10M lines, 1% invalid)
        spool = analysis.error_spool
        spool.seek(0)
        sha = sha256_of_stream(spool)
        spool.seek(0)
        uri = put_stream(storage, VALIDATION_KEY, spool)
        validation = NewCommit(
            uri=uri,
            sha256=sha,
            records=analysis.work.invalid,
            counts={"errored": analysis.work.invalid},
        )
    # shared capacity, the tenant's quota and budget are checked as the job is recorded
    admit = shared_admission(job_id, report, request.pools, deadline_waived=request.allow_infeasible)
    job, created = store.create_job(new_job, shards, validation, admit=admit)
    if created and job.state is JobState.REJECTED and admit is not None:
        # what would admit it, searched after the admission lock is released, on the same snapshot
        explained = admit.explained()
        if explained is not None:
            job = store.explain_rejection(job.job_id, explained)
    if not created or job.state is JobState.REJECTED:
        # lost an idempotency race (the first job stands) or refused: our validation object is garbage
        if validation is not None:
            storage.delete(VALIDATION_KEY)
        return _existing_result(store, job)
    return PlanResult(
        job_id=job.job_id,
        created=True,
        report=report,
        shard_specs=[shard_spec(job.job_id, s.shard_index) for s in shards],
        shards=len(shards),
        records=analysis.work.records,
        invalid=analysis.work.invalid,
    )


def _existing_result(store: ManifestStore, job: Any) -> PlanResult:
    shards = store.list_shards(job.job_id)
    if job.state == JobState.REJECTED:
        raise AdmissionRejected(
            f"job {job.job_id} was rejected at admission: " + "; ".join(job.admission.get("reasons", [])),
            report=job.admission,
            job_id=job.job_id,
        )
    return PlanResult(
        job_id=job.job_id,
        created=False,
        report=job.admission,
        shard_specs=[shard_spec(job.job_id, s.shard_index) for s in shards],
        shards=len(shards),
        records=sum(s.records for s in shards),
        invalid=job.input_lines - sum(s.records for s in shards),
    )


def shard_spec(job_id: str, shard_index: int) -> dict[str, Any]:
    """A literal, JSON-able shard spec (mapped fields are not templated in Airflow)."""
    return {"job_id": job_id, "shard_index": shard_index}
