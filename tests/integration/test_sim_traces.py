"""The simulator on the shared real Spot traces (skipped when ../shared/spot-traces is absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_deadline_batch.sim.engine import SimConfig
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
