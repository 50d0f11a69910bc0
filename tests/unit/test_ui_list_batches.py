"""The jobs list reads its jobs' rows in batches bounded by input lines (``plugins.progress._batches``):
one read for many small jobs, a large job alone, every job once and in order."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from airflow_deadline_batch.plugins.progress import _batches


def _jobs(*lines: int) -> list[Any]:
    return [SimpleNamespace(job_id=f"j{i}", input_lines=n) for i, n in enumerate(lines)]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ((), []),
        ((10, 20, 30), [[10, 20, 30]]),  # small jobs: one read
        ((60, 50, 10), [[60], [50, 10]]),
        ((500, 10, 10), [[500], [10, 10]]),  # a job over the budget alone
        ((10, 500, 10), [[10], [500], [10]]),
        ((100, 0, 0, 1), [[100, 0, 0], [1]]),  # exactly the budget fits
    ],
)
def test_batches_hold_at_most_the_budget_or_one_large_job(
    lines: tuple[int, ...], expected: list[list[int]]
) -> None:
    jobs = _jobs(*lines)
    batches = list(_batches(jobs, 100))
    assert [[job.input_lines for job in batch] for batch in batches] == expected
    assert [job for batch in batches for job in batch] == jobs
