"""Progress-versus-time plot of one start, one line per policy, markers at pool switches.

matplotlib is imported lazily (Agg backend) so the package works without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.sim.engine import SimConfig, simulate
from airflow_deadline_batch.sim.policies import make_policy
from airflow_deadline_batch.sim.traces import Trace

_MARKERS = {"spot": "^", "on_demand": "s", "none": "x"}


def plot_progress(
    trace: Trace, start_tick: int, config: SimConfig, policies: Sequence[str], out: Path
) -> Path:
    """Write a PNG of committed work over time for each policy, with the Spot capacity underneath."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigurationError(
            "--plot needs matplotlib; pip install 'airflow-deadline-batch[plot]'"
        ) from None
    fig, (ax, cap_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name in policies:
        result = simulate(trace, start_tick, config, make_policy(name), record=True)
        xs = [0.0] + [t for t, _ in result.progress]
        ys = [0.0] + [w for _, w in result.progress]
        (line,) = ax.step(xs, ys, where="post", label=f"{name} (cost {result.cost:.1f})")
        for t, _slot, mode in result.switches:
            y = max((w for tt, w in result.progress if tt <= t), default=0.0)
            ax.plot([t], [y], _MARKERS.get(mode, "o"), color=line.get_color(), markersize=4)
    ax.axvline(config.deadline_h, color="red", linestyle="--", label="deadline")
    ax.set_ylabel("committed work (GPU-h)")
    ax.set_title(
        f"{trace.name}, start at {start_tick * trace.gap_s / 3600:.1f} h "
        f"(markers: ^ Spot, s on-demand, x stop)"
    )
    ax.legend(loc="upper left", fontsize=8)
    gap = trace.gap_s / 3600
    ticks = int(config.deadline_h / gap) + 1
    cap_ax.step(
        [i * gap for i in range(ticks)], [trace.at(start_tick + i) for i in range(ticks)], where="post"
    )
    cap_ax.set_ylabel("Spot GPUs")
    cap_ax.set_xlabel("hours since start")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
