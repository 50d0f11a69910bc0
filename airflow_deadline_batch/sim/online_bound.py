"""The price of not knowing the future: the Bayes-optimal online policy on Markov Spot traces.

Issue 13's ``≤ 1.05 × omniscient`` target compares online policies with the exact offline optimum
(``omniscient.exact_optimum``), which sees the whole trace. How close can any policy that does not
see the future get? On Spot that IS a two-state Markov chain with known rates the answer is
computable: ``mdp``'s backward induction with the true rates, on a time grid that is exact for the
job (a step of one tick, a unit that divides the tick, the shard and the changeover), is the
expected-cost-optimal online policy among those that keep the on-demand fallback (docs/simulator.md,
*Fifth round*).

``python -m airflow_deadline_batch.sim.online_bound --traces DIR`` fits the two rates of every
single-node shared trace by maximum likelihood, generates a "Markov twin" from them, and runs the
study's ``N = 1`` settings on each twin: the exact optimum, the oracle-rates table (with and
without slack_aware's safety rule, and on ``mdp``'s own grid), ``mdp`` with learned rates,
``slack_aware``, ``uniform_progress`` and ``on_demand``. ``--check`` compares the oracle table
with a brute-force expectimax over every online policy on tiny jobs.

``--ages``: the same on semi-Markov twins whose spells remember their age (hazard by age bucket
fitted per trace, :func:`age_twin`), with the table that has the spell's age phase in its state
(``sim.mdp.AgeTable``) as the floor (docs/simulator.md, *Eighth round*).

``--regimes``: the same on regime twins of the long traces (hidden regimes with their own hazards
by age, switching between spells, fitted per trace by :func:`fit_regimes`), with the table told the
hidden regime and age phase (``sim.mdp.RegimeRates``) as the floor (docs/simulator.md, *Tenth round*).
"""

from __future__ import annotations

import argparse
import bisect
import functools
import itertools
import json
import math
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from airflow_deadline_batch.core.placement import JobSnapshot, PolicyParams
from airflow_deadline_batch.sim import spells
from airflow_deadline_batch.sim.engine import Choice, Mode, Policy, SimConfig, View, simulate
from airflow_deadline_batch.sim.mdp import (
    AgeRates,
    AgeTable,
    Grid,
    MarkovDecision,
    Rates,
    RegimeRates,
    Table,
)
from airflow_deadline_batch.sim.omniscient import exact_optimum
from airflow_deadline_batch.sim.policies import OnDemand, UniformProgress, slack_aware_at
from airflow_deadline_batch.sim.runner import start_ticks
from airflow_deadline_batch.sim.study import Setting, settings
from airflow_deadline_batch.sim.traces import Trace, load_trace, markov
from airflow_deadline_batch.sim.tuning import online_at

#: the columns of the measurement, in order (``exact`` is the offline optimum)
POLICIES = (
    "exact",
    "oracle",
    "table_alone",
    "oracle_mdp_grid",
    "mdp",
    "slack_aware",
    "uniform_progress",
    "on_demand",
)


@dataclass(frozen=True)
class MarkovFit:
    """A trace's two rates per hour (spells end at ``up_to_down``, return at ``down_to_up``)."""

    up_to_down: float
    down_to_up: float

    @property
    def availability(self) -> float:
        return self.down_to_up / (self.up_to_down + self.down_to_up)


def fit_markov(trace: Trace, workers: int = 1) -> MarkovFit:
    """Maximum-likelihood rates of the chain "Spot there" (capacity ≥ ``workers``) per tick.

    The per-tick transition counts give ``p = n(up→down) / n(up→·)`` and ``q = n(down→up) /
    n(down→·)``, the exact ML estimate of a discrete chain; they are turned into per-hour rates of
    the continuous-time chain that has those per-tick probabilities (``1 − p − q = e^{−(μ+λ)g}``).
    """
    up = [c >= workers for c in trace.capacity]
    counts = {(a, b): 0 for a in (False, True) for b in (False, True)}
    for a, b in itertools.pairwise(up):
        counts[a, b] += 1
    from_up = counts[True, True] + counts[True, False]
    from_down = counts[False, False] + counts[False, True]
    if not (counts[True, False] and counts[False, True]):
        raise ValueError(f"trace {trace.name!r} never changes state; fit a trace with spells both ways")
    p, q = counts[True, False] / from_up, counts[False, True] / from_down
    g = trace.gap_s / 3600.0
    total = -math.log(1.0 - p - q) / g if p + q < 1.0 else (p + q) / g
    return MarkovFit(total * p / (p + q), total * q / (p + q))


def twin_gap_s(gap_s: float) -> float:
    """A twin's tick: the trace's, rounded to a whole minute (so a 1-minute unit is exact for
    0.25 h shards and 0.1 / 0.2 h changeovers; the 32 s and 195 s ticks would need 4 s and 15 s)."""
    return max(60.0, 60.0 * round(gap_s / 60.0))


def twin(trace: Trace, fit: MarkovFit, hours: float = 1000.0, seed: int = 1) -> Trace:
    """The trace's Markov twin: the fitted chain, sampled at :func:`twin_gap_s`."""
    name = f"twin:{trace.name}"
    return markov(fit.up_to_down, fit.down_to_up, hours, twin_gap_s(trace.gap_s), seed, name=name)


def exact_grid(config: SimConfig, gap_h: float) -> Grid:
    """mdp's grid with a step of one tick and a unit dividing the tick, the shard and the changeover."""
    lengths = (gap_h, config.shard_size_h, config.changeover_h)
    seconds = [round(x * 3600) for x in lengths]
    if any(abs(s - x * 3600) > 1e-6 for s, x in zip(seconds, lengths, strict=True)):
        raise ValueError("exact_grid needs whole seconds for the tick, shard and changeover; round them")
    unit = math.gcd(*seconds)
    return Grid(
        step_h=gap_h,
        shard_h=config.shard_size_h,
        unit_h=unit / 3600.0,
        per_step=seconds[0] // unit,
        shard_units=seconds[1] // unit,
        changeover_units=seconds[2] // unit,
        steps=math.ceil(config.deadline_h / gap_h - 1e-9),
        shards=config.shards,
        merge=1,
    )


@functools.lru_cache(maxsize=4)
def oracle_table(config: SimConfig, grid: Grid, fit: MarkovFit, credit_commits: bool = True) -> Table:
    """The table for the true rates over the whole horizon (shared by every start of a row).

    ``credit_commits``: Spot is safe while on-demand still fits after a preemption at the next
    step, the commits of this step kept (exact); else counted from the shards left now, as
    ``mdp`` and slack_aware's safety rule count it.
    """
    rates = Rates.of(fit.up_to_down, fit.down_to_up, grid.step_h)
    return Table(grid, config, rates, grid.steps, credit_commits=credit_commits)


class OracleRates(MarkovDecision):
    """``mdp`` with the trace's true rates instead of learned ones, on the exact grid (``exact``):
    its table counts the fallback as slack_aware's safety rule above it does (the rule and the
    table agree, so the rule should seldom override it)."""

    name = "mdp_oracle_rates"

    def __init__(self, fit: MarkovFit, *, exact: bool = True) -> None:
        super().__init__()
        self.fit, self.exact = fit, exact

    def reset(self, config: SimConfig, gap_h: float) -> None:
        super().reset(config, gap_h)
        if self.exact:
            self.grid = exact_grid(config, gap_h)

    def _table(
        self,
        config: SimConfig,
        availability: float,
        run_h: float,
        time_left_h: float,
        *,
        waste_price: float = 0.0,
    ) -> Table:
        if waste_price:
            raise ValueError("the oracle-rates table has no risk term; run it with waste_price=0")
        if config.workers != 1:
            raise ValueError("the oracle-rates table is for one worker; run it with workers=1")
        return oracle_table(config, self.grid, self.fit, credit_commits=not self.safety_rule)


class TableAlone(OracleRates):
    """The Bayes-optimal online policy: the oracle table alone, with only its own, exact constraint
    (waiting or Spot only while on-demand still fits after Spot is gone at the next step, the
    commits of this step kept) and the penalty for a state unfinished at the deadline."""

    name = "mdp_oracle_table"
    safety_rule = False


# -- spells with memory: the table with the spell's age (docs/simulator.md, *Eighth round*) -------

#: hazards of an age bucket with no spell ending in it are taken as this (per hour): a phase no
#: spell leaves would hold Spot there or missing for ever
MIN_HAZARD_PER_H = 0.01


def fit_ages(trace: Trace, edges_h: Sequence[float] = spells.AGE_EDGES_H) -> AgeRates:
    """A trace's hazard of a spell ending by age bucket, present and absent (``spells.Hazard``:
    ends ÷ hours at risk in the bucket); a bucket no spell reaches takes the one before it."""
    fitted = []
    up, down = spells.Hazard(tuple(edges_h)), spells.Hazard(tuple(edges_h))
    present, absent = spells.spell_lengths(trace)
    up.add(present, trace.gap_s)
    down.add(absent, trace.gap_s)
    for kind in (down, up):
        rates: list[float] = []
        for rate in kind.per_h():
            rates.append(rates[-1] if rate is None and rates else max(rate or 0.0, MIN_HAZARD_PER_H))
        fitted.append(tuple(rates))
    return AgeRates((fitted[0], fitted[1]), tuple(edges_h))


def age_twin(
    trace: Trace, ages: AgeRates, hours: float = 1000.0, seed: int = 1
) -> tuple[Trace, tuple[int, ...]]:
    """The trace's semi-Markov twin: the chain of ``ages`` sampled at :func:`twin_gap_s` (first
    tick from its stationary share), and each tick's age phase (what :class:`AgeTableAlone` sees)."""
    double, states = chain_twin(f"age-twin:{trace.name}", twin_gap_s(trace.gap_s), ages, hours, seed)
    return double, tuple(z % ages.buckets for z in states)


def chain_twin(
    name: str, gap_s: float, chain: AgeRates | RegimeRates, hours: float, seed: int
) -> tuple[Trace, tuple[int, ...]]:
    """A trace drawn from ``chain`` every ``gap_s`` (first tick from its stationary share), and
    each tick's state ``z``."""
    step = chain.transition(gap_s / 3600.0)
    cumulative = [list(np.cumsum(row)) for row in step]
    up = chain.up.tolist()
    last = len(up) - 1
    rng = random.Random(seed)
    z = min(bisect.bisect_right(list(np.cumsum(chain.stationary())), rng.random()), last)
    capacity: list[int] = []
    states: list[int] = []
    for _ in range(max(1, round(hours * 3600 / gap_s))):
        capacity.append(int(up[z]))
        states.append(z)
        z = min(bisect.bisect_right(cumulative[z], rng.random()), last)
    return Trace(name, gap_s, tuple(capacity)), tuple(states)


@functools.lru_cache(maxsize=2)  # a row's two tables (told the regime, told the age phase)
def chain_table(config: SimConfig, grid: Grid, chain: AgeRates | RegimeRates) -> AgeTable:
    """The table over a twin's true chain (:class:`AgeRates`, :class:`RegimeRates`) for the whole
    horizon (the exact constraint)."""
    return AgeTable(grid, config, chain, grid.steps, credit_commits=True)


class ChainTableAlone(MarkovDecision):
    """The Bayes-optimal online policy on a twin drawn from a known chain: the table over that
    chain (:func:`chain_table`), told each tick's hidden state ``states[t]``, alone as
    :class:`TableAlone` (its exact constraint). Given that state nothing else in the trace's past
    says more of its future, so its cost is a floor for every policy that sees only the trace."""

    name = "mdp_chain_table"
    safety_rule = False

    def __init__(self, chain: AgeRates | RegimeRates, states: Sequence[int], start_tick: int) -> None:
        super().__init__()
        self.chain, self.states, self.start_tick = chain, states, start_tick
        self.tick = 0

    def reset(self, config: SimConfig, gap_h: float) -> None:
        super().reset(config, gap_h)
        self.grid = exact_grid(config, gap_h)

    def decide(self, view: View) -> list[Choice]:
        self.tick = view.tick
        return super().decide(view)

    def _table(
        self,
        config: SimConfig,
        availability: float,
        run_h: float,
        time_left_h: float,
        *,
        waste_price: float = 0.0,
    ) -> Table:
        if config.workers != 1:
            raise ValueError(f"{self.name} is a table for one worker; run it with workers=1")
        return chain_table(config, self.grid, self.chain)

    def _spot_state(self, snapshot: JobSnapshot) -> int:
        return self.states[(self.start_tick + self.tick) % len(self.states)]


class AgeTableAlone(ChainTableAlone):
    """:class:`ChainTableAlone` on a twin of :func:`age_twin`: the table with age, told each
    tick's age phase. Knowing the phase is at least as much as knowing the spell's age (given the
    phase the age says nothing more of the future)."""

    name = "mdp_age_table"

    def __init__(self, ages: AgeRates, phases: Sequence[int], start_tick: int) -> None:
        super().__init__(ages, phases, start_tick)
        self.ages = ages

    def _spot_state(self, snapshot: JobSnapshot) -> int:
        return int(snapshot.spot_available) * self.ages.buckets + super()._spot_state(snapshot)


class AgeTableByAge(AgeTableAlone):
    """:class:`AgeTableAlone` told only what a policy on the trace sees: the phase is taken as the
    age bucket of the current spell's age (ticks since Spot was last there / missing, from the
    trace up to now), not the twin's true phase. An online policy, so it costs no less than the
    floor; how much more is what not seeing the phase costs."""

    name = "mdp_age_table_by_age"

    def __init__(self, ages: AgeRates, trace: Trace, start_tick: int) -> None:
        super().__init__(ages, (), start_tick)
        self.trace = trace

    def _spot_state(self, snapshot: JobSnapshot) -> int:
        now, gap_h = self.start_tick + self.tick, self.trace.gap_s / 3600.0
        there = self.trace.at(now) > 0
        oldest = math.ceil(self.ages.edges_h[-1] / gap_h)  # past it the age's bucket is the last
        age = 0
        while age < oldest and now - age > 0 and (self.trace.at(now - age - 1) > 0) == there:
            age += 1
        bucket = max(i for i, edge in enumerate(self.ages.edges_h) if age * gap_h >= edge - 1e-9)
        return int(snapshot.spot_available) * self.ages.buckets + bucket


# -- regimes: the table told the hidden regime (docs/simulator.md, *Tenth round*) ---------------

#: the regime twins' regimes (3: their twins' successive spells correlate nearer the real traces'
#: than with 2, docs/simulator.md, *Tenth round*), and the EM rounds of their fit
REGIMES = 3
EM_ROUNDS = 100
#: coordinate-ascent rounds of each EM round's hazard fit (shared shape × each regime's factor)
INNER_ROUNDS = 5
#: the traces the regime twins are fitted to: those of this many days or more (the short ones hold
#: 28–98 spells of a kind, too few for two regimes' hazards by age)
REGIME_MIN_DAYS = 20.0


def fit_regimes(
    trace: Trace,
    regimes: int = REGIMES,
    edges_h: Sequence[float] = spells.AGE_EDGES_H,
    rounds: int = EM_ROUNDS,
) -> RegimeRates:
    """A hidden-Markov fit over the trace's successive spells (``spells.spell_lengths``' spells, in
    order, both kinds): each spell has a hidden regime, drawn anew by ``switch`` where Spot returns
    (a present spell and the absence after it share theirs: switching at every spell end would let
    two regimes merely take turns, one the present spells' and one the absent ones'), and its length
    the regime's hazard by age bucket, a piecewise-exponential likelihood (as :func:`fit_ages`'
    ends ÷ hours at risk). Per kind the regimes share the hazard's shape by age and differ by a
    factor on it (proportional hazards: one regime's spells of a kind are all longer; free hazards
    per regime let EM fit a mixture of spell shapes that take turns instead of runs).
    EM (Baum–Welch) from a split of each kind's spells by length (regime 0: the shortest); a
    bucket without weight takes the one before, no hazard under ``MIN_HAZARD_PER_H``, as in
    :func:`fit_ages`. Regimes ordered by their present spells' mean length."""
    if regimes < 1:
        raise ValueError(f"regimes must be >= 1 (e.g. {REGIMES}), got {regimes}")
    runs = [(there, len(list(group))) for there, group in itertools.groupby(c > 0 for c in trace.capacity)]
    runs = runs[1:-1]  # cut by the trace's ends
    if len(runs) < 4 * regimes:
        raise ValueError(f"trace {trace.name!r} has {len(runs)} whole spells; fit regimes to a longer trace")
    gap_h = trace.gap_s / 3600.0
    edges = list(edges_h)
    n, b = len(runs), len(edges)
    kind = np.array([int(there) for there, _ in runs])
    risk = np.zeros((n, b))  # hours at risk per age bucket
    ends = np.zeros((n, b))  # 1 in the bucket the spell ends in
    for i, (_, length) in enumerate(runs):
        buckets = np.searchsorted(edges, np.arange(length) * gap_h + 1e-9, side="right") - 1
        np.add.at(risk[i], buckets, gap_h)
        ends[i, buckets[-1]] = 1.0
    # start: each kind's spells split into ``regimes`` groups by length
    weight = np.zeros((n, regimes))
    for k in (0, 1):
        mine = np.flatnonzero(kind == k)
        order = mine[np.argsort([runs[i][1] for i in mine], kind="stable")]
        for rho, group in enumerate(np.array_split(order, regimes)):
            weight[group, rho] = 1.0
    switch = np.full((regimes, regimes), 1.0 / regimes)
    first = np.full(regimes, 1.0 / regimes)
    base = np.ones((2, b))
    scale = np.ones((regimes, 2))
    for _ in range(rounds):
        # M: per kind, the hazard by age shared by the regimes and each regime's factor on it
        # (coordinate ascent); the switch chances over successive spells (below, with E)
        for k in (0, 1):
            mine = kind == k
            ended, at_risk = weight[mine].T @ ends[mine], weight[mine].T @ risk[mine]  # [ρ, b]
            for _ in range(INNER_ROUNDS):
                scale[:, k] = ended.sum(axis=1) / np.maximum(at_risk @ base[k], 1e-12)
                exposure = scale[:, k] @ at_risk
                rates: list[float] = []
                for e, h in zip(ended.sum(axis=0), exposure, strict=True):
                    rates.append(
                        rates[-1] if h <= 0 and rates else max(e / h if h > 0 else 0.0, MIN_HAZARD_PER_H)
                    )
                base[k] = rates
        hazards = np.maximum(scale[:, :, None] * base[None], MIN_HAZARD_PER_H)  # [ρ, kind, b]
        # E: forward–backward over the spells, emissions the piecewise-exponential likelihood
        rate = hazards[:, kind, :].transpose(1, 0, 2)  # [spell, ρ, b]
        log_like = (np.log(rate) * ends[:, None, :] - rate * risk[:, None, :]).sum(axis=2)
        like = np.exp(log_like - log_like.max(axis=1, keepdims=True))
        # the regime is drawn anew only where Spot returns (after an absent spell)
        step = np.where(kind[:-1, None, None] == 0, switch[None], np.eye(regimes)[None])
        forward = np.zeros((n, regimes))
        forward[0] = first * like[0]
        forward[0] /= forward[0].sum()
        for i in range(1, n):
            forward[i] = (forward[i - 1] @ step[i - 1]) * like[i]
            forward[i] /= forward[i].sum()
        backward = np.ones((n, regimes))
        for i in range(n - 2, -1, -1):
            backward[i] = step[i] @ (like[i + 1] * backward[i + 1])
            backward[i] /= backward[i].sum()
        weight = forward * backward
        weight /= weight.sum(axis=1, keepdims=True)
        pairs = forward[:-1, :, None] * step * (like[1:] * backward[1:])[:, None, :]
        pairs = (pairs / pairs.sum(axis=(1, 2), keepdims=True))[kind[:-1] == 0].sum(axis=0)
        switch = pairs / pairs.sum(axis=1, keepdims=True)
        first = weight[0]
    mean_up = [
        float((weight[kind == 1, rho] * risk[kind == 1].sum(axis=1)).sum() / weight[kind == 1, rho].sum())
        for rho in range(regimes)
    ]
    order = np.argsort(mean_up, kind="stable")
    fitted = tuple(
        AgeRates((tuple(hazards[rho, 0].tolist()), tuple(hazards[rho, 1].tolist())), tuple(edges_h))
        for rho in order
    )
    return RegimeRates(fitted, tuple(tuple(float(switch[a, c]) for c in order) for a in order))


def regime_twin(
    trace: Trace, chain: RegimeRates, hours: float = 1000.0, seed: int = 1
) -> tuple[Trace, tuple[int, ...]]:
    """The trace's regime twin: ``chain`` sampled at :func:`twin_gap_s` (first tick from its
    stationary share), and each tick's state ``z`` (regime, Spot there, age phase: what
    :class:`ChainTableAlone` is told)."""
    return chain_twin(f"regime-twin:{trace.name}", twin_gap_s(trace.gap_s), chain, hours, seed)


# -- the check: brute force over every online policy on a tiny job ------------------------------


class _Paused(Exception):
    def __init__(self, view: View) -> None:
        self.view = view


class _Script:
    """Replays a fixed list of choices, one per tick, and pauses the run where it ends."""

    name = "script"

    def __init__(self, actions: Sequence[Mode]) -> None:
        self.actions = actions

    def reset(self, config: SimConfig, gap_h: float) -> None:
        pass

    def decide(self, view: View) -> list[Mode]:
        if view.tick < len(self.actions):
            return [self.actions[view.tick]]
        raise _Paused(view)


def online_optimum(config: SimConfig, gap_s: float, fit: MarkovFit, first_up: bool) -> float:
    """The least expected cost of any online policy that never misses, by expectimax over the
    engine itself: at each tick every choice (wait, Spot where there, on-demand) against both
    next states of the chain; runs are replayed from the start, and the cost-to-go is memoised on
    the engine's state. Exponential in nothing but the reachable states: for tiny jobs only."""
    rates = Rates.of(fit.up_to_down, fit.down_to_up, gap_s / 3600.0)
    step = ((1 - rates.down_up, rates.down_up), (1 - rates.up_up, rates.up_up))
    return chain_optimum(config, gap_s, step, (False, True), int(first_up))


def chain_optimum(
    config: SimConfig, gap_s: float, step: Sequence[Sequence[float]], up: Sequence[bool], first: int
) -> float:
    """:func:`online_optimum` for Spot driven by any chain the policy sees the state of: per tick
    ``step[z][z']`` from state ``z``, Spot there in the states ``up`` (a twin of
    :func:`age_twin`: ``z`` = there × phases + phase, the policy told the phase)."""
    memo: dict[tuple[object, ...], float] = {}

    def total(history: tuple[int, ...], actions: tuple[Mode, ...]) -> float:
        trace = Trace("brute", gap_s, tuple(int(up[z]) for z in history))
        try:
            result = simulate(trace, 0, config, _Script(actions))
        except _Paused as paused:
            return paused.view.cost + to_go(history, actions, paused.view)
        return math.inf if result.missed else result.cost

    def to_go(history: tuple[int, ...], actions: tuple[Mode, ...], view: View) -> float:
        slot = view.slots[0]
        key: tuple[object, ...] = (view.tick, history[-1], view.committed_shards, view.pending_shards)
        key += (slot.mode, slot.busy, round(slot.changeover_left_h, 6), round(slot.progress_h, 6))
        if key not in memo:
            best = math.inf
            z = history[-1]
            for choice in (Mode.NONE, Mode.ON_DEMAND) + ((Mode.SPOT,) if up[z] else ()):
                value = math.fsum(
                    p * total(history + (nxt,), actions + (choice,)) for nxt, p in enumerate(step[z]) if p > 0
                )
                best = min(best, value - view.cost)
            memo[key] = best
        return memo[key]

    return total((first,), ())


def expected_cost(
    make: Callable[[], Policy], config: SimConfig, gap_s: float, fit: MarkovFit, first_up: bool
) -> float:
    """A policy's exact expected cost on the chain: every trace up to the deadline, weighted."""
    rates = Rates.of(fit.up_to_down, fit.down_to_up, gap_s / 3600.0)
    ticks = math.ceil(config.deadline_h * 3600 / gap_s - 1e-9)
    mean = 0.0
    for rest in itertools.product((0, 1), repeat=ticks - 1):
        history = (int(first_up),) + rest
        weight = 1.0
        for a, b in itertools.pairwise(history):
            stay = rates.up_up if a else rates.down_up
            weight *= stay if b else 1 - stay
        result = simulate(Trace("all", gap_s, history + (0,)), 0, config, make())
        mean += weight * (math.inf if result.missed else result.cost)
    return mean


#: tiny jobs of the check: (work h, deadline h, changeover h), 10-minute ticks, 0.25 h shards
CHECK_JOBS = ((0.5, 1.5, 0.1), (0.75, 1.5, 0.2), (0.5, 1.5, 0.0))
CHECK_FIT = MarkovFit(up_to_down=1.5, down_to_up=1.0)


def check(fit: MarkovFit = CHECK_FIT, gap_s: float = 600.0) -> list[dict[str, float]]:
    """Brute force against the oracle table (its own value, and its run with and without the rule)."""
    out = []
    for (work, deadline, changeover), first_up in itertools.product(CHECK_JOBS, (True, False)):
        cfg = SimConfig(work_h=work, deadline_h=deadline, changeover_h=changeover, price_ratio=3.0)
        grid = exact_grid(cfg, gap_s / 3600.0)
        table = oracle_table(cfg, grid, fit)
        out.append(
            {
                "work_h": work,
                "deadline_h": deadline,
                "changeover_h": changeover,
                "first_up": float(first_up),
                "brute_force": online_optimum(cfg, gap_s, fit, first_up),
                "table_value": float(table.idle[grid.steps][int(first_up), grid.shards]),
                "oracle": expected_cost(lambda: OracleRates(fit), cfg, gap_s, fit, first_up),
                "table_alone": expected_cost(lambda: TableAlone(fit), cfg, gap_s, fit, first_up),
            }
        )
    return out


# -- the measurement on the Markov twins ----------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One twin × setting: each policy's cost per start, and what the oracle's rule did."""

    trace: str
    fit: MarkovFit
    setting: Setting
    costs: dict[str, tuple[float, ...]]
    misses: dict[str, int]
    overrides: int  # worker choices where slack_aware's rule changed the oracle table's action
    decisions: int


def run_row(args: tuple[Trace, MarkovFit, Setting]) -> Row:
    trace, fit, setting = args
    cfg = setting.config()
    ticks = start_ticks(trace, cfg, starts=setting.starts, seed=1)
    params = PolicyParams()
    makers: dict[str, Callable[[int], Policy]] = {
        "oracle": lambda _: OracleRates(fit),
        "table_alone": lambda _: TableAlone(fit),
        "oracle_mdp_grid": lambda _: OracleRates(fit, exact=False),
        "mdp": lambda t: online_at("mdp", trace, t, 1, params),
        "slack_aware": lambda t: slack_aware_at([trace], t, 1),
        "uniform_progress": lambda _: UniformProgress(),
        "on_demand": lambda _: OnDemand(),
    }
    costs: dict[str, list[float]] = {name: [] for name in POLICIES}
    misses = dict.fromkeys(POLICIES, 0)
    overrides = decisions = 0
    for tick in ticks:
        costs["exact"].append(exact_optimum(trace, tick, cfg).cost)
        for name, make in makers.items():
            policy = make(tick)
            result = simulate(trace, tick, cfg, policy)
            costs[name].append(result.cost)
            misses[name] += result.missed
            if name == "oracle" and isinstance(policy, OracleRates):
                overrides += policy.overrides
                decisions += policy.decisions
    frozen = {name: tuple(values) for name, values in costs.items()}
    return Row(trace.name, fit, setting, frozen, misses, overrides, decisions)


def measure(
    traces: Sequence[Trace], starts: int = 20, jobs: int = 1, hours: float = 1000.0, seed: int = 1
) -> list[Row]:
    """Every single-node trace's twin × the study's ``N = 1`` settings, ``starts`` starts each."""
    work = []
    for trace in traces:
        fit = fit_markov(trace)
        double = twin(trace, fit, hours, seed)
        work += [(double, fit, s) for s in settings(starts_n1=starts) if s.workers == 1]
    if jobs == 1:
        return [run_row(w) for w in work]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run_row, work))


#: the columns of the measurement on the semi-Markov twins (``--ages``), in order
AGE_POLICIES = (
    "exact",
    "age_table",
    "age_table_by_age",
    "table_alone",
    "mdp",
    "slack_aware",
    "uniform_progress",
)


def run_age_row(args: tuple[Trace, tuple[int, ...], AgeRates, Setting]) -> Row:
    """One semi-Markov twin × setting: the table with age (told the phase), the memoryless
    Bayes-optimal table for the twin's own Markov fit, and the online policies."""
    trace, phases, ages, setting = args
    fit = fit_markov(trace)
    params = PolicyParams()
    makers: dict[str, Callable[[int], Policy]] = {
        "age_table": lambda t: AgeTableAlone(ages, phases, t),
        "age_table_by_age": lambda t: AgeTableByAge(ages, trace, t),
        "table_alone": lambda _: TableAlone(fit),
        "mdp": lambda t: online_at("mdp", trace, t, 1, params),
        "slack_aware": lambda t: slack_aware_at([trace], t, 1),
        "uniform_progress": lambda _: UniformProgress(),
    }
    return _twin_row(trace, fit, setting, AGE_POLICIES, makers)


def _twin_row(
    trace: Trace,
    fit: MarkovFit,
    setting: Setting,
    columns: Sequence[str],
    makers: Mapping[str, Callable[[int], Policy]],
) -> Row:
    """One twin × setting: at each start the exact optimum (column ``exact``) and each policy of
    ``makers`` (built anew per start), their costs in ``columns``' order and their misses."""
    cfg = setting.config()
    costs: dict[str, list[float]] = {name: [] for name in columns}
    misses = dict.fromkeys(columns, 0)
    for tick in start_ticks(trace, cfg, starts=setting.starts, seed=1):
        costs["exact"].append(exact_optimum(trace, tick, cfg).cost)
        for name, make in makers.items():
            result = simulate(trace, tick, cfg, make(tick))
            costs[name].append(result.cost)
            misses[name] += result.missed
    frozen = {name: tuple(values) for name, values in costs.items()}
    return Row(trace.name, fit, setting, frozen, misses, 0, 0)


def measure_ages(
    traces: Sequence[Trace], starts: int = 20, hours: float = 1000.0, seed: int = 1
) -> list[Row]:
    """Every single-node trace's semi-Markov twin × the study's ``N = 1`` settings (one process:
    a table with age of a 60 s tick holds about 0.6 GB)."""
    rows = []
    for trace in traces:
        ages = fit_ages(trace)
        double, phases = age_twin(trace, ages, hours, seed)
        for s in settings(starts_n1=starts):
            if s.workers == 1:
                rows.append(run_age_row((double, phases, ages, s)))
                print(f"# {double.name} D={s.deadline_h:g} d={s.changeover_h:g}", file=sys.stderr, flush=True)
    return rows


#: the columns of the measurement on the regime twins (``--regimes``), in order
REGIME_POLICIES = ("exact", "regime_table", "age_table", "slack_aware", "uniform_progress")


def run_regime_row(args: tuple[Trace, tuple[int, ...], RegimeRates, Setting]) -> Row:
    """One regime twin × setting: the table told the hidden regime and age phase (the floor), the
    table with age for the twin's own semi-Markov fit told the age phase (the Eighth round's floor,
    blind to the regime), and the online policies."""
    trace, states, chain, setting = args
    ages = fit_ages(trace)
    phases = tuple(z % chain.buckets for z in states)
    makers: dict[str, Callable[[int], Policy]] = {
        "regime_table": lambda t: ChainTableAlone(chain, states, t),
        "age_table": lambda t: AgeTableAlone(ages, phases, t),
        "slack_aware": lambda t: slack_aware_at([trace], t, 1),
        "uniform_progress": lambda _: UniformProgress(),
    }
    return _twin_row(trace, fit_markov(trace), setting, REGIME_POLICIES, makers)


def measure_regimes(
    traces: Sequence[Trace], starts: int = 20, hours: float = 1000.0, seed: int = 1, regimes: int = REGIMES
) -> list[Row]:
    """Every long single-node trace's regime twin × the study's ``N = 1`` settings (one process)."""
    rows = []
    for trace in traces:
        if trace.hours < REGIME_MIN_DAYS * 24.0:
            continue
        chain = fit_regimes(trace, regimes)
        double, states = regime_twin(trace, chain, hours, seed)
        for s in settings(starts_n1=starts):
            if s.workers == 1:
                rows.append(run_regime_row((double, states, chain, s)))
                print(f"# {double.name} D={s.deadline_h:g} d={s.changeover_h:g}", file=sys.stderr, flush=True)
    return rows


def ratios(rows: Sequence[Row], name: str) -> tuple[float, float]:
    """``name``'s cost over the exact optimum: the ratio of the mean costs, and the mean per-start ratio."""
    mine = [c for r in rows for c in r.costs[name]]
    exact = [c for r in rows for c in r.costs["exact"]]
    per_start = math.fsum(a / b for a, b in zip(mine, exact, strict=True)) / len(mine)
    return math.fsum(mine) / math.fsum(exact), per_start


def standard_error(rows: Sequence[Row], name: str) -> float:
    """The ratio of means' standard error (delta method, starts taken as independent draws)."""
    mine = [c for r in rows for c in r.costs[name]]
    exact = [c for r in rows for c in r.costs["exact"]]
    n, ratio = len(mine), math.fsum(mine) / math.fsum(exact)
    residual = [a - ratio * b for a, b in zip(mine, exact, strict=True)]
    mean = math.fsum(residual) / n
    variance = math.fsum((x - mean) ** 2 for x in residual) / max(1, n - 1)
    return math.sqrt(variance / n) / (math.fsum(exact) / n)


def markdown(rows: Sequence[Row], columns: Sequence[str] = POLICIES[1:]) -> str:
    """Per twin (its 4 settings together) and overall: ratio of means (mean of ratios) per policy."""
    head = "| twin of | mean spell up / down h | availability | " + " | ".join(columns) + " |\n"
    head += "|---" * (3 + len(columns)) + "|\n"
    lines = []
    groups = {r.trace: [x for x in rows if x.trace == r.trace] for r in rows}
    for name, group in [*groups.items(), ("**all**", list(rows))]:
        fit = group[0].fit
        spells = f"{1 / fit.up_to_down:.2f} / {1 / fit.down_to_up:.2f}" if name != "**all**" else ""
        avail = f"{fit.availability:.3f}" if name != "**all**" else ""
        cells = [f"{a:.3f} ({b:.3f})" for a, b in (ratios(group, c) for c in columns)]
        lines.append(f"| {name.split(':', 1)[-1]} | {spells} | {avail} | " + " | ".join(cells) + " |")
    for key in sorted({(r.setting.deadline_h, r.setting.changeover_h) for r in rows}):
        group = [r for r in rows if (r.setting.deadline_h, r.setting.changeover_h) == key]
        cells = [f"{a:.3f} ({b:.3f})" for a, b in (ratios(group, c) for c in columns)]
        lines.append(f"| all, D = {key[0]:g} h, d = {key[1]:g} h | | | " + " | ".join(cells) + " |")
    return head + "\n".join(lines)


def summary(rows: Sequence[Row], columns: Sequence[str] = POLICIES[1:]) -> str:
    parts = [f"rows={len(rows)} starts={sum(len(r.costs['exact']) for r in rows)}"]
    for name in columns:
        a, b = ratios(rows, name)
        parts.append(f"{name}={a:.4f}/{b:.4f}±{standard_error(rows, name):.4f}")
    decisions = sum(r.decisions for r in rows)
    parts.append(f"oracle_overrides={sum(r.overrides for r in rows)}/{decisions}")
    parts.append("misses=" + ",".join(f"{n}:{sum(r.misses[n] for r in rows)}" for n in columns))
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_deadline_batch.sim.online_bound")
    parser.add_argument("--traces", type=Path, help="folder searched for *.json Spot traces (1-GPU rows)")
    parser.add_argument("--starts", type=int, default=20, help="starts per twin and setting")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--hours", type=float, default=1000.0, help="length of each twin")
    parser.add_argument("--twin-seed", type=int, default=1, help="the twins' draw")
    parser.add_argument("--check", action="store_true", help="brute force against the oracle on tiny jobs")
    parser.add_argument("--out", type=Path, help="also write every start's costs here (JSON lines)")
    parser.add_argument(
        "--ages", action="store_true", help="semi-Markov twins (spells with memory) and the table with age"
    )
    parser.add_argument(
        "--regimes", action="store_true", help="regime twins of the long traces and the table told the regime"
    )
    parser.add_argument("--regime-count", type=int, default=REGIMES, help="regimes of the regime twins' fit")
    args = parser.parse_args(argv)
    if args.check:
        for line in check():
            print(" ".join(f"{k}={v:.6g}" for k, v in line.items()))
        return 0
    if not args.traces:
        parser.error("pass --traces DIR (the shared spot-traces folder) or --check")
    traces = [load_trace(p) for p in sorted(args.traces.rglob("*.json"))]
    if args.ages and args.regimes:
        parser.error("pass --ages or --regimes, not both")
    if args.regimes:
        rows = measure_regimes(traces, args.starts, args.hours, args.twin_seed, args.regime_count)
        columns: Sequence[str] = REGIME_POLICIES[1:]
    elif args.ages:
        rows = measure_ages(traces, args.starts, args.hours, args.twin_seed)
        columns = AGE_POLICIES[1:]
    else:
        rows = measure(traces, args.starts, args.jobs, args.hours, args.twin_seed)
        columns = POLICIES[1:]
    print(markdown(rows, columns))
    print(summary(rows, columns))
    if args.out:
        with args.out.open("w") as out:
            for r in rows:
                fields = {
                    "trace": r.trace,
                    "deadline_h": r.setting.deadline_h,
                    "changeover_h": r.setting.changeover_h,
                }
                print(
                    json.dumps({**fields, "costs": r.costs, "misses": r.misses, "overrides": r.overrides}),
                    file=out,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
