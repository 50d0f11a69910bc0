"""Request-body parameters: which engine honours which, the one table (docs/engines.md).

Every parameter of an OpenAI ``/v1/chat/completions`` or ``/v1/completions`` body is either
honoured by the job's engine or refused, per line, at validation time: a line that asks for
something its engine would not do gets the outcome ``errored`` with code ``unsupported_parameter``
naming the parameter, so nothing runs that would come back different from what was asked. A
parameter set to its neutral value (``n: 1``, ``logprobs: false``, ``response_format`` text,
``null``, ...) asks for nothing and is accepted everywhere. Names not in the table are refused.

Per-job defaults (the ``generation`` mapping of the operator and the CLI) follow the same rules:
:func:`check_generation_defaults` names the first one the engine cannot honour.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "ENGINE_NAMES",
    "GENERATION_ONLY",
    "PARAMETERS",
    "ParamProblem",
    "ParamRule",
    "check_generation_defaults",
    "check_params",
]

Endpoint = Literal["chat", "completion"]

#: the engines the table knows (``worker.engines.ENGINES``); any other engine honours only neutral values
ENGINE_NAMES: Final = ("echo", "transformers", "vllm", "openai")

#: body keys that are the request itself, not parameters (read by ``core.records``)
REQUEST_KEYS: Final[Mapping[Endpoint, frozenset[str]]] = {
    "chat": frozenset({"model", "messages", "max_tokens", "max_completion_tokens"}),
    "completion": frozenset({"model", "prompt", "max_tokens", "max_completion_tokens"}),
}


@dataclass(frozen=True, slots=True)
class ParamProblem:
    """Why a parameter cannot run: ``unsupported`` (the engine cannot honour it) or ``invalid``."""

    kind: Literal["unsupported", "invalid"]
    name: str
    message: str


@dataclass(frozen=True, slots=True)
class ParamRule:
    """One body parameter: where it is allowed, its valid values, and what each engine does.

    ``engines`` maps an engine name to how it honours the parameter; an engine absent from it
    refuses every value but the neutral ones, for the reason ``refused``.
    """

    name: str
    endpoints: frozenset[Endpoint]
    valid: Callable[[Any], bool]
    expect: str
    neutral: Callable[[Any], bool]
    engines: Mapping[str, str]
    refused: str
    neutral_doc: str


def _number(lo: float, hi: float, *, open_lo: bool = False) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return False
        return (lo < v if open_lo else lo <= v) and v <= hi

    return check


def _int(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: not isinstance(v, bool) and isinstance(v, int) and lo <= v <= hi


def _stop(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _logit_bias(v: Any) -> bool:
    return isinstance(v, dict) and all(k.isdigit() and _number(-100, 100)(b) for k, b in v.items())


def _response_format(v: Any) -> bool:
    if not isinstance(v, dict):
        return False
    kind = v.get("type")
    if kind in ("text", "json_object"):
        return True
    schema = v.get("json_schema")
    return kind == "json_schema" and isinstance(schema, dict) and isinstance(schema.get("schema"), dict)


def _anything(v: Any) -> bool:
    return True


def _is_none(v: Any) -> bool:
    return v is None


def _none_or(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


_ALL: Final[frozenset[Endpoint]] = frozenset({"chat", "completion"})
_CHAT: Final[frozenset[Endpoint]] = frozenset({"chat"})
_COMPLETION: Final[frozenset[Endpoint]] = frozenset({"completion"})
_NO_EFFECT = "accepted; it does not change the output"
_EVERY = dict.fromkeys(ENGINE_NAMES, _NO_EFFECT)
_ONE_CHOICE = "several outputs / log probabilities are not mapped on this engine yet"


def _rule(
    name: str,
    endpoints: frozenset[Endpoint],
    valid: Callable[[Any], bool],
    expect: str,
    engines: Mapping[str, str],
    *,
    neutral: Callable[[Any], bool] = _is_none,
    refused: str = "",
    neutral_doc: str = "",
) -> ParamRule:
    doc = "`null`" + (f", {neutral_doc}" if neutral_doc else "")
    return ParamRule(name, endpoints, valid, expect, neutral, engines, refused, doc)


#: every body parameter the provider knows, in the order of docs/engines.md
PARAMETERS: Final[Mapping[str, ParamRule]] = {
    r.name: r
    for r in (
        _rule(
            "temperature",
            _ALL,
            _number(0, 2),
            "a number from 0 to 2",
            {
                "vllm": "SamplingParams.temperature",
                "transformers": "generate(do_sample=True, temperature=...); 0 is greedy",
                "openai": "forwarded",
                "echo": "accepted; echo has no sampling",
            },
        ),
        _rule(
            "top_p",
            _ALL,
            _number(0, 1, open_lo=True),
            "a number in (0, 1]",
            {
                "vllm": "SamplingParams.top_p",
                "transformers": "generate(top_p=...) when sampling",
                "openai": "forwarded",
                "echo": "accepted; echo has no sampling",
            },
        ),
        _rule(
            "seed",
            _ALL,
            _int(-(2**63), 2**63 - 1),
            "an integer",
            {
                "vllm": "SamplingParams.seed",
                "transformers": "torch.manual_seed before sampling",
                "openai": "forwarded",
                "echo": "accepted; echo is deterministic",
            },
        ),
        _rule(
            "stop",
            _ALL,
            _stop,
            "a string or a list of strings",
            {
                "vllm": "SamplingParams.stop",
                "transformers": "the text is cut at the first stop string",
                "openai": "forwarded",
                "echo": "the echo is cut at the first stop string",
            },
            neutral=lambda v: v is None or v == [],
            neutral_doc="`[]`",
        ),
        _rule(
            "n",
            _ALL,
            _int(1, 128),
            "an integer from 1 to 128",
            {
                "echo": "n identical echoes (`choices`)",
                "transformers": "generate(num_return_sequences=n) when sampling; greedy: one answer n times",
                "vllm": "SamplingParams.n",
            },
            neutral=_none_or(1),
            neutral_doc="`1`",
            refused=_ONE_CHOICE,
        ),
        _rule(
            "best_of",
            _COMPLETION,
            _int(1, 128),
            "an integer from 1 to 128",
            {},
            neutral=_none_or(1),
            neutral_doc="`1`",
            refused="no engine ranks candidates",
        ),
        _rule(
            "presence_penalty",
            _ALL,
            _number(-2, 2),
            "a number from -2 to 2",
            {
                "vllm": "SamplingParams.presence_penalty",
                "openai": "forwarded",
                "echo": "accepted; echo has no sampling",
            },
            neutral=_none_or(0, 0.0),
            neutral_doc="`0`",
            refused="transformers has no presence penalty (repetition_penalty is a different rule)",
        ),
        _rule(
            "frequency_penalty",
            _ALL,
            _number(-2, 2),
            "a number from -2 to 2",
            {
                "vllm": "SamplingParams.frequency_penalty",
                "openai": "forwarded",
                "echo": "accepted; echo has no sampling",
            },
            neutral=_none_or(0, 0.0),
            neutral_doc="`0`",
            refused="transformers has no frequency penalty (repetition_penalty is a different rule)",
        ),
        _rule(
            "logit_bias",
            _ALL,
            _logit_bias,
            "an object of token id -> number from -100 to 100",
            {
                "vllm": "SamplingParams.logit_bias (token ids of the served model)",
                "openai": "forwarded",
                "echo": "accepted; echo has no sampling",
            },
            neutral=lambda v: v is None or v == {},
            neutral_doc="`{}`",
            refused="not mapped on transformers yet",
        ),
        _rule(
            "logprobs",
            _ALL,
            lambda v: isinstance(v, bool) or _int(0, 20)(v),
            "true/false (chat) or an integer from 0 to 5 (completions)",
            {
                "echo": "every word a token of log probability 0",
                "transformers": "log_softmax of the raw logits (generate(output_logits=True)) of each token",
                "vllm": "SamplingParams.logprobs (completions: the integer; chat: top_logprobs, else 0)",
            },
            neutral=lambda v: v is None or v is False,
            neutral_doc="`false`",
            refused=_ONE_CHOICE,
        ),
        _rule(
            "top_logprobs",
            _CHAT,
            _int(0, 20),
            "an integer from 0 to 20",
            {
                "echo": "the word itself, log probability 0, as its only alternative",
                "transformers": "the k likeliest tokens at each position, from the same logits",
                "vllm": "SamplingParams.logprobs = k",
            },
            refused=_ONE_CHOICE,
        ),
        _rule(
            "response_format",
            _CHAT,
            _response_format,
            'an object with "type" text, json_object or json_schema (with "json_schema.schema")',
            {
                "vllm": "structured outputs: json_object -> any JSON object, json_schema -> that schema; "
                "validated before commit",
                "openai": "forwarded; validated before commit",
                "echo": "the last user message verbatim, validated before commit (a dry run of the check)",
            },
            neutral=lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
            neutral_doc='`{"type": "text"}`',
            refused="no constrained decoding on this engine: the output would not be guaranteed JSON",
        ),
        _rule(
            "stream",
            _ALL,
            lambda v: isinstance(v, bool),
            "true or false",
            {},
            neutral=lambda v: v is None or v is False,
            neutral_doc="`false`",
            refused="a batch never streams",
        ),
        _rule("stream_options", _ALL, _anything, "null", {}, refused="a batch never streams"),
        _rule(
            "echo",
            _COMPLETION,
            lambda v: isinstance(v, bool),
            "true or false",
            {},
            neutral=lambda v: v is None or v is False,
            neutral_doc="`false`",
            refused="the output is the completion only",
        ),
        _rule(
            "suffix",
            _COMPLETION,
            lambda v: isinstance(v, str),
            "a string",
            {},
            neutral=lambda v: v is None or v == "",
            neutral_doc='`""`',
            refused="no engine fills in a suffix",
        ),
        _rule(
            "tools",
            _CHAT,
            _anything,
            "null",
            {},
            neutral=lambda v: v is None or v == [],
            neutral_doc="`[]`",
            refused="a result record carries text only",
        ),
        _rule(
            "tool_choice",
            _CHAT,
            _anything,
            "null",
            {},
            neutral=_none_or("none"),
            neutral_doc='`"none"`',
            refused="a result record carries text only",
        ),
        _rule("parallel_tool_calls", _CHAT, _anything, "null", _EVERY),
        _rule(
            "functions",
            _CHAT,
            _anything,
            "null",
            {},
            neutral=lambda v: v is None or v == [],
            neutral_doc="`[]`",
            refused="a result record carries text only",
        ),
        _rule(
            "function_call",
            _CHAT,
            _anything,
            "null",
            {},
            neutral=_none_or("none"),
            neutral_doc='`"none"`',
            refused="a result record carries text only",
        ),
        _rule(
            "modalities",
            _CHAT,
            _anything,
            '["text"]',
            {},
            neutral=lambda v: v is None or v == ["text"],
            neutral_doc='`["text"]`',
            refused="text output only",
        ),
        _rule("audio", _CHAT, _anything, "null", {}, refused="text output only"),
        _rule("prediction", _CHAT, _anything, "null", {}, refused="predicted outputs are not supported"),
        _rule(
            "reasoning_effort",
            _CHAT,
            lambda v: isinstance(v, str),
            "a string",
            {"openai": "forwarded"},
            refused="only a served reasoning model (openai engine) takes it",
        ),
        _rule(
            "verbosity",
            _CHAT,
            lambda v: isinstance(v, str),
            "a string",
            {"openai": "forwarded"},
            refused="only the openai engine forwards it",
        ),
        _rule("web_search_options", _CHAT, _anything, "null", {}, refused="no engine searches the web"),
        _rule("user", _ALL, lambda v: isinstance(v, str), "a string", _EVERY),
        _rule("metadata", _CHAT, lambda v: isinstance(v, dict), "an object", _EVERY),
        _rule("store", _CHAT, lambda v: isinstance(v, bool), "true or false", _EVERY),
        _rule("service_tier", _ALL, lambda v: isinstance(v, str), "a string", _EVERY),
        _rule("prompt_cache_key", _CHAT, lambda v: isinstance(v, str), "a string", _EVERY),
        _rule("safety_identifier", _CHAT, lambda v: isinstance(v, str), "a string", _EVERY),
    )
}

#: keys of a job's ``generation`` mapping that are job settings, not body parameters
GENERATION_ONLY: Final = frozenset({"max_tokens", "max_completion_tokens"})


def check_params(params: Mapping[str, Any], endpoint: Endpoint, engine: str | None) -> ParamProblem | None:
    """The first parameter of ``params`` that cannot run, or None when every one can.

    ``engine`` None checks names and values only (a re-read of a planned shard); a known engine
    also refuses what it cannot honour; an engine the table does not know honours neutral
    values only.
    """
    for name, value in params.items():
        rule = PARAMETERS.get(name)
        if rule is None or endpoint not in rule.endpoints:
            where = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            return ParamProblem(
                "unsupported", name, f"body.{name} is not a {where} parameter this provider knows; remove it"
            )
        if value is None or rule.neutral(value):
            continue
        if not rule.valid(value):
            return ParamProblem("invalid", name, f"body.{name} must be {rule.expect}")
        if engine is not None and engine not in rule.engines:
            why = f" ({rule.refused})" if rule.refused else ""
            return ParamProblem(
                "unsupported",
                name,
                f"body.{name} is not supported by the {engine} engine{why}; remove it or change engine",
            )
    return None


def check_generation_defaults(generation: Mapping[str, Any], engine: str) -> ParamProblem | None:
    """:func:`check_params` for a job's ``generation`` defaults (they apply to both endpoints)."""
    for name, value in generation.items():
        if name in GENERATION_ONLY:
            continue
        rule = PARAMETERS.get(name)
        endpoint: Endpoint = "chat" if rule is None or "chat" in rule.endpoints else "completion"
        problem = check_params({name: value}, endpoint, engine)
        if problem is not None:
            return ParamProblem(problem.kind, name, problem.message.replace("body.", "generation ", 1))
    return None


def markdown_table() -> str:
    """The table as Markdown, one row a parameter (docs/engines.md holds this text exactly)."""
    head = "| parameter | endpoints | accepted everywhere | " + " | ".join(ENGINE_NAMES) + " |"
    rows = [head, "|" + "---|" * (len(ENGINE_NAMES) + 3)]
    for rule in PARAMETERS.values():
        where = ", ".join(sorted(rule.endpoints))
        cells = [rule.engines.get(e) or f"**refused**: {rule.refused}" for e in ENGINE_NAMES]
        rows.append(f"| `{rule.name}` | {where} | {rule.neutral_doc} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
