"""A plan's lease TTL is a number of seconds up to a day (``core.clock.MAX_SECONDS``), as the
worker requires: a job planned with more would be refused by every worker at its claim."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.service.planning import PlanRequest


def request(tmp_path: Path, lease_ttl_s: float) -> PlanRequest:
    return PlanRequest(
        input_uri=str(tmp_path / "in.jsonl"),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        pools=default_local_pools("echo"),
        lease_ttl_s=lease_ttl_s,
    )


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan"), float("inf"), 1e300, 86_400.5])
def test_a_lease_ttl_out_of_range_is_refused_in_one_line(tmp_path: Path, ttl: float) -> None:
    # before: anything in (0, inf) was planned, 1e300 included, and every worker refused the job
    with pytest.raises(
        ConfigurationError, match=r"^lease_ttl_s must be a number of seconds > 0 and <= 86400, got "
    ):
        request(tmp_path, ttl)


@pytest.mark.parametrize("ttl", [0.5, 60.0, 86_400.0])
def test_a_lease_ttl_up_to_a_day_is_planned(tmp_path: Path, ttl: float) -> None:
    assert request(tmp_path, ttl).lease_ttl_s == ttl
