"""The planner's block reader and batch parser agree with the line-by-line reference functions."""

from __future__ import annotations

import io
import random
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.records import (
    ValidationLimits,
    iter_line_blocks,
    iter_line_tuples,
    quick_parse,
    quick_parse_many,
)
from tests.unit.test_records_quick import _near_valid, _odd


def _flatten(data: bytes, max_line_bytes: int, block_bytes: int) -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    blocks = iter_line_blocks(
        io.BytesIO(data), start_line=5, start_offset=7, max_line_bytes=max_line_bytes, block_bytes=block_bytes
    )
    for first, start, datas, ends, heads in blocks:
        offset = start
        for i, line in enumerate(datas):
            rows.append((first + i, offset, ends[i], line, heads[i] if heads else None))
            offset = ends[i]
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_blocks_match_iter_line_tuples(seed: int) -> None:
    """Random lines (CRLF, blank, over-long, no final newline) at odd block sizes: the same tuples."""
    rng = random.Random(seed)
    for _ in range(500):
        parts = [
            bytes(rng.choice(b'ab{"\r') for _ in range(rng.choice([0, 1, 3, 10, 30, 80])))
            for _ in range(rng.randrange(12))
        ]
        data = b"\n".join(parts) + rng.choice([b"", b"\n", b"\r\n"])
        max_line_bytes = rng.choice([1, 2, 5, 20, 100])
        block_bytes = rng.choice([1, 2, 7, 64, 4096])
        expected = list(
            iter_line_tuples(io.BytesIO(data), start_line=5, start_offset=7, max_line_bytes=max_line_bytes)
        )
        assert _flatten(data, max_line_bytes, block_bytes) == expected, (data, max_line_bytes, block_bytes)


def test_blocks_reject_a_bad_limit() -> None:
    with pytest.raises(ValueError, match="max_line_bytes must be >= 1"):
        next(iter_line_blocks(io.BytesIO(b"x\n"), max_line_bytes=0))


def test_quick_parse_many_matches_quick_parse_line_by_line() -> None:
    """Undecodable lines in the middle of a batch (and None) do not shift the others' results."""
    limits = ValidationLimits(max_line_bytes=200)
    lines: list[bytes | None] = [
        orjson.dumps({"id": "a", "prompt": "hello"}),
        b'{"id": "broken", ',
        b"",
        None,
        orjson.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
        b"\xff\xfe",
        orjson.dumps({"id": "c", "prompt": "x" * 300}),  # over max_line_bytes
        orjson.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}),
        b"[1, 2]",
        b"{",
        orjson.dumps({"id": "e", "prompt": " \t"}),  # blank
        orjson.dumps({"id": "f", "prompt": "x", "max_tokens": 0}),
        orjson.dumps({"id": "g", "prompt": "x", "metadata": 5}),
        orjson.dumps(
            {
                "custom_id": "h",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "p", "max_tokens": 0},
            }
        ),
    ]
    got = quick_parse_many(lines, limits)
    assert got == [quick_parse(line, limits) if line is not None else None for line in lines]
    assert [r[0] if r else None for r in got] == ["a", None, None, None, "b", None, None, "d"] + [None] * 6


_LIMITS = ValidationLimits(max_line_bytes=400, max_prompt_chars=40, max_tokens_limit=100)


@given(
    obj=st.one_of(_near_valid(), _odd),
    junk=st.binary(max_size=30),
    engine=st.sampled_from([None, "echo", "transformers", "vllm"]),
)
@settings(max_examples=1500, deadline=None)
def test_quick_parse_many_is_quick_parse_line_by_line(obj: Any, junk: bytes, engine: str | None) -> None:
    """On the near-valid records of test_records_quick.py, between a valid line and arbitrary bytes."""
    limits = ValidationLimits(
        max_line_bytes=_LIMITS.max_line_bytes,
        max_prompt_chars=_LIMITS.max_prompt_chars,
        max_tokens_limit=_LIMITS.max_tokens_limit,
        engine=engine,
    )
    lines = [junk, orjson.dumps(obj), b'{"id": "ok", "prompt": "fine"}', orjson.dumps(obj), junk]
    assert quick_parse_many(lines, limits) == [quick_parse(data, limits) for data in lines]
