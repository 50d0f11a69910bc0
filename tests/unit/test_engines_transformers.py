"""The transformers engine on the shipped SmolLM2-135M-Instruct GGUF: real text, its exact decoding,
``n`` choices and log probabilities.

One file, so that one test process loads the model (15-45 s on two loaded cores) for all of them:
``scripts/test.sh`` hands whole files to its processes (``--dist loadfile``).
"""

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


def test_transformers_generates_real_text_for_chat_and_completion(engine) -> None:  # type: ignore[no-untyped-def]
    requests = [
        Request(
            "chat", None, (Message("user", "What is the capital of France? Answer in one word."),), 8, {}
        ),
        Request("completion", "The three primary colours are", None, None, {}),
    ]
    out = engine.generate(requests, GenerationParams(max_tokens=12))
    assert len(out) == 2
    for generation in out:
        assert generation.ok and generation.output and generation.output.strip()
        assert generation.prompt_tokens > 3
        assert 0 < generation.completion_tokens <= 12
    assert out[0].completion_tokens <= 8  # the request's own max_tokens wins
    assert "paris" in out[0].output.lower()  # type: ignore[union-attr]
    assert "The three primary colours are" not in out[1].output  # type: ignore[operator]
    assert engine.model_name == "SmolLM2-135M-Instruct"
    assert len(engine.model_digest) == 64


@pytest.mark.parametrize(
    ("device", "bf16", "dtype"),
    [
        ("cpu", False, "float32"),
        ("cuda", True, "bfloat16"),
        ("cuda:1", False, "float16"),
        ("cpu", True, "float32"),
    ],
)
def test_the_model_runs_in_half_precision_on_a_gpu_only(device: str, bf16: bool, dtype: str) -> None:
    from airflow_deadline_batch.worker.engines.transformers_engine import working_dtype

    assert working_dtype(device, bf16) == dtype


def test_on_the_cpu_the_loaded_model_stays_in_float32(engine) -> None:  # type: ignore[no-untyped-def]
    import torch

    assert next(engine._model.parameters()).dtype == torch.float32


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
