"""A preemption storm through the real ``deadline-batch run``: no Spot try can commit, on-demand can.

docs/design.md §5, *Observed preemptions*: the placement learns from the store's attempt rows that
Spot tries are preempted before committing anything and escalates to on-demand, early enough that
the default attempt budget (10 per shard) is never exhausted, although the deadline is far away.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.core.states import PREEMPTION_OUTCOMES
from airflow_deadline_batch.local.runner import PreemptionInjector
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import run_cli

#: each record takes this long to generate; one record per microbatch
DELAY_S = 4.0
#: Spot preemptions per worker-hour of claimed work: a mean of 1.5 s after a Spot worker's claim
RATE = 2400.0
NOTICE_S = 0.2
#: Spot launches whose preemption time the seed is checked for (far more than a storm takes)
CHECKED_LAUNCHES = 60
#: what the runner adds between a claim and its kill: a poll to see the claim, one to send the
#: SIGTERM and one to send the SIGKILL after the notice (0.1 s each), on a loaded machine
KILL_LAG_S = 1.0


def storm_seed() -> int:
    """A seed whose first Spot launches are all preempted (SIGKILL included) before one record's
    generation, which starts after the claim, could end: no Spot try can commit anything."""
    for seed in range(100_000):
        injector = PreemptionInjector(RATE, seed)
        if all(
            injector.exposure_s(PoolKind.SPOT) + NOTICE_S < DELAY_S - KILL_LAG_S
            for _ in range(CHECKED_LAUNCHES)
        ):
            return seed
    raise AssertionError("no seed keeps every checked preemption under a record's time")


def test_a_preemption_storm_escalates_to_on_demand_and_meets_the_deadline(tmp_path: Path) -> None:
    records = [{"id": f"r{i}", "prompt": f"storm record {i}"} for i in range(4)]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    result = run_cli(
        "run", str(source), "--deadline", "+4m", "--engine", "echo", "--workers", "2",
        "--microbatch-size", "1", "--preempt-rate", str(RATE), "--preempt-notice", str(NOTICE_S),
        "--seed", str(storm_seed()), "--store", store_url, "--output", str(tmp_path / "out"), "--json",
        cwd=tmp_path, env={"ADB_ECHO_DELAY_S": str(DELAY_S)}, timeout=400,
    )  # fmt: skip
    assert result.code == 0, result.describe()
    summary = result.json()
    assert summary["state"] == "completed", summary
    assert summary["deadline_met"] is True, summary
    assert summary["records"]["succeeded"] == len(records), summary
    assert summary["placements"]["on_demand"] > 0, summary

    store = ManifestStore(store_url)
    try:
        attempts = store.list_attempts(summary["job_id"])
        commits = store.list_commits(summary["job_id"])
    finally:
        store.close()
    spot = [a for a in attempts if a.pool == "local-spot"]
    # nothing was committed on Spot: every commit came from an on-demand try
    committed_by = {c.attempt_id for c in commits if c.shard_index >= 0}
    assert committed_by and not committed_by & {a.attempt_id for a in spot}
    assert all(a.outcome in PREEMPTION_OUTCOMES for a in spot)
    # the storm was noticed from the store, and before any shard's attempt budget ran out
    assert spot, "no Spot try ever claimed its shard: nothing to learn the storm from"
    per_shard: dict[int, int] = {}
    for attempt in attempts:
        per_shard[attempt.shard_index] = per_shard.get(attempt.shard_index, 0) + 1
    assert max(per_shard.values()) < 10, per_shard
