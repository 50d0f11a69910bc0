"""Spot capacity traces: the one place that interprets trace files, plus synthetic generators.

A :class:`Trace` is the number of Spot **GPUs** (= workers) available at each tick of ``gap_s``
seconds. Files from ``skypilot-org/spot-traces`` hold the number of Spot *instances* available per
tick (not inverted: 1 = available); an instance has the GPU count in the file name's last part
(``us-west-2a_v100_8.json`` = 8 GPUs per instance).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from airflow_deadline_batch.exceptions import ConfigurationError

_GPUS_IN_NAME = re.compile(r"_(\d+)$")


@dataclass(frozen=True)
class Trace:
    """Spot capacity over time: ``capacity[i]`` GPUs during tick ``i`` of ``gap_s`` seconds."""

    name: str
    gap_s: float
    capacity: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.gap_s <= 0:
            raise ValueError(f"trace {self.name!r}: gap_s must be > 0")
        if not self.capacity:
            raise ValueError(f"trace {self.name!r} has no ticks")
        if min(self.capacity) < 0:
            raise ValueError(f"trace {self.name!r} has negative capacity")

    @property
    def hours(self) -> float:
        return len(self.capacity) * self.gap_s / 3600.0

    def at(self, tick: int) -> int:
        """Capacity at ``tick``; the trace repeats when a run outlives it."""
        return self.capacity[tick % len(self.capacity)]

    def availability(self, workers: int = 1) -> float:
        """Mean fraction of ``workers`` that Spot could hold."""
        return sum(min(c, workers) for c in self.capacity) / (workers * len(self.capacity))


def load_trace(path: str | Path) -> Trace:
    """Read a ``{"metadata": {"gap_seconds": G}, "data": [...]}`` file into GPUs per tick.

    A path that is not a regular file (a directory, a FIFO, ``/dev/zero``) or is larger than any
    trace, a gap that is not a finite number of seconds >= 1 (a tiny one makes a run billions of
    ticks) and a tick that is not a whole number of instances are refused, naming the file.
    """
    path = Path(path)
    max_bytes = 64 * 2**20  # the shared traces are kilobytes (a year of 1-minute ticks is ~1 MiB)
    try:
        if not path.exists():
            raise FileNotFoundError(path)
        if not path.is_file():
            raise ConfigurationError(
                f"trace file {str(path)!r} is a directory, FIFO or device; pass a Spot trace file (.json)"
            )
        size = path.stat().st_size
        if size > max_bytes:
            raise ConfigurationError(
                f"trace file {str(path)!r} holds {size:,} bytes, more than a Spot trace "
                f"({max_bytes // 2**20} MiB at most); pass a Spot trace file"
            )
        raw = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise ConfigurationError(
            f"trace file {str(path)!r} does not exist; pass an existing --trace file"
        ) from None
    except OSError as exc:
        raise ConfigurationError(
            f"trace file {str(path)!r} cannot be read ({exc.strerror}); fix --trace"
        ) from None
    except orjson.JSONDecodeError as exc:
        raise ConfigurationError(
            f"trace file {str(path)!r} is not JSON ({exc}); pass a Spot trace file"
        ) from None
    try:
        gap = float(raw["metadata"]["gap_seconds"])
        data = raw["data"]
        if not isinstance(data, list):
            raise TypeError(data)
        # whole numbers of instances (2 or 2.0): not true, 1.5 or the characters of a string
        if not all(type(v) in (int, float) and math.isfinite(v) and v == int(v) for v in data):
            raise ValueError(data)
        values = [int(v) for v in data]
    except (KeyError, TypeError, ValueError):
        raise ConfigurationError(
            f"trace file {str(path)!r} lacks metadata.gap_seconds or a data list of whole numbers of "
            "instances; pass a file in the spot-traces format"
        ) from None
    if not (math.isfinite(gap) and gap >= 1):
        raise ConfigurationError(
            f"trace file {str(path)!r}: metadata.gap_seconds is {gap:g}, not a number of seconds >= 1; "
            "pass a valid trace"
        )
    match = _GPUS_IN_NAME.search(path.stem)
    gpus_per_instance = int(match.group(1)) if match else 1
    name = "/".join(path.parts[-3:]) if len(path.parts) >= 3 else path.name
    try:
        return Trace(name=name, gap_s=gap, capacity=tuple(v * gpus_per_instance for v in values))
    except ValueError as exc:
        raise ConfigurationError(f"trace file {str(path)!r}: {exc}; pass a valid trace") from None


# -- synthetic traces (for tests and tuning: the shared files are for evaluation only) ----------


def constant(capacity: int, hours: float, gap_s: float = 300.0, name: str | None = None) -> Trace:
    """Capacity that never changes (``0``: no Spot at all; ``>= workers``: full Spot)."""
    n = max(1, round(hours * 3600 / gap_s))
    return Trace(name or f"constant-{capacity}", gap_s, (capacity,) * n)


def from_segments(
    segments: Sequence[tuple[float, int]], gap_s: float = 300.0, name: str = "segments"
) -> Trace:
    """Hand-made trace: ``[(hours, capacity), ...]`` back to back."""
    ticks: list[int] = []
    for hours, cap in segments:
        ticks.extend([cap] * max(1, round(hours * 3600 / gap_s)))
    return Trace(name, gap_s, tuple(ticks))


def regime_switching(
    seed: int,
    hours: float = 400.0,
    gap_s: float = 300.0,
    capacity: int = 1,
    mean_up_h: float = 6.0,
    mean_down_h: float = 2.0,
    name: str | None = None,
) -> Trace:
    """Alternating available / unavailable spells with exponential lengths and a drifting regime.

    Every spell draws its mean from a regime that changes about once a day, so availability moves
    between scarce and plentiful periods, as on the real traces.
    """
    rng = random.Random(seed)
    ticks: list[int] = []
    n = round(hours * 3600 / gap_s)
    up, down, regime_left = mean_up_h, mean_down_h, 0.0
    state = rng.random() < mean_up_h / (mean_up_h + mean_down_h)
    while len(ticks) < n:
        if regime_left <= 0:
            scale = rng.choice((0.25, 0.5, 1.0, 2.0, 4.0))
            up, down = mean_up_h * scale, mean_down_h / scale
            regime_left = rng.expovariate(1 / 24.0)
        spell = rng.expovariate(1 / (up if state else down))
        regime_left -= spell
        count = max(1, round(spell * 3600 / gap_s))
        level = capacity if state else 0
        if state and capacity > 1 and rng.random() < 0.3:
            level = rng.randint(1, capacity)
        ticks.extend([level] * count)
        state = not state
    return Trace(name or f"regime-{seed}", gap_s, tuple(ticks[:n]))


def droughts(
    seed: int,
    hours: float = 400.0,
    gap_s: float = 300.0,
    capacity: int = 1,
    availability: float = 0.9,
    drought_h: float = 12.0,
    name: str | None = None,
) -> Trace:
    """Mostly available, with rare long droughts (the tail that makes waiting dangerous)."""
    rng = random.Random(seed)
    n = round(hours * 3600 / gap_s)
    ticks: list[int] = []
    mean_up = drought_h * availability / (1 - availability)
    state = True
    while len(ticks) < n:
        spell = rng.expovariate(1 / (mean_up if state else drought_h))
        ticks.extend([capacity if state else 0] * max(1, round(spell * 3600 / gap_s)))
        state = not state
    return Trace(name or f"drought-{seed}", gap_s, tuple(ticks[:n]))


def flapping(
    seed: int,
    hours: float = 200.0,
    gap_s: float = 60.0,
    capacity: int = 1,
    p_up: float = 0.5,
    mean_spell_ticks: float = 3.0,
    name: str | None = None,
) -> Trace:
    """Capacity that comes and goes within minutes: Spot runs shorter than a changeover."""
    rng = random.Random(seed)
    n = round(hours * 3600 / gap_s)
    ticks: list[int] = []
    while len(ticks) < n:
        state = rng.random() < p_up
        spell = max(1, round(rng.expovariate(1 / mean_spell_ticks)))
        ticks.extend([capacity if state else 0] * spell)
    return Trace(name or f"flapping-{seed}", gap_s, tuple(ticks[:n]))


def markov(
    up_to_down: float,
    down_to_up: float,
    hours: float = 400.0,
    gap_s: float = 600.0,
    seed: int = 0,
    capacity: int = 1,
    name: str | None = None,
) -> Trace:
    """Spot that IS a two-state Markov chain: spells end at ``up_to_down`` and return at
    ``down_to_up`` per hour (a continuous-time chain seen at every tick, so per tick the exact
    transition probabilities of ``sim.mdp.Rates``); the first tick drawn from the stationary share.

    The trace family on which the Bayes-optimal online policy is computable (docs/simulator.md,
    *Fifth round*).
    """
    if up_to_down <= 0 or down_to_up <= 0:
        raise ValueError("markov: both rates must be > 0 per hour; pass a spell end and return rate")
    rng = random.Random(seed)
    n = max(1, round(hours * 3600 / gap_s))
    share = down_to_up / (up_to_down + down_to_up)
    decay = math.exp(-(up_to_down + down_to_up) * gap_s / 3600.0)
    stay_up, come_back = share + (1.0 - share) * decay, share * (1.0 - decay)
    up = rng.random() < share
    ticks: list[int] = []
    for _ in range(n):
        ticks.append(capacity if up else 0)
        up = rng.random() < (stay_up if up else come_back)
    return Trace(name or f"markov-{seed}", gap_s, tuple(ticks))


def synthetic_suite(seed: int = 0, capacity: int = 1) -> list[Trace]:
    """A varied set for tuning and tests: regimes, droughts and flapping at several levels."""
    suite = [
        regime_switching(seed + 1, capacity=capacity, mean_up_h=4.0, mean_down_h=4.0),
        regime_switching(seed + 2, capacity=capacity, mean_up_h=10.0, mean_down_h=2.0),
        regime_switching(seed + 3, capacity=capacity, mean_up_h=1.5, mean_down_h=4.0),
        droughts(seed + 4, capacity=capacity, availability=0.9, drought_h=10.0),
        droughts(seed + 5, capacity=capacity, availability=0.7, drought_h=20.0),
        flapping(seed + 6, capacity=capacity, p_up=0.5),
        flapping(seed + 7, capacity=capacity, p_up=0.8, mean_spell_ticks=8.0),
    ]
    return suite


def gang(
    seed: int,
    capacity: int,
    hours: float = 400.0,
    gap_s: float = 600.0,
    mean_up_h: float = 2.0,
    mean_down_h: float = 2.0,
    all_or_nothing: float = 0.8,
    name: str | None = None,
) -> Trace:
    """Multi-GPU capacity 0..``capacity`` in spells: mostly all or nothing, else a partial level.

    ``all_or_nothing`` is the share of available spells at full capacity (the multi-node traces are
    mostly 0 or full); the others draw a level uniformly in ``1..capacity - 1``. Spell means drift
    by regime about once a day, as in :func:`regime_switching`; a 10-minute tick makes spells coarse.
    """
    rng = random.Random(seed)
    n = round(hours * 3600 / gap_s)
    ticks: list[int] = []
    up, down, regime_left = mean_up_h, mean_down_h, 0.0
    state = rng.random() < mean_up_h / (mean_up_h + mean_down_h)
    while len(ticks) < n:
        if regime_left <= 0:
            scale = rng.choice((0.25, 0.5, 1.0, 2.0, 4.0))
            up, down = mean_up_h * scale, mean_down_h / scale
            regime_left = rng.expovariate(1 / 24.0)
        spell = rng.expovariate(1 / (up if state else down))
        regime_left -= spell
        level = 0
        if state:
            full = capacity < 2 or rng.random() < all_or_nothing
            level = capacity if full else rng.randint(1, capacity - 1)
        ticks.extend([level] * max(1, round(spell * 3600 / gap_s)))
        state = not state
    return Trace(name or f"gang{capacity}-{seed}", gap_s, tuple(ticks[:n]))


def multi_gpu_suite(seed: int = 0, capacity: int = 4) -> list[Trace]:
    """Varied multi-GPU traces for tuning the ``N > 1`` behaviour (gang capacity 0..``capacity``).

    All-or-nothing and partial capacity, long and short spells, 5- and 10-minute ticks, and a
    coarse-tick flapping regime (spells of one or two ticks).
    """
    return [
        gang(seed + 1, capacity, mean_up_h=3.0, mean_down_h=3.0, all_or_nothing=0.95),
        gang(seed + 2, capacity, mean_up_h=1.0, mean_down_h=1.0, all_or_nothing=0.9),
        gang(seed + 3, capacity, mean_up_h=0.4, mean_down_h=0.5, all_or_nothing=0.5),
        gang(seed + 4, capacity, mean_up_h=6.0, mean_down_h=1.5, all_or_nothing=0.3, gap_s=300.0),
        gang(seed + 5, capacity, mean_up_h=0.8, mean_down_h=2.5, all_or_nothing=0.7, gap_s=300.0),
        gang(seed + 6, capacity, mean_up_h=0.25, mean_down_h=0.3, all_or_nothing=0.6),
    ]


def semi_markov(
    seed: int,
    hours: float = 400.0,
    gap_s: float = 300.0,
    capacity: int = 1,
    mean_up_h: float = 3.0,
    mean_down_h: float = 2.0,
    shape: float = 0.6,
    law: str = "weibull",
    name: str | None = None,
) -> Trace:
    """Alternating spells of Spot present / absent whose lengths are heavy-tailed and independent.

    Each spell is drawn with the given mean from a Weibull of ``shape`` (below 1: the chance a spell
    ends falls with its age, so a long spell is likely to last longer) or, with ``law="lognormal"``,
    a lognormal of log-sd ``shape``. A semi-Markov process: no regimes, all the memory is in the
    current spell's age, which a memoryless (Markov) estimate cannot see (docs/simulator.md,
    *Seventh round*). Spells are at least one tick.
    """
    if law not in ("weibull", "lognormal"):
        raise ValueError(f"semi_markov: unknown law {law!r}; use 'weibull' or 'lognormal'")
    if not (shape > 0 and mean_up_h > 0 and mean_down_h > 0):
        raise ValueError("semi_markov: shape and both means must be > 0")
    rng = random.Random(seed)
    n = max(1, round(hours * 3600 / gap_s))

    def draw(mean: float) -> float:
        if law == "weibull":
            return rng.weibullvariate(mean / math.gamma(1.0 + 1.0 / shape), shape)
        return rng.lognormvariate(math.log(mean) - shape * shape / 2.0, shape)

    state = rng.random() < mean_up_h / (mean_up_h + mean_down_h)
    ticks: list[int] = []
    while len(ticks) < n:
        spell = draw(mean_up_h if state else mean_down_h)
        ticks.extend([capacity if state else 0] * max(1, round(spell * 3600 / gap_s)))
        state = not state
    return Trace(name or f"semi-markov-{law}-{seed}", gap_s, tuple(ticks[:n]))


def semi_markov_suite(seed: int = 0, capacity: int = 1) -> list[Trace]:
    """Heavy-tailed spells at generic settings (not fitted to any shared trace): scarce and
    plentiful, short and long spells, Weibull shapes 0.5 / 0.7 and a lognormal, 5- and 10-minute
    ticks."""
    return [
        semi_markov(seed + 1, capacity=capacity, mean_up_h=3.0, mean_down_h=2.0, shape=0.5),
        semi_markov(seed + 2, capacity=capacity, mean_up_h=1.0, mean_down_h=3.0, shape=0.5, gap_s=600.0),
        semi_markov(seed + 3, capacity=capacity, mean_up_h=6.0, mean_down_h=1.0, shape=0.7),
        semi_markov(seed + 4, capacity=capacity, mean_up_h=1.5, mean_down_h=1.5, shape=0.7, gap_s=600.0),
        semi_markov(seed + 5, capacity=capacity, mean_up_h=2.0, mean_down_h=4.0, shape=1.2, law="lognormal"),
        semi_markov(seed + 6, capacity=capacity, mean_up_h=4.0, mean_down_h=1.0, shape=1.0, law="lognormal"),
    ]


def diurnal_markov(
    seed: int,
    hours: float = 1000.0,
    gap_s: float = 300.0,
    up_to_down: float = 0.5,
    down_to_up: float = 0.5,
    swing: float = 1.0,
    capacity: int = 1,
    name: str | None = None,
) -> Trace:
    """A Markov chain whose rates follow the hour of day: spells end at ``up_to_down · e^{swing·c}``
    and return at ``down_to_up · e^{−swing·c}`` per hour, ``c = cos(2π · hour / 24)`` (Spot scarce
    around hour 0, plentiful around hour 12); per tick the probabilities of a constant rate over it.

    A trace with a real time-of-day pattern, for the predictability measurement's tests
    (docs/simulator.md, *Ninth round*); the first tick is Spot present.
    """
    if up_to_down <= 0 or down_to_up <= 0:
        raise ValueError("diurnal_markov: both rates must be > 0 per hour; pass a spell end and return rate")
    rng = random.Random(seed)
    n = max(1, round(hours * 3600 / gap_s))
    gap_h = gap_s / 3600.0
    up = True
    ticks: list[int] = []
    for i in range(n):
        ticks.append(capacity if up else 0)
        c = math.cos(2.0 * math.pi * ((i * gap_h) % 24.0) / 24.0)
        rate = up_to_down * math.exp(swing * c) if up else down_to_up * math.exp(-swing * c)
        if rng.random() < 1.0 - math.exp(-rate * gap_h):
            up = not up
    return Trace(name or f"diurnal-markov-{seed}", gap_s, tuple(ticks))
