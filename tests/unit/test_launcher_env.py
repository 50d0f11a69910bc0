"""The local launcher's worker environment and parent-death signal (docs/design.md §8)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.local.launcher import die_with_parent, worker_environment


def test_the_callers_env_carries_the_real_store_url() -> None:
    env = worker_environment(
        "postgresql+psycopg://u:***@db/x", {"ADB_STORE_URL": "postgresql+psycopg://u:pw@db/x"}
    )
    assert env["ADB_STORE_URL"] == "postgresql+psycopg://u:pw@db/x"
    assert worker_environment("sqlite:////tmp/s.db")["ADB_STORE_URL"] == "sqlite:////tmp/s.db"


def test_a_masked_store_url_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADB_STORE_URL", raising=False)
    with pytest.raises(ConfigurationError, match="masked"):
        worker_environment("postgresql+psycopg://u:***@db/x")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_gets_a_parent_death_signal() -> None:
    preexec = die_with_parent()
    assert preexec is not None
    # the child reads its own parent-death signal back: PR_GET_PDEATHSIG (2)
    code = (
        "import ctypes, signal; v = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); "
        "raise SystemExit(0 if v.value == signal.SIGKILL else 1)"
    )
    assert subprocess.run([sys.executable, "-c", code], preexec_fn=preexec, check=False).returncode == 0
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 1
