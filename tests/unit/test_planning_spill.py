"""Planning in bounded memory: spilled duplicate-ID detection gives today's outcomes and shard cut.

``data/planning_cut_golden.json`` holds the analysis (records, totals, error codes, the error
spool's SHA-256, every shard cut) that the in-memory planner of commit 76eea3c produced for the
inputs of :mod:`tests.unit.planning_inputs`; the spilling planner must reproduce it bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
import tempfile
from array import array
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.records import (
    ErrorCode,
    LineError,
    ValidationLimits,
    iter_raw_lines,
    parse_line,
)
from airflow_deadline_batch.service import planning
from airflow_deadline_batch.service.planning import analyze_input
from airflow_deadline_batch.service.spill import Column, DuplicateFinder, IdSpill, combine, read_duplicates
from tests.unit.planning_inputs import MAX_LINE_BYTES, ODD_IDS, plan_request, summarize, write_input

GOLDEN = json.loads((Path(__file__).parent / "data" / "planning_cut_golden.json").read_text())
#: (seed, lines, ID pool) of each golden input; None: a pool of a third of the lines (many repeats)
CASES: list[tuple[int, int, int | None]] = [
    (1, 400, None),
    (2, 1500, None),
    (3, 3000, None),
    (4, 7, None),
    (5, 1, None),
    (6, 5000, None),
]
CASES += [(7, 4000, 10**6)]


# --------------------------------------------------------------------------------------------
# The shard cut and every outcome, against the in-memory planner's


@pytest.mark.parametrize("budget_mb", [512, 1])
@pytest.mark.parametrize(("seed", "lines", "pool"), CASES)
def test_analysis_is_identical_to_the_in_memory_planner(
    tmp_path: Path, seed: int, lines: int, pool: int | None, budget_mb: int
) -> None:
    path = write_input(tmp_path / "in.jsonl", lines, seed, pool=pool)
    analysis = analyze_input(plan_request(path, memory_budget_mb=budget_mb))
    try:
        got = summarize(analysis)
    finally:
        analysis.close()
    assert got == GOLDEN[f"{seed}-{lines}"]


@pytest.mark.parametrize("processes", [2, 3])
@pytest.mark.parametrize(("seed", "lines", "pool"), [CASES[1], CASES[5], CASES[6]])
def test_parallel_scan_is_identical_to_the_in_memory_planner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, lines: int, pool: int | None, processes: int
) -> None:
    monkeypatch.setattr(planning, "PARALLEL_MIN_BYTES", 1)
    path = write_input(tmp_path / "in.jsonl", lines, seed, pool=pool)
    request = plan_request(path, scan_processes=processes)
    assert planning._scan_processes(request, str(path)) == processes
    analysis = analyze_input(request)
    try:
        got = summarize(analysis)
    finally:
        analysis.close()
    assert got == GOLDEN[f"{seed}-{lines}"]


def test_parallel_range_hashes_are_the_sequential_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_input(tmp_path / "in.jsonl", 3000, 3)
    analysis = analyze_input(plan_request(path))
    analysis.close()
    cuts = analysis.cuts
    empty = dataclasses.replace(cuts[-1], index=len(cuts), byte_start=cuts[-1].byte_end)
    cuts = (*cuts, empty)
    whole, sequential = planning.hash_ranges(str(path), cuts)
    monkeypatch.setattr(planning, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(planning, "_cores", lambda: 3)
    assert planning.hash_ranges(str(path), cuts, include_whole=False) == ("", sequential)
    assert whole == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sequential[-1] == hashlib.sha256(b"").hexdigest()


def test_line_ranges_start_lines_and_cover_the_file(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\n" + b"x" * 5000 + b"\n\nb\nc")  # one line longer than a range
    size = path.stat().st_size
    ranges = planning._line_ranges(str(path), size, 8)
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a < b for a, b in ranges) and all(
        r[1] == s[0] for r, s in zip(ranges, ranges[1:], strict=False)
    )
    data = path.read_bytes()
    assert all(a == 0 or data[a - 1 : a] == b"\n" for a, _ in ranges)


def test_the_spill_files_are_gone_once_analysed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spill_root = tmp_path / "tmp"
    spill_root.mkdir()
    monkeypatch.setenv("TMPDIR", str(spill_root))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    path = write_input(tmp_path / "in.jsonl", 300, 3)
    analysis = analyze_input(plan_request(path))
    assert list(spill_root.iterdir()) == []  # the error spool is an anonymous temporary file
    assert analysis.error_spool.read().count(b"\n") == analysis.work.invalid
    analysis.close()


# --------------------------------------------------------------------------------------------
# Outcomes against a plain in-memory reference


def reference_outcomes(data: bytes, limits: ValidationLimits) -> tuple[list[int], list[dict[str, object]]]:
    """Valid record lines and error outcomes by the rule of docs/design.md §4.1, with a set."""
    seen: set[str] = set()
    records: list[int] = []
    errors: list[dict[str, object]] = []
    for raw in iter_raw_lines(io.BytesIO(data), max_line_bytes=limits.max_line_bytes):
        outcome = parse_line(raw, limits)
        if outcome is None:
            continue
        record_id = outcome.id
        if record_id is not None:
            if record_id in seen:
                clipped = record_id.encode("unicode_escape", "backslashreplace").decode("ascii")
                if len(clipped) > 80:
                    clipped = clipped[:77] + "..."
                outcome = LineError(
                    outcome.line,
                    record_id,
                    ErrorCode.DUPLICATE_ID,
                    f"ID '{clipped}' was already used by an earlier line (the first one is kept); "
                    "give every record a unique ID",
                )
            seen.add(record_id)
        if isinstance(outcome, LineError):
            code, message = outcome.code.value, outcome.message
            errors.append({"line": outcome.line, "id": outcome.id, "code": code, "message": message})
        else:
            records.append(outcome.line)
    return records, errors


def planned_outcomes(path: Path, **overrides: object) -> tuple[int, list[dict[str, Any]], list[int]]:
    analysis = analyze_input(plan_request(path, **overrides))
    try:
        spooled = [orjson.loads(line) for line in analysis.error_spool.read().splitlines()]
        excluded = [n for cut in analysis.cuts for n in cut.excluded_lines]
        return analysis.work.records, spooled, excluded
    finally:
        analysis.close()


def assert_same_outcomes(path: Path) -> None:
    limits = ValidationLimits(max_line_bytes=MAX_LINE_BYTES, engine="transformers")
    ref_records, ref_errors = reference_outcomes(path.read_bytes(), limits)
    records, spooled, excluded = planned_outcomes(path)
    assert records == len(ref_records)
    got = [
        {"line": r["line"], "id": r["id"], "code": r["error"]["code"], "message": r["error"]["message"]}
        for r in spooled
    ]
    assert got == ref_errors  # the same outcomes, in line order
    if records:
        assert excluded == [e["line"] for e in ref_errors]


LINE_IDS = st.sampled_from(["a", "b", "a" * 17, "x" * 200, *ODD_IDS])
LINES = st.one_of(
    st.builds(lambda i: orjson.dumps({"id": i, "prompt": "hello there"}), LINE_IDS),
    st.builds(lambda i: orjson.dumps({"id": i, "prompt": " "}), LINE_IDS),  # invalid, owns its ID
    st.builds(lambda i: orjson.dumps({"id": i, "prompt": "p", "max_tokens": 0}), LINE_IDS),
    st.builds(
        lambda i: orjson.dumps(
            {"custom_id": i, "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
        ),
        LINE_IDS,
    ),
    st.builds(lambda i: orjson.dumps({"id": i, "prompt": "w " * MAX_LINE_BYTES}), LINE_IDS),  # too long
    st.sampled_from([b"", b"  ", b"{", b'{"prompt": "no id"}', b"\xff", b'{"id": "\\ud800", "prompt": "x"}']),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINES, max_size=60), crlf=st.booleans())
def test_outcomes_match_an_in_memory_reference(tmp_path: Path, lines: list[bytes], crlf: bool) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(line + (b"\r\n" if crlf else b"\n") for line in lines))
    assert_same_outcomes(path)


def test_an_invalid_first_line_owns_its_id(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b'{"id": "a", "prompt": "  "}\n\n{"id": "a", "prompt": "fine"}\n{"id": "b", "prompt": "ok"}\n'
    )
    records, spooled, _ = planned_outcomes(path)
    assert records == 1
    assert [(r["line"], r["id"], r["error"]["code"]) for r in spooled] == [
        (1, "a", "empty_prompt"),
        (3, "a", "duplicate_id"),
    ]


def test_thousands_of_duplicates_of_one_id(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(b'{"id": "same", "prompt": "p %d"}\n' % i for i in range(5000)))
    records, spooled, excluded = planned_outcomes(path, memory_budget_mb=1)
    assert records == 1
    assert [r["line"] for r in spooled] == list(range(2, 5001))
    assert {r["error"]["code"] for r in spooled} == {"duplicate_id"}
    assert excluded == list(range(2, 5001))


def test_messy_inputs_match_the_reference(tmp_path: Path) -> None:
    for seed in (11, 12, 13):
        assert_same_outcomes(write_input(tmp_path / f"in-{seed}.jsonl", 800, seed))


# --------------------------------------------------------------------------------------------
# DuplicateIds on its own


def reference_duplicates(entries: list[tuple[int, str]]) -> list[tuple[int, str]]:
    seen: set[str] = set()
    out = []
    for line, record_id in entries:
        if record_id in seen:
            out.append((line, record_id))
        seen.add(record_id)
    return out


def find_duplicates(
    tmp_path: Path,
    entries: list[tuple[int, str]],
    *,
    partitions: int = 64,
    flush_entries: int = 1 << 16,
    memory_budget: int = 1 << 29,
    fan_in: int = 64,
) -> tuple[list[tuple[int, str]], DuplicateFinder, IdSpill]:
    spill = IdSpill(tmp_path / "ids", partitions=partitions, flush_entries=flush_entries)
    for line, record_id in entries:
        spill.add(line, record_id)
    finder = DuplicateFinder(tmp_path / "dups", memory_budget=memory_budget, fan_in=fan_in)
    return list(finder.duplicates(spill.close())), finder, spill


def test_duplicates_across_partitions_in_line_order(tmp_path: Path) -> None:
    rng = random.Random(5)
    entries = [(line, f"id-{rng.randrange(3000)}") for line in range(1, 10_001)]
    found, _, spill = find_duplicates(tmp_path, entries, partitions=8, flush_entries=100)
    assert found == reference_duplicates(entries)
    assert spill.ids == 10_000
    assert list((tmp_path / "ids").iterdir()) == []  # every spill file is deleted once read
    assert list((tmp_path / "dups").iterdir()) == []


def test_spills_of_consecutive_ranges_combine(tmp_path: Path) -> None:
    rng = random.Random(8)
    entries = [(line, f"id-{rng.randrange(700)}") for line in range(1, 3001)]
    spills = []
    for k, (a, b) in enumerate([(0, 1000), (1000, 1001), (1001, 1001), (1001, 3000)]):
        spill = IdSpill(tmp_path / f"ids-{k}", partitions=4, flush_entries=37)
        for line, record_id in entries[a:b]:
            spill.add(line, record_id)
        spills.append(spill.close())
    finder = DuplicateFinder(tmp_path / "dups", memory_budget=30_000)
    assert list(finder.duplicates(combine(spills))) == reference_duplicates(entries)


def test_duplicates_by_range_are_the_duplicates_cut_at_the_ranges_last_lines(tmp_path: Path) -> None:
    rng = random.Random(9)
    entries = [(line, rng.choice(ODD_IDS) + str(rng.randrange(500))) for line in range(1, 2001)]
    spill = IdSpill(tmp_path / "ids", partitions=4, flush_entries=53)
    for line, record_id in entries:
        spill.add(line, record_id)
    finder = DuplicateFinder(tmp_path / "dups", memory_budget=30_000, fan_in=3)
    last_lines = [0, 700, 700, 1999, 2000]  # empty ranges, and one of a single line
    paths = finder.merged_by_range(finder.check(spill.close()), last_lines)
    by_range = [list(read_duplicates(path)) for path in paths]
    expected = reference_duplicates(entries)
    assert [e for part in by_range for e in part] == expected
    for k, part in enumerate(by_range):
        assert all((last_lines[k - 1] if k else 0) < line <= last_lines[k] for line, _ in part)
    assert by_range[0] == by_range[2] == []
    assert list((tmp_path / "dups").iterdir()) == []  # every run and range file is deleted once read


def test_a_column_extends_from_another_columns_file(tmp_path: Path) -> None:
    first, second = Column(tmp_path / "a", "q"), Column(tmp_path / "b", "q")
    first.extend(array("q", [1, 2, 3]))
    second.extend(array("q", [4, 5]))
    second.seal()
    first.extend_from_file(second.path)
    first.extend(array("q", [6]))
    first.seal()
    assert len(first) == 6 and list(first.values()) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(RuntimeError, match="sealed"):
        first.extend_from_file(second.path)


def test_a_partition_over_the_budget_is_split_and_stays_exact(tmp_path: Path) -> None:
    rng = random.Random(6)
    entries = [(line, rng.choice(ODD_IDS) + str(rng.randrange(2000))) for line in range(1, 8001)]
    found, finder, _ = find_duplicates(
        tmp_path, entries, partitions=2, memory_budget=20_000, flush_entries=64
    )
    assert finder.splits > 0
    assert found == reference_duplicates(entries)


def test_one_id_many_times_stops_splitting(tmp_path: Path) -> None:
    entries = [(line, "same") for line in range(1, 20_001)]
    found, finder, _ = find_duplicates(tmp_path, entries, partitions=1, memory_budget=1000)
    assert finder.splits == 1
    assert found == entries[1:]


def test_many_runs_are_merged_with_a_small_fan_in(tmp_path: Path) -> None:
    entries = [(line, f"k{line % 500}") for line in range(1, 6001)]
    found, _, _ = find_duplicates(tmp_path, entries, partitions=64, fan_in=2, flush_entries=50)
    assert found == reference_duplicates(entries)


def test_ids_are_compared_exactly_long_short_and_odd(tmp_path: Path) -> None:
    ids = [
        "a",
        "A",
        "é",
        "e\u0301",
        "\ud800",  # a lone surrogate survives the round trip
        "\ud800\udc00",
        "𐀀",
        "x" * 16,
        "x" * 17,
        "x" * 10_000,
        "x" * 10_000 + "y",
        "\u0000",
    ]
    entries = [(line, record_id) for line, record_id in enumerate(ids + ids[::-1] + ids, start=1)]
    found, _, _ = find_duplicates(tmp_path, entries, partitions=4)
    assert found == reference_duplicates(entries)
    assert len(found) == 2 * len(ids)


def test_partitions_must_be_a_power_of_two(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="power of two"):
        IdSpill(tmp_path, partitions=3)


# --------------------------------------------------------------------------------------------
# Column


def test_column_reads_back_in_chunks_by_index_and_range(tmp_path: Path) -> None:
    column = Column(tmp_path / "c", "d")
    values = [i / 7 for i in range(1000)]
    for start in range(0, 1000, 300):
        column.extend(array("d", values[start : start + 300]))
    column.seal()
    assert len(column) == 1000
    assert list(column.values()) == values
    assert [len(c) for c in column.chunks(size=400)] == [400, 400, 200]
    assert column[0] == values[0] and column[-1] == values[-1] and column[555] == values[555]
    assert column.read_list(10, 13) == values[10:13]
    with pytest.raises(IndexError):
        column[1000]
    column.close()


def test_an_empty_column(tmp_path: Path) -> None:
    column = Column(tmp_path / "c", "q").seal()
    assert list(column.values()) == [] and column.read_list(0, 5) == []
    column.close()


def test_records_only_the_reference_accepts_keep_their_place_in_a_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # messages with text parts decline both fast paths but are valid: the reference's records are
    # merged back among the block's ordinary ones by line number
    rng = random.Random(5)
    odd = [
        orjson.dumps(
            {"id": f"t{i}", "messages": [{"role": "user", "content": [{"type": "text", "text": "w " * i}]}]}
        )
        for i in range(1, 40)
    ]
    lines = []
    for i in range(3000):
        roll = rng.random()
        lines.append(
            rng.choice(odd) if roll < 0.1 else orjson.dumps({"id": f"r{i}", "prompt": "x" * (i % 97 + 1)})
        )
        if roll > 0.97:
            lines.append(orjson.dumps({"id": f"bad{i}", "prompt": " "}))
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    analyses = {}
    default = planning.SCAN_BLOCK_BYTES
    for block_bytes in (default, 1):  # one line a block: nothing to merge
        monkeypatch.setattr(planning, "SCAN_BLOCK_BYTES", block_bytes)
        analysis = analyze_input(plan_request(path))
        try:
            analyses[block_bytes] = summarize(analysis)
        finally:
            analysis.close()
    assert analyses[1]["records"] > 3000 * 0.9
    assert len(analyses[1]["cuts"]) > 8
    assert analyses[default] == analyses[1]
