"""A deterministic engine with no model: the fast default for tests and dry runs."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_deadline_batch.core.results import Choice, FinishReason, TokenLogprob, TopLogprob
from airflow_deadline_batch.worker.engines.base import (
    ENGINE_ERROR,
    Generation,
    GenerationParams,
    option_float,
    prompt_text,
    refusal,
    text_digest,
    truncate_at_stop,
)

if TYPE_CHECKING:
    from airflow_deadline_batch.core.records import Request

#: a prompt containing this marker yields an errored Generation, to exercise per-record errors
FAIL_MARKER = "__adb_fail_record__"


class EchoEngine:
    """Echoes the last user message (``"echo: " + words``, cut at the request's max_tokens words
    and at its first stop string).

    Echo has no model, so sampling parameters (temperature, penalties, logit_bias, ...) are
    accepted and have nothing to act on. ``n`` gives n identical choices; ``logprobs`` makes
    every word a token of log probability 0 (certain), with itself as its only alternative. With
    a JSON ``response_format`` the last user message comes back verbatim (no ``echo:`` prefix),
    so a test or a dry run decides whether the completion conforms; the worker validates it
    like any engine's (``invalid_structured_output``).

    Option ``delay_s_per_record`` (or env ``ADB_ECHO_DELAY_S``) makes each record take real time,
    so tests can interrupt a worker in the middle of a microbatch. Option ``delay_file`` (or env
    ``ADB_ECHO_DELAY_FILE``) names a file holding that delay, read again for every microbatch:
    writing a larger number into it slows every running worker on cue (a throughput drop).
    Option ``load_s`` (or env ``ADB_ECHO_LOAD_S``) makes :meth:`load` take that long, as a model's
    load does, so tests can show what a slow start does.
    """

    name = "echo"

    def __init__(
        self,
        model: str | None = None,
        *,
        delay_s_per_record: float = 0.0,
        delay_file: str | None = None,
        load_s: float = 0.0,
    ) -> None:
        if delay_s_per_record < 0:
            raise ValueError(f"delay_s_per_record must be >= 0, got {delay_s_per_record}")
        if not 0 <= load_s <= 3600:
            raise ValueError(f"load_s must be from 0 to 3600 seconds, got {load_s}")
        self.load_s = load_s
        self._model = model or "echo-v1"
        self.delay_s_per_record = delay_s_per_record
        self.delay_file = Path(delay_file) if delay_file else None
        if self.delay_file is not None:
            self._read_delay()  # a missing or unreadable file is a configuration error, now

    def _read_delay(self) -> float:
        assert self.delay_file is not None
        try:
            delay = float(self.delay_file.read_text().strip() or 0)
        except (OSError, ValueError) as exc:
            raise ValueError(f"echo delay_file {self.delay_file}: {exc}; write a number of seconds") from exc
        if not delay >= 0:
            raise ValueError(f"echo delay_file {self.delay_file} holds {delay}; write a number >= 0")
        return delay

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def model_digest(self) -> str:
        return text_digest("echo-v1")

    def load(self) -> None:
        """Nothing to load; ``load_s`` of simulated loading."""
        if self.load_s:
            time.sleep(self.load_s)  # simulated loading, not synchronisation

    def generate(self, requests: Sequence[Request], params: GenerationParams) -> list[Generation]:
        results = []
        delay = self._read_delay() if self.delay_file is not None else self.delay_s_per_record
        for request in requests:
            if delay:
                time.sleep(delay)  # simulated work, not synchronisation
            refused = refusal(request, self.name)
            results.append(refused or echo_one(request, params.for_request(request)))
        return results


def echo_one(request: Request, params: GenerationParams) -> Generation:
    """The echo of one request; pure, so the same input always gives the same output."""
    text = prompt_text(request)
    prompt_tokens = len(text.split())
    if FAIL_MARKER in text:
        return Generation.failed(ENGINE_ERROR, "echo engine: the prompt asked to fail", prompt_tokens)
    if params.json_format() is not None:
        output, finish = _verbatim(text, params)
    else:
        words = ["echo:", *text.split()]
        finish = "length" if len(words) > params.max_tokens else "stop"
        output = truncate_at_stop(" ".join(words[: params.max_tokens]), params.stop)
    tokens = len(output.split())
    if params.n == 1 and not params.logprobs:
        return Generation(output, None, prompt_tokens, tokens, finish_reason=finish)
    logprobs = _certain_logprobs(output, params.top_logprobs) if params.logprobs else None
    choices = tuple(
        Choice(index=i, text=output, finish_reason=finish, logprobs=logprobs) for i in range(params.n)
    )
    return Generation(output, None, prompt_tokens, tokens * params.n, finish_reason=finish, choices=choices)


def _verbatim(text: str, params: GenerationParams) -> tuple[str, FinishReason]:
    """The text itself, cut after ``max_tokens`` words (whitespace kept) and at a stop string."""
    finish: FinishReason = "stop"
    words = list(re.finditer(r"\S+", text))
    if len(words) > params.max_tokens:
        text, finish = text[: words[params.max_tokens - 1].end()], "length"
    return truncate_at_stop(text, params.stop), finish


def _certain_logprobs(output: str, top: int) -> tuple[TokenLogprob, ...]:
    """Each word a token (with its leading space, so the tokens join to the text), log prob 0."""
    tokens = re.findall(r"\s*\S+", output)
    return tuple(
        TokenLogprob(token=t, logprob=0.0, top_logprobs=(TopLogprob(token=t, logprob=0.0),) if top else ())
        for t in tokens
    )


def build(model: str | None, options: dict[str, Any]) -> EchoEngine:
    return EchoEngine(
        model,
        delay_s_per_record=option_float(options, "delay_s_per_record", 0.0, env="ADB_ECHO_DELAY_S"),
        delay_file=str(options.get("delay_file") or os.environ.get("ADB_ECHO_DELAY_FILE") or "") or None,
        load_s=option_float(options, "load_s", 0.0, env="ADB_ECHO_LOAD_S"),
    )


def check(model: str | None, options: dict[str, Any]) -> None:
    """The echo engine needs nothing; its options must parse."""
    build(model, options)
