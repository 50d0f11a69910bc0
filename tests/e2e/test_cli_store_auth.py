"""``deadline-batch run`` on a PostgreSQL store whose role logs in with a password (scram-sha-256).

The runner's own store shows a masked URL (``user:***@host``); the workers must get the real one,
by environment and never in argv or a log (docs/design.md §8), or they never log in.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import run_cli
from tests.helpers.inputs import mixed_input
from tests.helpers.outcomes import assert_outcomes_match, read_manifest, read_outcomes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_run_with_a_password_protected_postgresql_store(pg_password_store_url: str, tmp_path: Path) -> None:
    password = pg_password_store_url.split(":", 2)[2].split("@", 1)[0]
    mixed = mixed_input(80, seed=3, bad_fraction=0.0)
    path = mixed.write(tmp_path / "input.jsonl")
    out = tmp_path / "out"
    result = run_cli(
        "run", str(path), "--deadline", "+1h", "--engine", "echo", "--workers", "2",
        "--store", pg_password_store_url, "--output", str(out), "--json",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.code == 0, result.describe()
    summary = result.json()
    assert summary["state"] == "completed" and summary["deadline_met"] is True, summary
    assert_outcomes_match(read_outcomes(read_manifest(summary["manifest"])), mixed)
    for text in (result.stdout, result.stderr, (out / "worker.log").read_text()):
        assert password not in text
