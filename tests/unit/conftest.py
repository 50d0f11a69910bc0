"""Fixtures shared by the unit tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def transformers_engine() -> Any:
    """The real ``transformers`` engine on CPU, loaded once for every module that needs it
    (de-quantising the GGUF takes 15-40 s on 2 loaded cores); generation leaves it unchanged."""
    from airflow_deadline_batch.worker.engines import get_engine

    engine = get_engine("transformers")
    engine.load()
    return engine
