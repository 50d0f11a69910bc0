"""Run an example DAG file's source with a listed set of replacements (tests/e2e/dags/ use it).

Each replacement must match exactly once, so an example cannot drift from what a test runs. The
source is compiled under the calling DAG file's name (Airflow records a DAG's ``fileloc`` from the
frame that defines it) and run with ``__file__`` = the example, so paths relative to the example
(its data folder) still resolve.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def derived_source(example: Path, replacements: Sequence[tuple[str, str]]) -> str:
    source = example.read_text()
    for old, new in replacements:
        if source.count(old) != 1:
            raise ValueError(f"{example.name} no longer holds {old!r} exactly once; update the test DAG")
        source = source.replace(old, new)
    return source


def run_derived(
    example: Path, replacements: Sequence[tuple[str, str]], *, dag_file: str, into: dict[str, Any]
) -> None:
    """Execute the derived example; its module-level names (``dag`` among them) land in ``into``."""
    namespace: dict[str, Any] = {"__name__": into.get("__name__", "derived_dag"), "__file__": str(example)}
    exec(compile(derived_source(example, replacements), dag_file, "exec"), namespace)  # noqa: S102
    into.update({k: v for k, v in namespace.items() if not k.startswith("__")})
