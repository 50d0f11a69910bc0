"""The planner's msgspec fast path (``fast_parse_many``) accepts only what ``parse_line`` accepts.

``parse_line`` is the reference. The fast path may decline any line (None: the line then goes to
``quick_parse_many`` and ``parse_line``, which alone give error codes), but a line it accepts must
be one ``parse_line`` accepts, with the same ID, texts, limit and token estimate, and the same
tuple as ``quick_parse``. Beside the Hypothesis strategies of ``test_records_quick.py``, explicit
lines probe where msgspec and orjson differ (duplicate keys, big numbers, surrogates, invalid
UTF-8 inside values msgspec only skips, nesting depth, BOM, whitespace).
"""

from __future__ import annotations

import typing
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core import records
from airflow_deadline_batch.core.estimate import estimate_prompt_tokens, estimate_texts_tokens
from airflow_deadline_batch.core.records import (
    ALLOWED_ROLES,
    RawLine,
    Record,
    ValidationLimits,
    fast_parse_many,
    parse_line,
    quick_parse,
)
from tests.unit.test_records_quick import _near_valid, _odd

LIMITS = ValidationLimits(max_line_bytes=400, max_prompt_chars=40, max_tokens_limit=100)
ENGINES = ["echo", "transformers", "vllm", "openai", "custom", None]


def _assert_agrees(data: bytes, limits: ValidationLimits = LIMITS) -> bool:
    """Check the fast path against the reference on ``data``; True when the fast path accepted it."""
    fast = fast_parse_many([data], limits)[0]
    if fast is None:
        return False
    ref = parse_line(RawLine(3, 0, len(data) + 1, data), limits)
    assert isinstance(ref, Record), (data, ref)
    record_id, texts, limit = fast
    request = ref.request
    assert (record_id, limit) == (ref.id, request.max_tokens)
    if request.kind == "completion":
        assert texts == request.prompt
    else:
        assert texts == tuple(m.content for m in request.messages or ())
    assert estimate_texts_tokens(texts) == estimate_prompt_tokens(request)
    assert quick_parse(data, limits) == fast
    return True


@settings(max_examples=1500, deadline=None)
@given(obj=st.one_of(_near_valid(), _odd))
def test_fast_path_accepts_only_what_parse_line_accepts_with_the_same_numbers(obj: Any) -> None:
    _assert_agrees(orjson.dumps(obj))


@settings(max_examples=800, deadline=None)
@given(obj=_near_valid(), engine=st.sampled_from(ENGINES))
def test_fast_path_agrees_under_every_engine(obj: Any, engine: str | None) -> None:
    """Engines drawn in any order: the cached parameter verdicts must be per engine."""
    limits = ValidationLimits(max_line_bytes=400, max_prompt_chars=40, max_tokens_limit=100, engine=engine)
    _assert_agrees(orjson.dumps(obj), limits)


@given(data=st.binary(max_size=80))
def test_fast_path_on_arbitrary_bytes(data: bytes) -> None:
    _assert_agrees(data)


@settings(max_examples=300, deadline=None)
@given(objs=st.lists(st.one_of(_near_valid(), _odd), max_size=12), gaps=st.lists(st.booleans(), max_size=12))
def test_a_block_is_its_lines_one_by_one(objs: list[Any], gaps: list[bool]) -> None:
    datas: list[bytes | None] = [orjson.dumps(o) for o in objs]
    datas += [None if gap else b"" for gap in gaps]  # over-long lines (None) and blank ones
    assert fast_parse_many(datas, LIMITS) == [
        None if data is None else fast_parse_many([data], LIMITS)[0] for data in datas
    ]


def test_the_role_literal_is_allowed_roles() -> None:
    assert set(typing.get_args(records._Role)) == ALLOWED_ROLES


_CHAT = b'{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": '
_COMPLETION = b'{"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": '
_MSGS = b'[{"role": "user", "content": "hi"}]'
_ACCEPTED = [
    b'{"id": "r1", "prompt": "hello"}',
    b'{"id": "r1", "prompt": "hello", "messages": null, "max_tokens": null, "metadata": null}',
    b'{"id": "r1", "prompt": "hello", "max_tokens": 100, "metadata": {"k": "\xc3\xa9", "x": 1e-400}}',
    b'{"id": "r1", "prompt": "hi", "metadata": {"b": true}, "metadata": {"n": -9223372036854775808}}',
    b'{"id":"r1","messages":[{"role":"system","content":"be brief"},'
    b'{"role":"user","content":"\xe6\x97\xa5"}]}',
    b' \t{"id": "r1", "prompt": "hello"} ',
    b'{"id": "r1", "prompt": "x", "prompt": "hello"}',  # duplicate keys: both decoders keep the last
    b'{"\\u0069d": "r1", "prompt": "h\\u00e9llo \\ud83d\\ude00 \\u0000"}',
    b'{"id": "r1", "prompt": "hello", "max_tokens": -0, "max_tokens": 7}',
    _CHAT + b'{"model": "m", "max_tokens": 64, "temperature": 0, "messages": ' + _MSGS + b"}}",
    _CHAT
    + b'{"max_tokens": 9, "max_completion_tokens": 9, "seed": 3, "stop": ["a"], "messages": '
    + _MSGS
    + b"}}",
    _COMPLETION + b'{"prompt": "hi", "temperature": 0.5, "top_p": 1, "n": 1, "logprobs": false}}',
    b'{"body": {"prompt": "hi"}, "url": "/v1/completions", "method": "POST", "custom_id": "r1"}',
    # typed parameters repeated or spelt with escapes: msgspec checks every occurrence, the last wins
    _COMPLETION + b'{"prompt": "hi", "temperature": 7, "temperature": 0.5, "seed": -1, "seed": 3}}',
    _CHAT + b'{"t\\u0065mperature": 1, "stop": "x", "stop": ["a"], "user": "u", "messages": ' + _MSGS + b"}}",
    _COMPLETION + b'{"prompt": "hi", "n": 1, "logprobs": 2, "echo": false, "stream": null, "suffix": ""}}',
]


@pytest.mark.parametrize("data", _ACCEPTED)
def test_common_and_odd_but_valid_shapes_take_the_fast_path(data: bytes) -> None:
    assert _assert_agrees(data)


_DEEP = b"[" * 300 + b"]" * 300
_DECLINED = [
    # values msgspec skips or keeps raw, which orjson refuses: checked by orjson
    b'{"id": "r1", "prompt": "hello", "metadata": {"k": "\xff"}}',
    b'{"id": "r1", "prompt": "hello", "metadata": {"\xed\xa0\x80": 1}}',
    b'{"id": "r1", "prompt": "hello", "metadata": {"k": 1e400}}',
    b'{"id": "r1", "prompt": "hello", "metadata": {"k": ' + _DEEP + b"}}",
    b'{"id": "r1", "prompt": "hello", "metadata": [1]}',
    b'{"id": "r1", "prompt": "hello", "metadata": {"k": [1, {"a": "\xc3\xa9"}]}}',  # nested: to orjson
    b'{"id": "r1", "prompt": "hello", "metadata": {"n": 9223372036854775808}}',  # beyond int64
    b'{"id": "r1", "prompt": "hello", "metadata": {"n": 1' + b"0" * 400 + b"}}",
    b'{"id": "r1", "prompt": "hello", "metadata": "x"}',
    _COMPLETION + b'{"prompt": "hi", "temperature": 1e400}}',
    _COMPLETION + b'{"prompt": "hi", "stop": "\xc0\x80"}}',
    _COMPLETION + b'{"prompt": "hi", "stop": ' + _DEEP + b"}}",
    # a raw member repeated: msgspec only skips the first value, orjson refuses the line
    b'{"id": "r1", "prompt": "hello", "metadata": {"k": "\xff"}, "metadata": {}}',
    b'{"id": "r1", "prompt": "hello", "metadata": {"k": 1e400}, "metad\\u0061ta": {}}',
    b'{"id": "r1", "prompt": "hello", "metad\\u0061ta": [1e400], "metadata": null}',
    _COMPLETION + b'{"prompt": "hi", "temperature": 1e400, "temperature": 0}}',
    _COMPLETION + b'{"prompt": "hi", "stop": "\xff", "st\\u006fp": "x"}}',
    _COMPLETION + b'{"prompt": "hi", "temperature": 5}}',  # invalid value
    _COMPLETION + b'{"prompt": "hi", "temperature": 0, "temperature": 2.0000000000000004}}',
    _COMPLETION + b'{"prompt": "hi", "seed": 1.0}}',  # a typed parameter of another type
    _COMPLETION + b'{"prompt": "hi", "seed": 9223372036854775808}}',
    _COMPLETION + b'{"prompt": "hi", "n": 1, "n": "1"}}',
    _COMPLETION + b'{"prompt": "hi", "wibble": 1}}',  # unknown parameter
    _COMPLETION + b'{"prompt": "hi", "messages": null}}',  # a parameter for parse_line
    _CHAT + b'{"prompt": null, "messages": ' + _MSGS + b"}}",
    # strings: encoding, surrogates, control characters
    b'{"id": "r1", "prompt": "h\xffllo"}',
    b'{"id": "r1", "prompt": "\\ud800"}',
    b'{"id": "r1", "prompt": "\\udc00x"}',
    b'{"id": "r1", "prompt": "a\x01b"}',
    # numbers: floats, bools, out of range, beyond 64 bits (orjson: a float)
    b'{"id": "r1", "prompt": "hello", "max_tokens": 5.0}',
    b'{"id": "r1", "prompt": "hello", "max_tokens": 1e1}',
    b'{"id": "r1", "prompt": "hello", "max_tokens": true}',
    b'{"id": "r1", "prompt": "hello", "max_tokens": 0}',
    b'{"id": "r1", "prompt": "hello", "max_tokens": -0}',
    b'{"id": "r1", "prompt": "hello", "max_tokens": 99999999999999999999}',
    b'{"id": "r1", "prompt": "hello", "max_tokens": 7, "max_tokens": "7"}',
    _COMPLETION + b'{"prompt": "hi", "max_tokens": 5, "max_completion_tokens": 6}}',
    _COMPLETION + b'{"prompt": "hi", "max_tokens": 18446744073709551617, "max_completion_tokens": 1}}',
    # the key set decides the shape: presence, not value
    b'{"id": "r1", "prompt": "hello", "custom_id": null}',
    b'{"id": "r1", "prompt": "hello", "body": null}',
    b'{"custom_id": "r1", "id": null, "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}',
    b'{"id": "r1", "prompt": "hello", "extra": 1}',
    b'{"id": "", "prompt": "hello"}',
    b'{"id": 7, "prompt": "hello"}',
    b'{"id": "r1", "prompt": "hello", "messages": ' + _MSGS + b"}",
    b'{"id": "r1", "messages": []}',
    b'{"id": "r1", "messages": [{"role": "user", "content": "hi", "name": "x"}]}',
    b'{"id": "r1", "messages": [{"role": "robot", "content": "hi"}]}',
    b'{"id": "r1", "messages": [{"role": "user", "content": null}, {"role": "user", "content": "hi"}]}',
    # framing: BOM, other whitespace, trailing bytes, blank
    b'\xef\xbb\xbf{"id": "r1", "prompt": "hello"}',
    b'\x0c{"id": "r1", "prompt": "hello"}',
    b'{"id": "r1", "prompt": "hello"}\x00',
    b'{"id": "r1", "prompt": "hello"} {}',
    b"",
    b"   ",
    # text checks
    b'{"id": "r1", "prompt": " \\t "}',
    b'{"id": "r1", "prompt": "' + b"x" * 41 + b'"}',
    b'{"id": "r1", "messages": [{"role": "user", "content": ""}, {"role": "user", "content": " "}]}',
]


@pytest.mark.parametrize("data", _DECLINED)
def test_lines_where_the_decoders_differ_or_that_are_invalid_are_declined(data: bytes) -> None:
    assert fast_parse_many([data], LIMITS) == [None]


@pytest.mark.parametrize("depth", [254, 255, 256, 1021, 1022, 1023, 1024, 1025])
def test_nesting_near_orjsons_limit_agrees(depth: int) -> None:
    nested = b"[" * depth + b"]" * depth
    for data in (
        b'{"id": "r1", "prompt": "hello", "metadata": {"k": ' + nested + b"}}",
        _COMPLETION + b'{"prompt": "hi", "stop": ' + nested + b"}}",
    ):
        _assert_agrees(data)


def test_over_long_lines_are_declined() -> None:
    data = b'{"id": "r1", "prompt": "' + b"x" * 30 + b'"}'
    assert fast_parse_many([data], ValidationLimits(max_line_bytes=len(data) - 1)) == [None]
    assert fast_parse_many([data], ValidationLimits(max_line_bytes=len(data)))[0] is not None


# --------------------------------------------------------------------------------------------
# Random body parameters: typed and raw ones, repeated keys, numbers at the decoders' edges

#: a parameter's value as JSON text, including spellings orjson and msgspec might read apart
_PARAM_TEXTS = st.one_of(
    st.builds(
        orjson.dumps,
        st.one_of(
            st.none(),
            st.booleans(),
            st.floats(allow_nan=False, allow_infinity=False),
            st.sampled_from([0, 1, 2, 0.5, 1.0, 2.0, -0.0, 5, 20, 21, 128, 129, 1e308]),
            st.text(max_size=4),
            st.lists(st.text(max_size=3), max_size=2),
            st.sampled_from([{}, {"type": "text"}, {"5": 1}, [1], ["text"], "none"]),
        ),
    ),
    st.integers(-(2**66), 2**66).map(lambda i: str(i).encode()),
    st.sampled_from(
        [b"1E400", b"-1e400", b"1e2", b"-0", b"2.0000000000000001", b"0.50", b'"\\ud800"', b'"\xff"']
    ),
)

_NUMBERS = st.one_of(st.floats(-3, 3), st.integers(-3, 3), st.sampled_from([0.0, 2.0, 1e-400, -0.0])).map(
    orjson.dumps
) | st.sampled_from([b"-0", b"1e0", b"2.0000000000000001", b"2.0000000000000004"])
_USUAL_PARAMS: dict[str, st.SearchStrategy[bytes]] = {
    "temperature": _NUMBERS,
    "top_p": _NUMBERS,
    "presence_penalty": _NUMBERS,
    "frequency_penalty": _NUMBERS,
    "seed": st.integers(-(2**64), 2**64).map(lambda i: str(i).encode()),
    "n": st.sampled_from([b"1", b"1.0", b"2", b"null"]),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)).map(orjson.dumps),
    "user": st.text(max_size=4).map(orjson.dumps),
    "logit_bias": st.sampled_from([b"{}", b'{"5": 1}', b'{"5": 1e400}', b'{"x": 1}']),
    "response_format": st.sampled_from([b'{"type": "text"}', b'{"type": "json_object"}', b'{"type": 1}']),
}


@st.composite
def _openai_line_with_params(draw: Any) -> bytes:
    chat = draw(st.booleans())
    members = [b'"model": "m"', b'"messages": ' + _MSGS if chat else b'"prompt": "hi"']
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):  # any parameter, any value: mostly declined
            name, value = draw(st.sampled_from(sorted(records.PARAMETERS))), draw(_PARAM_TEXTS)
        else:  # one most engines accept, with a value near its valid range
            name, value = draw(st.sampled_from(sorted(_USUAL_PARAMS.items())))
            value = draw(st.one_of(value, _PARAM_TEXTS)) if draw(st.integers(0, 3)) == 0 else draw(value)
        members.append(orjson.dumps(name) + b": " + value)
    body = b"{" + b", ".join(draw(st.permutations(members))) + b"}}"
    return (_CHAT if chat else _COMPLETION) + body


@settings(max_examples=1500, deadline=None)
@given(data=_openai_line_with_params(), engine=st.sampled_from(ENGINES))
def test_random_parameters_agree_with_parse_line(data: bytes, engine: str | None) -> None:
    limits = ValidationLimits(max_line_bytes=400, max_prompt_chars=40, max_tokens_limit=100, engine=engine)
    _assert_agrees(data, limits)


def test_typed_parameters_are_parameters() -> None:
    assert set(records._TYPED_PARAMS) <= set(records.PARAMETERS)
