"""Admission by max flow against degenerate numbers: no exception escapes, reasons stay one line."""

from __future__ import annotations

import datetime as dt
import random

import pytest

from airflow_deadline_batch.core.admission import Demand, SharedPool, edf_test

NOW = dt.datetime(2026, 11, 30, tzinfo=dt.timezone.utc)
WORK = [0.0, 1e-12, 1.0, 3600.0, 1e9, 1e15, 1e300, float("inf")]
OFFSETS_S = [-3600.0, 0.0, 1e-3, 1.0, 3600.0, 86400 * 365 * 100.0, 86400 * 365 * 5000.0]


def _deadline(offset_s: float) -> dt.datetime:
    try:
        return NOW + dt.timedelta(seconds=offset_s)
    except OverflowError:
        return dt.datetime.max.replace(tzinfo=dt.timezone.utc)


def test_huge_work_far_deadlines_and_empty_pools_never_raise() -> None:
    rng = random.Random(7)
    for _ in range(300):
        names = [f"p{k}" for k in range(rng.randint(1, 5))]
        pools = [
            SharedPool(name=n, gpus=rng.choice([0, 1, 8, 2**31 - 1]), lead_s=rng.choice([0.0, 60.0, 1e9]))
            for n in names
        ]

        def demand(j: int, names: list[str] = names) -> Demand:
            return Demand(
                job_id=f"j{j}",
                tenant="ads",
                deadline=_deadline(rng.choice(OFFSETS_S)),
                gpu_seconds=rng.choice(WORK),
                pools=frozenset(rng.sample(names, rng.randint(0, len(names)))),
            )

        new, held = demand(0), [demand(j) for j in range(1, rng.randint(1, 7))]
        result = edf_test(new, held, pools=pools, now=NOW)
        result.to_dict()
        assert all("\n" not in line for line in result.reasons()), result.reasons()


@pytest.mark.parametrize("work", [1e300, float("inf")])
def test_work_beyond_any_calendar_is_refused_without_an_earliest_deadline(work: float) -> None:
    new = Demand(job_id="j", tenant="ads", deadline=NOW + dt.timedelta(hours=1), gpu_seconds=work)
    held = [Demand(job_id="h", tenant="ml", deadline=NOW + dt.timedelta(hours=2), gpu_seconds=work)]
    result = edf_test(new, held, pools=[SharedPool(name="gpu", gpus=1)], now=NOW)
    assert not result.feasible and result.earliest_feasible_deadline is None
    assert result.reasons() and all("\n" not in line for line in result.reasons())


@pytest.mark.parametrize("work", [float("nan"), -1.0])
def test_work_that_is_no_number_of_seconds_is_refused_in_one_line(work: float) -> None:
    with pytest.raises(ValueError, match="gpu_seconds must be >= 0") as raised:
        Demand(job_id="j", tenant="ads", deadline=NOW, gpu_seconds=work)
    assert "\n" not in str(raised.value)
