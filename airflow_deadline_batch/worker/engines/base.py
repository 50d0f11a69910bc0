"""The engine contract: what the worker needs from an inference backend.

An engine turns a microbatch of validated requests into one :class:`Generation` per request, in
order. A bad record is an errored ``Generation``; an exception from ``generate`` means the whole
microbatch failed: the try ends, classified by the exception (``core.failures``: a reset
connection is transient, an engine bug deterministic, which spends the shard's budget when the
try committed nothing), and the next attempt redoes the microbatch. So one bad record should be
an errored Generation, never an exception.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from airflow_deadline_batch.core.records import Request
    from airflow_deadline_batch.core.results import Choice, FinishReason

DEFAULT_MAX_TOKENS = 256

#: error codes an engine puts in an errored Generation (docs/design.md §4.2 ``error.code``)
ENGINE_ERROR = "engine_error"
PROMPT_TOO_LONG = "prompt_too_long"
REQUEST_REJECTED = "request_rejected"
UNSUPPORTED_PARAMETER = "unsupported_parameter"
#: the completion of a ``response_format`` json_object / json_schema request is not that JSON
INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"


@dataclass(frozen=True, kw_only=True)
class GenerationParams:
    """Sampling parameters of a job; a request's own ``max_tokens``/params override them."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: token id -> bias, sorted by token id (a tuple, so params stay hashable for grouping)
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: the body's ``response_format`` as canonical JSON (None or text: free text)
    response_format: str | None = None
    #: outputs per request (the body's ``n``)
    n: int = 1
    #: per-token log probabilities asked for (chat ``logprobs: true``, completions ``logprobs: k``)
    logprobs: bool = False
    #: alternatives per position (chat ``top_logprobs``, completions ``logprobs: k``)
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if float(self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < float(self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.n) < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> GenerationParams:
        """Build from a job's ``generation`` config, ignoring keys that are not sampling params."""
        return cls()._merged(values or {})

    def for_request(self, request: Request) -> GenerationParams:
        """The effective params of one request: its ``max_tokens`` and body params win."""
        merged = self._merged(getattr(request, "params", None) or {})
        max_tokens = getattr(request, "max_tokens", None)
        return replace(merged, max_tokens=int(max_tokens)) if max_tokens else merged

    def _merged(self, values: Mapping[str, Any]) -> GenerationParams:
        updates: dict[str, Any] = {}
        for key in ("max_tokens", "max_completion_tokens"):
            if values.get(key) is not None:
                updates["max_tokens"] = int(values[key])
        for key, kind in (("temperature", float), ("top_p", float), ("seed", int)):
            if values.get(key) is not None:
                updates[key] = kind(values[key])
        stop = values.get("stop")
        if stop:
            updates["stop"] = (stop,) if isinstance(stop, str) else tuple(str(s) for s in stop)
        for key in ("presence_penalty", "frequency_penalty"):
            if values.get(key) is not None:
                updates[key] = float(values[key])
        bias = values.get("logit_bias")
        if bias:
            updates["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in dict(bias).items()))
        if values.get("n") is not None:
            updates["n"] = int(values["n"])
        logprobs = values.get("logprobs")
        if logprobs is not None and logprobs is not False:
            updates["logprobs"] = True
            if not isinstance(logprobs, bool):  # completions: logprobs is the number of alternatives
                updates["top_logprobs"] = int(logprobs)
        if values.get("top_logprobs") is not None:
            updates["top_logprobs"] = int(values["top_logprobs"])
        fmt = values.get("response_format")
        if fmt is not None:
            if not isinstance(fmt, Mapping):
                raise ValueError(f"response_format must be an object, got {fmt!r}")
            text = fmt.get("type") == "text"
            updates["response_format"] = None if text else json.dumps(fmt, sort_keys=True)
        return replace(self, **updates) if updates else self

    def json_format(self) -> tuple[Literal["json_object", "json_schema"], dict[str, Any] | None] | None:
        """The structured output asked for: ``("json_object", None)``, ``("json_schema", schema)``
        or None for free text."""
        if self.response_format is None:
            return None
        fmt = json.loads(self.response_format)
        if fmt.get("type") == "json_schema":
            return "json_schema", dict(fmt["json_schema"]["schema"])
        return "json_object", None


@dataclass(frozen=True)
class GenerationError:
    """Why one record failed: a machine-readable ``code`` and a human ``message``."""

    code: str
    message: str


@dataclass(frozen=True)
class Generation:
    """The outcome of one request: ``output`` or ``error``, plus token usage.

    ``finish_reason`` says why generation stopped, when the engine knows; ``choices`` lists every
    output (``choices[0].text == output``) when the request asked for ``n > 1`` or log
    probabilities; ``completion_tokens`` then counts the tokens of all of them.
    """

    output: str | None
    error: GenerationError | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None
    choices: tuple[Choice, ...] | None = None

    @classmethod
    def failed(cls, code: str, message: str, prompt_tokens: int = 0) -> Generation:
        return cls(output=None, error=GenerationError(code, message), prompt_tokens=prompt_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None


@runtime_checkable
class Engine(Protocol):
    """What the worker needs from an inference backend."""

    name: str

    @property
    def model_name(self) -> str: ...

    @property
    def model_digest(self) -> str:
        """SHA-256 identifying the exact weights, checked against the job's pin."""
        ...

    def load(self) -> None:
        """Load the model; idempotent. Raises EngineError with the fix when it cannot."""
        ...

    def generate(self, requests: Sequence[Request], params: GenerationParams) -> list[Generation]:
        """One Generation per request, in order."""
        ...


@dataclass(frozen=True)
class ChatTurn:
    """A chat message as plain strings, the shape every chat API takes."""

    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


def chat_turns(request: Request) -> list[ChatTurn]:
    """The request's messages, or its prompt as one user message."""
    messages = getattr(request, "messages", None)
    if messages:
        return [ChatTurn(str(m.role), str(m.content)) for m in messages]
    return [ChatTurn("user", str(getattr(request, "prompt", "") or ""))]


def is_chat(request: Request) -> bool:
    return str(getattr(request, "kind", "chat")) == "chat"


def prompt_text(request: Request) -> str:
    """The completion prompt, or the last user message of a chat."""
    if not is_chat(request) and getattr(request, "prompt", None) is not None:
        return str(request.prompt)
    turns = chat_turns(request)
    users = [t.content for t in turns if t.role == "user"]
    return users[-1] if users else (turns[-1].content if turns else "")


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """Cut ``text`` at the first occurrence of any stop string (the stop string is not kept)."""
    cut = len(text)
    for s in stop:
        if s:
            at = text.find(s)
            if 0 <= at < cut:
                cut = at
    return text[:cut]


_DIGEST_CACHE: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, cached in memory by (path, size, mtime) so repeated loads are free."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    cached = _DIGEST_CACHE.get(key)
    if cached is None:
        h = hashlib.sha256()
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        cached = _DIGEST_CACHE[key] = h.hexdigest()
    return cached


def weights_digest(path: Path) -> str:
    """Digest of a weights file, or of a directory's manifest (relative path + file digest, sorted)."""
    if path.is_file():
        return file_sha256(path)
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue  # caches and lock files (.cache/, .git/) are not weights
        h.update(f"{rel}\0{file_sha256(file)}\n".encode())
    return h.hexdigest()


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def option_float(options: Mapping[str, Any], key: str, default: float, env: str | None = None) -> float:
    """Read a float option (CLI options arrive as strings), falling back to an env var, then default."""
    raw = options.get(key)
    if raw is None and env:
        raw = os.environ.get(env)
    return default if raw in (None, "") else float(raw)


@dataclass(frozen=True)
class ParamGroup:
    """Positions of requests that share the same effective params (batched together)."""

    params: GenerationParams
    positions: list[int] = field(default_factory=list)


def group_by_params(requests: Sequence[Request], params: GenerationParams) -> list[ParamGroup]:
    """Group requests by effective params, keeping first-seen order, for engines that batch."""
    groups: dict[GenerationParams, ParamGroup] = {}
    for pos, request in enumerate(requests):
        p = params.for_request(request)
        groups.setdefault(p, ParamGroup(p)).positions.append(pos)
    return list(groups.values())


def refusal(request: Request, engine: str) -> Generation | None:
    """An ``unsupported_parameter`` Generation when the request asks for what ``engine`` cannot do.

    The planner already refused such lines (core.params); this is the engine's own guard, so a
    record that reaches an engine some other way is refused, never run without its parameter.
    """
    from airflow_deadline_batch.core.params import check_params

    params = getattr(request, "params", None)
    if not params:
        return None
    problem = check_params(params, "chat" if is_chat(request) else "completion", engine)
    if problem is None:
        return None
    code = UNSUPPORTED_PARAMETER if problem.kind == "unsupported" else "invalid_record"
    return Generation.failed(code, problem.message)


def check_structured(generation: Generation, params: GenerationParams) -> Generation:
    """``generation`` unchanged, or an ``invalid_structured_output`` one when the request asked
    for JSON (``response_format`` json_object / json_schema) and an output is not that JSON.

    Run on every engine's results before commit (the worker calls it), so a success is never a
    completion that breaks the schema it was asked for, whatever the engine guaranteed.
    """
    fmt = params.json_format()
    if fmt is None or generation.output is None:
        return generation
    kind, schema = fmt
    texts = [c.text for c in generation.choices] if generation.choices else [generation.output]
    for index, text in enumerate(texts):
        problem = structured_output_problem(text, kind, schema)
        if problem is not None:
            which = f"choice {index}: " if len(texts) > 1 else ""
            return Generation(
                None,
                GenerationError(INVALID_STRUCTURED_OUTPUT, which + problem),
                generation.prompt_tokens,
                generation.completion_tokens,
            )
    return generation


def structured_output_problem(
    text: str, kind: Literal["json_object", "json_schema"], schema: Mapping[str, Any] | None
) -> str | None:
    """Why ``text`` is not the JSON ``response_format`` asked for, in one line; None when it is."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"the completion is not JSON ({exc}); response_format asked for {kind}"
    if kind == "json_object" or schema is None:
        return None if isinstance(value, dict) else "the completion is JSON but not an object"
    import jsonschema

    try:
        validator_class = jsonschema.validators.validator_for(schema)
        validator_class.check_schema(schema)
        error = jsonschema.exceptions.best_match(validator_class(schema).iter_errors(value))
    except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.UnknownType) as exc:
        return f"the response_format schema is invalid: {str(exc).splitlines()[0]}"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"the completion does not match the json_schema at {where}: {error.message}"
