"""Input splitting, parsing and validation (docs/design.md §4.1)."""

from __future__ import annotations

import io
import tracemalloc
from collections.abc import Iterator

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.records import (
    ErrorCode,
    LineError,
    Message,
    RawLine,
    Record,
    Request,
    ValidationLimits,
    Validator,
    iter_raw_lines,
    parse_line,
)

LIMITS = ValidationLimits(max_line_bytes=4096, max_prompt_chars=100, max_tokens_limit=1000)


def raw(data: bytes | None, line: int = 2) -> RawLine:
    return RawLine(line, 0, 0 if data is None else len(data) + 1, data)


def parse(obj: object, line: int = 2) -> Record | LineError | None:
    data = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    return parse_line(raw(data, line), LIMITS)


def lines_of(data: bytes, max_line_bytes: int = 4096) -> list[RawLine]:
    return list(iter_raw_lines(io.BytesIO(data), max_line_bytes=max_line_bytes))


# ------------------------------------------------------------------------------------------ split


def test_split_lf_crlf_blank_and_final_line_without_newline() -> None:
    data = b"a\r\n\nb\n  \nc"
    got = lines_of(data)
    assert [(r.line, r.data) for r in got] == [(1, b"a"), (2, b""), (3, b"b"), (4, b"  "), (5, b"c")]
    assert [(r.offset, r.end_offset) for r in got] == [(0, 3), (3, 4), (4, 6), (6, 9), (9, 10)]


def test_split_no_phantom_line_after_final_newline_and_empty_input() -> None:
    assert [r.data for r in lines_of(b"a\nb\n")] == [b"a", b"b"]
    assert lines_of(b"") == []


def test_split_respects_start_line_and_offset() -> None:
    got = list(iter_raw_lines(io.BytesIO(b"x\ny\n"), start_line=10, start_offset=100, max_line_bytes=10))
    assert [(r.line, r.offset, r.end_offset) for r in got] == [(10, 100, 102), (11, 102, 104)]


def test_split_line_exactly_at_limit_is_kept_one_over_is_not() -> None:
    got = lines_of(b"abcd\r\nabcd\nabcde\nabcd", max_line_bytes=4)
    assert [r.data for r in got] == [b"abcd", b"abcd", None, b"abcd"]
    assert [r.end_offset for r in got] == [6, 11, 17, 21]


def test_split_too_long_final_line_without_newline() -> None:
    got = lines_of(b"ok\n" + b"x" * 50, max_line_bytes=10)
    assert [r.data for r in got] == [b"ok", None]
    assert got[-1].end_offset == 53


class _Endless(io.RawIOBase):
    """A stream of one huge line (never materialised) followed by a short valid one."""

    def __init__(self, size: int, tail: bytes) -> None:
        self.remaining = size
        self.tail = tail

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self.remaining > 0:
            n = min(len(buffer), self.remaining)
            buffer[:n] = b"y" * n
            self.remaining -= n
            return n
        n = min(len(buffer), len(self.tail))
        buffer[:n] = self.tail[:n]
        self.tail = self.tail[n:]
        return n


def test_huge_line_is_skipped_in_bounded_memory() -> None:
    size = 64 * 1024 * 1024
    tail = b'\n{"id": "after", "prompt": "hi"}\n'
    stream = io.BufferedReader(_Endless(size, tail), buffer_size=65536)
    validator = Validator(LIMITS)
    tracemalloc.start()
    try:
        outcomes = [validator.feed(r) for r in iter_raw_lines(stream, max_line_bytes=LIMITS.max_line_bytes)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024
    first, second = outcomes
    assert isinstance(first, LineError) and first.code is ErrorCode.LINE_TOO_LONG and first.line == 1
    assert isinstance(second, Record) and second.id == "after" and second.line == 2


# ------------------------------------------------------------------------------------------ parse


def test_native_prompt_record() -> None:
    rec = parse({"id": "r1", "prompt": "Summarise this.", "max_tokens": 64, "metadata": {"k": 1}})
    assert rec == Record(2, "r1", Request("completion", "Summarise this.", None, 64, {}), rec.nbytes)  # type: ignore[union-attr]
    assert isinstance(rec, Record) and rec.nbytes == len(
        orjson.dumps({"id": "r1", "prompt": "Summarise this.", "max_tokens": 64, "metadata": {"k": 1}})
    )


def test_native_messages_record_with_text_parts() -> None:
    rec = parse(
        {
            "id": "r2",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}],
                },
            ],
        }
    )
    assert isinstance(rec, Record)
    assert rec.request.kind == "chat"
    assert rec.request.messages == (Message("system", "Be brief."), Message("user", "Hello world"))
    assert rec.request.max_tokens is None


def test_openai_chat_line_passes_params_through() -> None:
    rec = parse(
        {
            "custom_id": "c1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "gpt-x",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_completion_tokens": 20,
                "temperature": 0.2,
                "seed": 7,
                "stop": ["\n"],
            },
        }
    )
    assert isinstance(rec, Record)
    assert rec.id == "c1"
    assert rec.request == Request(
        "chat", None, (Message("user", "Hi"),), 20, {"temperature": 0.2, "seed": 7, "stop": ["\n"]}
    )


def test_openai_completion_line() -> None:
    rec = parse(
        {
            "custom_id": "c2",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "Once upon", "max_tokens": 5, "top_p": 0.9},
        }
    )
    assert isinstance(rec, Record)
    assert rec.request == Request("completion", "Once upon", None, 5, {"top_p": 0.9})


def test_bom_stripped_on_first_line_only() -> None:
    data = b'\xef\xbb\xbf{"id": "a", "prompt": "x"}'
    assert isinstance(parse_line(raw(data, line=1), LIMITS), Record)
    later = parse_line(raw(data, line=2), LIMITS)
    assert isinstance(later, LineError) and later.code is ErrorCode.INVALID_JSON


@pytest.mark.parametrize("data", [b"", b"   ", b"\t \x0b", b"\xef\xbb\xbf  "])
def test_blank_lines_have_no_outcome(data: bytes) -> None:
    assert parse_line(raw(data, line=1), LIMITS) is None


CHAT = "/v1/chat/completions"
ERROR_CASES = [
    # (name, line bytes or object, expected code, expected id)
    ("truncated json", b'{"id": "a", "prompt": ', ErrorCode.INVALID_JSON, None),
    ("nan", b'{"id": "a", "prompt": NaN}', ErrorCode.INVALID_JSON, None),
    ("trailing comma", b'{"id": "a",}', ErrorCode.INVALID_JSON, None),
    ("no id", {"prompt": "x"}, ErrorCode.MISSING_ID, None),
    ("numeric id", {"id": 12, "prompt": "x"}, ErrorCode.MISSING_ID, None),
    ("empty id", {"id": "", "prompt": "x"}, ErrorCode.MISSING_ID, None),
    ("openai no custom_id", {"method": "POST", "url": CHAT, "body": {}}, ErrorCode.MISSING_ID, None),
    ("empty prompt", {"id": "a", "prompt": "  \n "}, ErrorCode.EMPTY_PROMPT, "a"),
    (
        "empty messages",
        {"id": "a", "messages": [{"role": "user", "content": " "}]},
        ErrorCode.EMPTY_PROMPT,
        "a",
    ),
    ("long prompt", {"id": "a", "prompt": "x" * 101}, ErrorCode.PROMPT_TOO_LONG, "a"),
    (
        "long messages",
        {"id": "a", "messages": [{"role": "user", "content": "x" * 60}] * 2},
        ErrorCode.PROMPT_TOO_LONG,
        "a",
    ),
    (
        "embeddings url",
        {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}},
        ErrorCode.UNSUPPORTED_URL,
        "a",
    ),
    ("max_tokens zero", {"id": "a", "prompt": "x", "max_tokens": 0}, ErrorCode.INVALID_MAX_TOKENS, "a"),
    ("max_tokens bool", {"id": "a", "prompt": "x", "max_tokens": True}, ErrorCode.INVALID_MAX_TOKENS, "a"),
    ("max_tokens float", {"id": "a", "prompt": "x", "max_tokens": 10.5}, ErrorCode.INVALID_MAX_TOKENS, "a"),
    ("max_tokens string", {"id": "a", "prompt": "x", "max_tokens": "10"}, ErrorCode.INVALID_MAX_TOKENS, "a"),
    (
        "max_tokens over limit",
        {"id": "a", "prompt": "x", "max_tokens": 1001},
        ErrorCode.INVALID_MAX_TOKENS,
        "a",
    ),
    (
        "max tokens disagree",
        {
            "custom_id": "a",
            "method": "POST",
            "url": CHAT,
            "body": {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 5,
                "max_completion_tokens": 6,
            },
        },
        ErrorCode.INVALID_MAX_TOKENS,
        "a",
    ),
    ("invalid utf-8", b'{"id": "a", "prompt": "caf\xe9"}', ErrorCode.INVALID_ENCODING, None),
    ("binary junk", b"\x00\xff\xfe\x80\x81garbage", ErrorCode.INVALID_ENCODING, None),
    ("lone surrogate", b'{"id": "a", "prompt": "\\ud800"}', ErrorCode.INVALID_ENCODING, None),
    ("too long", None, ErrorCode.LINE_TOO_LONG, None),
    ("array", [1, 2], ErrorCode.INVALID_RECORD, None),
    ("string", "hello", ErrorCode.INVALID_RECORD, None),
    ("neither", {"id": "a"}, ErrorCode.INVALID_RECORD, "a"),
    (
        "both",
        {"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
        ErrorCode.INVALID_RECORD,
        "a",
    ),
    ("unknown field", {"id": "a", "prompt": "x", "promt": "y"}, ErrorCode.INVALID_RECORD, "a"),
    ("bad role", {"id": "a", "messages": [{"role": "robot", "content": "x"}]}, ErrorCode.INVALID_RECORD, "a"),
    ("message not object", {"id": "a", "messages": ["hi"]}, ErrorCode.INVALID_RECORD, "a"),
    ("messages empty list", {"id": "a", "messages": []}, ErrorCode.INVALID_RECORD, "a"),
    (
        "image part",
        {"id": "a", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        ErrorCode.INVALID_RECORD,
        "a",
    ),
    ("prompt not string", {"id": "a", "prompt": ["x"]}, ErrorCode.INVALID_RECORD, "a"),
    ("metadata not object", {"id": "a", "prompt": "x", "metadata": [1]}, ErrorCode.INVALID_RECORD, "a"),
    (
        "method GET",
        {"custom_id": "a", "method": "GET", "url": CHAT, "body": {}},
        ErrorCode.INVALID_RECORD,
        "a",
    ),
    (
        "body not object",
        {"custom_id": "a", "method": "POST", "url": CHAT, "body": "x"},
        ErrorCode.INVALID_RECORD,
        "a",
    ),
    (
        "chat body without messages",
        {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"prompt": "x"}},
        ErrorCode.INVALID_RECORD,
        "a",
    ),
    (
        "unknown body parameter",
        {
            "custom_id": "a",
            "method": "POST",
            "url": CHAT,
            "body": {"messages": [{"role": "user", "content": "x"}], "frobnicate": 1},
        },
        ErrorCode.UNSUPPORTED_PARAMETER,
        "a",
    ),
    (
        "completion body without prompt",
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"messages": []}},
        ErrorCode.INVALID_RECORD,
        "a",
    ),
]


@pytest.mark.parametrize(
    ("data", "code", "record_id"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_error_codes(data: object, code: ErrorCode, record_id: str | None) -> None:
    outcome = parse_line(raw(None), LIMITS) if data is None else parse(data)
    assert isinstance(outcome, LineError)
    assert outcome.code is code, outcome.message
    assert outcome.id == record_id
    assert outcome.line == 2
    assert "\n" not in outcome.message and len(outcome.message) < 300


def test_every_error_code_is_covered_by_the_table() -> None:
    covered = {c[2] for c in ERROR_CASES} | {ErrorCode.DUPLICATE_ID}
    assert covered == set(ErrorCode)


def test_error_messages_clip_user_data() -> None:
    outcome = parse({"id": "a", "prompt": "x", "max_tokens": "9" * 10_000})
    assert isinstance(outcome, LineError)
    assert len(outcome.message) < 200
    assert "9" * 81 not in outcome.message


def test_numeric_id_message_names_the_fix() -> None:
    outcome = parse({"id": 7, "prompt": "x"})
    assert isinstance(outcome, LineError) and "non-empty strings" in outcome.message


def test_limits_validate_themselves() -> None:
    with pytest.raises(ValueError, match="max_line_bytes"):
        ValidationLimits(max_line_bytes=0)
    with pytest.raises(ValueError, match="max_tokens_limit"):
        ValidationLimits(max_tokens_limit=True)


# ------------------------------------------------------------------------------------------ validator


Outcome = Record | LineError | None


def feed_all(data: bytes, limits: ValidationLimits = LIMITS) -> tuple[Validator, list[Outcome]]:
    validator = Validator(limits)
    raws = iter_raw_lines(io.BytesIO(data), max_line_bytes=limits.max_line_bytes)
    return validator, [validator.feed(r) for r in raws]


def test_duplicates_first_occurrence_wins_even_when_invalid() -> None:
    data = (
        b"\n".join(
            [
                b'{"id": "a", "prompt": "one"}',
                b'{"id": "a", "prompt": "two"}',
                b"",
                b'{"id": "b", "prompt": ""}',
                b'{"id": "b", "prompt": "valid but repeated"}',
                b'{"id": "c", "prompt": "three"}',
            ]
        )
        + b"\n"
    )
    validator, outcomes = feed_all(data)
    summary = [(o.line, o.id, getattr(o, "code", "ok")) for o in outcomes if o is not None]
    assert summary == [
        (1, "a", "ok"),
        (2, "a", ErrorCode.DUPLICATE_ID),
        (4, "b", ErrorCode.EMPTY_PROMPT),
        (5, "b", ErrorCode.DUPLICATE_ID),
        (6, "c", "ok"),
    ]
    assert validator.lines == 6 and validator.records == 2 and validator.invalid == 3
    assert validator.errors == {ErrorCode.DUPLICATE_ID: 2, ErrorCode.EMPTY_PROMPT: 1}


def test_same_id_across_shapes_is_a_duplicate() -> None:
    data = (
        b'{"id": "x", "prompt": "p"}\n'
        b'{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}\n'
    )
    _, outcomes = feed_all(data)
    assert isinstance(outcomes[1], LineError) and outcomes[1].code is ErrorCode.DUPLICATE_ID


# ------------------------------------------------------------------------------------------ properties

_line = st.one_of(
    st.just(b""),
    st.just(b"   "),
    st.just(b"\r"),
    st.builds(
        lambda i, p: orjson.dumps({"id": f"id{i}", "prompt": p}), st.integers(0, 5), st.text(max_size=20)
    ),
    st.binary(max_size=30).map(lambda b: b.replace(b"\n", b"")),
    st.just(b"x" * 80),
)


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(_line, max_size=25), final_newline=st.booleans(), crlf=st.booleans())
def test_every_non_blank_line_yields_one_outcome_and_offsets_tile(
    lines: list[bytes], final_newline: bool, crlf: bool
) -> None:
    sep = b"\r\n" if crlf else b"\n"
    data = sep.join(lines) + (sep if final_newline and lines else b"")
    limits = ValidationLimits(max_line_bytes=64, max_prompt_chars=10, max_tokens_limit=10)
    raws = list(iter_raw_lines(io.BytesIO(data), max_line_bytes=64))
    # offsets tile the file and line numbers are strictly increasing from 1
    assert [r.line for r in raws] == list(range(1, len(raws) + 1))
    position = 0
    for r in raws:
        assert r.offset == position and r.end_offset > r.offset
        position = r.end_offset
    assert position == len(data)
    validator = Validator(limits)
    outcomes: Iterator[Record | LineError | None] = (validator.feed(r) for r in raws)
    for r, outcome in zip(raws, outcomes, strict=True):
        if _is_blank(r):
            assert outcome is None
        else:
            assert isinstance(outcome, (Record, LineError))
            assert outcome.line == r.line
    assert validator.records + validator.invalid == sum(1 for r in raws if not _is_blank(r))


def _is_blank(r: RawLine) -> bool:
    if r.data is None:
        return False
    content = r.data[3:] if r.line == 1 and r.data.startswith(b"\xef\xbb\xbf") else r.data
    return not content.strip()


def test_core_imports_none_of_the_heavy_libraries() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import airflow_deadline_batch.core.records, airflow_deadline_batch.core.estimate\n"
        "import airflow_deadline_batch.core.feasibility, airflow_deadline_batch.core.packing\n"
        "import airflow_deadline_batch.core.states, airflow_deadline_batch.core.results\n"
        "heavy = {'airflow', 'sqlalchemy', 'boto3', 'botocore', 'kubernetes'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
