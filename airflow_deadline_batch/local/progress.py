"""A terminal progress bar for ``deadline-batch run``: committed records only (design.md §4.5, inv. 4)."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from airflow_deadline_batch.service.planning import PlanResult
    from airflow_deadline_batch.store import Progress as JobProgress


class ProgressDisplay:
    """Shows committed records against the total; silent when ``enabled`` is false (no TTY)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressDisplay:
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._progress.start()
        return self

    def planned(self, plan: PlanResult) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task(
                f"job {plan.job_id}", total=plan.records + plan.invalid, detail=f"{plan.shards} shards"
            )

    def update(self, progress: JobProgress) -> None:
        if self._progress is None or self._task is None:
            return
        shards = progress.shards_by_state
        done = shards.get("succeeded", 0)
        detail = (
            f"shards {done}/{progress.shards_total}, attempts {progress.attempts}, "
            f"preemptions {progress.preemptions}"
        )
        self._progress.update(
            self._task, completed=progress.committed_records, total=progress.total_records, detail=detail
        )

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
