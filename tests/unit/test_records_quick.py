"""The planner's fast path (``quick_parse``, ``Validator.feed_quick``) agrees with ``parse_line``.

``parse_line`` is the reference; the fast path may decline any line (None), but a line it accepts
must be one ``parse_line`` accepts, with the same ID, texts, limit and token estimate.
"""

from __future__ import annotations

import io
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.estimate import estimate_prompt_tokens, estimate_texts_tokens
from airflow_deadline_batch.core.records import (
    ErrorCode,
    LineError,
    RawLine,
    Record,
    ValidationLimits,
    Validator,
    iter_line_tuples,
    iter_raw_lines,
    parse_line,
    quick_parse,
)

LIMITS = ValidationLimits(max_line_bytes=400, max_prompt_chars=40, max_tokens_limit=100)


def _reference(data: bytes, limits: ValidationLimits = LIMITS) -> Record | LineError | None:
    return parse_line(RawLine(3, 0, len(data) + 1, data), limits)


def _assert_agrees(data: bytes, limits: ValidationLimits = LIMITS) -> bool:
    """Check the fast path against the reference on ``data``; True when the fast path accepted it."""
    quick = quick_parse(data, limits)
    if quick is None:
        return False
    ref = _reference(data, limits)
    assert isinstance(ref, Record), (data, ref)
    record_id, texts, limit = quick
    request = ref.request
    assert record_id == ref.id
    assert limit == request.max_tokens
    if request.kind == "completion":
        assert texts == request.prompt
    else:
        assert texts == tuple(m.content for m in request.messages or ())
    assert estimate_texts_tokens(texts) == estimate_prompt_tokens(request)
    return True


_text = st.one_of(
    st.sampled_from(["", " ", "\t\n", "hi", "héllo wörld", "日本語のテキスト", "x" * 40, "x" * 41]),
    st.text(max_size=45),
)
_odd = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 102),
    st.just(5.0),
    st.just("7"),
    _text,
    st.just([]),
    st.just(["user"]),
    st.just({}),
    st.just({"a": 1}),
)
_role = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot", ""]), _odd)
_content = st.one_of(_text, _odd, st.just([{"type": "text", "text": "part"}]), st.just([{"type": "image"}]))
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": _text}),
    st.fixed_dictionaries({"role": _role, "content": _content}),
    _odd,
)
_messages = st.one_of(st.lists(_message, min_size=1, max_size=3), _odd)
_id = st.one_of(st.sampled_from(["r1", "a-much-longer-record-identifier"]), _odd)

_BASES: list[dict[str, Any]] = [
    {"id": "r1", "prompt": "hello there"},
    {"id": "r1", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    {
        "custom_id": "r1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    },
    {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "hi"}},
]
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "id": _id,
    "custom_id": _id,
    "prompt": _text | _odd,
    "messages": _messages,
    "max_tokens": _odd,
    "max_completion_tokens": _odd,
    "metadata": _odd,
    "method": st.sampled_from(["POST", "GET"]) | _odd,
    "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]) | _odd,
    "extra": _odd,
    "body": _odd,
    # body parameters (core.params): valid, neutral, refused by some engines, malformed
    "temperature": st.one_of(st.sampled_from([0, 0.5, 2, 2.5, -1]), _odd),
    "n": st.one_of(st.sampled_from([1, 2]), _odd),
    "presence_penalty": st.one_of(st.sampled_from([0, 0.5, 3]), _odd),
    "logit_bias": st.one_of(st.sampled_from([{}, {"5": 1}, {"x": 1}]), _odd),
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}]), _odd
    ),
    "logprobs": st.one_of(st.sampled_from([False, True, 2]), _odd),
    "stream": _odd,
}


@st.composite
def _near_valid(draw: Any) -> Any:
    """A valid line of one of the shapes with up to three fields changed, added or removed."""
    obj = orjson.loads(orjson.dumps(draw(st.sampled_from(_BASES))))
    for _ in range(draw(st.integers(0, 3))):
        target = (
            obj["body"] if "body" in obj and isinstance(obj["body"], dict) and draw(st.booleans()) else obj
        )
        key = draw(st.sampled_from(sorted(_FIELDS)))
        if draw(st.integers(0, 4)) == 0:
            target.pop(key, None)
        else:
            target[key] = orjson.loads(
                orjson.dumps(draw(_FIELDS[key]))
            )  # a copy: st.just() values are shared
    return obj


@settings(max_examples=1500, deadline=None)
@given(obj=st.one_of(_near_valid(), _odd))
def test_quick_parse_accepts_only_what_parse_line_accepts_with_the_same_numbers(obj: Any) -> None:
    _assert_agrees(orjson.dumps(obj))


@settings(max_examples=800, deadline=None)
@given(obj=_near_valid(), engine=st.sampled_from(["echo", "transformers", "vllm", "openai", "custom"]))
def test_quick_parse_agrees_under_every_engine(obj: Any, engine: str) -> None:
    limits = ValidationLimits(max_line_bytes=400, max_prompt_chars=40, max_tokens_limit=100, engine=engine)
    _assert_agrees(orjson.dumps(obj), limits)


@given(data=st.binary(max_size=60))
def test_quick_parse_on_arbitrary_bytes(data: bytes) -> None:
    _assert_agrees(data)


@pytest.mark.parametrize(
    "obj",
    [
        {"id": "r1", "prompt": "hello"},
        {"id": "r1", "prompt": "hello", "messages": None, "max_tokens": 100, "metadata": {"k": 1}},
        {
            "id": "r1",
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "日本"}],
        },
        {
            "custom_id": "r1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "max_tokens": 9,
                "max_completion_tokens": 9,
                "messages": [{"role": "user", "content": "hi"}],
            },
        },
        {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "seed": 3}},
    ],
)
def test_common_shapes_take_the_fast_path(obj: dict[str, Any]) -> None:
    assert _assert_agrees(orjson.dumps(obj))


_OPENAI_COMPLETION = b'{"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": '


@pytest.mark.parametrize(
    "data",
    [
        b'{"id": "r1", "prompt": "   "}',
        b'{"id": "r1", "prompt": "' + b"x" * 41 + b'"}',
        b'{"id": "r1", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}',
        b'{"id": "r1", "messages": [{"role": ["user"], "content": "hi"}]}',
        b'{"id": 7, "prompt": "hi"}',
        b'{"id": "r1", "prompt": "hi", "max_tokens": true}',
        _OPENAI_COMPLETION + b'{"prompt": "hi", "max_tokens": 5, "max_completion_tokens": 6}}',
        _OPENAI_COMPLETION + b'{"prompt": "hi", "max_tokens": true, "max_completion_tokens": 1}}',
        _OPENAI_COMPLETION + b'{"prompt": "hi", "max_tokens": 5.0, "max_completion_tokens": 5}}',
        b'\xef\xbb\xbf{"id": "r1", "prompt": "hi"}',
        b"[1, 2]",
        b"",
    ],
)
def test_unusual_or_bad_lines_are_left_to_parse_line(data: bytes) -> None:
    assert quick_parse(data, LIMITS) is None


def test_unhashable_role_is_an_invalid_record_not_a_crash() -> None:
    outcome = _reference(b'{"id": "r1", "messages": [{"role": ["user"], "content": "hi"}]}')
    assert isinstance(outcome, LineError)
    assert outcome.code is ErrorCode.INVALID_RECORD


def test_feed_quick_counts_and_leaves_duplicates_to_feed() -> None:
    long_id = "an-identifier-longer-than-sixteen-characters"
    lines = [orjson.dumps({"id": i, "prompt": "hi"}) for i in ("r1", long_id, "r1", long_id)]
    validator = Validator(LIMITS)
    assert validator.feed_quick(lines[0]) is not None
    assert validator.feed_quick(lines[1]) is not None
    assert validator.feed_quick(lines[2]) is None
    assert validator.feed_quick(lines[3]) is None
    assert (validator.lines, validator.records) == (2, 2)
    outcomes = [validator.feed(RawLine(n, 0, 0, data)) for n, data in ((3, lines[2]), (4, lines[3]))]
    assert [o.code for o in outcomes if isinstance(o, LineError)] == [ErrorCode.DUPLICATE_ID] * 2
    assert (validator.lines, validator.records, validator.invalid) == (4, 2, 2)


def test_line_tuples_match_raw_lines() -> None:
    data = b'a\r\n\n{"x": 1}\n' + b"y" * 50 + b"\nlast"
    tuples = list(iter_line_tuples(io.BytesIO(data), start_line=5, start_offset=7, max_line_bytes=20))
    raws = list(iter_raw_lines(io.BytesIO(data), start_line=5, start_offset=7, max_line_bytes=20))
    assert [RawLine(*t) for t in tuples] == raws
    assert [t[3] for t in tuples] == [b"a", b"", b'{"x": 1}', None, b"last"]
