"""``DeadlineWeightStrategy``: earliest deadline weighs most, and a weight always comes back."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any

from airflow_deadline_batch.plugins.priority import (
    MAX_WEIGHT,
    WEIGHT_ANCHOR,
    DeadlineWeightStrategy,
    deadline_weight,
)

UTC = dt.timezone.utc


def test_a_minute_sooner_weighs_one_more_and_weights_stay_in_range() -> None:
    deadline = dt.datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
    assert deadline_weight(deadline - dt.timedelta(minutes=1)) == deadline_weight(deadline) + 1
    assert deadline_weight(deadline, base=10) == deadline_weight(deadline) + 9
    assert deadline_weight(WEIGHT_ANCHOR + dt.timedelta(days=1), base=3) == 3
    assert deadline_weight(dt.datetime(1, 1, 1, tzinfo=UTC)) <= MAX_WEIGHT


def _ti(dag: Any, priority_weight: Any = 5) -> Any:
    task = SimpleNamespace(priority_weight=priority_weight, upstream_task_ids={"plan"}, dag=dag)
    return SimpleNamespace(task=task, run_id="r", dag_id="d", map_index=-1)


class _Dag:
    def __init__(self, deadline: Any) -> None:
        self.deadline = deadline

    def get_task(self, task_id: str) -> Any:
        if isinstance(self.deadline, Exception):
            raise self.deadline
        return SimpleNamespace(deadline=self.deadline)


def test_a_literal_plan_deadline_ranks_a_task_before_the_plan_ran() -> None:
    strategy = DeadlineWeightStrategy()
    at = dt.datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
    assert strategy.get_weight(_ti(_Dag("2026-12-01T06:00:00Z"))) == deadline_weight(at, 5)  # type: ignore[arg-type]
    soon = strategy.get_weight(_ti(_Dag("+1h")))  # type: ignore[arg-type]
    late = strategy.get_weight(_ti(_Dag("+3h")))  # type: ignore[arg-type]
    assert soon - late in range(119, 122)


def test_whatever_goes_wrong_the_fixed_weight_comes_back() -> None:
    strategy = DeadlineWeightStrategy()
    for dag in (_Dag("{{ params.deadline }}"), _Dag("not a deadline"), _Dag(RuntimeError("db gone")), None):
        assert strategy.get_weight(_ti(dag)) == 5  # type: ignore[arg-type]
    assert strategy.get_weight(_ti(None, priority_weight="heavy")) == 1  # type: ignore[arg-type]
    assert strategy.get_weight(SimpleNamespace()) == 1  # type: ignore[arg-type]


def test_a_fixed_weight_out_of_the_32_bit_range_is_clamped_into_it() -> None:
    deadline = dt.datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
    assert deadline_weight(deadline, base=2**40) == MAX_WEIGHT
    assert deadline_weight(WEIGHT_ANCHOR + dt.timedelta(days=1), base=-(2**40)) == -MAX_WEIGHT - 1
    assert DeadlineWeightStrategy().get_weight(_ti(_Dag(deadline), priority_weight=2**40)) == MAX_WEIGHT
