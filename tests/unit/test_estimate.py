"""Token and GPU-time estimates."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.core.estimate import (
    CHAT_PRIMING_TOKENS,
    COMPLETION_OVERHEAD_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    WorkModel,
    WorkSummaryBuilder,
    estimate_prompt_tokens,
    estimate_text_tokens,
    expected_output_tokens,
)
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.records import ErrorCode, LineError, Message, Record, Request


def completion(prompt: str, max_tokens: int | None = None) -> Request:
    return Request("completion", prompt, None, max_tokens, {})


def test_text_heuristic_latin_and_cjk() -> None:
    assert estimate_text_tokens("") == 0
    assert estimate_text_tokens("abcd" * 25) == 25
    assert estimate_text_tokens("abcde") == 2
    assert estimate_text_tokens("日本語のテキスト") == 8  # one token per CJK character
    assert estimate_text_tokens("ab日本") == 1 + 2


def test_heuristic_is_in_the_right_range_for_english() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 20  # ~10 words → ~11-12 real tokens each
    tokens = estimate_text_tokens(text)
    assert 180 <= tokens <= 260


def test_prompt_tokens_add_template_overhead() -> None:
    assert estimate_prompt_tokens(completion("abcd" * 10)) == 10 + COMPLETION_OVERHEAD_TOKENS
    chat = Request("chat", None, (Message("system", "abcd"), Message("user", "abcdabcd")), None, {})
    assert estimate_prompt_tokens(chat) == 1 + 2 + 2 * MESSAGE_OVERHEAD_TOKENS + CHAT_PRIMING_TOKENS


class WordCounter:
    def count(self, text: str) -> int:
        return len(text.split())


def test_token_counter_replaces_heuristic() -> None:
    tokens = estimate_prompt_tokens(completion("one two three"), WordCounter())
    assert tokens == 3 + COMPLETION_OVERHEAD_TOKENS


def test_expected_output_tokens_upper_quantile() -> None:
    assert expected_output_tokens(completion("x", 100), default_max_tokens=256) == 100
    assert expected_output_tokens(completion("x"), default_max_tokens=256) == 256
    assert expected_output_tokens(completion("x", 100), default_max_tokens=256, quantile_fraction=0.35) == 35
    assert expected_output_tokens(completion("x", 1), default_max_tokens=256, quantile_fraction=0.01) == 1
    with pytest.raises(ValueError, match="quantile_fraction"):
        expected_output_tokens(completion("x"), default_max_tokens=256, quantile_fraction=0)
    with pytest.raises(ValueError, match="default_max_tokens"):
        expected_output_tokens(completion("x"), default_max_tokens=0)


def test_work_model_seconds_and_from_pool() -> None:
    model = WorkModel(prefill_tokens_per_s=1000, decode_tokens_per_s=100, per_record_overhead_s=0.5)
    assert model.seconds(2000, 300) == pytest.approx(2 + 3 + 0.5)
    assert model.total_seconds(2000, 300, 4) == pytest.approx(2 + 3 + 2)
    pool = PoolSpec(name="p", kind=PoolKind.SPOT, prefill_tokens_per_s=500, decode_tokens_per_s=50)
    assert WorkModel.from_pool(pool) == WorkModel(500, 50, 0.0)
    with pytest.raises(ValueError):
        WorkModel(0, 1)


def test_builder_accumulates_outcomes() -> None:
    model = WorkModel(prefill_tokens_per_s=10, decode_tokens_per_s=1)
    builder = WorkSummaryBuilder(model, default_max_tokens=8)
    r1 = Record(1, "a", completion("abcd" * 9, max_tokens=4), 50)
    assert builder.add(r1) == pytest.approx(10 / 10 + 4 / 1)
    assert builder.add(None) == 0.0
    assert builder.add(LineError(3, None, ErrorCode.INVALID_JSON, "bad")) == 0.0
    builder.add(Record(4, "b", completion("abcd"), 20))
    summary = builder.build()
    assert (summary.records, summary.invalid, summary.lines) == (2, 1, 4)
    assert (summary.prompt_tokens, summary.output_tokens) == (10 + 2, 4 + 8)
    assert summary.gpu_seconds == pytest.approx(5.0 + 0.2 + 8)
    assert summary.invalid_fraction == pytest.approx(1 / 3)
    assert summary.to_dict()["records"] == 2
