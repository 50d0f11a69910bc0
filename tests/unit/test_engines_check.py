"""``check_engine``: the cheap admission check of an engine (docs/design.md §8), no model loaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from airflow_deadline_batch.exceptions import ConfigurationError, EngineError
from airflow_deadline_batch.worker.engines import check_engine


def test_echo_always_passes() -> None:
    check_engine("echo")
    check_engine("echo", "any-name", delay_s_per_record="0.1")


def test_unknown_engine_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="unknown engine"):
        check_engine("gpt-17")


def test_transformers_needs_its_model_on_disk(tmp_path: Path) -> None:
    with pytest.raises(EngineError) as info:
        check_engine("transformers", str(tmp_path / "no-such-model"))
    assert info.value.exit_code == 2


def test_transformers_accepts_a_local_model_folder(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        with pytest.raises(EngineError, match="pip install"):
            check_engine("transformers", str(tmp_path))
    else:
        check_engine("transformers", str(tmp_path))


def test_vllm_needs_vllm_and_a_model() -> None:
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(EngineError, match="vLLM"):
            check_engine("vllm", "some/model")
    else:
        with pytest.raises(EngineError, match="--model"):
            check_engine("vllm", None)


def test_openai_needs_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADB_OPENAI_BASE_URL", raising=False)
    with pytest.raises(EngineError, match="base URL"):
        check_engine("openai", "served-model")
    check_engine("openai", "served-model", base_url="http://127.0.0.1:9/v1")
