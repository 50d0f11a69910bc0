"""The transformers engine generates real text with the shipped SmolLM2-135M-Instruct GGUF."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_deadline_batch.core.records import Message, Request
from airflow_deadline_batch.worker.engines import GenerationParams

pytestmark = pytest.mark.slow


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
