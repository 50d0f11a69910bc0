"""Calibration: per-pool service rates learned from committed microbatches, and Spot availability.

Pure functions over plain values. A pool's prior is its :class:`PoolSpec` rates; each committed
microbatch (a :class:`RateSample`: tokens, seconds and the pool it ran on) moves that pool's
estimate by an exponentially weighted step whose weight grows with the sample's size, and single
outliers are clipped so one slow microbatch (a cold cache, a noisy neighbour) cannot swing the
remaining-work estimate. :mod:`core.job_view` folds a job's commits into a :class:`Calibration`
and takes remaining work, predicted finish, slack and placement from it.

:class:`AvailabilityEstimate` learns how often Spot capacity is there (the simulator's
``slack_aware`` policy feeds it the capacity it sees); :class:`PoolAvailability` is production's
counterpart, from the time a pool's Spot tries ran against the time they waited for capacity in
vain (:func:`availability_prior`: over earlier jobs on the pool). :class:`SpotTries` learns what the job's
finished Spot tries tell: preemptions per Spot-hour and whether Spot still makes progress (the job
view folds the store's attempt rows into it, the simulator its own preempted tries; docs/design.md
§5, *Observed preemptions*).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from airflow_deadline_batch.core.pools import PoolSpec

#: tokens of evidence the prior is worth (a few microbatches' worth)
PRIOR_TOKENS = 20_000.0
#: a sample may move the rate by at most this factor either way
MAX_STEP_RATIO = 4.0
#: completion share of the prior blend when nothing has been measured yet
DEFAULT_COMPLETION_SHARE = 0.5


@dataclass(frozen=True)
class RateSample:
    """One committed microbatch: tokens processed in ``elapsed_s`` on ``pool`` (a pool name)."""

    pool: str
    records: int
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class PoolEstimate:
    """What is known of one pool's speed for the job's model.

    ``prior_tokens_per_s`` is the pool's nominal rate for the job's mix of prompt and completion
    tokens; ``tokens_per_s`` the learned one (equal to the prior until a microbatch commits).
    """

    tokens_per_s: float
    prior_tokens_per_s: float
    evidence_tokens: float = PRIOR_TOKENS
    samples: int = 0
    busy_s: float = 0.0

    @property
    def measured(self) -> bool:
        return self.samples > 0

    @property
    def slowdown(self) -> float:
        """Seconds this pool really takes per nominal second (1.0 before any measurement)."""
        return self.prior_tokens_per_s / self.tokens_per_s


def prior_tokens_per_s(spec: PoolSpec, completion_share: float = DEFAULT_COMPLETION_SHARE) -> float:
    """Blended tokens/s from a pool's prefill and decode rates (harmonic: time adds up, not rate)."""
    share = min(max(completion_share, 0.0), 1.0)
    return 1.0 / ((1 - share) / spec.prefill_tokens_per_s + share / spec.decode_tokens_per_s)


def completion_share(samples: Iterable[RateSample]) -> float:
    """Share of completion tokens in the samples (:data:`DEFAULT_COMPLETION_SHARE` without any)."""
    prompt = completion = 0
    for sample in samples:
        prompt += max(0, sample.prompt_tokens)
        completion += max(0, sample.completion_tokens)
    total = prompt + completion
    return completion / total if total else DEFAULT_COMPLETION_SHARE


@dataclass(frozen=True)
class Calibration:
    """Per-pool estimates keyed by pool name; immutable, every update returns a new one."""

    pools: Mapping[str, PoolEstimate] = field(default_factory=dict)

    @classmethod
    def from_specs(
        cls, specs: Iterable[PoolSpec], completion_share: float = DEFAULT_COMPLETION_SHARE
    ) -> Calibration:
        estimates = {}
        for spec in specs:
            prior = prior_tokens_per_s(spec, completion_share)
            estimates[spec.name] = PoolEstimate(tokens_per_s=prior, prior_tokens_per_s=prior)
        return cls(estimates)

    def estimate(self, pool: str) -> PoolEstimate:
        try:
            return self.pools[pool]
        except KeyError:
            raise KeyError(f"no calibration for pool {pool!r}; known: {sorted(self.pools)}") from None

    def observe_rate(self, sample: RateSample) -> Calibration:
        """Fold one committed microbatch into its pool's tokens/s (size-weighted, clipped)."""
        return self.observe_all((sample,))

    def observe_all(self, samples: Iterable[RateSample]) -> Calibration:
        """Fold samples in order (oldest first), each into its pool's tokens/s (size-weighted, clipped),
        on plain numbers, with one :class:`PoolEstimate` per pool at the end (the job view folds
        every commit of the job on every decision)."""
        state: dict[str, list[float]] = {}
        for sample in samples:
            tokens = sample.prompt_tokens + sample.completion_tokens
            if sample.elapsed_s <= 0 or tokens <= 0:
                continue
            now = state.get(sample.pool)
            if now is None:
                est = self.estimate(sample.pool)
                now = state[sample.pool] = [est.tokens_per_s, est.evidence_tokens, est.samples, est.busy_s]
            rate, evidence = now[0], now[1]
            measured = tokens / sample.elapsed_s
            measured = min(max(measured, rate / MAX_STEP_RATIO), rate * MAX_STEP_RATIO)
            weight = tokens / (evidence + tokens)
            # Average time per token (not rate) so that slow and fast samples weigh by the time they took.
            seconds_per_token = (1 - weight) / rate + weight / measured
            now[0] = 1.0 / seconds_per_token
            now[1] = min(evidence + tokens, 2 * PRIOR_TOKENS)
            now[2] += 1
            now[3] += sample.elapsed_s
        if not state:
            return self
        pools = dict(self.pools)
        for name, (rate, evidence, samples_seen, busy) in state.items():
            pools[name] = replace(
                pools[name],
                tokens_per_s=rate,
                evidence_tokens=evidence,
                samples=int(samples_seen),
                busy_s=busy,
            )
        return Calibration(pools)


def calibrate(specs: Iterable[PoolSpec], samples: Iterable[RateSample]) -> Calibration:
    """The calibration of a job's pools after its committed microbatches (oldest first).

    The priors blend each pool's prefill and decode rates in the measured share of completion
    tokens, so a measured rate is compared with the nominal rate for the same mix of tokens.
    """
    samples = list(samples)
    return Calibration.from_specs(specs, completion_share(samples)).observe_all(samples)


#: finished spells :class:`SpellAges` keeps per kind (the most recent): bounds its work per tick
MAX_SPELLS = 200


@dataclass(frozen=True)
class SpellAges:
    """The finished spells of Spot present and absent, and the age of the current one.

    Spot capacity comes in spells; on the real traces the chance that a spell ends falls with its
    age (a spell that has lasted hours is likely to last hours more: docs/simulator.md, *Seventh
    round*), which the memoryless rate of :class:`AvailabilityEstimate` cannot tell. From the
    finished spells of one kind, each weighing less by half every ``half_life_hours`` since it
    ended, plus ``prior_spells`` spells of an exponential of their mean (``prior_mean_hours``
    before any has finished; a spell older than any seen falls back to memoryless),
    :meth:`rest_hours` is the expected rest of a spell of age ``a``: ``E[L − a | L > a]``, and
    :meth:`age_factor` that over the mean length of a fresh spell (1 for memoryless spells; above
    1 for an old spell when long spells last longer). A spell whose start was not seen (the first)
    is not kept. O(``MAX_SPELLS``) per tick.
    """

    half_life_hours: float = 24.0
    prior_spells: float = 2.0
    #: mean spell length assumed before any spell of a kind has finished (hours)
    prior_mean_hours: float = 1.0
    #: hours observed so far: the clock the spells' ends are stamped with
    clock_hours: float = 0.0
    #: whether Spot is present in the current spell (``None``: nothing observed yet)
    present: bool | None = None
    age_hours: float = 0.0
    #: the current spell's start was seen (not the first spell)
    start_seen: bool = False
    #: finished spells as (length h, clock h at the end), oldest first
    up_spells: tuple[tuple[float, float], ...] = ()
    down_spells: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.half_life_hours <= 0 or self.prior_spells <= 0 or self.prior_mean_hours <= 0:
            raise ValueError("half_life_hours, prior_spells and prior_mean_hours must be > 0")

    def observe(self, present: bool, hours: float) -> SpellAges:
        """Fold ``hours`` with Spot ``present`` or not."""
        clock = self.clock_hours + hours
        if self.present is None or present == self.present:
            return replace(self, clock_hours=clock, present=present, age_hours=self.age_hours + hours)
        up, down = self.up_spells, self.down_spells
        if self.start_seen:
            ended = (self.age_hours, self.clock_hours)
            if self.present:
                up = (up + (ended,))[-MAX_SPELLS:]
            else:
                down = (down + (ended,))[-MAX_SPELLS:]
        return replace(
            self,
            clock_hours=clock,
            present=present,
            age_hours=hours,
            start_seen=True,
            up_spells=up,
            down_spells=down,
        )

    def _outliving(self, present: bool, age_h: float) -> tuple[list[tuple[float, float]], float, float]:
        """The finished spells of one kind longer than ``age_h`` as (weight, length), oldest first;
        the weighted mean length of all of them (the prior's mean before any); and the prior's
        weight of spells outliving ``age_h`` (its exponential of that mean)."""
        rate = math.log(2.0) / self.half_life_hours
        total = length_sum = 0.0
        outliving = []
        for length, end in self.up_spells if present else self.down_spells:
            w = math.exp(-rate * (self.clock_hours - end))
            total += w
            length_sum += w * length
            if length > age_h:
                outliving.append((w, length))
        mean = length_sum / total if total > 0 else self.prior_mean_hours
        return outliving, mean, self.prior_spells * math.exp(-age_h / mean)

    def rest_hours(self, present: bool, age_h: float) -> float:
        """Expected rest of a spell of Spot ``present`` (or absent) that has lasted ``age_h`` hours;
        at age 0 the spells' mean (the prior's exponential has the same)."""
        outliving, mean, prior = self._outliving(present, age_h)
        alive = rest = 0.0
        for w, length in outliving:
            alive += w
            rest += w * (length - age_h)
        return (rest + prior * mean) / (alive + prior)

    def end_chance(self, present: bool, age_h: float, horizon_h: float) -> tuple[float, float]:
        """(chance a spell of age ``age_h`` ends within ``horizon_h``, the same for memoryless
        spells of the same mean): the first from the spells and the prior, as :meth:`rest_hours`."""
        outliving, mean, prior = self._outliving(present, age_h)
        alive = ending = 0.0
        for w, length in outliving:
            alive += w
            if length <= age_h + horizon_h:
                ending += w
        memoryless = -math.expm1(-horizon_h / mean)
        return (ending + prior * memoryless) / (alive + prior), memoryless

    def age_factor(self, present: bool, horizon_h: float | None = None) -> float:
        """How much longer than a fresh spell the spell of Spot ``present`` that runs now is
        expected to last (1 when the current spell is of the other kind: one starts now): its
        expected rest over the mean; with ``horizon_h``, memoryless spells' chance of ending within
        the horizon over this spell's (young spells that mostly end soon give less than 1)."""
        if self.present != present or not self.start_seen:
            return 1.0
        if horizon_h is None:
            return self.rest_hours(present, self.age_hours) / self.rest_hours(present, 0.0)
        chance, memoryless = self.end_chance(present, self.age_hours, horizon_h)
        return memoryless / max(chance, 1e-9)


@dataclass(frozen=True)
class AvailabilityEstimate:
    """Fraction of the job's workers Spot could hold, recent ticks weighing more, shrunk to a prior;
    and the rate at which Spot spells end, a Gamma–Poisson posterior.

    The availability prior counts as ``prior_hours`` of evidence, so a few lucky minutes do not make
    waiting look safe; older evidence halves in weight every ``half_life_hours``.

    Spell ends are a Poisson process over the hours Spot is there: with a Gamma prior of mean
    ``1 / prior_run_hours`` worth ``run_prior_hours`` of exposure (the pool's declared or persisted
    behaviour), the posterior mean rate is ``(run_prior_hours / prior_run_hours + ends) /
    (run_prior_hours + hours with Spot)``, both counts forgetting with the same half-life, and the
    expected spell is its inverse. O(1) per observation.
    """

    prior: float = 0.5
    prior_hours: float = 6.0
    half_life_hours: float = 24.0
    weighted_sum: float = 0.0
    weight: float = 0.0
    #: prior mean length of a spell with capacity (hours) and the exposure it is worth (hours)
    prior_run_hours: float = 1.0
    run_prior_hours: float = 1.0
    #: spells ended and hours with capacity seen, both decayed
    spell_ends: float = 0.0
    spot_hours: float = 0.0
    current_run_hours: float = 0.0
    #: the spells' lengths and the current one's age, folded only when a policy uses them
    #: (``PolicyParams.spell_age_*``; ``None``: not kept)
    ages: SpellAges | None = None

    def __post_init__(self) -> None:
        if self.prior_run_hours <= 0 or self.run_prior_hours <= 0 or self.half_life_hours <= 0:
            raise ValueError("prior_run_hours, run_prior_hours and half_life_hours must be > 0")

    def observe(self, capacity: int, workers: int, hours: float) -> AvailabilityEstimate:
        if workers < 1 or hours < 0:
            raise ValueError("workers must be >= 1 and hours >= 0")
        decay = 0.5 ** (hours / self.half_life_hours)
        share = min(max(capacity, 0), workers) / workers
        ends, spot, current = self.spell_ends * decay, self.spot_hours * decay, self.current_run_hours
        if capacity > 0:
            spot, current = spot + hours, current + hours
        elif current > 0:
            ends, current = ends + 1.0, 0.0
        return replace(
            self,
            weighted_sum=self.weighted_sum * decay + hours * share,
            weight=self.weight * decay + hours,
            spell_ends=ends,
            spot_hours=spot,
            current_run_hours=current,
            ages=None if self.ages is None else self.ages.observe(capacity > 0, hours),
        )

    @property
    def spell_end_rate(self) -> float:
        """Posterior mean of the rate at which Spot spells end, per hour of Spot (Gamma–Poisson)."""
        alpha = self.run_prior_hours / self.prior_run_hours + self.spell_ends
        return alpha / (self.run_prior_hours + self.spot_hours)

    @property
    def run_hours(self) -> float:
        """Expected length of a Spot spell: the posterior mean, at least the spell running now."""
        return max(1.0 / self.spell_end_rate, self.current_run_hours)

    @property
    def value(self) -> float:
        return (self.weighted_sum + self.prior * self.prior_hours) / (self.weight + self.prior_hours)


#: one finished Spot try as :meth:`SpotTries.observe` takes it: (ended_s, duration_s, preempted, commits)
SpotTry = tuple[float, float, bool, int]


@dataclass(frozen=True)
class SpotTries:
    """The job's finished Spot tries, folded oldest first: observed preemption rate and progress.

    The rate is shrunk to the pool's declared rate (``prior_per_hour``, worth ``prior_hours`` of
    Spot time), so one early preemption does not swing it. ``fruitless`` counts the most recent
    consecutive tries that were preempted without committing anything: a try that committed at
    least once resets it (Spot is making progress); a try that ended otherwise (a failure, a
    success without commits) leaves it as it is. O(1) per observation.
    """

    prior_per_hour: float = 0.0
    prior_hours: float = 1.0
    tries: int = 0
    preemptions: int = 0
    spot_s: float = 0.0
    #: the most recent consecutive tries preempted without a commit
    fruitless: int = 0
    #: when the latest of them ended (seconds on the caller's clock); None when ``fruitless`` is 0
    fruitless_end_s: float | None = None

    def __post_init__(self) -> None:
        if self.prior_per_hour < 0 or self.prior_hours <= 0:
            raise ValueError("prior_per_hour must be >= 0 and prior_hours > 0")

    def observe(self, *, ended_s: float, duration_s: float, preempted: bool, commits: int) -> SpotTries:
        """Fold one finished Spot try: how long it ran, whether it was preempted, what it committed."""
        return self.observe_all(((ended_s, duration_s, preempted, commits),))

    def observe_all(self, tries: Iterable[SpotTry]) -> SpotTries:
        """Fold finished tries in order (oldest end first), on plain numbers: a try that committed
        ends a run of fruitless ones, a preempted try without a commit extends it."""
        count, preemptions, spot_s = self.tries, self.preemptions, self.spot_s
        fruitless, end = self.fruitless, self.fruitless_end_s
        for ended_s, duration_s, preempted, commits in tries:
            if commits > 0:
                fruitless, end = 0, None
            elif preempted:
                fruitless, end = fruitless + 1, ended_s if end is None else max(end, ended_s)
            count += 1
            preemptions += 1 if preempted else 0
            spot_s += max(0.0, duration_s)
        if count == self.tries:
            return self
        return SpotTries(
            prior_per_hour=self.prior_per_hour,
            prior_hours=self.prior_hours,
            tries=count,
            preemptions=preemptions,
            spot_s=spot_s,
            fruitless=fruitless,
            fruitless_end_s=end,
        )

    @property
    def preemptions_per_hour(self) -> float:
        """Observed preemptions per Spot-hour, shrunk to the declared rate."""
        evidence = self.preemptions + self.prior_per_hour * self.prior_hours
        return evidence / (self.spot_s / 3600.0 + self.prior_hours)

    @property
    def mean_run_s(self) -> float | None:
        """Expected Spot run before a preemption (None: no preemption expected, declared or seen)."""
        rate = self.preemptions_per_hour
        return 3600.0 / rate if rate > 0 else None


#: Spot-hours of earlier jobs' tries the prior may weigh at most: beyond it the history is scaled
#: down, so a long history still leaves the job's own tries room to move the estimate
MAX_HISTORY_HOURS = 24.0


@dataclass(frozen=True, kw_only=True)
class PoolHistory:
    """What earlier jobs' finished tries on one pool showed (``store.pool_stats``)."""

    pool: str
    tries: int = 0
    preemptions: int = 0
    spot_s: float = 0.0
    #: tries whose pod waited for capacity until its startup timeout and never ran, and their waits
    unschedulable: int = 0
    wait_s: float = 0.0
    #: when the latest of those gave up, and when the latest try that ran started (epoch seconds)
    last_unschedulable_s: float | None = None
    last_start_s: float | None = None

    def __post_init__(self) -> None:
        if (
            min(self.tries, self.preemptions, self.unschedulable) < 0
            or not (self.spot_s >= 0 and self.wait_s >= 0)  # NaN in either fails (min() keeps one)
        ):
            raise ValueError(
                f"pool history of {self.pool!r}: tries, preemptions, unschedulable, spot_s and wait_s "
                "must be >= 0"
            )


def spot_prior(
    declared_per_hour: float,
    history: PoolHistory | None = None,
    *,
    prior_hours: float = 1.0,
    max_history_hours: float = MAX_HISTORY_HOURS,
) -> SpotTries:
    """The prior a job's Spot tries on one pool start from: the declaration, updated by earlier jobs.

    Gamma–Poisson: the declared rate is worth ``prior_hours`` of Spot time; earlier jobs' tries add
    their preemptions and Spot-hours (scaled down to ``max_history_hours`` when longer). The result
    is a :class:`SpotTries` with no tries of its own, whose ``prior_per_hour`` is that posterior
    rate and whose ``prior_hours`` its weight; the job then folds its own tries into it.
    """
    if declared_per_hour < 0 or prior_hours <= 0 or max_history_hours <= 0:
        raise ValueError("declared_per_hour must be >= 0, prior_hours and max_history_hours > 0")
    preemptions, hours = declared_per_hour * prior_hours, prior_hours
    if history is not None and history.tries > 0:
        seen_h = _observed_s(history.spot_s) / 3600.0  # finite: inf x a weight of 0 is NaN
        weight = 1.0 if seen_h <= max_history_hours else max_history_hours / seen_h
        preemptions += weight * history.preemptions
        hours += weight * seen_h
    return SpotTries(prior_per_hour=preemptions / hours, prior_hours=hours)


#: hours of evidence the availability prior is worth (a few startup timeouts' worth of waiting)
AVAILABILITY_PRIOR_HOURS = 1.0
#: how long a pool counts as out of Spot capacity after a try of it gave up waiting, unless a try
#: has started on it since (capacity comes back in minutes to hours; a fresh try re-probes after)
CAPACITY_MISSING_S = 900.0
#: the most seconds one run or wait counts as evidence (about 300 years, longer than any two
#: clocks span): a longer or infinite value (a corrupt row) is clamped to it, NaN counts as none,
#: so the estimate stays a number within [0, 1]
MAX_OBSERVED_S = 1e10


#: one try as :meth:`PoolAvailability.observe` takes it: (present_s, absent_s, started_s, gave_up_s)
PoolTry = tuple[float, float, float | None, float | None]


@dataclass(frozen=True, kw_only=True)
class PoolAvailability:
    """How often a Spot pool had capacity when tries asked for it: a Beta-like posterior.

    Evidence is time: ``present_s``, the seconds Spot tries ran on the pool (capacity was there),
    against ``absent_s``, the seconds tries waited for capacity and gave up (their pods stayed
    unschedulable until the startup timeout). The prior ``prior`` is worth ``prior_hours`` of it, so
    the estimate :attr:`value` is ``(prior × prior time + present) / (prior time + present +
    absent)``: within [0, 1], the prior while little is seen, the observed share of time with
    capacity as evidence grows. It is the placement's ``SpotOption.availability`` /
    ``JobSnapshot.spot_availability``, as :class:`AvailabilityEstimate` is in the simulator.
    """

    prior: float = 0.5
    prior_hours: float = AVAILABILITY_PRIOR_HOURS
    present_s: float = 0.0
    absent_s: float = 0.0
    #: when the latest try of the pool gave up waiting for capacity (epoch seconds; None: never)
    last_unschedulable_s: float | None = None
    #: when the latest try that ran on the pool started (epoch seconds; None: none seen)
    last_start_s: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior <= 1.0 or not self.prior_hours > 0:
            raise ValueError("an availability prior must be within [0, 1] and worth prior_hours > 0")
        if not (0 <= self.present_s < math.inf and 0 <= self.absent_s < math.inf):
            raise ValueError("present_s and absent_s must be finite and >= 0")

    def observe(
        self,
        *,
        present_s: float = 0.0,
        absent_s: float = 0.0,
        started_s: float | None = None,
        gave_up_s: float | None = None,
    ) -> PoolAvailability:
        """Fold one try: the seconds it ran (``started_s``: when), or waited in vain (``gave_up_s``)."""
        return self.observe_all(((present_s, absent_s, started_s, gave_up_s),))

    def observe_all(self, tries: Iterable[PoolTry]) -> PoolAvailability:
        """Fold tries in order, on plain numbers (times clamped and NaN dropped as evidence)."""
        present, absent = self.present_s, self.absent_s
        last_start, last_gave_up = self.last_start_s, self.last_unschedulable_s
        seen = False
        for present_s, absent_s, started_s, gave_up_s in tries:
            seen = True
            if present_s:  # adding a zero changes nothing
                present += _observed_s(present_s)
            if absent_s:
                absent += _observed_s(absent_s)
            if started_s is not None:
                last_start = _latest(last_start, _finite(started_s))
            if gave_up_s is not None:
                last_gave_up = _latest(last_gave_up, _finite(gave_up_s))
        if not seen:
            return self
        return replace(
            self,
            present_s=present,
            absent_s=absent,
            last_start_s=last_start,
            last_unschedulable_s=last_gave_up,
        )

    @property
    def value(self) -> float:
        """Posterior mean of the fraction of time the pool had Spot capacity."""
        prior_s = self.prior_hours * 3600.0
        return (self.prior * prior_s + self.present_s) / (prior_s + self.present_s + self.absent_s)

    def available(self, now_s: float, missing_s: float = CAPACITY_MISSING_S) -> bool:
        """False while the latest try gave up waiting less than ``missing_s`` ago and none started since.

        A give-up more than ``missing_s`` after ``now_s`` is a skewed clock's, not news: it is ignored.
        """
        gave_up = self.last_unschedulable_s
        if gave_up is None or (self.last_start_s is not None and self.last_start_s >= gave_up):
            return True
        return abs(now_s - gave_up) >= missing_s


def gave_up_waiting(failure_class: str | None) -> bool:
    """Whether an ``unschedulable`` attempt is a try that gave up waiting for capacity (it is a
    failed try, with a failure class), not the wait of a pod that was scheduled at last (none)."""
    return failure_class is not None


def _observed_s(seconds: float) -> float:
    """A run or wait time as evidence: within [0, MAX_OBSERVED_S], NaN as none."""
    return 0.0 if math.isnan(seconds) else min(max(seconds, 0.0), MAX_OBSERVED_S)


def _finite(epoch_s: float | None) -> float | None:
    """A time as evidence: None for NaN or an infinity."""
    return epoch_s if epoch_s is not None and math.isfinite(epoch_s) else None


def _latest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def availability_prior(
    prior: float,
    history: PoolHistory | None = None,
    *,
    prior_hours: float = AVAILABILITY_PRIOR_HOURS,
    max_history_hours: float = MAX_HISTORY_HOURS,
) -> PoolAvailability:
    """The availability a job's Spot tries on one pool start from: ``prior``, updated by earlier jobs.

    ``prior`` is the policy's ``availability_prior`` (a :class:`PoolSpec` declares no
    availability); earlier jobs' run and wait time on the pool add to it, scaled down together to
    ``max_history_hours`` when longer, so the job's own tries keep room to move the estimate. The
    latest give-up and start of those jobs carry over (:meth:`PoolAvailability.available`).
    """
    if max_history_hours <= 0:
        raise ValueError("max_history_hours must be > 0")
    out = PoolAvailability(prior=prior, prior_hours=prior_hours)
    if history is None:
        return out
    seen_h = (history.spot_s + history.wait_s) / 3600.0
    weight = 1.0 if seen_h <= max_history_hours else max_history_hours / seen_h
    return out.observe(
        present_s=weight * history.spot_s,
        absent_s=weight * history.wait_s,
        started_s=history.last_start_s,
        gave_up_s=history.last_unschedulable_s,
    )
