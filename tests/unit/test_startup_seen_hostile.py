"""A hostile review of the pools' seen starts (``core.job_view.startup_seen_s``, session 23).

Each test states a way the seen starts were wrong and fails on the code before its fix. The rows
are the store's own row types (``store.placement_rows``) with the stamps each case needs.
"""

from __future__ import annotations

import datetime as dt

import pytest

from airflow_deadline_batch.core.job_view import changeover_s, startup_seen_s
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.store.placement_rows import AttemptFacts, CommitFacts
from tests.unit.test_pod_spec import ON_DEMAND, SPOT, T0


def _attempt(pool: str, started: dt.datetime) -> AttemptFacts:
    return AttemptFacts("a1", 0, pool, started, None, AttemptOutcome.RUNNING, None, None)


def _commit(at: dt.datetime, elapsed_s: float = 10.0) -> CommitFacts:
    return CommitFacts("a1", None, 1, 1, 1, elapsed_s, at)


def test_a_start_seen_on_a_pool_named_by_its_kind_raises_the_changeover() -> None:
    """Every other fold of the view resolves an attempt's pool by name, else by kind
    (``core.job_view.pool_index``); the seen starts were looked up by name only, so a worker run
    with ``--pool spot`` taught the changeover nothing (120 s declared, 600 s seen)."""
    seen = startup_seen_s([_attempt("spot", T0)], [_commit(T0 + dt.timedelta(seconds=610))])
    assert seen == {"spot": 600.0}
    assert changeover_s((SPOT, ON_DEMAND), seen) == 600.0
    assert changeover_s((SPOT, ON_DEMAND), {"gpu-spot": 300.0, "spot": 600.0}) == 600.0
    assert changeover_s((SPOT, ON_DEMAND), {"a pool the job no longer has": 5000.0}) == 120.0


def test_a_timezone_naive_stamp_is_named_not_a_type_error() -> None:
    """Rows from a fake or an older store may carry naive datetimes; as the other folds of the
    view, the seen starts name the field instead of failing every decision with ``TypeError``."""
    naive = T0.replace(tzinfo=None)
    with pytest.raises(ValueError, match="started_at must be timezone-aware"):
        startup_seen_s([_attempt(SPOT.name, naive)], [_commit(T0)])
    with pytest.raises(ValueError, match="committed_at must be timezone-aware"):
        startup_seen_s([_attempt(SPOT.name, T0)], [_commit(naive)])


def test_each_attempt_is_timed_from_its_own_claim_to_its_own_first_commit() -> None:
    """What held (a guard): a takeover of an expired lease, a racer or an attempt resumed at a
    later cursor is timed from its own claim to its own first commit, never to another attempt's;
    the plan's validation commit (attempt ``plan``, shard -1) has no attempt row and counts for
    nothing; an attempt that never committed tells nothing."""
    first = AttemptFacts("a1", 0, SPOT.name, T0, T0, AttemptOutcome.LOST_LEASE, None, None)
    takeover = AttemptFacts(
        "a2", 0, SPOT.name, T0 + dt.timedelta(seconds=500), None, AttemptOutcome.RUNNING, None, None
    )
    silent = AttemptFacts("a3", 1, ON_DEMAND.name, T0, None, AttemptOutcome.RUNNING, None, None)
    commits = [
        CommitFacts("a1", SPOT.name, 1, 1, 1, 10.0, T0 + dt.timedelta(seconds=100)),
        CommitFacts("a1", SPOT.name, 1, 1, 1, 10.0, T0 + dt.timedelta(seconds=700)),  # only its first counts
        CommitFacts("a2", SPOT.name, 1, 1, 1, 10.0, T0 + dt.timedelta(seconds=530)),
        CommitFacts("plan", None, 1, 1, 1, 0.0, T0 + dt.timedelta(hours=5)),
    ]
    assert startup_seen_s([first, takeover, silent], commits) == {SPOT.name: 90.0}
