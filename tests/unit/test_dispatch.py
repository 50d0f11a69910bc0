"""The dispatch rule (core.dispatch): least slack first within weighted fair shares."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.dispatch import (
    DispatchRequest,
    GrantReason,
    fair_shares,
    next_grant,
    plan_grants,
)

TENANTS = ("ads", "search", "ml")


def _req(
    tenant: str, latest_start: float, job: str = "j", shard: int = 0, at: float = 0.0
) -> DispatchRequest:
    return DispatchRequest(
        job_id=job, shard_index=shard, tenant=tenant, latest_start=latest_start, requested_at=at
    )


def test_an_urgent_job_of_one_tenant_cannot_take_the_other_tenants_share() -> None:
    # search holds nothing and waits with relaxed work; ads holds 2 of 3 and has an urgent job
    waiting = [_req("ads", 10.0, "urgent"), _req("search", 500.0, "old")]
    grant = next_grant(3, {"ads": 2}, {"ads": 2.0, "search": 1.0}, waiting)
    assert grant is not None and grant.request.job_id == "old"
    assert grant.reason is GrantReason.BELOW_SHARE
    assert grant.shares == {"ads": 2.0, "search": 1.0}


def test_below_share_tenants_go_by_least_slack_and_a_full_share_still_gets_idle_slots() -> None:
    waiting = [_req("ads", 30.0, "a"), _req("search", 20.0, "s"), _req("search", 5.0, "s2")]
    # 2 slots, equal weights: search's most urgent first, then search is at its share and ads is not
    grants = plan_grants(2, {}, {}, waiting)
    assert [g.request.job_id for g in grants] == ["s2", "a"]
    assert [g.reason for g in grants] == [GrantReason.BELOW_SHARE] * 2
    # 4 slots: both stay below their share of 2 throughout, so it is least slack first
    assert [g.request.job_id for g in plan_grants(4, {}, {}, waiting)] == ["s2", "s", "a"]
    # search holds its share (2 of 4, equal weights), ads holds 1 and waits for nothing: the idle
    # slot still goes to search (work-conserving)
    grant = next_grant(4, {"search": 2, "ads": 1}, {}, [_req("search", 1.0)])
    assert grant is not None and grant.reason is GrantReason.WORK_CONSERVING


def test_ties_go_to_the_earliest_request_then_job_then_shard() -> None:
    waiting = [
        _req("ads", 1.0, "b", 0, at=5.0),
        _req("ads", 1.0, "b", 1, at=4.0),
        _req("ads", 1.0, "a", 3, at=4.0),
    ]
    assert [(g.request.job_id, g.request.shard_index) for g in plan_grants(3, {}, {}, waiting)] == [
        ("a", 3),
        ("b", 1),
        ("b", 0),
    ]


def test_nothing_is_granted_without_a_free_slot() -> None:
    assert next_grant(2, {"ads": 2}, {}, [_req("search", 0.0)]) is None
    assert next_grant(0, {}, {}, [_req("search", 0.0)]) is None
    assert fair_shares(6, {"ads": 2.0, "x": -1.0}, ["ads", "search"]) == {"ads": 4.0, "search": 2.0}


requests = st.lists(
    st.builds(
        _req,
        st.sampled_from(TENANTS),
        st.floats(0, 1000, allow_nan=False),
        st.sampled_from(["j1", "j2", "j3"]),
        st.integers(0, 50),
        st.floats(0, 100, allow_nan=False),
    ),
    max_size=25,
    unique_by=lambda r: (r.job_id, r.shard_index),
)


@settings(max_examples=300, deadline=None)
@given(
    slots=st.integers(0, 8),
    held=st.dictionaries(st.sampled_from(TENANTS), st.integers(0, 4)),
    weights=st.dictionaries(st.sampled_from(TENANTS), st.floats(0.1, 10)),
    waiting=requests,
)
def test_the_rule_never_overfills_serves_below_share_first_and_least_slack_within_a_tenant(
    slots: int, held: dict[str, int], weights: dict[str, float], waiting: list[DispatchRequest]
) -> None:
    grants = plan_grants(slots, held, weights, waiting)
    free = max(0, slots - sum(held.values()))
    # work-conserving and never over capacity
    assert len(grants) == min(free, len(waiting))
    assert len({(g.request.job_id, g.request.shard_index) for g in grants}) == len(grants)
    for grant in grants:
        below = [t for t, r in grant.best.items() if grant.held.get(t, 0) < grant.shares[t]]
        if below:
            # a tenant below its share with waiting work is served before any tenant at or above it
            assert grant.request.tenant in below and grant.reason is GrantReason.BELOW_SHARE
            assert grant.request.key == min(grant.best[t].key for t in below)
        else:
            assert grant.request.key == min(r.key for r in grant.best.values())
    # within a tenant, least slack first
    for tenant in TENANTS:
        mine = [g.request for g in grants if g.request.tenant == tenant]
        expected = sorted((r for r in waiting if r.tenant == tenant), key=lambda r: r.key)[: len(mine)]
        assert mine == expected


@settings(max_examples=100, deadline=None)
@given(
    slots=st.integers(1, 12),
    w_ads=st.integers(1, 4),
    w_search=st.integers(1, 4),
)
def test_two_backlogged_tenants_hold_their_weighted_shares(slots: int, w_ads: int, w_search: int) -> None:
    """Slots freed one by one and refilled by the rule settle at the weighted shares (±1 slot)."""
    weights = {"ads": float(w_ads), "search": float(w_search)}
    held = {"ads": slots, "search": 0}  # ads grabbed the whole pool before search arrived
    backlog = [_req(t, float(i), t, i) for i in range(200) for t in ("ads", "search")]
    for step in range(4 * slots):
        victim = "ads" if step % 2 == 0 and held["ads"] else ("search" if held["search"] else "ads")
        held[victim] -= 1  # some worker ends
        grant = next_grant(slots, held, weights, backlog)
        assert grant is not None
        held[grant.request.tenant] += 1
        backlog.remove(grant.request)
    share = slots * w_ads / (w_ads + w_search)
    assert abs(held["ads"] - share) <= 1.0


def test_huge_and_tiny_weights_still_split_the_pool_by_ratio() -> None:
    # two weights of 1e308 sum to inf: the shares must not collapse to 0 (nobody below share)
    assert fair_shares(4, {"a": 1e308, "b": 1e308}, ["a", "b"]) == {"a": 2.0, "b": 2.0}
    shares = fair_shares(3, {"a": 1e308, "b": 1e308, "c": 5e-324}, ["a", "b", "c"])
    assert shares["a"] == shares["b"] == 1.5 and shares["c"] >= 0.0
