"""Input records: split a JSON Lines stream into lines, parse each line, report every bad one.

Every non-blank input line becomes exactly one :class:`Record` or one :class:`LineError`
(docs/design.md §4.1); blank lines are not records and get no outcome, but they still count for line
numbers. This module is the hot loop of planning a million records, so it reads with buffered
``readline(limit)`` calls, parses with orjson and keeps only 16-byte digests of seen IDs.
"""

from __future__ import annotations

import enum
import hashlib
import io
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat, starmap
from operator import add
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO, Literal

import msgspec
import orjson

from airflow_deadline_batch.core.params import PARAMETERS, REQUEST_KEYS, check_params

__all__ = [
    "ALLOWED_ROLES",
    "ErrorCode",
    "LineBlock",
    "LineError",
    "Message",
    "QuickRecord",
    "RawLine",
    "Record",
    "Request",
    "ValidationLimits",
    "Validator",
    "duplicate_error",
    "fast_parse_many",
    "id_key",
    "iter_line_blocks",
    "iter_line_tuples",
    "iter_raw_lines",
    "parse_line",
    "quick_parse",
    "quick_parse_many",
    "recover_id",
]


class ErrorCode(str, enum.Enum):
    """Machine-readable reason a line is not a valid record (the ``error.code`` of its outcome)."""

    INVALID_JSON = "invalid_json"
    MISSING_ID = "missing_id"
    DUPLICATE_ID = "duplicate_id"
    EMPTY_PROMPT = "empty_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"
    UNSUPPORTED_URL = "unsupported_url"
    INVALID_MAX_TOKENS = "invalid_max_tokens"
    INVALID_ENCODING = "invalid_encoding"
    LINE_TOO_LONG = "line_too_long"
    INVALID_RECORD = "invalid_record"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"


ALLOWED_ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "developer", "tool"})

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
_NATIVE_KEYS = ("id", "prompt", "messages", "max_tokens", "metadata")
_OPENAI_KEYS = ("custom_id", "method", "url", "body")
_BOM = b"\xef\xbb\xbf"
_ECHO_CHARS = 80
#: bytes of an over-long line kept to recover its ID from (docs/design.md §4.1)
HEAD_BYTES = 16_384


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message; ``content`` is plain text (text parts are joined at parse time)."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Request:
    """What to generate for one record: a completion prompt or a chat conversation.

    ``params`` carries other generation parameters from an OpenAI body (temperature, top_p,
    seed, stop, ...) as they are, for the engine to apply.
    """

    kind: Literal["chat", "completion"]
    prompt: str | None
    messages: tuple[Message, ...] | None
    max_tokens: int | None
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def text_chars(self) -> int:
        """Characters of prompt text (the sum of message contents for chat)."""
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m.content) for m in self.messages or ())


@dataclass(frozen=True, slots=True)
class Record:
    """A valid input record: its 1-based line number, its ID, what to generate, its size in bytes."""

    line: int
    id: str
    request: Request
    nbytes: int


@dataclass(frozen=True, slots=True)
class LineError:
    """A bad input line; it becomes a terminal ``errored`` outcome with ``code``."""

    line: int
    id: str | None
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class RawLine:
    """One line of the input as bytes, without its newline.

    ``offset`` is the byte offset of the line's first byte, ``end_offset`` that of the byte after
    its newline, so consecutive lines tile the file and a planner can cut byte ranges.
    ``data`` is None when the line is longer than the limit (it was skipped, never loaded); then
    ``head`` holds its first bytes (at most :data:`HEAD_BYTES`), from which its ID is recovered.
    """

    line: int
    offset: int
    end_offset: int
    data: bytes | None
    head: bytes | None = None


@dataclass(frozen=True, slots=True)
class ValidationLimits:
    """Bounds a record must respect; they protect workers from pathological lines.

    ``engine`` names the job's engine: a line whose body asks for a parameter that engine cannot
    honour is refused (``unsupported_parameter``, see :mod:`~airflow_deadline_batch.core.params`).
    None checks parameter names and values only (re-reading a planned shard).
    """

    max_line_bytes: int = 1_048_576
    max_prompt_chars: int = 200_000
    max_tokens_limit: int = 32_768
    engine: str | None = None

    def __post_init__(self) -> None:
        if self.engine is not None and (not isinstance(self.engine, str) or not self.engine):
            raise ValueError(f"ValidationLimits.engine must be None or an engine name, got {self.engine!r}")
        for name in ("max_line_bytes", "max_prompt_chars", "max_tokens_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ValidationLimits.{name} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------------------------
# Splitting


def iter_raw_lines(
    stream: BinaryIO, *, start_line: int = 1, start_offset: int = 0, max_line_bytes: int
) -> Iterator[RawLine]:
    """Yield every line of ``stream`` (blank ones too), splitting on ``b"\\n"`` only.

    A trailing ``b"\\r"`` is stripped; a final line without a newline still counts. A line longer
    than ``max_line_bytes`` (not counting its line ending) is skipped in chunks and yielded with
    ``data=None``, so memory stays bounded by about ``max_line_bytes`` whatever the input.
    ``start_line``/``start_offset`` let a reader of a byte range keep file-wide numbering.
    """
    return starmap(
        RawLine,
        iter_line_tuples(
            stream, start_line=start_line, start_offset=start_offset, max_line_bytes=max_line_bytes
        ),
    )


def iter_line_tuples(
    stream: BinaryIO, *, start_line: int = 1, start_offset: int = 0, max_line_bytes: int
) -> Iterator[tuple[int, int, int, bytes | None, bytes | None]]:
    """:func:`iter_raw_lines` as plain ``(line, offset, end_offset, data, head)`` tuples.

    For hot loops over millions of lines: a tuple costs a fifth of a :class:`RawLine`.
    """
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    readline = stream.readline
    limit = max_line_bytes + 2  # room for the b"\r\n" ending of a line exactly at the limit
    line = start_line
    offset = start_offset
    while True:
        chunk = readline(limit)
        if not chunk:
            return
        end = offset + len(chunk)
        head: bytes | None = None
        if chunk[-1:] == b"\n":
            data = chunk[:-1]
            if data[-1:] == b"\r":
                data = data[:-1]
        elif len(chunk) < limit:  # the final line, without a newline
            data = chunk
            if data[-1:] == b"\r":
                data = data[:-1]
        else:  # longer than the limit: skip to the next newline, keeping only its head
            data = None
            head = chunk[:HEAD_BYTES]
            while True:
                more = readline(65_536)
                end += len(more)
                if not more or more[-1:] == b"\n":
                    break
        if data is not None and len(data) > max_line_bytes:
            head, data = data[:HEAD_BYTES], None
        yield line, offset, end, data, head
        line += 1
        offset = end


#: what :func:`iter_line_blocks` yields: first line number, the first line's byte offset, the lines'
#: data (None: too long), their end offsets, and their heads (None where no line is too long)
LineBlock = tuple[int, int, list[bytes | None], list[int], list[bytes | None] | None]


def iter_line_blocks(
    stream: BinaryIO,
    *,
    start_line: int = 1,
    start_offset: int = 0,
    max_line_bytes: int,
    block_bytes: int = 1 << 16,
) -> Iterator[LineBlock]:
    """:func:`iter_line_tuples` in blocks of consecutive lines, split at C speed.

    The same lines, data, offsets and heads as :func:`iter_line_tuples`, without a Python step
    per line: ``stream.read(block_bytes)``, ``bytes.split`` and prefix sums of the lengths. A
    block with an over-long line (or the input's final line without a newline) is handed to
    :func:`iter_line_tuples`; a line with no newline within ``max_line_bytes + 2`` bytes is
    skipped to its newline keeping only its head, so memory stays about two blocks.
    """
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    read = stream.read
    limit = max_line_bytes + 2
    line = start_line
    offset = start_offset
    pending = b""
    while True:
        chunk = read(block_bytes)
        buf = pending + chunk if pending else chunk
        if not chunk:
            if buf:  # the final line, without a newline
                yield _tuples_block(buf, line, offset, max_line_bytes)
            return
        cut = buf.rfind(b"\n")
        if cut < 0:
            if len(buf) < limit:
                pending = buf
                continue
            # longer than the limit: skip to the next newline, keeping only its head
            head = buf[: min(HEAD_BYTES, limit)]  # what readline(limit) would have kept
            end = offset + len(buf)
            pending = b""
            while more := read(block_bytes):
                newline = more.find(b"\n")
                if newline >= 0:
                    end += newline + 1
                    pending = more[newline + 1 :]
                    break
                end += len(more)
            yield line, offset, [None], [end], [head]
            line += 1
            offset = end
            continue
        pending = buf[cut + 1 :]
        lines = buf[:cut].split(b"\n")
        datas = lines
        if buf.find(b"\r", 0, cut) >= 0:
            datas = [data[:-1] if data[-1:] == b"\r" else data for data in lines]
        if max(map(len, datas)) > max_line_bytes:
            yield _tuples_block(buf[: cut + 1], line, offset, max_line_bytes)
        else:
            ends = list(accumulate(map(add, map(len, lines), repeat(1)), initial=offset))
            del ends[0]
            yield line, offset, datas, ends, None  # type: ignore[misc]
        line += len(lines)
        offset += cut + 1


def _tuples_block(data: bytes, line: int, offset: int, max_line_bytes: int) -> LineBlock:
    """The lines of ``data`` (whole lines) by :func:`iter_line_tuples`, as one block."""
    rows = list(
        iter_line_tuples(
            io.BytesIO(data), start_line=line, start_offset=offset, max_line_bytes=max_line_bytes
        )
    )
    return line, offset, [row[3] for row in rows], [row[2] for row in rows], [row[4] for row in rows]


# --------------------------------------------------------------------------------------------
# Parsing


class _Bad(Exception):
    """Internal: a line is invalid; carries the code and message (never escapes this module)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.record_id: str | None = None


def _clip(value: Any) -> str:
    """A short, one-line rendering of user data for error messages."""
    text = value if isinstance(value, str) else repr(value)
    text = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    if len(text) > _ECHO_CHARS:
        text = text[: _ECHO_CHARS - 3] + "..."
    return f"'{text}'"


def _decode_error(data: bytes, exc: ValueError) -> _Bad:
    """Tell invalid UTF-8 (or escaped lone surrogates) apart from broken JSON."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return _Bad(
            ErrorCode.INVALID_ENCODING,
            f"line is not valid UTF-8 (bad byte at position {err.start}); re-encode the file as UTF-8",
        )
    if "surrogate" in str(exc):
        return _Bad(
            ErrorCode.INVALID_ENCODING,
            "line contains an unpaired UTF-16 surrogate escape; re-encode the text as UTF-8",
        )
    return _Bad(
        ErrorCode.INVALID_JSON,
        f"line is not valid JSON ({_one_line(str(exc))}); write one JSON object per line",
    )


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 120 else text[:117] + "..."


def _read_id(value: Any, key: str) -> str:
    if isinstance(value, str) and value:
        return value
    if value is None:
        raise _Bad(
            ErrorCode.MISSING_ID, f'record has no "{key}"; give every record a non-empty string "{key}"'
        )
    raise _Bad(
        ErrorCode.MISSING_ID,
        f'"{key}" is {_clip(value)}; IDs must be non-empty strings (quote numeric IDs)',
    )


def _read_max_tokens(value: Any, key: str, limits: ValidationLimits) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limits.max_tokens_limit:
        raise _Bad(
            ErrorCode.INVALID_MAX_TOKENS,
            f'"{key}" is {_clip(value)}; use an integer from 1 to {limits.max_tokens_limit}',
        )
    return value


def _read_content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            is_text = isinstance(part, dict) and part.get("type") == "text"
            if not is_text or not isinstance(part.get("text"), str):
                raise _Bad(
                    ErrorCode.INVALID_RECORD,
                    f"message {index} has a content part that is not text ({_clip(part)}); "
                    'only {"type": "text", "text": "..."} parts are supported',
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _Bad(
        ErrorCode.INVALID_RECORD,
        f"message {index} content is {_clip(content)}; use a string or a list of text parts",
    )


def _read_messages(value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise _Bad(
            ErrorCode.INVALID_RECORD, '"messages" must be a non-empty list of {"role", "content"} objects'
        )
    messages = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise _Bad(
                ErrorCode.INVALID_RECORD,
                f'message {index} is {_clip(item)}; each message must be an object with "role" and "content"',
            )
        role = item.get("role")
        if not isinstance(role, str) or role not in ALLOWED_ROLES:  # a list or object is unhashable
            raise _Bad(
                ErrorCode.INVALID_RECORD,
                f"message {index} has role {_clip(role)}; use one of {', '.join(sorted(ALLOWED_ROLES))}",
            )
        messages.append(Message(role, _read_content(item.get("content"), index)))
    return tuple(messages)


def _read_prompt(value: Any, key: str = "prompt") -> str:
    if not isinstance(value, str):
        raise _Bad(ErrorCode.INVALID_RECORD, f'"{key}" is {_clip(value)}; it must be a string')
    return value


def _check_text(request: Request, limits: ValidationLimits) -> None:
    if request.prompt is not None:
        empty = not request.prompt or request.prompt.isspace()
    else:
        empty = all(not m.content or m.content.isspace() for m in request.messages or ())
    if empty:
        raise _Bad(ErrorCode.EMPTY_PROMPT, "the prompt is empty; give the record some text or drop it")
    chars = request.text_chars
    if chars > limits.max_prompt_chars:
        raise _Bad(
            ErrorCode.PROMPT_TOO_LONG,
            f"the prompt has {chars} characters, more than the limit of {limits.max_prompt_chars}; "
            "shorten it or raise max_prompt_chars",
        )


def _parse_native(obj: dict[str, Any], limits: ValidationLimits) -> tuple[str, Request]:
    record_id = _read_id(obj.get("id"), "id")
    try:
        unknown = [k for k in obj if k not in _NATIVE_KEYS]
        if unknown:
            raise _Bad(
                ErrorCode.INVALID_RECORD,
                f"unknown field {_clip(unknown[0])}; native records allow {', '.join(_NATIVE_KEYS)} "
                '(put extra data under "metadata")',
            )
        has_prompt = obj.get("prompt") is not None
        has_messages = obj.get("messages") is not None
        if has_prompt == has_messages:
            raise _Bad(
                ErrorCode.INVALID_RECORD,
                'record needs exactly one of "prompt" (a string) or "messages" (a list); '
                + ("it has both" if has_prompt else "it has neither"),
            )
        metadata = obj.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise _Bad(ErrorCode.INVALID_RECORD, f'"metadata" is {_clip(metadata)}; it must be an object')
        max_tokens = _read_max_tokens(obj.get("max_tokens"), "max_tokens", limits)
        if has_prompt:
            request = Request("completion", _read_prompt(obj["prompt"]), None, max_tokens, {})
        else:
            request = Request("chat", None, _read_messages(obj["messages"]), max_tokens, {})
        _check_text(request, limits)
    except _Bad as bad:
        bad.record_id = record_id
        raise
    return record_id, request


def _parse_openai(obj: dict[str, Any], limits: ValidationLimits) -> tuple[str, Request]:
    record_id = _read_id(obj.get("custom_id"), "custom_id")
    try:
        unknown = [k for k in obj if k not in _OPENAI_KEYS]
        if unknown:
            raise _Bad(
                ErrorCode.INVALID_RECORD,
                f"unknown field {_clip(unknown[0])}; OpenAI Batch lines allow {', '.join(_OPENAI_KEYS)}",
            )
        method = obj.get("method")
        if method != "POST":
            raise _Bad(
                ErrorCode.INVALID_RECORD, f'"method" is {_clip(method)}; OpenAI Batch lines use "POST"'
            )
        url = obj.get("url")
        if url not in (CHAT_URL, COMPLETIONS_URL):
            raise _Bad(
                ErrorCode.UNSUPPORTED_URL,
                f'"url" is {_clip(url)}; supported endpoints are {CHAT_URL} and {COMPLETIONS_URL}',
            )
        body = obj.get("body")
        if not isinstance(body, dict):
            raise _Bad(ErrorCode.INVALID_RECORD, f'"body" is {_clip(body)}; it must be a JSON object')
        max_tokens = _read_max_tokens(body.get("max_tokens"), "body.max_tokens", limits)
        max_completion = _read_max_tokens(
            body.get("max_completion_tokens"), "body.max_completion_tokens", limits
        )
        if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
            raise _Bad(
                ErrorCode.INVALID_MAX_TOKENS,
                f"body.max_tokens ({max_tokens}) and body.max_completion_tokens ({max_completion}) "
                "disagree; give only one",
            )
        limit = max_completion if max_completion is not None else max_tokens
        kind: Literal["chat", "completion"] = "chat" if url == CHAT_URL else "completion"
        reserved = REQUEST_KEYS[kind]
        params = {k: v for k, v in body.items() if k not in reserved}
        if url == CHAT_URL:
            if body.get("messages") is None:
                raise _Bad(ErrorCode.INVALID_RECORD, f'a {CHAT_URL} body needs "messages"')
            request = Request("chat", None, _read_messages(body["messages"]), limit, params)
        else:
            if body.get("prompt") is None:
                raise _Bad(ErrorCode.INVALID_RECORD, f'a {COMPLETIONS_URL} body needs "prompt" (a string)')
            request = Request("completion", _read_prompt(body["prompt"], "body.prompt"), None, limit, params)
        problem = check_params(params, kind, limits.engine) if params else None
        if problem is not None:
            code = (
                ErrorCode.UNSUPPORTED_PARAMETER if problem.kind == "unsupported" else ErrorCode.INVALID_RECORD
            )
            raise _Bad(code, problem.message)
        _check_text(request, limits)
    except _Bad as bad:
        bad.record_id = record_id
        raise
    return record_id, request


def _parse_object(data: bytes, limits: ValidationLimits) -> tuple[str, Request]:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise _decode_error(data, exc) from None
    if not isinstance(obj, dict):
        raise _Bad(
            ErrorCode.INVALID_RECORD,
            f"line is a JSON {type(obj).__name__}, not an object; write one JSON object per line",
        )
    if "custom_id" in obj or "body" in obj or "url" in obj or "method" in obj:
        return _parse_openai(obj, limits)
    return _parse_native(obj, limits)


def parse_line(raw: RawLine, limits: ValidationLimits) -> Record | LineError | None:
    """Parse one raw line into a :class:`Record`, a :class:`LineError`, or None for a blank line.

    Accepts the native shape and OpenAI Batch API lines (docs/design.md §4.1). The error keeps the
    record's ID whenever it could be read. Duplicate IDs are the :class:`Validator`'s job.
    """
    data = raw.data
    if data is None:
        head = raw.head or b""
        return LineError(
            raw.line,
            recover_id(head[3:] if raw.line == 1 and head[:3] == _BOM else head),
            ErrorCode.LINE_TOO_LONG,
            f"line is longer than {limits.max_line_bytes} bytes; shorten the record or raise max_line_bytes",
        )
    if raw.line == 1 and data[:3] == _BOM:
        data = data[3:]
    if data[:1] != b"{" and not data.strip():  # the common case skips copying the line
        return None
    if len(data) > limits.max_line_bytes:
        return LineError(
            raw.line,
            recover_id(data[:HEAD_BYTES]),
            ErrorCode.LINE_TOO_LONG,
            f"line is longer than {limits.max_line_bytes} bytes; shorten the record or raise max_line_bytes",
        )
    try:
        record_id, request = _parse_object(data, limits)
    except _Bad as bad:
        return LineError(raw.line, bad.record_id, bad.code, bad.message)
    return Record(raw.line, record_id, request, len(data))


# --------------------------------------------------------------------------------------------
# The ID of a line too long to parse

_WS = b" \t\r\n"
_OPENAI_MARKERS = frozenset({"custom_id", "method", "url", "body"})


def recover_id(head: bytes) -> str | None:
    """The ID of a line from its first bytes alone: exact, or None.

    Scans the top-level members of the JSON object that ``head`` begins (a bounded scan: ``head``
    is at most :data:`HEAD_BYTES`), skipping values without parsing them. ``"custom_id"`` is the
    ID when present; ``"id"`` when no OpenAI Batch member was seen (the shape :func:`parse_line`
    would pick). The value counts only if its whole string lies inside ``head`` and is a
    non-empty JSON string; anything malformed gives None. One case stays ambiguous: a line that
    mixes ``"id"`` with OpenAI Batch members placed after its head is read as native.
    """
    members: dict[str, bytes] = {}
    keys: set[str] = set()
    n = len(head)
    i = _skip_ws(head, 0)
    if i >= n or head[i] != 0x7B:  # "{"
        return None
    i += 1
    while True:
        i = _skip_ws(head, i)
        if i >= n or head[i] != 0x22:  # a key's opening quote, or the end of what we have
            break
        end = _string_end(head, i)
        if end < 0:
            break
        key = _json_string(head[i:end])
        if key is None:
            return None
        i = _skip_ws(head, end)
        if i >= n or head[i] != 0x3A:  # ":"
            break
        i = _skip_ws(head, i + 1)
        end = _value_end(head, i)
        if end < 0:
            break
        keys.add(key)
        if key in ("id", "custom_id") and key not in members:
            members[key] = head[i:end]
        i = _skip_ws(head, end)
        if i >= n or head[i] != 0x2C:  # ","
            break
        i += 1
    if "custom_id" in members:
        raw = members["custom_id"]
    elif "id" in members and not keys & _OPENAI_MARKERS:
        raw = members["id"]
    else:
        return None
    value = _json_string(raw)
    return value or None


def _skip_ws(data: bytes, i: int) -> int:
    n = len(data)
    while i < n and data[i] in _WS:
        i += 1
    return i


def _string_end(data: bytes, i: int) -> int:
    """Index after the closing quote of the JSON string opening at ``i``; -1 if it is cut off."""
    j = i + 1
    while True:
        j = data.find(b'"', j)
        if j < 0:
            return -1
        backslashes = 0
        k = j - 1
        while k > i and data[k] == 0x5C:
            backslashes += 1
            k -= 1
        if backslashes % 2 == 0:
            return j + 1
        j += 1


def _value_end(data: bytes, i: int) -> int:
    """Index after the JSON value starting at ``i`` (not validated); -1 if it is cut off."""
    n = len(data)
    if i >= n:
        return -1
    if data[i] == 0x22:
        return _string_end(data, i)
    depth = 0
    while i < n:
        c = data[i]
        if c == 0x22:
            i = _string_end(data, i)
            if i < 0:
                return -1
            continue
        if c in (0x7B, 0x5B):  # "{" "["
            depth += 1
        elif c in (0x7D, 0x5D):  # "}" "]"
            if depth == 0:
                return i
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and (c == 0x2C or c in _WS):  # the end of a number or literal
            return i
        i += 1
    return -1


def _json_string(raw: bytes) -> str | None:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


# --------------------------------------------------------------------------------------------
# The planner's shortcut for ordinary lines

_NATIVE_KEY_SET = frozenset(_NATIVE_KEYS)
_OPENAI_KEY_SET = frozenset(_OPENAI_KEYS)

#: what :func:`quick_parse` returns: the ID, the prompt (str) or chat contents (tuple), max_tokens
QuickRecord = tuple[str, str | tuple[str, ...], int | None]


def _quick_contents(messages: Any, roles: frozenset[str] = ALLOWED_ROLES) -> tuple[str, ...] | None:
    """Message contents when every message is a plain ``{"role", "content": str}``; else None."""
    if type(messages) is not list or not messages:
        return None
    contents = []
    for item in messages:
        if type(item) is not dict:
            return None
        role = item.get("role")
        content = item.get("content")
        if type(role) is not str or role not in roles or type(content) is not str:
            return None
        contents.append(content)
    return tuple(contents)


def quick_parse(data: bytes, limits: ValidationLimits) -> QuickRecord | None:
    """``(id, prompt or chat contents, max_tokens)`` of a valid line of a common shape, else None.

    Planning a million lines spends most of its time building :class:`Record` objects it
    throws away, so this checks the ordinary shapes (string contents, no text parts) straight
    on the decoded dict. None means "use :func:`parse_line`", which stays the reference: this
    never accepts a line that :func:`parse_line` rejects, and what it returns is exactly the
    ID, texts and limit of the :class:`Request` that :func:`parse_line` would build.
    :func:`quick_parse_many` is the same, for many lines at once (the planner's).
    """
    if len(data) > limits.max_line_bytes:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if type(obj) is not dict:
        return None
    record_id = obj.get("id")
    texts: str | tuple[str, ...] | None
    if record_id is not None:  # native; any OpenAI key makes it an OpenAI line, left to parse_line
        if type(record_id) is not str or not record_id or not obj.keys() <= _NATIVE_KEY_SET:
            return None
        limit = obj.get("max_tokens")
        metadata = obj.get("metadata")
        if limit is not None and (type(limit) is not int or not 1 <= limit <= limits.max_tokens_limit):
            return None
        if metadata is not None and type(metadata) is not dict:
            return None
        prompt = obj.get("prompt")
        messages = obj.get("messages")
        if messages is None:
            texts = prompt if type(prompt) is str else None
        else:
            texts = _quick_contents(messages) if prompt is None else None
    else:
        record_id = obj.get("custom_id")
        if type(record_id) is not str or not record_id or not obj.keys() <= _OPENAI_KEY_SET:
            return None
        body = obj.get("body")
        if obj.get("method") != "POST" or type(body) is not dict:
            return None
        limit = body.get("max_tokens")
        completion_limit = body.get("max_completion_tokens")
        if completion_limit is not None:  # the newer name wins when both agree (parse_line rejects others)
            if limit is not None and (type(limit) is not int or limit != completion_limit):  # True == 1
                return None
            limit = completion_limit
        if limit is not None and (type(limit) is not int or not 1 <= limit <= limits.max_tokens_limit):
            return None
        url = obj.get("url")
        if url == CHAT_URL:
            texts = _quick_contents(body.get("messages"))
            kind: Literal["chat", "completion"] = "chat"
        elif url == COMPLETIONS_URL:
            prompt = body.get("prompt")
            texts = prompt if type(prompt) is str else None
            kind = "completion"
        else:
            return None
        if not body.keys() <= REQUEST_KEYS[kind]:  # parameters: the same check as parse_line
            reserved = REQUEST_KEYS[kind]
            params = {k: v for k, v in body.items() if k not in reserved}
            if check_params(params, kind, limits.engine) is not None:
                return None
    if texts is None:
        return None
    # the joined contents are empty or blank exactly when every message is
    text = texts if type(texts) is str else "".join(texts)
    if not text or text.isspace() or len(text) > limits.max_prompt_chars:
        return None
    return record_id, texts, limit


#: what a line that orjson could not decode becomes in :func:`quick_parse_many` (not a dict)
_UNDECODED = object()


def quick_parse_many(datas: Sequence[bytes | None], limits: ValidationLimits) -> list[QuickRecord | None]:
    """:func:`quick_parse` of each line of ``datas`` (None for a None item), in one call.

    The same checks as :func:`quick_parse`, line for line (``tests/unit/test_records_blocks.py``
    holds the two together on the Hypothesis strategies of ``test_records_quick.py``).

    The planner's hot loop: the lines are decoded by ``map(orjson.loads, ...)`` at C speed (a
    line that does not decode only interrupts it), and the shape checks run inline, without a
    Python call per line.
    """
    loads = orjson.loads
    decode_error = orjson.JSONDecodeError
    objs: list[Any] = []
    rest = iter(datas)
    while True:
        try:
            objs.extend(map(loads, rest))  # type: ignore[arg-type]  # keeps what it decoded before a failure
            break
        except (decode_error, TypeError):
            objs.append(_UNDECODED)
    max_bytes = limits.max_line_bytes
    max_tokens = limits.max_tokens_limit
    max_chars = limits.max_prompt_chars
    engine = limits.engine
    native_keys = _NATIVE_KEY_SET
    openai_keys = _OPENAI_KEY_SET
    roles = ALLOWED_ROLES
    try:
        long_lines = max(map(len, datas), default=0) > max_bytes  # type: ignore[arg-type]
    except TypeError:  # a None item: check each line
        long_lines = True
    out: list[QuickRecord | None] = []
    append = out.append
    for index, obj in enumerate(objs):
        if type(obj) is not dict or (long_lines and len(datas[index] or b"") > max_bytes):
            append(None)
            continue
        record_id = obj.get("id")
        texts: Any
        if record_id is not None:  # native; any OpenAI key makes it an OpenAI line, left to parse_line
            if type(record_id) is not str or not record_id or not obj.keys() <= native_keys:
                append(None)
                continue
            limit = obj.get("max_tokens")
            if limit is not None and (type(limit) is not int or not 1 <= limit <= max_tokens):
                append(None)
                continue
            metadata = obj.get("metadata")
            if metadata is not None and type(metadata) is not dict:
                append(None)
                continue
            prompt = obj.get("prompt")
            messages = obj.get("messages")
            if messages is None:
                texts = prompt if type(prompt) is str else None
            else:
                texts = _quick_contents(messages, roles) if prompt is None else None
        else:
            record_id = obj.get("custom_id")
            if type(record_id) is not str or not record_id or not obj.keys() <= openai_keys:
                append(None)
                continue
            body = obj.get("body")
            if obj.get("method") != "POST" or type(body) is not dict:
                append(None)
                continue
            limit = body.get("max_tokens")
            completion_limit = body.get("max_completion_tokens")
            if (
                completion_limit is not None
            ):  # the newer name wins when both agree (parse_line rejects others)
                if limit is not None and (type(limit) is not int or limit != completion_limit):  # True == 1
                    append(None)
                    continue
                limit = completion_limit
            if limit is not None and (type(limit) is not int or not 1 <= limit <= max_tokens):
                append(None)
                continue
            url = obj.get("url")
            kind: Literal["chat", "completion"]
            if url == CHAT_URL:
                texts = _quick_contents(body.get("messages"), roles)
                kind = "chat"
            elif url == COMPLETIONS_URL:
                prompt = body.get("prompt")
                texts = prompt if type(prompt) is str else None
                kind = "completion"
            else:
                append(None)
                continue
            if not body.keys() <= REQUEST_KEYS[kind]:  # parameters: the same check as parse_line
                reserved = REQUEST_KEYS[kind]
                params = {k: v for k, v in body.items() if k not in reserved}
                if check_params(params, kind, engine) is not None:
                    append(None)
                    continue
        if texts is None:
            append(None)
            continue
        # the joined contents are empty or blank exactly when every message is
        text = texts if type(texts) is str else "".join(texts)
        if not text or text.isspace() or len(text) > max_chars:
            append(None)
            continue
        append((record_id, texts, limit))
    return out


# --------------------------------------------------------------------------------------------
# The planner's typed fast path: the common shapes decoded and checked by msgspec, at C speed
#
# A line accepted here is one that quick_parse accepts with the same ID, texts and limit; any
# doubt makes it decline (None) and the line goes to quick_parse_many / parse_line, which alone
# decide error codes and messages. What msgspec checks: the key set (forbid_unknown_fields: an
# extra, a misspelt or a duplicated-shape key declines), the types (no bool for int, no float,
# no null where parse_line's presence test differs), string contents (UTF-8, escapes, lone
# surrogates, control characters). What msgspec does not check the way orjson does, inside a
# value kept as ``msgspec.Raw`` (invalid UTF-8, numbers out of the double range, nesting depth),
# is checked by orjson itself on those bytes: body parameters once per distinct byte string
# (cached with their check_params verdict); a line where a raw member may be repeated (only
# the last occurrence would be checked) declines. ``metadata`` is decoded flat, not kept raw.
# The usual body parameters (numbers, flags, strings, ``stop``) are typed instead of raw: msgspec
# checks every occurrence of their key as orjson would, so a line needs no repeated-key search.

_Role = Literal["system", "user", "assistant", "developer", "tool"]  # ALLOWED_ROLES (a test holds them equal)
_NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]


class _FastMessage(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    role: _Role
    content: str


_FastMessages = Annotated[list[_FastMessage], msgspec.Meta(min_length=1)]
#: integers within int64 (orjson turns those beyond 64 bits into floats)
_Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
#: a flat ``metadata`` value, decoded (so checked) at every occurrence of the key; nested → declined
_FlatValue = str | _Int64 | float | bool | None
#: a JSON number as orjson reads it: an integer literal an int, any other a float (msgspec refuses
#: one beyond a double, as orjson does)
_Number = _Int64 | float | None
#: body parameters decoded with their JSON type (one of another type declines; check_params still
#: gives the verdict, on the re-encoded values); every other parameter of PARAMETERS stays raw
_TYPED_PARAMS: Mapping[str, Any] = {
    **dict.fromkeys(("temperature", "top_p", "presence_penalty", "frequency_penalty"), _Number),
    **dict.fromkeys(("seed", "n", "best_of", "top_logprobs"), _Int64 | None),
    "logprobs": bool | _Int64 | None,
    **dict.fromkeys(("stream", "echo", "store", "parallel_tool_calls"), bool | None),
    **dict.fromkeys(
        (
            "user",
            "suffix",
            "service_tier",
            "reasoning_effort",
            "verbosity",
            "prompt_cache_key",
            "safety_identifier",
        ),
        str | None,
    ),
    "stop": str | list[str] | None,
}


class _FastNative(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A native line; parse_line reads every member with ``.get``, so null is the same as absent
    (``metadata`` need only be an object or null: msgspec checks it as orjson would)."""

    id: _NonEmptyStr
    prompt: str | None = None
    messages: _FastMessages | None = None
    max_tokens: int | None = None
    metadata: dict[str, _FlatValue] | None = None


class _FastBodyBase(msgspec.Struct, forbid_unknown_fields=True, gc=False, omit_defaults=True):
    """An OpenAI body's request members; ``messages`` or ``prompt`` present (even null) in the
    other endpoint's body is a parameter for parse_line, hence UNSET for "absent"."""

    model: str | None | msgspec.UnsetType = msgspec.UNSET
    messages: _FastMessages | msgspec.UnsetType = msgspec.UNSET
    prompt: str | msgspec.UnsetType = msgspec.UNSET
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


if TYPE_CHECKING:
    _FastBody = _FastBodyBase
else:  # every known parameter typed or as raw JSON bytes (an unknown name declines: check_params refuses it)
    _FastBody = msgspec.defstruct(
        "_FastBody",
        [
            (name, _TYPED_PARAMS.get(name, msgspec.Raw) | msgspec.UnsetType, msgspec.UNSET)
            for name in PARAMETERS
            if name not in _FastBodyBase.__struct_fields__
        ],
        bases=(_FastBodyBase,),
        forbid_unknown_fields=True,
        gc=False,
        omit_defaults=True,
    )


class _FastOpenAI(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    custom_id: _NonEmptyStr
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v1/completions"]
    body: _FastBody


_NATIVE_DECODER = msgspec.json.Decoder(_FastNative)
_OPENAI_DECODER = msgspec.json.Decoder(_FastOpenAI)
_BODY_ENCODER = msgspec.json.Encoder()
#: check_params verdicts by (engine, endpoint, the body's re-encoded members without its text)
_PARAMS_VERDICTS: dict[tuple[str | None, str, bytes], tuple[bytes, ...] | None] = {}
_PARAMS_VERDICTS_MAX = 4096
_UNKNOWN: Any = object()
#: orjson refuses JSON nested deeper than 1024; raw bytes with this many brackets are left to it
_MAX_RAW_BRACKETS = 256


def _raw_loads(data: bytes) -> tuple[bool, Any]:
    """``(True, value)`` when orjson decodes ``data`` as it would inside the line, else ``(False, None)``."""
    if len(data) >= _MAX_RAW_BRACKETS and data.count(b"[") + data.count(b"{") >= _MAX_RAW_BRACKETS:
        return False, None  # maybe nested too deep for orjson inside the line (1024 levels)
    try:
        return True, orjson.loads(data)
    except orjson.JSONDecodeError:
        return False, None


def _params_names(
    key: bytes, kind: Literal["chat", "completion"], engine: str | None
) -> tuple[bytes, ...] | None:
    """The quoted names of the raw parameters among the body members re-encoded as ``key`` (the
    typed ones need no repeated-key search), or None when one of the parameters cannot run on
    ``engine`` (check_params, once per distinct ``key``)."""
    cache_key = (engine, kind, key)
    try:
        return _PARAMS_VERDICTS[cache_key]
    except KeyError:
        pass
    names = None
    decoded, members = _raw_loads(key)
    if decoded and type(members) is dict:
        reserved = REQUEST_KEYS[kind]
        params = {k: v for k, v in members.items() if k not in reserved}
        if not params or check_params(params, kind, engine) is None:
            names = tuple(b'"%s"' % name.encode() for name in params if name not in _TYPED_PARAMS)
    if len(_PARAMS_VERDICTS) >= _PARAMS_VERDICTS_MAX:
        _PARAMS_VERDICTS.clear()
    _PARAMS_VERDICTS[cache_key] = names
    return names


#: how an OpenAI Batch line of the usual key order starts (the fast path's first guess of its shape)
_OPENAI_START = b'{"custom_id"'
_BACKSLASH = ord("\\")


def _decode_reordered(data: bytes) -> _FastOpenAI | None:
    """An OpenAI Batch line whose first member is not ``custom_id`` (the fast path's second try)."""
    if data.startswith(_OPENAI_START) or b'"custom_id"' not in data:
        return None
    try:
        return _OPENAI_DECODER.decode(data)
    except msgspec.DecodeError:
        return None


def _contents(messages: list[_FastMessage]) -> tuple[str, ...]:
    """The messages' contents; the usual one or two messages without a comprehension (which
    costs a function object and a list)."""
    if len(messages) == 2:
        return (messages[0].content, messages[1].content)
    if len(messages) == 1:
        return (messages[0].content,)
    return tuple([message.content for message in messages])


def fast_parse_many(datas: Sequence[bytes | None], limits: ValidationLimits) -> list[QuickRecord | None]:
    """:func:`quick_parse_many` for the common shapes, decoded by typed msgspec structs.

    Each item is :func:`quick_parse`'s tuple or None; None means only "not decided here": the
    caller passes those lines to :func:`quick_parse_many` and :meth:`Validator.feed` (the
    reference, which alone gives error codes). A line accepted here is accepted by
    :func:`parse_line` with the same ID, texts and limit (``tests/unit/test_records_fast.py``).
    """
    max_bytes = limits.max_line_bytes
    max_tokens = limits.max_tokens_limit
    max_chars = limits.max_prompt_chars
    engine = limits.engine
    decode_native = _NATIVE_DECODER.decode
    decode_openai = _OPENAI_DECODER.decode
    encode = _BODY_ENCODER.encode
    unset = msgspec.UNSET
    decode_error = msgspec.DecodeError
    native_type = _FastNative
    openai_start = _OPENAI_START
    verdicts = _PARAMS_VERDICTS  # cleared in place when full, never replaced
    contents = _contents
    try:
        long_lines = max(map(len, datas), default=0) > max_bytes  # type: ignore[arg-type]
    except TypeError:  # a None item: check each line
        long_lines = True
    out: list[QuickRecord | None] = []
    append = out.append
    texts: str | tuple[str, ...] | None
    line: _FastNative | _FastOpenAI | None
    for data in datas:
        if long_lines and (data is None or len(data) > max_bytes):
            append(None)
            continue
        try:
            # a slice compared, not startswith: a method call costs more than the comparison
            line = decode_openai(data) if data[:12] == openai_start else decode_native(data)  # type: ignore[index,arg-type]
        except decode_error:
            line = _decode_reordered(data)  # type: ignore[arg-type]
            if line is None:
                append(None)
                continue
        if type(line) is native_type:
            limit = line.max_tokens
            if limit is not None and not 1 <= limit <= max_tokens:
                append(None)
                continue
            messages = line.messages
            if messages is None:
                texts = line.prompt
                if texts is None:
                    append(None)
                    continue
            elif line.prompt is not None:
                append(None)
                continue
            else:
                # two messages (a system prompt and a question) without the function call
                texts = (
                    (messages[0].content, messages[1].content) if len(messages) == 2 else contents(messages)
                )
            record_id = line.id
        else:
            assert type(line) is _FastOpenAI
            body = line.body
            limit = body.max_tokens
            completion_limit = body.max_completion_tokens
            if completion_limit is not None:  # the newer name wins when both agree
                if limit is not None and limit != completion_limit:
                    append(None)
                    continue
                limit = completion_limit
            if limit is not None and not 1 <= limit <= max_tokens:
                append(None)
                continue
            kind: Literal["chat", "completion"]
            if line.url == CHAT_URL:
                chat = body.messages
                if chat is unset or body.prompt is not unset:
                    append(None)
                    continue
                texts = (chat[0].content,) if len(chat) == 1 else contents(chat)
                body.messages = unset
                kind = "chat"
            else:
                prompt = body.prompt
                if prompt is unset or body.messages is not unset:
                    append(None)
                    continue
                texts = prompt
                body.prompt = unset
                kind = "completion"
            # the rest of the body (model, limits, parameters) as bytes: one verdict per distinct one
            key = encode(body)
            names = verdicts.get((engine, kind, key), _UNKNOWN)  # a hit without the function call
            if names is _UNKNOWN:
                names = _params_names(key, kind, engine)
            if names is None:
                append(None)
                continue
            if names:  # a raw parameter repeated would have its earlier values only skipped by msgspec
                # (no UTF-8 or number-range check): decline when one may be; a key can be spelt
                # with escapes only through \u00XX
                # a one-byte search first, by the byte's value (memchr; ``b"\\" in data`` costs 10x)
                if _BACKSLASH in data and b"\\u00" in data:  # type: ignore[operator]
                    append(None)
                    continue
                for name in names:
                    if data.count(name) != 1:  # type: ignore[union-attr]
                        break
                else:
                    name = b""
                if name:
                    append(None)
                    continue
            record_id = line.custom_id
        # the joined contents are empty or blank exactly when every message is
        text = texts if type(texts) is str else "".join(texts)
        if not text or text.isspace() or len(text) > max_chars:
            append(None)
            continue
        append((record_id, texts, limit))
    return out


# --------------------------------------------------------------------------------------------
# Validation with duplicate detection


def _id_digest(record_id: str) -> bytes | str:
    """The key an ID is remembered by: itself when short (exact, and cheaper than hashing), else
    its 16-byte BLAKE2b digest (a str never equals a bytes, so the two kinds cannot collide)."""
    if len(record_id) <= 16:
        return record_id
    return hashlib.blake2b(id_key(record_id), digest_size=16).digest()


def id_key(record_id: str) -> bytes:
    """An ID as bytes, exactly: equal keys are equal IDs (for spilling IDs to disk)."""
    return record_id.encode("utf-8", "surrogatepass")


def duplicate_error(line: int, record_id: str) -> LineError:
    """The outcome of a line whose ID an earlier line already owns."""
    return LineError(
        line,
        record_id,
        ErrorCode.DUPLICATE_ID,
        f"ID {_clip(record_id)} was already used by an earlier line (the first one is kept); "
        "give every record a unique ID",
    )


class Validator:
    """Parse lines in order, flag repeated IDs, and count outcomes.

    The first line carrying an ID owns it, even when that line is itself invalid, so every ID
    maps to exactly one outcome. Seen IDs of more than 16 characters are kept as 16-byte BLAKE2b
    digests, shorter ones as they are (about 80 MB for a million IDs either way).

    With ``check_duplicates=False`` nothing is remembered and every line is judged on its own:
    the planner does that and finds duplicates afterwards from IDs spilled to disk
    (:mod:`airflow_deadline_batch.service.spill`), so its memory does not grow with the input.
    """

    def __init__(self, limits: ValidationLimits | None = None, *, check_duplicates: bool = True) -> None:
        self.limits = limits or ValidationLimits()
        self.check_duplicates = check_duplicates
        self._seen: set[bytes | str] = set()
        self.lines = 0
        self.records = 0
        self.errors: Counter[ErrorCode] = Counter()

    @property
    def invalid(self) -> int:
        """Number of lines that became :class:`LineError`."""
        return sum(self.errors.values())

    def feed_quick(self, data: bytes) -> QuickRecord | None:
        """:meth:`feed` for an ordinary valid line with a new ID, without building any object.

        Returns :func:`quick_parse`'s tuple and counts the record; None when the line is not
        that simple case, and then nothing was counted: the caller must :meth:`feed` it.
        """
        quick = quick_parse(data, self.limits)
        if quick is None:
            return None
        if self.check_duplicates:
            digest = _id_digest(quick[0])
            if digest in self._seen:
                return None
            self._seen.add(digest)
        self.lines += 1
        self.records += 1
        return quick

    def feed(self, raw: RawLine) -> Record | LineError | None:
        """Parse ``raw`` and return its outcome (None for a blank line)."""
        self.lines += 1
        outcome = parse_line(raw, self.limits)
        if outcome is None:
            return None
        if self.check_duplicates and outcome.id is not None:
            digest = _id_digest(outcome.id)
            if digest in self._seen:
                outcome = duplicate_error(outcome.line, outcome.id)
            else:
                self._seen.add(digest)
        if isinstance(outcome, Record):
            self.records += 1
        else:
            self.errors[outcome.code] += 1
        return outcome
