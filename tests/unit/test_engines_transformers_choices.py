"""The transformers engine's exact text, ``n`` and log probabilities, on the shipped SmolLM2 GGUF."""

from __future__ import annotations

import math
from typing import Any

import pytest

from airflow_deadline_batch.core.records import Message, Request
from airflow_deadline_batch.worker.engines import GenerationParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def engine(transformers_engine: Any) -> Any:
    return transformers_engine  # loaded once for the session (tests/unit/conftest.py)


def test_the_text_is_exactly_what_generate_decodes(engine: Any) -> None:
    """Greedy generation by hand on the engine's own model and tokenizer: the engine's output is
    the decoded new tokens, leading space included (never stripped)."""
    import torch

    prompt = "The three primary colours are"
    (gen,) = engine.generate([Request("completion", prompt, None, 6, {})], GenerationParams())
    tok, model = engine._tokenizer, engine._model  # the same weights, without a second 100 MB load
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    expected = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert gen.output == expected
    assert expected[:1].isspace()  # the case a strip() used to change
    assert gen.finish_reason == "length" and gen.completion_tokens == 6


def test_n_choices_and_logprobs(engine: Any) -> None:
    question = (Message("user", "What is the capital of France? One word."),)
    greedy, sampled = engine.generate(
        [
            Request("chat", None, question, 6, {"n": 2, "logprobs": True, "top_logprobs": 2}),
            Request("completion", "Once upon a time", None, 5, {"n": 3, "temperature": 1.0, "seed": 7}),
        ],
        GenerationParams(),
    )
    assert greedy.ok and greedy.choices is not None and len(greedy.choices) == 2
    first, second = greedy.choices
    assert (first.index, second.index) == (0, 1)
    assert second == first.model_copy(update={"index": 1})  # greedy decoding has one answer
    assert greedy.output == greedy.choices[0].text
    logprobs = greedy.choices[0].logprobs
    assert logprobs is not None and len(logprobs) * 2 == greedy.completion_tokens
    assert "".join(t.token for t in logprobs) == greedy.output  # the tokens join to the text
    for t in logprobs:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        # greedy picks the likeliest token: it is the first alternative, with the same log probability
        assert t.top_logprobs[0].token == t.token and math.isclose(t.top_logprobs[0].logprob, t.logprob)
    assert sampled.ok and sampled.choices is not None
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert all(c.logprobs is None for c in sampled.choices)
    assert (
        sampled.completion_tokens
        == sum(len(engine._tokenizer(c.text, add_special_tokens=False)["input_ids"]) for c in sampled.choices)
        or sampled.completion_tokens <= 15
    )


def test_json_response_format_is_refused_not_run_unconstrained(engine: Any) -> None:
    """No constrained-decoding library is installed, so the table refuses it (core.params); the
    engine's own guard refuses it too, and nothing is generated for that request."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    refused, ran = engine.generate(
        [
            Request("chat", None, (Message("user", "Give JSON"),), 4, {"response_format": schema}),
            Request("chat", None, (Message("user", "Say hi"),), 4, {"response_format": {"type": "text"}}),
        ],
        GenerationParams(),
    )
    assert refused.error is not None and refused.error.code == "unsupported_parameter"
    assert "body.response_format" in refused.error.message and refused.completion_tokens == 0
    assert ran.ok
