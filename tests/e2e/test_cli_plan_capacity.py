"""``deadline-batch plan`` prints the capacity math: tokens, GPU-hours per pool, half the window."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.conftest import run_cli
from tests.helpers.inputs import mixed_input


def test_plan_reports_capacity_in_text_and_json(tmp_path: Path) -> None:
    sample = mixed_input(40, seed=3, bad_fraction=0.0).write(tmp_path / "sample.jsonl")
    text = run_cli("plan", str(sample), "--deadline", "+8h", cwd=tmp_path)
    assert text.code == 0, text.describe()
    assert "capacity:" in text.stdout and "tokens in" in text.stdout, text.describe()
    assert "GPU-hours" in text.stdout and "half of it (4h00m)" in text.stdout, text.describe()

    as_json = run_cli("plan", str(sample), "--deadline", "+8h", "--json", cwd=tmp_path)
    assert as_json.code == 0, as_json.describe()
    room = as_json.json()["capacity"]
    work = as_json.json()["report"]["work"]
    assert room["prompt_tokens"] == work["prompt_tokens"] and room["output_tokens"] == work["output_tokens"]
    assert {p["pool"] for p in room["pools"]} == {"local-spot", "local-on-demand"}
    assert all(p["gpu_hours"] > 0 and p["gpus_for_half_window"] >= 1 for p in room["pools"])
