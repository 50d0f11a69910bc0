"""Predictability: is there memory in a Spot trace beyond the current spell's state and age?

The Eighth round priced spell-age memory (the semi-Markov twins) at about 0.6 % of cost. This
measures whether the real traces hold predictable structure the semi-Markov twins lack — time of
day, day of week, regimes (a recent window's availability), the other zones of the same run — by
forecasting each trace's second half from models fitted on its first half (docs/simulator.md,
*Ninth round*).

At each tick ``t`` (the history up to and including ``t`` known), for horizons of 1, 4 and 12 h
(``H`` ticks), two targets: Spot present at ``t + H`` (capacity ≥ 1), a probability scored by log
loss and Brier, and the fraction of ticks present over ``(t, t + H]``, scored by mean absolute
error. Models, from least to most information:

* ``markov``: the two-state chain fitted by per-tick transition counts, ``P^H`` (the Fifth round's
  model); ``state``: the first half's mean outcome given the state alone;
* ``age``: given state and spell-age bucket (the semi-Markov fit: for spells that remember only
  their age this is the best forecast up to the bucket's width);
* ``hour``, ``week``: ``age`` plus hour of day (3 h blocks) and day of week (traces of 3 weeks or
  more); the files carry no clock time, so the hour is counted from the trace's start, which
  shifts a daily cycle but does not hide it;
* ``past6``, ``past24``, ``past72``: ``age`` plus the availability over the past 6 / 24 / 72 h
  (six bins); ``zones``: ``age`` plus how many of the other zones recorded in the same run (same
  folder, tick and length) have Spot now;
* ``logit``: a ridge-regularised logistic regression (Newton steps) on all of them (a fraction
  target is fitted by the same cross-entropy); ``logit_age``: the same regression on the state and
  the spell's age only (age buckets and log age), the fair baseline for ``logit``: the regression
  sees the age within its bucket, which ``age`` does not.

Each cell model adds to its parent (``state`` for ``age``, ``age`` for the others) the first half's
mean residual in its cell, shrunk by ``n / (n + m)`` with ``m`` a day of ticks: neighbouring ticks
share their future, so a cell's ticks are worth far fewer independent samples than their count.
That and the regression's ridge (0.3 per sample on standardised features) were set on synthetic
traces (a Markov trace, where less shrinkage let ``hour`` and ``logit`` fit noise; a daily cycle).
Differences between models are judged by a block bootstrap over the days of the second half.

``python -m airflow_deadline_batch.sim.predictability --traces DIR`` prints the tables; ``--twins``
the same on the traces' semi-Markov twins, with their hidden age phase as one more model (the
calibration: what the phase adds there is what the Eighth round priced in cost); ``--regimes`` on
the long traces' regime twins (docs/simulator.md, *Tenth round*), hidden regime and phase; without
``--traces``, the same on synthetic controls (a Markov trace, one with a daily cycle).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from airflow_deadline_batch.sim import spells, traces
from airflow_deadline_batch.sim.traces import Trace, load_trace

HORIZONS_H = (1.0, 4.0, 12.0)
WINDOWS_H = (6.0, 24.0, 72.0)
#: lower edges of the spell-age buckets, hours (the Seventh round's, split at 0.25 h and 16 h)
AGE_EDGES_H = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
#: upper edges of the past-availability bins (the last bin is 0.9 – 1)
PAST_EDGES = (0.1, 0.3, 0.5, 0.7, 0.9)
HOUR_BLOCK_H = 3.0
#: shrinkage of a cell's mean residual, hours of ticks (see the module docstring)
SHRINK_H = 24.0
#: a trace gets the day-of-week model only if it spans this many days (its first half: 1.5 weeks)
WEEK_MIN_DAYS = 21.0
#: the logistic regression's ridge penalty per sample (standardised features) and its Newton steps
RIDGE = 0.3
NEWTON_STEPS = 12
EPS = 1e-4
BOOTSTRAP = 1000

MODELS = (
    "markov",
    "state",
    "age",
    "phase",
    "logit_age",
    "hour",
    "week",
    "past6",
    "past24",
    "past72",
    "zones",
    "logit",
)
#: the columns of :func:`design` that ``logit_age`` keeps: per state its intercept, age buckets, log age
AGE_COLUMNS = len(AGE_EDGES_H)
TARGETS = ("present", "fraction")
METRICS = ("logloss", "brier", "mae")


@dataclass
class Series:
    """One trace's history features at every tick (numpy arrays of the trace's length)."""

    name: str
    gap_s: float
    up: np.ndarray
    age_h: np.ndarray
    hour: np.ndarray
    weekday: np.ndarray | None
    past: dict[float, np.ndarray]
    zones: np.ndarray | None = None
    phase: np.ndarray | None = None

    @property
    def ticks_per_h(self) -> float:
        return 3600.0 / self.gap_s


def series(trace: Trace, siblings: Sequence[Trace] = ()) -> Series:
    """The features of ``trace``; ``siblings``: other zones recorded in the same run, tick for tick."""
    up = np.array([c >= 1 for c in trace.capacity], dtype=float)
    n, gap_h = len(up), trace.gap_s / 3600.0
    change = np.ones(n, dtype=bool)
    change[1:] = up[1:] != up[:-1]
    starts = np.maximum.accumulate(np.where(change, np.arange(n), 0))
    age_h = (np.arange(n) - starts + 1) * gap_h
    clock_h = np.arange(n) * gap_h
    cum = np.concatenate([[0.0], np.cumsum(up)])
    past = {}
    for w in WINDOWS_H:
        k = max(1, round(w / gap_h))
        lo = np.maximum(np.arange(n) + 1 - k, 0)
        past[w] = (cum[1:] - cum[lo]) / (np.arange(n) + 1 - lo)
    weekday = (clock_h // 24.0) % 7 if n * gap_h >= WEEK_MIN_DAYS * 24.0 else None
    zones = None
    if siblings:
        if any(len(s.capacity) != n or s.gap_s != trace.gap_s for s in siblings):
            raise ValueError(f"{trace.name}: siblings must have the same tick and length")
        zones = np.sum([np.array([c >= 1 for c in s.capacity], dtype=float) for s in siblings], axis=0)
    return Series(trace.name, trace.gap_s, up, age_h, clock_h % 24.0, weekday, past, zones)


def targets(up: np.ndarray, h: int) -> tuple[np.ndarray, np.ndarray]:
    """For every ``t`` with ``t + h`` in the trace: Spot present at ``t + h``, and the fraction
    present over ``(t, t + h]``."""
    cum = np.concatenate([[0.0], np.cumsum(up)])
    n = len(up) - h
    return up[h:], (cum[h + 1 : h + 1 + n] - cum[1 : 1 + n]) / h


def markov_forecast(s: Series, train: np.ndarray, rows: np.ndarray, h: int) -> tuple[np.ndarray, np.ndarray]:
    """The two-state chain fitted on ``train``'s transitions: ``P^h[x_t, 1]`` and its mean over 1..h."""
    a, b = s.up[train[:-1]], s.up[train[:-1] + 1]
    p = float(np.sum((a == 1) & (b == 0))) / max(1.0, float(np.sum(a == 1)))
    q = float(np.sum((a == 0) & (b == 1))) / max(1.0, float(np.sum(a == 0)))
    if p + q == 0:
        raise ValueError(f"{s.name}: the fitting half never changes state; use a longer trace")
    pi, r = q / (p + q), 1.0 - p - q
    x = s.up[rows] - pi
    geometric = r * (1.0 - r**h) / (h * (1.0 - r)) if r != 1.0 else 1.0
    return pi + x * r**h, pi + x * geometric


def cells_fit(cell: np.ndarray, y: np.ndarray, parent: np.ndarray, train: np.ndarray, m: float) -> np.ndarray:
    """``parent`` plus each cell's shrunk mean residual on ``train`` (cells unseen there: the parent)."""
    size = int(cell.max()) + 1
    count = np.bincount(cell[train], minlength=size)
    residual = np.bincount(cell[train], weights=y[train] - parent[train], minlength=size)
    shift = residual / (count + m)
    return np.clip(parent + shift[cell], EPS, 1.0 - EPS)


def age_bucket(age_h: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.array(AGE_EDGES_H), age_h, side="right") - 1


def design(s: Series, rows: np.ndarray) -> np.ndarray:
    """The logistic regression's features: per state an intercept (the first two columns), then
    state × (age bucket one-hot, log age, hour harmonics, weekday harmonics, past availabilities,
    other zones' count)."""
    x = s.up[rows]
    columns = [(x == 0.0).astype(float), (x == 1.0).astype(float)]
    bucket = age_bucket(s.age_h[rows])
    for mask in columns[:2]:
        extra = [(bucket == i).astype(float) for i in range(1, len(AGE_EDGES_H))]
        extra.append(np.log1p(s.age_h[rows]))
        angle = 2 * math.pi * s.hour[rows] / 24.0
        extra += [np.sin(angle), np.cos(angle), np.sin(2 * angle), np.cos(2 * angle)]
        if s.weekday is not None:
            angle = 2 * math.pi * s.weekday[rows] / 7.0
            extra += [np.sin(angle), np.cos(angle)]
        extra += [s.past[w][rows] for w in WINDOWS_H]
        if s.zones is not None:
            extra.append(s.zones[rows])
        columns += [mask * e for e in extra]
    return np.stack(columns, axis=1)


def logistic(xs: np.ndarray, y: np.ndarray, ridge: float | None = None) -> np.ndarray:
    """Weights minimising the mean cross-entropy of ``y`` in [0, 1] plus ``ridge / 2 · |w|²`` over
    all but the first two (the per-state intercepts of :func:`design`); Newton's method, convex."""
    ridge = RIDGE if ridge is None else ridge
    n, k = xs.shape
    w = np.zeros(k)
    penalty = np.full(k, ridge)
    penalty[:2] = 1e-9
    for _ in range(NEWTON_STEPS):
        p = 1.0 / (1.0 + np.exp(-(xs @ w)))
        grad = xs.T @ (p - y) / n + penalty * w
        hess = (xs.T * (p * (1 - p))) @ xs / n + np.diag(penalty)
        w -= np.linalg.solve(hess, grad)
    return w


def forecasts(
    s: Series, horizon_h: float
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray], np.ndarray]:
    """Every model's forecast of both targets on the second half, fitted on the first.

    Returns ``{model: {target: forecast}}``, ``{target: outcome}`` and the scored ticks."""
    h = max(1, round(horizon_h * s.ticks_per_h))
    n = len(s.up)
    half = n // 2
    present, fraction = targets(s.up, h)
    ys = {"present": present, "fraction": fraction}
    every = np.arange(n - h)
    train = np.arange(half - h)
    test = np.arange(half, n - h)
    m = SHRINK_H * s.ticks_per_h
    state = s.up[every].astype(int)
    bucket = age_bucket(s.age_h[every])
    out: dict[str, dict[str, np.ndarray]] = {name: {} for name in MODELS}
    mk = markov_forecast(s, np.arange(half), every, h)
    scaled = design(s, every)
    sd = scaled[train].std(axis=0)
    scaled[:, 2:] = scaled[:, 2:] / np.where(sd[2:] > 0, sd[2:], 1.0)
    per_state = (scaled.shape[1] - 2) // 2
    age_cols = np.array(
        [0, 1, *range(2, 2 + AGE_COLUMNS), *range(2 + per_state, 2 + per_state + AGE_COLUMNS)]
    )
    for i, target in enumerate(TARGETS):
        y = ys[target]
        out["markov"][target] = mk[i]
        base = np.full(len(every), float(y[train].mean()))
        st = cells_fit(state, y, base, train, m)
        age = cells_fit(state * len(AGE_EDGES_H) + bucket, y, st, train, m)
        out["state"][target], out["age"][target] = st, age
        blocks = int(24 / HOUR_BLOCK_H)
        out["hour"][target] = cells_fit(
            state * blocks + (s.hour[every] // HOUR_BLOCK_H).astype(int), y, age, train, m
        )
        if s.weekday is not None:
            out["week"][target] = cells_fit(state * 7 + s.weekday[every].astype(int), y, age, train, m)
        for w in WINDOWS_H:
            past = np.searchsorted(np.array(PAST_EDGES), s.past[w][every], side="right")
            cell = state * (len(PAST_EDGES) + 1) + past
            out[f"past{w:g}"][target] = cells_fit(cell, y, age, train, m)
        if s.phase is not None:
            out["phase"][target] = cells_fit(
                state * (int(s.phase.max()) + 1) + s.phase[every], y, st, train, m
            )
        if s.zones is not None:
            out["zones"][target] = cells_fit(state * 10 + s.zones[every].astype(int), y, age, train, m)
        for name, cols in (("logit_age", age_cols), ("logit", np.arange(scaled.shape[1]))):
            w_fit = logistic(scaled[train][:, cols], y[train])
            out[name][target] = np.clip(1.0 / (1.0 + np.exp(-(scaled[:, cols] @ w_fit))), EPS, 1.0 - EPS)
    return (
        {name: {t: f[test] for t, f in v.items()} for name, v in out.items() if v},
        {t: y[test] for t, y in ys.items()},
        test,
    )


def losses(forecast: dict[str, np.ndarray], outcome: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per scored tick: log loss and Brier of the presence forecast, absolute error of the fraction."""
    p, y = np.clip(forecast["present"], EPS, 1.0 - EPS), outcome["present"]
    return {
        "logloss": -(y * np.log(p) + (1 - y) * np.log(1 - p)),
        "brier": (p - y) ** 2,
        "mae": np.abs(forecast["fraction"] - outcome["fraction"]),
    }


@dataclass
class Score:
    """One trace × horizon: each model's mean loss per metric, its per-day block sums for the
    bootstrap, the second half's size in days and spell ends (changes of state), and the first
    half's spell ends."""

    trace: str
    horizon_h: float
    mean: dict[str, dict[str, float]]
    blocks: dict[str, dict[str, np.ndarray]]
    counts: np.ndarray
    days: float
    spells: int
    fit_spells: int


def score(s: Series, horizon_h: float) -> Score:
    """The models' losses on the second half of ``s`` at ``horizon_h``."""
    fc, outcome, test = forecasts(s, horizon_h)
    day = ((test - test[0]) * s.gap_s // 86400).astype(int)
    counts = np.bincount(day).astype(float)
    mean: dict[str, dict[str, float]] = {}
    blocks: dict[str, dict[str, np.ndarray]] = {}
    for name, f in fc.items():
        per = losses(f, outcome)
        mean[name] = {k: float(v.mean()) for k, v in per.items()}
        blocks[name] = {k: np.bincount(day, weights=v) for k, v in per.items()}
    half = len(s.up) // 2
    changes = np.flatnonzero(s.up[1:] != s.up[:-1])
    return Score(
        s.name,
        horizon_h,
        mean,
        blocks,
        counts,
        len(test) * s.gap_s / 86400.0,
        int(np.sum(changes >= half)),
        int(np.sum(changes < half)),
    )


def bootstrap(
    scores: Sequence[Score], model: str, metric: str, base: str, seed: int = 1
) -> tuple[float, float, float]:
    """The difference ``model − base`` of the traces' mean loss (averaged over traces, each trace's
    second half resampled by whole days), as a fraction of ``base``'s: estimate and 95 % interval.
    Traces without ``model`` are left out."""
    rng = np.random.default_rng(seed)
    mine = [sc for sc in scores if model in sc.mean]
    if not mine:
        return math.nan, math.nan, math.nan
    diffs = np.zeros(BOOTSTRAP)
    bases = np.zeros(BOOTSTRAP)
    est_d = est_b = 0.0
    for sc in mine:
        d = sc.blocks[model][metric] - sc.blocks[base][metric]
        b = sc.blocks[base][metric]
        weights = rng.multinomial(
            len(sc.counts), np.full(len(sc.counts), 1.0 / len(sc.counts)), size=BOOTSTRAP
        )
        total = weights @ sc.counts
        diffs += (weights @ d) / total
        bases += (weights @ b) / total
        est_d += float(d.sum() / sc.counts.sum())
        est_b += float(b.sum() / sc.counts.sum())
    ratio = diffs / bases
    lo, hi = np.quantile(ratio, [0.025, 0.975])
    return est_d / est_b, float(lo), float(hi)


def measure(trace_list: Sequence[Trace]) -> list[Score]:
    """Every trace × horizon; traces of one folder with the same tick and length are each other's zones."""
    out = []
    for trace in trace_list:
        folder = trace.name.rsplit("/", 1)[0]
        siblings = [
            o
            for o in trace_list
            if o is not trace
            and o.name.rsplit("/", 1)[0] == folder
            and o.gap_s == trace.gap_s
            and len(o.capacity) == len(trace.capacity)
        ]
        s = series(trace, siblings)
        out += [score(s, h) for h in HORIZONS_H]
    return out


def measure_twins(trace_list: Sequence[Trace], hours: float = 1000.0, seed: int = 1) -> list[Score]:
    """The same on each trace's semi-Markov twin (the Eighth round's, ``online_bound.age_twin``),
    where ``phase`` (state and the twin's hidden age phase, its whole memory) is the best forecast:
    it calibrates a gain in forecast against the Eighth round's gain in cost. No zones (the twins
    are drawn independently)."""
    from airflow_deadline_batch.sim.online_bound import age_twin, fit_ages

    return [sc for trace in trace_list for sc in score_twin(*age_twin(trace, fit_ages(trace), hours, seed))]


def score_twin(double: Trace, phases: Sequence[int]) -> list[Score]:
    """Every horizon on a twin whose age phase at each tick is ``phases`` (the ``phase`` model)."""
    s = series(double)
    s.phase = np.array(phases)
    return [score(s, h) for h in HORIZONS_H]


def measure_regime_twins(trace_list: Sequence[Trace], hours: float = 1000.0, seed: int = 1) -> list[Score]:
    """The same on each long trace's regime twin (the Tenth round's, ``online_bound.regime_twin``),
    where ``phase`` is the twin's hidden regime and age phase (its whole memory): the twins should
    show the real traces' gains of ``past6`` and ``logit`` if they carry their regimes."""
    from airflow_deadline_batch.sim.online_bound import REGIME_MIN_DAYS, fit_regimes, regime_twin

    out = []
    for trace in trace_list:
        if trace.hours >= REGIME_MIN_DAYS * 24.0:
            chain = fit_regimes(trace)
            double, states = regime_twin(trace, chain, hours, seed)
            b = chain.buckets
            out += score_twin(double, [z // (2 * b) * b + z % b for z in states])
    return out


def regime_succession_table(trace_list: Sequence[Trace], seed: int = 1) -> str:
    """:func:`succession_table` for each long trace and its regime twin side by side."""
    from airflow_deadline_batch.sim.online_bound import REGIME_MIN_DAYS, fit_regimes, regime_twin

    lines = ["| trace | real: log-length correlation (pairs) | regime twin (pairs) |", "|---|---|---|"]
    for trace in trace_list:
        if trace.hours >= REGIME_MIN_DAYS * 24.0:
            cells = []
            for shown in (trace, regime_twin(trace, fit_regimes(trace), 1000.0, seed)[0]):
                r, pairs = spells.succession(shown)
                cells.append(f"{'–' if r is None else f'{r:+.2f}'} ({pairs})")
            lines.append(f"| {trace.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(scores: Sequence[Score], title: str) -> list[str]:
    """Per horizon and metric, the traces' mean loss per model (over the traces it applies to, their
    count in brackets where not all), then its difference to ``age`` (the semi-Markov fit; for
    ``logit``, to ``logit_age``, the regression on the same age information) with the bootstrap
    interval."""
    lines = [f"| {title} | metric | " + " | ".join(MODELS) + " |", "|---" * (2 + len(MODELS)) + "|"]
    for h in HORIZONS_H:
        group = [sc for sc in scores if sc.horizon_h == h]
        for metric in METRICS:
            cells = []
            for name in MODELS:
                values = [sc.mean[name][metric] for sc in group if name in sc.mean]
                some = f" ({len(values)})" if 0 < len(values) < len(group) else ""
                cells.append(f"{np.mean(values):.4f}{some}" if values else "–")
            lines.append(f"| {h:g} h | {metric} | " + " | ".join(cells) + " |")
            cells = []
            for name in MODELS:
                if name == "age":
                    cells.append("")
                    continue
                est, lo, hi = bootstrap(group, name, metric, "logit_age" if name == "logit" else "age")
                cells.append(
                    "–" if math.isnan(est) else f"{100 * est:+.1f} % [{100 * lo:+.1f}, {100 * hi:+.1f}]"
                )
            lines.append("| | vs age | " + " | ".join(cells) + " |")
    return lines


def markdown(scores: Sequence[Score], long_days: float = 20.0) -> str:
    """:func:`summary` over all traces and over those of ``long_days`` or more, then the per-trace
    log loss at each horizon."""
    lines = summary(scores, "all traces")
    long = [sc for sc in scores if sc.days * 2 >= long_days]
    if long and len(long) < len(scores):
        lines += ["", *summary(long, f"traces of {long_days:g} days or more")]
    for h in HORIZONS_H:
        lines += [
            "",
            f"| trace ({h:g} h, log loss) | days / spells scored (fitted on) | " + " | ".join(MODELS) + " |",
        ]
        lines.append("|---" * (2 + len(MODELS)) + "|")
        for sc in scores:
            if sc.horizon_h != h:
                continue
            cells = [f"{sc.mean[name]['logloss']:.4f}" if name in sc.mean else "–" for name in MODELS]
            lines.append(
                f"| {sc.trace} | {sc.days:.1f} / {sc.spells} ({sc.fit_spells}) | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def succession_table(trace_list: Sequence[Trace], twins: bool = False, seed: int = 1) -> str:
    """Per trace (or its semi-Markov twin): the correlation of successive same-kind spells' log
    lengths (``spells.succession``), with its number of pairs: a regime shows as a positive one."""
    from airflow_deadline_batch.sim.online_bound import age_twin, fit_ages

    lines = ["| trace | successive spells' log-length correlation (pairs) |", "|---|---|"]
    for trace in trace_list:
        shown = age_twin(trace, fit_ages(trace), 1000.0, seed)[0] if twins else trace
        r, pairs = spells.succession(shown)
        lines.append(f"| {shown.name} | {'–' if r is None else f'{r:+.2f}'} ({pairs}) |")
    return "\n".join(lines)


def synthetic() -> list[Trace]:
    """Controls with a known answer: a Markov trace (nothing beats ``markov``) and one whose rates
    follow the hour of day (``hour`` beats ``age``)."""
    return [
        traces.markov(0.2, 0.3, 1000.0, 300.0, seed=1, name="synthetic/markov/1"),
        traces.diurnal_markov(1, 1000.0, up_to_down=0.3, down_to_up=0.3, name="synthetic/diurnal/1"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_deadline_batch.sim.predictability")
    parser.add_argument("--traces", type=Path, help="a directory of shared trace files (measurement only)")
    parser.add_argument("--twins", action="store_true", help="score the traces' semi-Markov twins instead")
    parser.add_argument("--regimes", action="store_true", help="score the long traces' regime twins instead")
    args = parser.parse_args(argv)
    if args.traces is not None and not args.traces.is_dir():
        raise SystemExit(f"--traces {str(args.traces)!r} is not a directory; pass ../shared/spot-traces")
    trace_list = (
        synthetic() if args.traces is None else [load_trace(p) for p in sorted(args.traces.rglob("*.json"))]
    )
    if args.regimes:
        if args.traces is None or args.twins:
            raise SystemExit("--regimes scores the regime twins of --traces DIR; pass it alone with --traces")
        print(markdown(measure_regime_twins(trace_list)))
        print("\n" + regime_succession_table(trace_list))
        return 0
    print(markdown(measure_twins(trace_list) if args.twins else measure(trace_list)))
    print("\n" + succession_table(trace_list, args.twins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
