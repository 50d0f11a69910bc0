"""The simulator on the shared real Spot traces (skipped when ../shared/spot-traces is absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_deadline_batch.sim.engine import SimConfig, simulate
from airflow_deadline_batch.sim.policies import SlackAware
from airflow_deadline_batch.sim.runner import compare, start_ticks
from airflow_deadline_batch.sim.traces import load_trace

TRACES = Path(__file__).parents[2].parent / "shared" / "spot-traces"
FILES = sorted(TRACES.rglob("*.json")) if TRACES.is_dir() else []

pytestmark = pytest.mark.skipif(not FILES, reason=f"no Spot traces under {TRACES} (shared folder absent)")


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_policies_on_real_trace(path: Path) -> None:
    trace = load_trace(path)
    cfg = SimConfig(work_h=8.0, deadline_h=10.0, workers=1, changeover_h=0.2, price_ratio=3.0, shard_h=0.25)
    rows = {r.policy: r for r in compare(trace, cfg, start_ticks(trace, cfg, starts=6, seed=3))}
    assert rows["on_demand"].mean_cost == pytest.approx((8.0 + 0.2) * 3.0)
    for name in ("greedy", "uniform_progress", "slack_aware"):
        assert rows[name].miss_rate == 0.0, name  # every deadline here is feasible on on-demand
        assert rows[name].mean_cost >= rows["omniscient"].mean_cost - 1e-9, name
    assert rows["omniscient"].mean_cost <= rows["on_demand"].mean_cost


def test_loader_reads_instances_times_gpus_per_instance() -> None:
    eight = next((p for p in FILES if p.stem.endswith("_8")), None)
    if eight is None:
        pytest.skip("no 8-GPU trace in the shared folder")
    assert set(load_trace(eight).capacity) <= {0, 8}


US_EAST_1A = TRACES / "availability" / "1-node" / "aws-02-15-2023" / "us-east-1a_v100_1.json"


@pytest.mark.skipif(not US_EAST_1A.is_file(), reason="us-east-1a trace absent")
@pytest.mark.parametrize(
    ("shard_h", "start_h"),
    [(1 / 60, 694.4979166666667), (15 / 3600, 9214 * 195 / 3600)],
    ids=["one-minute-shards", "fifteen-second-shards"],
)
def test_short_shards_do_not_miss_where_on_demand_meets(shard_h: float, start_h: float) -> None:
    # issue 13: a running Spot try was treated as risk-free during its changeover, so slack_aware
    # kept it until slack fell under one shard and missed D = 52 h (W = 48 h, d = 0.2 h).
    trace = load_trace(US_EAST_1A)
    cfg = SimConfig(work_h=48, deadline_h=52, changeover_h=0.2, price_ratio=3.1446, shard_h=shard_h)
    tick = round(start_h * 3600 / trace.gap_s)
    result = simulate(trace, tick, cfg, SlackAware())
    assert cfg.on_demand_feasible()
    assert not result.missed, result.finish_h
