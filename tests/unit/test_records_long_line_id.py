"""An over-long line keeps its ID when its head carries it (``core.records.recover_id``): exact or
nothing, and the duplicate-ID rule still holds (docs/design.md §4.1)."""

from __future__ import annotations

import io

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.records import (
    ErrorCode,
    LineError,
    RawLine,
    Record,
    ValidationLimits,
    Validator,
    iter_raw_lines,
    parse_line,
    recover_id,
)

LIMITS = ValidationLimits(max_line_bytes=200)


def _outcomes(data: bytes) -> list[Record | LineError | None]:
    validator = Validator(LIMITS)
    return [validator.feed(r) for r in iter_raw_lines(io.BytesIO(data), max_line_bytes=LIMITS.max_line_bytes)]


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b'{"id": "a-1", "prompt": "yyyy', "a-1"),
        (b'{"prompt": "short", "id": "late", "metadata": {"k": [1, {"x": "}"}]}, "p": "', "late"),
        (b'{"metadata": {"id": "inner"}, "id": "outer", "prompt": "', "outer"),
        (b'  {"id":"esc\\"aped\\\\","prompt":"', 'esc"aped\\'),
        (b'{"id": "\\u00fcn\\u00efc\\u00f8de", "prompt": "', "ünïcøde"),
        (b'{"custom_id": "req-7", "method": "POST", "url": "/v1/chat/completions", "body": {"m', "req-7"),
        (b'{"method": "POST", "custom_id": "req-8", "body": {"messages": [', "req-8"),
        (b'{"id": "native", "body": {}, "prompt": "', None),  # OpenAI shape: custom_id, not id
        (b'{"id": "cut-of', None),  # the ID itself is cut off
        (b'{"prompt": "yyyyyyyy', None),  # the ID would come later
        (b'{"id": 17, "prompt": "', None),
        (b'{"id": "", "prompt": "', None),
        (b'["id", "x"', None),
        (b"", None),
        (b'{"id" "x", "prompt": "', None),
    ],
)
def test_recover_id_from_a_head(head: bytes, expected: str | None) -> None:
    assert recover_id(head) == expected


def test_an_over_long_line_keeps_its_id_and_owns_it() -> None:
    long_line = orjson.dumps({"id": "big", "prompt": "y" * 500})
    data = long_line + b"\n" + orjson.dumps({"id": "big", "prompt": "again"}) + b"\n"
    first, second = _outcomes(data)
    assert isinstance(first, LineError) and first.code is ErrorCode.LINE_TOO_LONG and first.id == "big"
    assert isinstance(second, LineError) and second.code is ErrorCode.DUPLICATE_ID and second.id == "big"


def test_an_over_long_line_with_an_id_already_used_is_a_duplicate() -> None:
    data = (
        orjson.dumps({"id": "k", "prompt": "first"}) + b"\n" + orjson.dumps({"id": "k", "prompt": "y" * 500})
    )
    first, second = _outcomes(data + b"\n")
    assert isinstance(first, Record) and first.id == "k"
    assert isinstance(second, LineError) and second.code is ErrorCode.DUPLICATE_ID and second.id == "k"


def test_an_over_long_first_line_with_a_bom_keeps_its_id() -> None:
    data = b"\xef\xbb\xbf" + orjson.dumps({"custom_id": "c", "method": "POST", "body": {"x": "y" * 500}})
    (only,) = _outcomes(data + b"\n")
    assert isinstance(only, LineError) and only.code is ErrorCode.LINE_TOO_LONG and only.id == "c"


_ids = st.text(min_size=0, max_size=12)
_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(
    members=st.dictionaries(
        st.sampled_from(["id", "custom_id", "prompt", "body", "x", "metadata"]), _values | _ids
    ),
    cut=st.integers(min_value=0, max_value=400),
)
def test_recovered_id_is_exact_or_nothing(members: dict[str, object], cut: int) -> None:
    """Whatever the object and wherever its head is cut, a recovered ID is the one parsing the
    whole line would read (the line's own error may differ: only the ID is compared)."""
    line = orjson.dumps(members)
    got = recover_id(line[:cut])
    if got is None:
        return
    if "id" in members and not {"custom_id", "body"}.isdisjoint(members):
        # mixing "id" with OpenAI Batch members: the head cannot tell the shape when they come
        # after it (documented on recover_id); only the ID a head does show is checked
        assert got in (members.get("id"), members.get("custom_id")), (line, cut)
        return
    whole = parse_line_id(line)
    assert got == whole, (line, cut)


def parse_line_id(line: bytes) -> str | None:
    outcome = parse_line(RawLine(1, 0, len(line) + 1, line), ValidationLimits())
    return None if outcome is None else outcome.id
