"""Calibration: service rates, startup time, preemption rate and Spot availability, learned online.

Pure functions over plain values. The prior comes from the pool's :class:`PoolSpec`; each committed
microbatch (a :class:`RateSample`) moves the estimate by an exponentially weighted step whose
weight grows with the sample's size, and single outliers are clipped so one slow microbatch (a cold
cache, a noisy neighbour) cannot swing the remaining-work estimate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from airflow_deadline_batch.core.pools import PoolKind, PoolSpec

#: tokens of evidence the prior is worth (a few microbatches' worth)
PRIOR_TOKENS = 20_000.0
#: a sample may move the rate by at most this factor either way
MAX_STEP_RATIO = 4.0


@dataclass(frozen=True)
class RateSample:
    """One committed microbatch: tokens processed in ``elapsed_s`` on ``pool`` (a pool name or kind)."""

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
    """What is known of one pool: effective tokens/s, startup seconds, preemptions per hour."""

    tokens_per_s: float
    startup_s: float
    preemptions_per_hour: float
    evidence_tokens: float = PRIOR_TOKENS
    busy_hours: float = 0.0
    preemptions: int = 0
    startups: int = 0


def prior_tokens_per_s(spec: PoolSpec, completion_share: float = 0.5) -> float:
    """Blended tokens/s from a pool's prefill and decode rates (harmonic: time adds up, not rate)."""
    share = min(max(completion_share, 0.0), 1.0)
    return 1.0 / ((1 - share) / spec.prefill_tokens_per_s + share / spec.decode_tokens_per_s)


@dataclass(frozen=True)
class Calibration:
    """Per-pool estimates keyed by pool name; immutable, every update returns a new one."""

    pools: Mapping[str, PoolEstimate] = field(default_factory=dict)

    @classmethod
    def from_specs(cls, specs: Iterable[PoolSpec], completion_share: float = 0.5) -> Calibration:
        return cls(
            {
                s.name: PoolEstimate(
                    tokens_per_s=prior_tokens_per_s(s, completion_share),
                    startup_s=s.startup_seconds,
                    preemptions_per_hour=s.preemptions_per_hour,
                )
                for s in specs
            }
        )

    def estimate(self, pool: str) -> PoolEstimate:
        try:
            return self.pools[pool]
        except KeyError:
            raise KeyError(f"no calibration for pool {pool!r}; known: {sorted(self.pools)}") from None

    def _with(self, pool: str, est: PoolEstimate) -> Calibration:
        return Calibration({**self.pools, pool: est})

    def observe_rate(self, sample: RateSample) -> Calibration:
        """Fold one committed microbatch into its pool's tokens/s (size-weighted, clipped)."""
        if sample.elapsed_s <= 0 or sample.tokens <= 0:
            return self
        est = self.estimate(sample.pool)
        measured = sample.tokens / sample.elapsed_s
        measured = min(max(measured, est.tokens_per_s / MAX_STEP_RATIO), est.tokens_per_s * MAX_STEP_RATIO)
        weight = sample.tokens / (est.evidence_tokens + sample.tokens)
        # Average time per token (not rate) so that slow and fast samples weigh by the time they took.
        seconds_per_token = (1 - weight) / est.tokens_per_s + weight / measured
        return self._with(
            sample.pool,
            replace(
                est,
                tokens_per_s=1.0 / seconds_per_token,
                evidence_tokens=min(est.evidence_tokens + sample.tokens, 2 * PRIOR_TOKENS),
                busy_hours=est.busy_hours + sample.elapsed_s / 3600.0,
            ),
        )

    def observe_startup(self, pool: str, seconds: float, alpha: float = 0.3) -> Calibration:
        """Exponentially weighted startup time (pod scheduling + model load)."""
        est = self.estimate(pool)
        return self._with(
            pool,
            replace(
                est,
                startup_s=(1 - alpha) * est.startup_s + alpha * max(0.0, seconds),
                startups=est.startups + 1,
            ),
        )

    def observe_preemption(self, pool: str) -> Calibration:
        est = self.estimate(pool)
        return self._with(
            pool,
            replace(
                est,
                preemptions=est.preemptions + 1,
                preemptions_per_hour=preemption_rate(
                    est.preemptions + 1, est.busy_hours, est.preemptions_per_hour
                ),
            ),
        )


def preemption_rate(
    preemptions: int, busy_hours: float, prior_per_hour: float, prior_hours: float = 2.0
) -> float:
    """Preemptions per hour: the observed count over exposure, with the prior as pseudo-exposure."""
    return (preemptions + prior_per_hour * prior_hours) / (busy_hours + prior_hours)


def re_estimate_remaining(
    remaining_tokens: float, calibration: Calibration, pool: str, reference_pool: str | None = None
) -> float:
    """Remaining GPU-seconds at the reference pool's learned rate (what placement calls remaining work)."""
    est = calibration.estimate(reference_pool or pool)
    return max(0.0, remaining_tokens) / est.tokens_per_s


def rate_by_kind(calibration: Calibration, kinds: Mapping[str, PoolKind]) -> dict[PoolKind, float]:
    """Slowest learned tokens/s per pool kind (the conservative figure for deadlines)."""
    out: dict[PoolKind, float] = {}
    for name, kind in kinds.items():
        rate = calibration.estimate(name).tokens_per_s
        out[kind] = min(out.get(kind, rate), rate)
    return out


@dataclass(frozen=True)
class AvailabilityEstimate:
    """Fraction of the job's workers Spot could hold, recent ticks weighing more, shrunk to a prior.

    The prior counts as ``prior_hours`` of evidence, so a few lucky minutes do not make waiting
    look safe; older evidence halves in weight every ``half_life_hours``. O(1) per observation.
    """

    prior: float = 0.5
    prior_hours: float = 6.0
    half_life_hours: float = 24.0
    weighted_sum: float = 0.0
    weight: float = 0.0
    #: mean length of a spell with capacity (hours), exponentially weighted over finished spells
    prior_run_hours: float = 1.0
    mean_run_hours: float | None = None
    current_run_hours: float = 0.0
    run_alpha: float = 0.3

    def observe(self, capacity: int, workers: int, hours: float) -> AvailabilityEstimate:
        if workers < 1 or hours < 0:
            raise ValueError("workers must be >= 1 and hours >= 0")
        decay = 0.5 ** (hours / self.half_life_hours)
        share = min(max(capacity, 0), workers) / workers
        mean, current = self.mean_run_hours, self.current_run_hours
        if capacity > 0:
            current += hours
        elif current > 0:
            base = self.prior_run_hours if mean is None else mean
            mean, current = (1 - self.run_alpha) * base + self.run_alpha * current, 0.0
        return replace(
            self,
            weighted_sum=self.weighted_sum * decay + hours * share,
            weight=self.weight * decay + hours,
            mean_run_hours=mean,
            current_run_hours=current,
        )

    @property
    def run_hours(self) -> float:
        """Expected length of a Spot spell: the learned mean, at least the spell running now."""
        mean = self.prior_run_hours if self.mean_run_hours is None else self.mean_run_hours
        return max(mean, self.current_run_hours)

    @property
    def value(self) -> float:
        return (self.weighted_sum + self.prior * self.prior_hours) / (self.weight + self.prior_hours)


def observed_availability(
    history: Sequence[int],
    workers: int,
    gap_s: float,
    *,
    prior: float = 0.5,
    prior_hours: float = 6.0,
    half_life_hours: float = 24.0,
) -> float:
    """:class:`AvailabilityEstimate` over a whole capacity history (oldest first)."""
    if gap_s <= 0:
        raise ValueError("gap_s must be > 0")
    est = AvailabilityEstimate(prior=prior, prior_hours=prior_hours, half_life_hours=half_life_hours)
    for cap in history:
        est = est.observe(cap, workers, gap_s / 3600.0)
    return est.value
