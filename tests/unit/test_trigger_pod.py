"""``triggers.pod.resume_hold_s``: the hold of a deferred shard pod's event, under clock skew."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_deadline_batch.core.failures import MIN_RESUME_DELAY_S
from airflow_deadline_batch.triggers.pod import resume_hold_s

NOW = 1_800_000_000.0


def test_the_event_is_held_until_the_resume_time():
    assert resume_hold_s(NOW + 3.0, NOW) == pytest.approx(3.0)
    assert resume_hold_s(NOW - 1.0, NOW) == 0.0  # already past: no hold


def test_a_deferring_worker_a_day_ahead_holds_the_event_no_longer_than_the_resume_delay():
    # its resume_after is a day ahead of the triggerer's clock: the pod's end must not wait a day
    assert resume_hold_s(NOW + 86400.0 + MIN_RESUME_DELAY_S, NOW) == MIN_RESUME_DELAY_S


@given(skew=st.floats(min_value=-1e9, max_value=1e9, allow_nan=False))
def test_the_hold_is_within_zero_and_the_resume_delay(skew: float):
    assert 0.0 <= resume_hold_s(NOW + MIN_RESUME_DELAY_S + skew, NOW) <= MIN_RESUME_DELAY_S
