"""Inference engines for the shard worker; each heavy backend is imported only when selected."""

from __future__ import annotations

import importlib
from typing import Any

from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.worker.engines.base import (
    Engine,
    Generation,
    GenerationError,
    GenerationParams,
)

#: engine name -> module holding its ``build(model, options)``
ENGINES: dict[str, str] = {
    "echo": "airflow_deadline_batch.worker.engines.echo",
    "transformers": "airflow_deadline_batch.worker.engines.transformers_engine",
    "vllm": "airflow_deadline_batch.worker.engines.vllm_engine",
    "openai": "airflow_deadline_batch.worker.engines.openai_engine",
}


def get_engine(name: str, model: str | None = None, **options: Any) -> Engine:
    """Build (not load) the named engine; options are engine-specific and may be strings."""
    module = ENGINES.get(name)
    if module is None:
        raise ConfigurationError(f"unknown engine {name!r}; choose one of {', '.join(sorted(ENGINES))}")
    engine: Engine = importlib.import_module(module).build(model, dict(options))
    return engine


def check_engine(name: str, model: str | None = None, **options: Any) -> None:
    """Cheaply check that the named engine can run here: its packages importable, its model present.

    Loads nothing heavy (no torch import, no weights read): ``deadline-batch run`` calls it at
    admission, before a job exists, and refuses with the fix (docs/design.md §8). Raises
    :class:`EngineError` (or ConfigurationError for an unknown engine).
    """
    module = ENGINES.get(name)
    if module is None:
        raise ConfigurationError(f"unknown engine {name!r}; choose one of {', '.join(sorted(ENGINES))}")
    importlib.import_module(module).check(model, dict(options))


__all__ = [
    "ENGINES",
    "Engine",
    "Generation",
    "GenerationError",
    "GenerationParams",
    "check_engine",
    "get_engine",
]
