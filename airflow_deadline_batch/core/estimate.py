"""Token and GPU-time estimates of the work in a batch (docs/design.md §5).

Without a tokenizer, prompt tokens come from a calibrated heuristic (about one token per four
bytes of ASCII text, one per character otherwise, which covers CJK and errs high for accented
Latin). Output tokens are an upper quantile of the record's budget, not a mean, because output
lengths are heavy-tailed and a deadline is missed by the tail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from airflow_deadline_batch.core.pools import PoolSpec
from airflow_deadline_batch.core.records import LineError, Record, Request

__all__ = [
    "CHAT_PRIMING_TOKENS",
    "COMPLETION_OVERHEAD_TOKENS",
    "MESSAGE_OVERHEAD_TOKENS",
    "TokenCounter",
    "WorkModel",
    "WorkSummary",
    "WorkSummaryBuilder",
    "estimate_prompt_tokens",
    "estimate_text_tokens",
    "estimate_texts_tokens",
    "expected_output_tokens",
]

#: chat-template tokens around each message (role markers, separators)
MESSAGE_OVERHEAD_TOKENS = 4
#: tokens that open the assistant's turn after the last message
CHAT_PRIMING_TOKENS = 3
#: a beginning-of-sequence token for plain completions
COMPLETION_OVERHEAD_TOKENS = 1


class TokenCounter(Protocol):
    """Counts tokens with the job's real tokenizer; replaces the heuristic when given."""

    def count(self, text: str) -> int: ...


def estimate_text_tokens(text: str) -> int:
    """Heuristic token count of ``text``: ceil(ASCII chars / 4) + one per non-ASCII char."""
    if text.isascii():
        return (len(text) + 3) // 4
    ascii_chars = len(text.encode("ascii", "ignore"))
    return (ascii_chars + 3) // 4 + (len(text) - ascii_chars)


def estimate_prompt_tokens(request: Request, counter: TokenCounter | None = None) -> int:
    """Prompt tokens of ``request``, including chat-template overhead per message."""
    count = counter.count if counter is not None else estimate_text_tokens
    if request.prompt is not None:
        return count(request.prompt) + COMPLETION_OVERHEAD_TOKENS
    messages = request.messages or ()
    overhead = MESSAGE_OVERHEAD_TOKENS * len(messages) + CHAT_PRIMING_TOKENS
    return sum(count(m.content) for m in messages) + overhead


def estimate_texts_tokens(texts: str | Sequence[str]) -> int:
    """:func:`estimate_prompt_tokens` without a tokenizer, from a prompt (str) or chat contents.

    The planner's fast path gets texts from :func:`~airflow_deadline_batch.core.records.quick_parse`
    rather than a :class:`Request`; the numbers are the same.
    """
    if isinstance(texts, str):
        return estimate_text_tokens(texts) + COMPLETION_OVERHEAD_TOKENS
    return sum(map(estimate_text_tokens, texts)) + MESSAGE_OVERHEAD_TOKENS * len(texts) + CHAT_PRIMING_TOKENS


def expected_output_tokens(
    request: Request, *, default_max_tokens: int, quantile_fraction: float = 1.0
) -> int:
    """Output tokens to plan for: ``quantile_fraction`` of the record's budget, at least one.

    1.0 (the default) assumes every record uses its whole ``max_tokens``; a job calibrated on
    observed lengths passes the ratio of, say, the p95 output length to the budget.
    """
    if default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
    if not 0.0 < quantile_fraction <= 1.0:
        raise ValueError(f"quantile_fraction must be in (0, 1], got {quantile_fraction}")
    budget = request.max_tokens if request.max_tokens is not None else default_max_tokens
    return max(1, math.ceil(budget * quantile_fraction))


@dataclass(frozen=True, slots=True)
class WorkModel:
    """Per-GPU service rates that turn tokens into GPU-seconds."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    per_record_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_tokens_per_s <= 0:
            raise ValueError("WorkModel token rates must be > 0 tokens per second")
        if self.per_record_overhead_s < 0:
            raise ValueError("WorkModel.per_record_overhead_s must be >= 0")

    def seconds(self, prompt_tokens: int, output_tokens: int) -> float:
        """GPU-seconds for one record."""
        return (
            prompt_tokens / self.prefill_tokens_per_s
            + output_tokens / self.decode_tokens_per_s
            + self.per_record_overhead_s
        )

    def total_seconds(self, prompt_tokens: int, output_tokens: int, records: int) -> float:
        """GPU-seconds for many records given their token totals (the rates are linear)."""
        return (
            prompt_tokens / self.prefill_tokens_per_s
            + output_tokens / self.decode_tokens_per_s
            + records * self.per_record_overhead_s
        )

    @classmethod
    def from_pool(cls, pool: PoolSpec, per_record_overhead_s: float = 0.0) -> WorkModel:
        """The rates measured for ``pool``'s GPUs."""
        return cls(pool.prefill_tokens_per_s, pool.decode_tokens_per_s, per_record_overhead_s)


@dataclass(frozen=True, slots=True)
class WorkSummary:
    """The work in one batch: counts, token totals and GPU-seconds under one :class:`WorkModel`.

    ``lines`` counts every input line (blank ones too), ``invalid`` the lines that became errors.
    """

    records: int
    invalid: int
    lines: int
    prompt_tokens: int
    output_tokens: int
    gpu_seconds: float

    @property
    def invalid_fraction(self) -> float:
        """Invalid lines over non-blank lines (0 for an empty input)."""
        outcomes = self.records + self.invalid
        return self.invalid / outcomes if outcomes else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "records": self.records,
            "invalid": self.invalid,
            "lines": self.lines,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "gpu_seconds": self.gpu_seconds,
        }


class WorkSummaryBuilder:
    """Accumulate a :class:`WorkSummary` while streaming the validator's outcomes."""

    def __init__(
        self,
        work_model: WorkModel,
        *,
        default_max_tokens: int,
        quantile_fraction: float = 1.0,
        counter: TokenCounter | None = None,
    ) -> None:
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
        if not 0.0 < quantile_fraction <= 1.0:
            raise ValueError(f"quantile_fraction must be in (0, 1], got {quantile_fraction}")
        self.work_model = work_model
        self.default_max_tokens = default_max_tokens
        self.quantile_fraction = quantile_fraction
        self.counter = counter
        self.records = self.invalid = self.lines = self.prompt_tokens = self.output_tokens = 0
        self.gpu_seconds = 0.0

    def add(self, outcome: Record | LineError | None) -> float:
        """Count one line's outcome; return the record's estimated GPU-seconds (0 for non-records)."""
        self.lines += 1
        if outcome is None:
            return 0.0
        if isinstance(outcome, LineError):
            self.invalid += 1
            return 0.0
        prompt = estimate_prompt_tokens(outcome.request, self.counter)
        output = expected_output_tokens(
            outcome.request,
            default_max_tokens=self.default_max_tokens,
            quantile_fraction=self.quantile_fraction,
        )
        seconds = self.work_model.seconds(prompt, output)
        self.records += 1
        self.prompt_tokens += prompt
        self.output_tokens += output
        self.gpu_seconds += seconds
        return seconds

    def build(self) -> WorkSummary:
        return WorkSummary(
            records=self.records,
            invalid=self.invalid,
            lines=self.lines,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            gpu_seconds=self.gpu_seconds,
        )
