"""Planning's worker processes kept for a second round, the duplicate check in them, and the ID
spill's partitioning per flush (the same files, entry for entry, as one entry at a time)."""

from __future__ import annotations

import json
import os
import random
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.records import id_key
from airflow_deadline_batch.service import planning, spill
from airflow_deadline_batch.service.planning import analyze_input
from airflow_deadline_batch.service.processes import Processes
from airflow_deadline_batch.service.spill import DuplicateFinder, IdSpill, check_partitions
from tests.unit.planning_inputs import ODD_IDS, plan_request, summarize, write_input

GOLDEN = json.loads((Path(__file__).parent / "data" / "planning_cut_golden.json").read_text())


def test_children_stay_for_a_second_round() -> None:
    with Processes(2) as workers:
        first = workers.map(os.getpid, [(), ()])
        second = workers.map(os.getpid, [()])
    assert len(set(first)) == 2 and os.getpid() not in first
    assert second == first[:1]


def test_a_failure_in_a_later_round_raises_with_its_traceback() -> None:
    with Processes(2) as workers:
        assert workers.map(abs, [(-3,), (4,)]) == [3, 4]
        with pytest.raises(RuntimeError, match="(?s)factorial.*ValueError"):
            import math

            workers.map(math.factorial, [(3,), (-1,)])


def test_more_calls_than_processes_are_refused() -> None:
    with Processes(1) as workers, pytest.raises(ValueError, match="at most one each"):
        workers.map(abs, [(1,), (2,)])


@pytest.mark.parametrize("processes", [2, 3])
def test_duplicates_checked_in_the_scan_processes_within_a_small_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int
) -> None:
    monkeypatch.setattr(planning, "PARALLEL_MIN_BYTES", 1)
    path = write_input(tmp_path / "in.jsonl", 5000, 6)
    analysis = analyze_input(plan_request(path, scan_processes=processes, memory_budget_mb=1))
    try:
        got = summarize(analysis)
    finally:
        analysis.close()
    assert got == GOLDEN["6-5000"]


def test_groups_of_partitions_checked_apart_merge_to_the_duplicates(tmp_path: Path) -> None:
    rng = random.Random(9)
    entries = [(line, rng.choice(ODD_IDS) + str(rng.randrange(900))) for line in range(1, 6001)]
    ids = IdSpill(tmp_path / "ids", partitions=8, flush_entries=333)
    for line, record_id in entries:
        ids.add(line, record_id)
    partitions = ids.close()
    runs = [check_partitions(partitions[k::3], str(tmp_path / f"check-{k}"), 1 << 20) for k in range(3)]
    seen: set[str] = set()
    expected = []
    for line, record_id in entries:
        if record_id in seen:
            expected.append((line, record_id))
        seen.add(record_id)
    finder = DuplicateFinder(tmp_path / "merge", fan_in=2)
    assert list(finder.merged([run for group in runs for run in group])) == expected


IDS = st.one_of(
    st.none(),
    st.sampled_from((*ODD_IDS, "\ud800", "a\udfffb")),
    st.text(max_size=20),
    st.from_regex(r"r[0-9]{1,6}"),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    blocks=st.lists(st.lists(IDS, max_size=40), max_size=12),
    partitions=st.sampled_from([1, 2, 8, 64]),
    flush_entries=st.integers(1, 50),
)
def test_partition_files_are_those_of_one_entry_at_a_time(
    tmp_path_factory: pytest.TempPathFactory,
    blocks: list[list[str | None]],
    partitions: int,
    flush_entries: int,
) -> None:
    directory = tmp_path_factory.mktemp("ids")
    ids = IdSpill(directory, partitions=partitions, flush_entries=flush_entries)
    # the rule before the spill was vectorised: each entry appended to its partition's pending
    # chunk (CRC-32 of the key), every pending chunk written once flush_entries are pending
    expected: list[list[list[tuple[int, bytes]]]] = [[] for _ in range(partitions)]
    pending: list[list[tuple[int, bytes]]] = [[] for _ in range(partitions)]
    buffered, line = 0, 1

    def flush() -> None:
        for p in range(partitions):
            if pending[p]:
                expected[p].append(pending[p])
                pending[p] = []

    for block in blocks:
        ids.add_many(line, block)
        for record_id in block:
            if record_id is not None:
                key = id_key(record_id)
                pending[zlib.crc32(key) & (partitions - 1)].append((line, key))
                buffered += 1
            line += 1
        if buffered >= flush_entries:
            flush()
            buffered = 0
    flush()
    files = ids.close()
    got = [
        [
            list(zip(lines.tolist(), keys, strict=True))
            for path in paths
            for lines, keys in spill._read_chunks(path)
        ]
        for paths, _ in files
    ]
    assert got == expected
    assert [count for _, count in files] == [sum(map(len, chunks)) for chunks in expected]
