"""The tuning set of ``slack_aware`` (synthetic traces only) and its score against Uniform Progress.

``python -m airflow_deadline_batch.sim.tuning '{"switch_run_factor": 2.5}'`` prints the mean / max
of slack_aware ÷ uniform_progress over every case (and per ``N``), the cases above 1.01, the misses
beyond on-demand's, and against on-demand only the worst case (mean over its starts) and the worst
single run. ``--gap '<json>'`` instead splits slack_aware's excess over the exact optimum on the
``N = 1`` cases into Spot and on-demand hours, changeovers, lost work, and on-demand hours taken
while Spot was there or missing (docs/simulator.md, *Third round*). ``--multi-gpu '<json>' ...``
scores candidates on the study's unseen multi-GPU rows (evaluation, never tuning);
``--semi-markov '<json>'`` scores on the semi-Markov set (:func:`semi_markov_cases`). The shared
trace files are never read here: they are for evaluation. ``--policy mdp`` (anywhere in the
arguments) scores the research policy of :mod:`.mdp` in place of slack_aware (its ``PolicyParams``
set the safety rule's interval and the estimate's prior, and ``cost_cap`` its cap rule), with
``--guards`` (slack_aware's storm and expected-cost guards in front of its table) and
``--waste-price X`` (the table's risk term; ``--waste-above F``: only while the run has saved
less than ``F ×`` on-demand only's cost); ``--starts M`` sets the multi-GPU starts per row and
``--jobs N`` the processes.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from airflow_deadline_batch.core.placement import PolicyParams
from airflow_deadline_batch.sim import traces
from airflow_deadline_batch.sim.engine import Mode, Policy, RunResult, SimConfig, simulate
from airflow_deadline_batch.sim.mdp import MarkovDecision
from airflow_deadline_batch.sim.omniscient import omniscient
from airflow_deadline_batch.sim.policies import OnDemand, SlackAware, UniformProgress, pool_priors
from airflow_deadline_batch.sim.runner import start_ticks

Case = tuple[traces.Trace, SimConfig, int]
#: the online policies this module scores (``--policy``)
TUNED = ("slack_aware", "mdp")


@dataclass(frozen=True)
class MdpVariant:
    """``mdp`` with the options of :class:`.mdp.MarkovDecision` (``--guards``, ``--waste-price``)."""

    guards: bool = False
    waste_price: float = 0.0
    waste_above: float | None = None


def online_at(
    policy: str | MdpVariant, trace: traces.Trace, start: int, workers: int, params: PolicyParams
) -> Policy:
    """``policy`` (slack_aware, mdp, or an mdp variant) for a job starting at ``start``, with the
    pool's persisted prior."""
    if isinstance(policy, str) and policy not in TUNED:
        raise ValueError(f"unknown --policy {policy!r}; use one of {', '.join(TUNED)}")
    priors = pool_priors([trace], start, workers, params=params)
    if policy == "slack_aware":
        return SlackAware(params, priors)
    variant = policy if isinstance(policy, MdpVariant) else MdpVariant()
    return MarkovDecision(
        params,
        priors,
        guards=variant.guards,
        waste_price=variant.waste_price,
        waste_above=variant.waste_above,
    )


Score = tuple[str, int, float, float, float, int, float, float]


def cases(seed: int = 500, starts: int = 8) -> list[Case]:
    """1-GPU regimes/droughts/flapping and gang traces for ``N = 1``; 4- and 8-GPU gangs for ``N = 4``."""
    one = (
        traces.synthetic_suite(seed)
        + traces.multi_gpu_suite(seed + 50, capacity=1)
        + [traces.gang(seed + 90, 8, mean_up_h=0.5, mean_down_h=0.6)]
    )
    multi = traces.multi_gpu_suite(seed + 100, capacity=4) + traces.multi_gpu_suite(seed + 200, capacity=8)
    out: list[Case] = []
    for d in (0.1, 0.2):
        for deadline in (20.0, 30.0):
            out += [(t, SimConfig(work_h=16, deadline_h=deadline, changeover_h=d), starts) for t in one]
        out += [(t, SimConfig(work_h=32, deadline_h=10, workers=4, changeover_h=d), starts) for t in multi]
    return out


def semi_markov_cases(seed: int = 800, starts: int = 8) -> list[Case]:
    """The semi-Markov set (``--semi-markov``): heavy-tailed spells with no regimes
    (:func:`.traces.semi_markov_suite`), the tuning set's settings: 1 GPU for ``N = 1``, an
    all-or-nothing 4-GPU gang for ``N = 4`` (docs/simulator.md, *Seventh round*)."""
    one = traces.semi_markov_suite(seed)
    multi = traces.semi_markov_suite(seed + 100, capacity=4)
    out: list[Case] = []
    for d in (0.1, 0.2):
        for deadline in (20.0, 30.0):
            out += [(t, SimConfig(work_h=16, deadline_h=deadline, changeover_h=d), starts) for t in one]
        out += [(t, SimConfig(work_h=32, deadline_h=10, workers=4, changeover_h=d), starts) for t in multi]
    return out


def score(args: tuple[traces.Trace, SimConfig, int, PolicyParams, str | MdpVariant]) -> Score:
    """slack_aware ÷ uniform_progress (summed cost over the starts), its misses, and its mean and
    worst run ÷ on-demand only for one case."""
    trace, cfg, starts, params, policy = args
    ticks = start_ticks(trace, cfg, starts=starts, seed=7)
    up = sum(simulate(trace, t, cfg, UniformProgress()).cost for t in ticks)
    runs = [simulate(trace, t, cfg, online_at(policy, trace, t, cfg.workers, params)) for t in ticks]
    misses = sum(r.missed for r in runs) - (0 if cfg.on_demand_feasible() else len(ticks))
    on_demand = simulate(trace, ticks[0], cfg, OnDemand()).cost
    cost = sum(r.cost for r in runs)
    worst = max(r.cost for r in runs)
    return (
        trace.name,
        cfg.workers,
        cfg.deadline_h,
        cfg.changeover_h,
        cost / up,
        misses,
        cost / len(runs) / on_demand,
        worst / on_demand,
    )


def evaluate(
    params: PolicyParams,
    jobs: int = 2,
    policy: str | MdpVariant = "slack_aware",
    case_list: list[Case] | None = None,
) -> dict[str, float]:
    work = [(t, c, s, params, policy) for t, c, s in (cases() if case_list is None else case_list)]
    with ProcessPoolExecutor(jobs) as pool:
        rows = list(pool.map(score, work))

    def stats(ratios: list[float]) -> tuple[float, float]:
        return sum(ratios) / len(ratios), max(ratios)

    all_ = [r[4] for r in rows]
    mean, worst = stats(all_)
    mean1, max1 = stats([r[4] for r in rows if r[1] == 1])
    mean4, max4 = stats([r[4] for r in rows if r[1] > 1])
    return {
        "cases": len(rows),
        "mean": mean,
        "max": worst,
        "over_1.01": sum(x > 1.01 for x in all_),
        "mean_n1": mean1,
        "max_n1": max1,
        "mean_n4": mean4,
        "max_n4": max4,
        "misses": sum(r[5] for r in rows),
        "max_case_over_on_demand": max(r[6] for r in rows),
        "cases_over_1.01_on_demand": sum(r[6] > 1.01 for r in rows),
        "max_run_over_on_demand": max(r[7] for r in rows),
    }


def on_demand_hours_by_spot(trace: traces.Trace, start: int, run: RunResult) -> tuple[float, float]:
    """On-demand worker-hours of a recorded run while Spot capacity was there, and while it was not."""
    gap = trace.gap_s / 3600.0
    switches = sorted(run.switches)
    modes: dict[int, str] = {}
    there = missing = 0.0
    tick, index = 0, 0
    while tick * gap < run.finish_h - 1e-9:
        t = tick * gap
        while index < len(switches) and switches[index][0] <= t + 1e-9:
            modes[switches[index][1]] = switches[index][2]
            index += 1
        hours = min(gap, run.finish_h - t) * sum(m == Mode.ON_DEMAND.value for m in modes.values())
        if trace.at(start + tick) > 0:
            there += hours
        else:
            missing += hours
        tick += 1
    return there, missing


GAP_KEYS: tuple[str, ...] = ("sa", "up", "opt", "sa_spot_h", "sa_od_h", "sa_changeover_h", "sa_redone_h")
GAP_KEYS += ("opt_spot_h", "opt_od_h", "sa_od_h_spot_there", "sa_od_h_spot_missing")


def gap_case(
    args: tuple[traces.Trace, SimConfig, int, PolicyParams, str | MdpVariant],
) -> list[tuple[float, ...]]:
    """Per start: slack_aware (or ``policy``), UP and the exact optimum's cost, and the policy's
    hours (GAP_KEYS)."""
    trace, cfg, starts, params, policy = args
    out: list[tuple[float, ...]] = []
    for t in start_ticks(trace, cfg, starts=starts, seed=7):
        run = simulate(trace, t, cfg, online_at(policy, trace, t, cfg.workers, params), record=True)
        best = omniscient(trace, t, cfg)
        up = simulate(trace, t, cfg, UniformProgress()).cost
        there, missing = on_demand_hours_by_spot(trace, t, run)
        out.append(
            (run.cost, up, best.cost, run.spot_hours, run.on_demand_hours, run.changeover_hours)
            + (run.redone_hours, best.spot_hours, best.on_demand_hours, there, missing)
        )
    return out


def gap(params: PolicyParams, jobs: int = 2, policy: str | MdpVariant = "slack_aware") -> dict[str, float]:
    """Means per run over the ``N = 1`` cases (the optimum is exact there), keyed by GAP_KEYS."""
    work = [(t, c, s, params, policy) for t, c, s in cases() if c.workers == 1]
    with ProcessPoolExecutor(jobs) as pool:
        runs = [r for rows in pool.map(gap_case, work) for r in rows]
    out: dict[str, float] = {"runs": len(runs)}
    out.update({key: sum(r[i] for r in runs) / len(runs) for i, key in enumerate(GAP_KEYS)})
    return out


def multi_gpu_row(
    args: tuple[traces.Trace, SimConfig, int, tuple[PolicyParams, ...], str | MdpVariant],
) -> list[tuple[float, ...]]:
    """Per candidate on one multi-GPU row: slack_aware ÷ UP (summed over the starts), its worst run
    and its mean ÷ on-demand only, and its misses."""
    trace, cfg, starts, candidates, policy = args
    ticks = start_ticks(trace, cfg, starts=starts, seed=1)
    on_demand = simulate(trace, ticks[0], cfg, OnDemand()).cost
    up = sum(simulate(trace, t, cfg, UniformProgress()).cost for t in ticks)
    out: list[tuple[float, ...]] = []
    for params in candidates:
        runs = [simulate(trace, t, cfg, online_at(policy, trace, t, cfg.workers, params)) for t in ticks]
        cost = sum(r.cost for r in runs)
        worst = max(r.cost for r in runs)
        out.append((cost / up, worst / on_demand, cost / len(runs) / on_demand, sum(r.missed for r in runs)))
    return out


def multi_gpu(
    candidates: list[PolicyParams],
    jobs: int = 2,
    policy: str | MdpVariant = "slack_aware",
    starts: int | None = None,
) -> list[dict[str, float]]:
    """Candidates on the study's unseen multi-GPU rows (``study --multi-gpu``: ``N = 8``, 24 rows,
    40 starts, seed 1), UP run once per row: evaluation, not tuning (docs/simulator.md)."""
    from airflow_deadline_batch.sim.study import multi_gpu_settings, multi_gpu_traces

    work = [
        (t, s.config(), starts or s.starts, tuple(candidates), policy)
        for s in multi_gpu_settings()
        for t in multi_gpu_traces()
    ]
    with ProcessPoolExecutor(jobs) as pool:
        rows = list(pool.map(multi_gpu_row, work))
    out = []
    for i in range(len(candidates)):
        r = [row[i] for row in rows]
        out.append(
            {
                "rows": len(r),
                "mean_sa_over_up": sum(x[0] for x in r) / len(r),
                "max_sa_over_up": max(x[0] for x in r),
                "rows_over_1.01_up": sum(x[0] > 1.01 for x in r),
                "max_row_over_on_demand": max(x[2] for x in r),
                "worst_run_over_on_demand": max(x[1] for x in r),
                "rows_with_a_run_over_1.01_on_demand": sum(x[1] > 1.01 + 1e-12 for x in r),
                "misses": sum(x[3] for x in r),
            }
        )
    return out


def _option(args: list[str], name: str, default: str) -> tuple[list[str], str]:
    """``args`` without ``name VALUE``, and VALUE (``default`` when absent)."""
    if name not in args:
        return args, default
    i = args.index(name)
    if i + 1 >= len(args):
        raise SystemExit(f"{name} needs a value, e.g. {name} {default}")
    return args[:i] + args[i + 2 :], args[i + 1]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    args, policy = _option(args, "--policy", "slack_aware")
    args, jobs_text = _option(args, "--jobs", "2")
    args, starts_text = _option(args, "--starts", "0")
    args, waste_text = _option(args, "--waste-price", "0")
    args, above_text = _option(args, "--waste-above", "")
    guards = "--guards" in args
    args = [a for a in args if a != "--guards"]
    if policy not in TUNED:
        raise SystemExit(f"unknown --policy {policy!r}; use one of {', '.join(TUNED)}")
    waste = float(waste_text)
    if policy != "mdp" and (guards or waste or above_text):
        raise SystemExit("--guards, --waste-price and --waste-above are options of mdp: add --policy mdp")
    if not waste >= 0:
        raise SystemExit(f"--waste-price must be >= 0, e.g. --waste-price 1, got {waste_text}")
    above = float(above_text) if above_text else None
    online: str | MdpVariant = MdpVariant(guards, waste, above) if policy == "mdp" else policy
    jobs = int(jobs_text)
    if args and args[0] == "--multi-gpu":
        candidates = [PolicyParams(**json.loads(a)) for a in args[1:]] or [PolicyParams()]
        rows = multi_gpu(candidates, jobs, online, int(starts_text) or None)
        for text, row in zip(args[1:] or ["{}"], rows, strict=True):
            print(
                text, " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
            )
        return 0
    split = bool(args) and args[0] == "--gap"
    args = args[1:] if split else args
    semi = bool(args) and args[0] == "--semi-markov"
    args = args[1:] if semi else args
    params = PolicyParams(**json.loads(args[0])) if args else PolicyParams()
    case_list = semi_markov_cases() if semi else None
    result = gap(params, jobs, online) if split else evaluate(params, jobs, online, case_list)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
