"""The placement view's fast path builds the same view, and so the same decisions, as the plain fold.

``operators.placement.job_view_of`` finds a job's finished Spot tries once and folds them on plain
numbers (``SpotTries.observe_all``, ``PoolAvailability.observe_all``, ``Calibration.observe_all``),
resolves pools through one dictionary and folds a shard's tries only when read. The reference
below is the view as it was built before (each row resolved by ``pool_named``, each try folded by
``observe`` / ``observe_rate`` one at a time, every shard's tries folded up front), kept here as
the specification: for random jobs (pools named by name or by kind, unknown pools, every outcome,
running tries, racers, commits under any attempt, clocks in UTC and not) every field of the two
views is equal, exactly, and every shard's decision is the same.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.calibration import (
    Calibration,
    PoolAvailability,
    PoolHistory,
    RateSample,
    SpotTries,
    availability_prior,
    completion_share,
    gave_up_waiting,
    spot_prior,
)
from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.job_view import (
    JobView,
    _work_scale,
    pool_named,
    shard_done_fraction,
)
from airflow_deadline_batch.core.placement import DEFAULT_POLICY
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import (
    PREEMPTION_OUTCOMES,
    UNRUN_ATTEMPT_OUTCOMES,
    AttemptOutcome,
    JobState,
    ShardState,
)
from airflow_deadline_batch.operators.placement import (
    PlacementView,
    decide_for_try,
    job_view_of,
    parse_pools,
)

UTC = dt.timezone.utc
NOW = dt.datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
ZONES = (UTC, UTC, UTC, dt.timezone(dt.timedelta(hours=2)), dt.timezone(dt.timedelta(hours=-5)))


@dataclasses.dataclass(frozen=True)
class Job:
    job_id: str
    state: JobState
    deadline: dt.datetime
    created_at: dt.datetime
    completed_at: dt.datetime | None
    input_lines: int
    config: Mapping[str, Any]
    tenant: str = "default"


@dataclasses.dataclass(frozen=True)
class Shard:
    shard_index: int
    state: ShardState
    est_work_s: float
    num_microbatches: int
    cursor: int
    last_pool: str | None
    lease_attempt_id: str | None = None
    race_attempt_id: str | None = None
    last_error: str | None = None


@dataclasses.dataclass(frozen=True)
class Attempt:
    attempt_id: str
    shard_index: int
    pool: str | None
    started_at: dt.datetime
    ended_at: dt.datetime | None
    outcome: AttemptOutcome
    heartbeat_at: dt.datetime | None
    failure_class: str | None


@dataclasses.dataclass(frozen=True)
class Commit:
    attempt_id: str
    pool: str | None
    records: int
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float
    committed_at: dt.datetime


# -- the reference: the view as it was built before, one row and one observation at a time ------


def reference_spot_tries(
    attempts: Sequence[Attempt], commits: Sequence[Commit], pools: Sequence[PoolSpec]
) -> tuple[SpotTries, dict[int, SpotTries]]:
    declared = max((p.preemptions_per_hour for p in pools if p.kind is PoolKind.SPOT), default=0.0)
    job = SpotTries(prior_per_hour=declared)
    shards: dict[int, SpotTries] = {}
    finished = []
    for attempt in attempts:
        pool = pool_named(attempt.pool, pools)
        if attempt.ended_at is None or pool is None or pool.kind is not PoolKind.SPOT:
            continue
        if attempt.outcome in UNRUN_ATTEMPT_OUTCOMES:
            continue
        finished.append(attempt)
    per_attempt: dict[str, int] = {}
    for commit in commits:
        per_attempt[commit.attempt_id] = per_attempt.get(commit.attempt_id, 0) + 1
    for attempt in sorted(finished, key=lambda a: ensure_aware(a.ended_at or a.started_at)):
        ended = ensure_aware(attempt.ended_at or attempt.started_at)
        duration = (ended - ensure_aware(attempt.started_at)).total_seconds()
        # a crash (the launcher's class for a death it did not cause) is no preemption
        crashed = attempt.failure_class in ("deterministic", "configuration")
        preempted = AttemptOutcome(attempt.outcome) in PREEMPTION_OUTCOMES and not crashed
        done = per_attempt.get(attempt.attempt_id, 0)
        job = job.observe(ended_s=ended.timestamp(), duration_s=duration, preempted=preempted, commits=done)
        before = shards.get(attempt.shard_index, SpotTries(prior_per_hour=declared))
        shards[attempt.shard_index] = before.observe(
            ended_s=ended.timestamp(), duration_s=duration, preempted=preempted, commits=done
        )
    return job, shards


def reference_calibration(pools: Sequence[PoolSpec], commits: Sequence[Commit]) -> Calibration:
    samples = []
    for commit in sorted(commits, key=lambda c: c.committed_at):
        pool = pool_named(commit.pool, pools)
        if pool is not None:
            samples.append(
                RateSample(
                    pool.name,
                    commit.records,
                    commit.prompt_tokens,
                    commit.completion_tokens,
                    commit.elapsed_s,
                )
            )
    calibration = Calibration.from_specs(pools, completion_share(samples))
    for sample in samples:
        calibration = calibration.observe_rate(sample)
    return calibration


def reference_view(
    job: Job,
    shards: Sequence[Shard],
    commits: Sequence[Commit],
    attempts: Sequence[Attempt],
    history: Mapping[str, PoolHistory],
) -> PlacementView:
    pools = parse_pools(None, job.config)
    calibration = reference_calibration(pools, commits)
    scale = _work_scale(calibration, pools)
    shard_work: dict[int, float] = {}
    last_kinds: dict[int, PoolKind | None] = {}
    committed = 0.0
    for shard in shards:
        done = shard_done_fraction(shard)
        work = max(0.0, float(shard.est_work_s)) * scale
        committed += work * done
        if done < 1.0:
            shard_work[shard.shard_index] = work * (1.0 - done)
        last = pool_named(shard.last_pool, pools)
        last_kinds[shard.shard_index] = last.kind if last is not None else None
    pool_of = {a.attempt_id: a.pool for a in attempts}
    on_demand: set[int] = set()
    on_spot: set[int] = set()
    for shard in shards:
        if shard.state is not ShardState.LEASED:
            continue
        holders = [pool_of.get(shard.lease_attempt_id or "", shard.last_pool)]
        if shard.race_attempt_id is not None:
            holders.append(pool_of.get(shard.race_attempt_id))
        for name in holders:
            pool = pool_named(name, pools)
            if pool is not None:
                (on_demand if pool.kind is PoolKind.ON_DEMAND else on_spot).add(shard.shard_index)
    job_tries, shard_tries = reference_spot_tries(attempts, commits, pools)
    pool_tries = {}
    availability: dict[str, PoolAvailability] = {}
    for pool in pools:
        if pool.kind is not PoolKind.SPOT:
            continue
        mine = [a for a in attempts if a.ended_at is not None and pool_named(a.pool, pools) is pool]
        seen = reference_spot_tries(mine, commits, [pool])[0] if mine else SpotTries()
        prior = spot_prior(pool.preemptions_per_hour, history.get(pool.name))
        pool_tries[pool.name] = dataclasses.replace(
            seen, prior_per_hour=prior.prior_per_hour, prior_hours=prior.prior_hours
        )
        availability[pool.name] = availability_prior(
            DEFAULT_POLICY.availability_prior, history.get(pool.name)
        )
    for attempt in attempts:
        pool = pool_named(attempt.pool, pools)
        if pool is None or pool.name not in availability:
            continue
        started = ensure_aware(attempt.started_at)
        if attempt.ended_at is not None:
            ended = ensure_aware(attempt.ended_at)
        else:
            ended = min(NOW, ensure_aware(attempt.heartbeat_at or attempt.started_at))
        span = (ended - started).total_seconds()
        if attempt.outcome == AttemptOutcome.UNSCHEDULABLE:
            gave_up = ended.timestamp() if gave_up_waiting(attempt.failure_class) else None
            availability[pool.name] = availability[pool.name].observe(absent_s=span, gave_up_s=gave_up)
        else:
            availability[pool.name] = availability[pool.name].observe(
                present_s=span, started_s=started.timestamp()
            )
    startup: dict[str, float] = {}  # claim to first commit, less its microbatch, longest per pool
    for attempt in attempts:
        mine = sorted(
            (c for c in commits if c.attempt_id == attempt.attempt_id), key=lambda c: c.committed_at
        )
        if mine and attempt.pool is not None:
            start = (mine[0].committed_at - attempt.started_at).total_seconds() - max(0.0, mine[0].elapsed_s)
            if start > startup.get(attempt.pool, 0.0):  # a pool none was seen to take time on: absent
                startup[attempt.pool] = start
    return PlacementView(
        job_id=job.job_id,
        state=job.state,
        now=NOW,
        deadline=job.deadline,
        started_at=job.created_at,
        completed_at=job.completed_at,
        parallelism=max(1, int(job.config.get("workers") or 1)),
        pools=pools,
        calibration=calibration,
        work_scale=scale,
        shard_work_s=shard_work,
        committed_work_s=committed,
        on_demand_shards=frozenset(on_demand),
        last_kinds=last_kinds,
        total_records=job.input_lines,
        committed_records=sum(c.records for c in commits),
        spot_tries=job_tries,
        shard_spot_tries=shard_tries,
        spot_shards=frozenset(on_spot),
        tenant=job.tenant,
        startup_seen_s=startup,
        pool_tries=pool_tries,
        pool_availability=availability,
    )


# -- random jobs ----------------------------------------------------------------------------------

POOL_NAMES = ("spot-a", "spot-b", "spot-c", "od-a", "od-b")


@st.composite
def pools(draw: st.DrawFn) -> tuple[PoolSpec, ...]:
    spot = draw(st.integers(1, 3))
    on_demand = draw(st.integers(0, 2))
    names = [*POOL_NAMES[:spot], *POOL_NAMES[3 : 3 + on_demand]]
    out = []
    for name in names:
        out.append(
            PoolSpec(
                name=name,
                kind=PoolKind.SPOT if name.startswith("spot") else PoolKind.ON_DEMAND,
                price_per_gpu_hour=draw(st.sampled_from((0.8, 1.0, 1.3, 2.8, 3.0))),
                decode_tokens_per_s=draw(st.sampled_from((900.0, 1500.0, 2400.0))),
                preemptions_per_hour=draw(st.sampled_from((0.0, 0.2, 0.5, 2.0))),
                startup_seconds=draw(st.sampled_from((30.0, 120.0))),
            )
        )
    return tuple(out)


def moments(base: dt.datetime) -> st.SearchStrategy[dt.datetime]:
    return st.builds(
        lambda minutes, micros, zone: (base + dt.timedelta(minutes=minutes, microseconds=micros)).astimezone(
            zone
        ),
        st.integers(-600, 60),
        st.integers(0, 999_999),
        st.sampled_from(ZONES),
    )


@st.composite
def jobs(draw: st.DrawFn) -> tuple[Job, list[Shard], list[Commit], list[Attempt], dict[str, PoolHistory]]:
    specs = draw(pools())
    pool_refs = st.sampled_from([*(p.name for p in specs), "spot", "on_demand", "gone", None])
    count = draw(st.integers(1, 12))
    attempts = []
    for n in range(draw(st.integers(0, 40))):
        started = draw(moments(NOW))
        running = draw(st.booleans()) and n % 3 == 0
        ended = None if running else started + dt.timedelta(seconds=draw(st.floats(0.0, 7200.0)))
        attempts.append(
            Attempt(
                attempt_id=f"a{n}",
                shard_index=draw(st.integers(0, count - 1)),
                pool=draw(pool_refs),
                started_at=started,
                ended_at=ended,
                outcome=AttemptOutcome.RUNNING if running else draw(st.sampled_from(list(AttemptOutcome))),
                heartbeat_at=draw(st.none() | moments(NOW)),
                failure_class=draw(st.sampled_from((None, *(c.value for c in FailureClass)))),
            )
        )
    ids = [a.attempt_id for a in attempts] or ["plan"]
    commits = [
        Commit(
            attempt_id=draw(st.sampled_from([*ids, "plan"])),
            pool=draw(pool_refs),
            records=draw(st.integers(0, 50)),
            prompt_tokens=draw(st.integers(0, 20_000)),
            completion_tokens=draw(st.integers(0, 8_000)),
            elapsed_s=draw(st.floats(0.0, 30.0)),
            committed_at=draw(moments(NOW)),
        )
        for _ in range(draw(st.integers(0, 30)))
    ]
    shards = []
    for index in range(count):
        microbatches = draw(st.integers(0, 10))
        shards.append(
            Shard(
                shard_index=index,
                state=draw(st.sampled_from(list(ShardState))),
                est_work_s=draw(st.floats(-10.0, 7200.0)),
                num_microbatches=microbatches,
                cursor=draw(st.integers(0, microbatches + 1)),
                last_pool=draw(pool_refs),
                lease_attempt_id=draw(st.none() | st.sampled_from(ids)),
                race_attempt_id=draw(st.none() | st.sampled_from(ids)),
            )
        )
    history = {
        p.name: PoolHistory(
            pool=p.name,
            tries=draw(st.integers(0, 300)),
            preemptions=draw(st.integers(0, 60)),
            spot_s=draw(st.floats(0.0, 1e6)),
            unschedulable=draw(st.integers(0, 5)),
            wait_s=draw(st.floats(0.0, 1e4)),
            last_unschedulable_s=draw(st.none() | st.just(NOW.timestamp() - 300.0)),
            last_start_s=draw(st.none() | st.just(NOW.timestamp() - 600.0)),
        )
        for p in specs
        if p.kind is PoolKind.SPOT and draw(st.booleans())
    }
    job = Job(
        job_id="j-prop",
        state=draw(st.sampled_from((JobState.RUNNING, JobState.RUNNING, JobState.CANCELLED))),
        deadline=NOW + dt.timedelta(hours=draw(st.floats(0.5, 12.0))),
        created_at=NOW - dt.timedelta(hours=2),
        completed_at=None,
        input_lines=1000,
        config={"workers": draw(st.integers(1, 8)), "pools": [p.to_dict() for p in specs]},
    )
    return job, shards, commits, attempts, history


def fields_of(view: JobView) -> dict[str, Any]:
    out = {f.name: getattr(view, f.name) for f in dataclasses.fields(view)}
    out["shard_spot_tries"] = dict(view.shard_spot_tries)
    return out


@settings(max_examples=60, deadline=None)
@given(jobs())
def test_the_fast_view_equals_the_reference_and_decides_the_same(
    case: tuple[Job, list[Shard], list[Commit], list[Attempt], dict[str, PoolHistory]],
) -> None:
    job, shards, commits, attempts, history = case
    expected = reference_view(job, shards, commits, attempts, history)
    fast = job_view_of(job, shards, commits, attempts, now=NOW, history=history)  # type: ignore[arg-type]
    assert fields_of(fast) == fields_of(expected)
    for shard in shards:
        assert decide_for_try(fast, shard) == decide_for_try(expected, shard)  # type: ignore[arg-type]


def test_a_shards_tries_fold_only_when_read_and_read_as_a_mapping() -> None:
    spot = PoolSpec(name="spot-a", kind=PoolKind.SPOT, preemptions_per_hour=0.5)
    job = Job("j", JobState.RUNNING, NOW + dt.timedelta(hours=4), NOW, None, 10, {"pools": [spot.to_dict()]})
    shards = [Shard(i, ShardState.PENDING, 900.0, 10, 0, None) for i in range(3)]
    attempts = [
        Attempt(
            f"a{n}",
            n % 2,
            "spot-a",
            NOW - dt.timedelta(minutes=40 - n),
            NOW,
            AttemptOutcome.PREEMPTED,
            None,
            None,
        )
        for n in range(4)
    ]
    view = job_view_of(job, shards, [], attempts, now=NOW)  # type: ignore[arg-type]
    tries = view.shard_spot_tries
    assert sorted(tries) == [0, 1] and len(tries) == 2 and 2 not in tries
    assert tries[0].tries == 2 and tries[0].preemptions == 2 and tries[0].fruitless == 2
    assert tries.get(2) is None and tries[0] is tries[0]
    assert tries == reference_spot_tries(attempts, [], (spot,))[1]
