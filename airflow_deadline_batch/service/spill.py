"""Planning's spill files: what the validating pass keeps per line lives on disk, not in RAM.

Two pieces, both append-only while the input is read and read back in chunks afterwards:

* :class:`Column`: one number per record (or per invalid line) in a file of its own, so the
  per-record bookkeeping of ten million records costs a few chunks of memory, not gigabytes;
* :class:`IdSpill` and :class:`DuplicateFinder`: exact duplicate-ID detection without a set of
  every ID. Each ID goes, with its line number, to one of a fixed number of partition files by a
  hash of the ID; after the pass each partition is checked on its own with a set of only its IDs
  (a partition too big for the memory budget is split again by another hash first). The first
  line of an ID in a partition is the first line of that ID in the input, so the verdicts are
  the in-memory ones, exactly: IDs are compared in full, never by digest.

They live in a :class:`SpillDirectory` under the temporary directory (``TMPDIR``), which a planner
killed outright cannot delete: the next planner there does.
"""

from __future__ import annotations

import fcntl
import hashlib
import heapq
import marshal
import os
import shutil
import stat
import tempfile
import weakref
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, repeat
from operator import is_not, itemgetter
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "Column",
    "DuplicateFinder",
    "IdSpill",
    "PartitionFiles",
    "SpillDirectory",
    "check_partitions",
    "combine",
    "read_duplicates",
    "sweep_abandoned",
]

#: planning's default memory budget for its duplicate check (docs/benchmarks.md)
DEFAULT_MEMORY_BUDGET = 512 * 1024 * 1024
#: rows a column keeps in memory before it appends them to its file
CHUNK_ROWS = 1 << 16
#: estimated bytes of RAM per distinct ID in a set, on top of the ID's own bytes
_SET_ENTRY_BYTES = 112
_TYPECODES = {"q": np.int64, "d": np.float64}
#: a spill directory's name starts so (in the temporary directory)
SPILL_PREFIX = "deadline-batch-plan-"
#: the lock file its planner holds locked while it lives (:class:`SpillDirectory`)
_LOCK = "owner.lock"


class SpillDirectory:
    """A planner's spill directory under the temporary directory (``TMPDIR``), locked while it lives.

    Its planner holds an exclusive ``flock`` on the directory's lock file until :meth:`cleanup`.
    The kernel drops the lock when the process ends, however it ends, so a directory whose lock
    can be taken is one whose planner was killed outright (SIGKILL, the OOM killer) and could not
    delete it: a new spill directory first deletes those (:func:`sweep_abandoned`). The lock file
    appears already locked (locked under another name, then renamed), so no sweeper sees a live
    planner's directory unlocked; one without it (being made, or on a file system without locks)
    is never swept.
    """

    def __init__(self) -> None:
        parent = tempfile.gettempdir()
        sweep_abandoned(parent)
        self.path = Path(tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=parent))
        try:
            lock = _take_lock(self.path)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        # as TemporaryDirectory: deleted at exit too, if nobody called cleanup()
        self._finalizer = weakref.finalize(self, _remove, self.path, lock)

    def cleanup(self) -> None:
        """Delete the directory, then release its lock."""
        self._finalizer()


def _take_lock(directory: Path) -> int | None:
    """Lock a new spill directory's lock file; the descriptor (None where locks are unsupported)."""
    staging = directory / f".{_LOCK}"
    fd = os.open(staging, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without locks: the directory is never swept
        os.close(fd)
        return None
    try:
        os.rename(staging, directory / _LOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove(path: Path, lock: int | None) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if lock is not None:
        os.close(lock)  # after the files are gone: a sweeper finds nothing half deleted


def sweep_abandoned(parent: str) -> list[Path]:
    """Delete the spill directories in ``parent`` (this user's) whose planner is gone: their lock
    file unlocked. Those of live planners, and anything else, are left alone. The ones deleted."""
    swept: list[Path] = []
    try:
        entries = [entry for entry in os.scandir(parent) if entry.name.startswith(SPILL_PREFIX)]
    except OSError:
        return swept
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, _LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone, or no lock file: being made, or not a planner's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live planner holds it
            continue
        else:
            shutil.rmtree(entry.path, ignore_errors=True)
            swept.append(Path(entry.path))
        finally:
            os.close(fd)
    return swept


class Column:
    """An append-only column of ``int64`` (``"q"``) or ``float64`` (``"d"``) values in a file.

    Writers :meth:`extend` it with arrays (the caller batches); once :meth:`seal`-ed it reads
    back in chunks, by index and by range, without ever loading the whole column.
    """

    def __init__(self, path: Path, typecode: str, *, written: int | None = None) -> None:
        """A new, empty column; or with ``written``, the sealed column of that many values at ``path``
        (another process wrote it)."""
        if typecode not in _TYPECODES:
            raise ValueError(f"column typecode must be one of {sorted(_TYPECODES)}, got {typecode!r}")
        self.path = path
        self.typecode = typecode
        self._dtype = np.dtype(_TYPECODES[typecode])
        self._itemsize = self._dtype.itemsize
        self._file: BinaryIO | None = path.open("wb") if written is None else None
        self._reader: BinaryIO | None = None
        self._len = written or 0

    def __len__(self) -> int:
        return self._len

    def extend(self, values: array[Any] | np.ndarray) -> None:
        """Append ``values`` (an ``array`` of this typecode or a matching NumPy array)."""
        if self._file is None:
            raise RuntimeError(f"column {self.path.name} is sealed")
        if isinstance(values, np.ndarray):
            self._file.write(np.ascontiguousarray(values, dtype=self._dtype).tobytes())
        else:
            values.tofile(self._file)
        self._len += len(values)

    def extend_from_file(self, path: Path) -> None:
        """Append the values of a sealed column's file (another writer's, of this typecode)."""
        if self._file is None:
            raise RuntimeError(f"column {self.path.name} is sealed")
        with path.open("rb") as source:
            shutil.copyfileobj(source, self._file)
        self._len += path.stat().st_size // self._itemsize

    def seal(self) -> Column:
        """Stop writing; reading may begin."""
        if self._file is not None:
            self._file.close()
            self._file = None
        return self

    def close(self) -> None:
        self.seal()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _read(self, start: int, count: int) -> np.ndarray:
        if self._file is not None:
            raise RuntimeError(f"column {self.path.name} is still being written: seal it first")
        if self._reader is None:
            self._reader = self.path.open("rb")
        self._reader.seek(start * self._itemsize)
        return np.fromfile(self._reader, dtype=self._dtype, count=count)

    def chunks(self, start: int = 0, stop: int | None = None, size: int = CHUNK_ROWS) -> Iterator[np.ndarray]:
        """The values ``[start, stop)`` as NumPy arrays of at most ``size`` values."""
        stop = self._len if stop is None else min(stop, self._len)
        while start < stop:
            count = min(size, stop - start)
            yield self._read(start, count)
            start += count

    def values(self, start: int = 0, stop: int | None = None) -> Iterator[float]:
        """The values ``[start, stop)`` one by one, as Python numbers."""
        for chunk in self.chunks(start, stop):
            yield from chunk.tolist()

    def read_list(self, start: int, stop: int) -> list[Any]:
        """The values ``[start, stop)`` as a list of Python numbers (for short ranges)."""
        values: list[Any] = self._read(start, max(0, min(stop, self._len) - start)).tolist()
        return values

    def __getitem__(self, index: int) -> Any:
        """One value, as a Python number."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"column index {index} out of range (length {self._len})")
        return self._read(index, 1).tolist()[0]


#: a chunk of spilled (line, ID key) entries, as columns: the lines, the keys (the same length)
Entries = tuple["np.ndarray[Any, np.dtype[np.int64]]", list[bytes]]


def _write_chunk(file: BinaryIO, lines: np.ndarray, keys: list[bytes]) -> None:
    # length-prefixed: marshal.load() on a file reads object by object, ten times slower; the
    # lines as int64 bytes and the keys as a flat list (a list of tuples costs twice as much);
    # format 2, without back-references: 7x faster for keys another list also holds
    data = marshal.dumps((np.ascontiguousarray(lines, dtype=np.int64).tobytes(), keys), 2)
    file.write(len(data).to_bytes(8, "little"))
    file.write(data)


def _read_chunks(path: Path) -> Iterator[Entries]:
    with path.open("rb") as file:
        while size := file.read(8):
            lines, keys = marshal.loads(file.read(int.from_bytes(size, "little")))
            yield np.frombuffer(lines, dtype=np.int64), keys


class _Partition:
    """One partition file of (line, ID key) entries, in line order."""

    __slots__ = ("count", "file", "path")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: BinaryIO | None = None
        self.count = 0

    def write(self, lines: np.ndarray, keys: list[bytes]) -> None:
        if not keys:
            return
        if self.file is None:
            self.file = self.path.open("wb")
        _write_chunk(self.file, lines, keys)
        self.count += len(keys)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


#: one partition of the spilled IDs: its files, in line order, and how many entries they hold
PartitionFiles = tuple[tuple[Path, ...], int]


def _encode_ids(record_ids: Iterable[str]) -> list[bytes]:
    """:func:`~airflow_deadline_batch.core.records.id_key` of each ID (at C speed unless one holds a
    lone surrogate, which only ``surrogatepass`` encodes)."""
    record_ids = list(record_ids)
    try:
        return list(map(str.encode, record_ids))
    except UnicodeEncodeError:
        return [record_id.encode("utf-8", "surrogatepass") for record_id in record_ids]


class IdSpill:
    """Spill every line's ID, with its line number, to one of ``partitions`` files by a hash of the ID.

    :meth:`add` IDs in line order (invalid lines with an ID too: the first line of an ID owns it
    even when it is invalid); :meth:`close` returns the partitions for :func:`find_duplicates`.
    Memory: at most ``flush_entries`` pending entries, kept in line order and distributed over
    the partitions (by CRC-32 of the key) only when they are written, with NumPy. Several spills
    of consecutive parts of the input (one per process) combine partition by partition, in
    input order.
    """

    def __init__(self, directory: Path, *, partitions: int = 64, flush_entries: int = CHUNK_ROWS) -> None:
        if partitions < 1 or partitions & (partitions - 1):
            raise ValueError(f"partitions must be a power of two, got {partitions}")
        if flush_entries < 1:
            raise ValueError(f"flush_entries must be >= 1, got {flush_entries}")
        directory.mkdir(parents=True, exist_ok=True)
        self._flush_entries = flush_entries
        self._mask = partitions - 1
        self._parts = [_Partition(directory / f"ids-{p:04d}") for p in range(partitions)]
        self._lines: list[np.ndarray] = []
        self._keys: list[bytes] = []
        self.ids = 0

    def add(self, line: int, record_id: str) -> None:
        """Remember that ``line`` carries ``record_id`` (lines must come in increasing order)."""
        self.add_many(line, [record_id])

    def add_many(self, first_line: int, record_ids: Sequence[str | None]) -> None:
        """:meth:`add` for consecutive lines from ``first_line``; a None item is a line without an ID."""
        count = len(record_ids)
        if None in record_ids:
            present = list(map(is_not, record_ids, repeat(None)))
            self._lines.append(np.flatnonzero(present) + first_line)
            self._keys += _encode_ids(compress(record_ids, present))  # type: ignore[arg-type]
        elif count:
            self._lines.append(np.arange(first_line, first_line + count, dtype=np.int64))
            self._keys += _encode_ids(record_ids)  # type: ignore[arg-type]
        if len(self._keys) >= self._flush_entries:
            self._flush()

    def _flush(self) -> None:
        """Write the pending entries, each partition's in line order (one chunk per partition)."""
        keys = self._keys
        if not keys:
            return
        lines = np.concatenate(self._lines)
        crcs = np.fromiter(map(zlib.crc32, keys), dtype=np.uint32, count=len(keys))
        partition = crcs & np.uint32(self._mask)
        order = np.argsort(partition, kind="stable")  # stable: line order within a partition
        sorted_keys = itemgetter(*order.tolist())(keys) if len(keys) > 1 else tuple(keys)
        sorted_lines = lines[order]
        start = 0
        for part, count in zip(
            self._parts, np.bincount(partition, minlength=self._mask + 1).tolist(), strict=True
        ):
            if count:
                part.write(sorted_lines[start : start + count], list(sorted_keys[start : start + count]))
                start += count
        self.ids += len(keys)
        self._lines, self._keys = [], []

    def close(self) -> list[PartitionFiles]:
        """Write what is pending; the partitions' files (none for an empty one) and entry counts."""
        self._flush()
        for part in self._parts:
            part.close()
        return [((part.path,) if part.count else (), part.count) for part in self._parts]


def combine(spills: Sequence[Sequence[PartitionFiles]]) -> list[PartitionFiles]:
    """The partitions of consecutive parts of the input, joined partition by partition, in order."""
    if not spills:
        return []
    return [
        (tuple(path for spill in spills for path in spill[p][0]), sum(spill[p][1] for spill in spills))
        for p in range(len(spills[0]))
    ]


class DuplicateFinder:
    """Exact duplicate-ID detection over spilled partitions, within a memory budget.

    Each partition is checked on its own with a set of only its IDs (at most about half of
    ``memory_budget``; a bigger partition is split first by an independent hash), its later
    lines are written as a sorted run, and the runs are merged by line, at most ``fan_in`` open
    at once. Every file it reads is deleted once read.
    """

    def __init__(
        self, directory: Path, *, memory_budget: int = DEFAULT_MEMORY_BUDGET, fan_in: int = 64
    ) -> None:
        if memory_budget < 1 or fan_in < 2:
            raise ValueError("memory_budget must be >= 1 and fan_in >= 2")
        directory.mkdir(parents=True, exist_ok=True)
        self._dir = directory
        self._set_budget = memory_budget // 2
        self._flush_entries = CHUNK_ROWS
        self._fan_in = fan_in
        self._runs: list[Path] = []
        self._names = 0
        self.splits = 0  # partitions split for the budget (for tests and diagnostics)

    def _new_path(self, stem: str) -> Path:
        self._names += 1
        return self._dir / f"{stem}-{self._names:06d}"

    def duplicates(self, partitions: Sequence[PartitionFiles]) -> Iterator[tuple[int, str]]:
        """``(line, id)`` of every line whose ID an earlier line carries, in line order."""
        return self.merged(self.check(partitions))

    def check(self, partitions: Sequence[PartitionFiles]) -> list[Path]:
        """Check ``partitions`` (each on its own); the sorted runs of their later lines, for :meth:`merged`.

        Partitions share no ID, so disjoint groups of them may be checked by several finders
        (in several processes: :func:`check_partitions`) and their runs merged by one."""
        for paths, count in partitions:
            if count:
                self._check(paths, count, sum(p.stat().st_size for p in paths), depth=0)
        runs, self._runs = self._runs, []
        return runs

    def merged(self, runs: Sequence[Path]) -> Iterator[tuple[int, str]]:
        """``(line, id)`` of the runs' entries (from :meth:`check`, of one or several finders), in
        line order; each run deleted once read."""
        for line, key in self._merge(list(runs)):
            yield line, key.decode("utf-8", "surrogatepass")

    def merged_by_range(self, runs: Sequence[Path], last_lines: Sequence[int]) -> list[Path]:
        """The entries of :meth:`merged`, written to one file per range of lines (range ``k`` ends at
        ``last_lines[k]``, after range ``k - 1``), so that whoever handles a range reads only its
        own with :func:`read_duplicates`; each run deleted once read."""
        outs = [_Partition(self._new_path("range")) for _ in last_lines]
        batch: list[tuple[int, bytes]] = []
        k = 0
        for entry in self._merge(list(runs)):
            while entry[0] > last_lines[k]:
                _write_entries(outs[k], batch)
                batch = []
                k += 1
            batch.append(entry)
            if len(batch) >= 4096:
                _write_entries(outs[k], batch)
                batch = []
        _write_entries(outs[k], batch)
        for out in outs:
            out.close()
        return [out.path for out in outs]

    def _check(self, paths: Sequence[Path], count: int, size: int, depth: int) -> None:
        """Find the duplicates of one partition, splitting it first when it is too big."""
        if count * _SET_ENTRY_BYTES + size > self._set_budget and depth < 6:
            children = self._split(paths, depth)
            self.splits += 1
            for child, child_count in children:
                if child_count == count:  # every entry hashed alike: one ID (or a few) many times
                    self._check_in_memory((child,))
                elif child_count:
                    self._check((child,), child_count, child.stat().st_size, depth + 1)
            return
        self._check_in_memory(paths)

    def _split(self, paths: Sequence[Path], depth: int) -> list[tuple[Path, int]]:
        """Distribute a partition's entries over 16 files by a second, independent hash."""
        person = f"adb-split-{depth}".encode()
        children = [_Partition(self._new_path("split")) for _ in range(16)]
        pending: list[list[tuple[int, bytes]]] = [[] for _ in children]
        for lines, keys in _read_all(paths):
            for entry in zip(lines.tolist(), keys, strict=True):
                digest = hashlib.blake2b(entry[1], digest_size=1, person=person).digest()
                pending[digest[0] & 15].append(entry)
            for child, entries in zip(children, pending, strict=True):
                if len(entries) >= self._flush_entries // 16 + 1:
                    _write_entries(child, entries)
                    entries.clear()
        result = []
        for child, entries in zip(children, pending, strict=True):
            _write_entries(child, entries)
            child.close()
            result.append((child.path, child.count))
        return result

    def _check_in_memory(self, paths: Sequence[Path]) -> None:
        """The duplicates of one partition, with a set of its distinct IDs; written as a sorted run."""
        seen: set[bytes] = set()
        run: list[tuple[int, bytes]] = []
        run_file = _Partition(self._new_path("run"))
        for lines, keys in _read_all(paths):
            distinct = set(keys)
            if len(distinct) == len(keys) and seen.isdisjoint(distinct):
                seen |= distinct  # the common case: no duplicate in this chunk, at C speed
                continue
            for entry in zip(lines.tolist(), keys, strict=True):
                if entry[1] in seen:
                    run.append(entry)
                else:
                    seen.add(entry[1])
            if len(run) >= 4096:
                _write_entries(run_file, run)
                run = []
        _write_entries(run_file, run)
        run_file.close()
        if run_file.count:
            self._runs.append(run_file.path)

    def _merge(self, runs: list[Path]) -> Iterator[tuple[int, bytes]]:
        """Merge sorted runs by line, at most ``fan_in`` files open at once."""
        while len(runs) > self._fan_in:
            merged: list[Path] = []
            for start in range(0, len(runs), self._fan_in):
                group = runs[start : start + self._fan_in]
                out_path = self._new_path("run")
                out = _Partition(out_path)
                batch: list[tuple[int, bytes]] = []
                for entry in heapq.merge(*(_iter_run(p) for p in group)):
                    batch.append(entry)
                    if len(batch) >= 4096:
                        _write_entries(out, batch)
                        batch = []
                _write_entries(out, batch)
                out.close()
                for path in group:
                    path.unlink()
                merged.append(out_path)
            runs = merged
        yield from heapq.merge(*(_iter_run(p) for p in runs))
        for path in runs:
            path.unlink()


def check_partitions(partitions: Sequence[PartitionFiles], directory: str, memory_budget: int) -> list[Path]:
    """:meth:`DuplicateFinder.check` of some partitions, by a finder of its own in ``directory``
    (run in a worker process: the runs it returns are merged by the caller's finder)."""
    return DuplicateFinder(Path(directory), memory_budget=memory_budget).check(partitions)


def read_duplicates(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, id)`` of a file of :meth:`DuplicateFinder.merged_by_range`, in line order (none if it
    was never written); the file deleted once read."""
    if not path.exists():
        return
    for line, key in _iter_run(path):
        yield line, key.decode("utf-8", "surrogatepass")
    path.unlink()


def _read_all(paths: Sequence[Path]) -> Iterator[Entries]:
    """The chunks of ``paths`` in order, each file deleted once read."""
    for path in paths:
        yield from _read_chunks(path)
        path.unlink()


def _iter_run(path: Path) -> Iterator[tuple[int, bytes]]:
    for lines, keys in _read_chunks(path):
        yield from zip(lines.tolist(), keys, strict=True)


def _write_entries(out: _Partition, entries: Sequence[tuple[int, bytes]]) -> None:
    """Append (line, key) entries to a file as one chunk (nothing for none)."""
    if entries:
        lines, keys = zip(*entries, strict=True)
        out.write(np.array(lines, dtype=np.int64), list(keys))
