"""Spell memory: how the chance that a Spot spell ends depends on how long it has lasted.

A spell is a run of ticks with Spot present (capacity >= 1) or absent (0). The empirical hazard at
age ``a`` is the share of spells still running at ``a`` that end in the next tick; a memoryless
(Markov) fit has one hazard for every age, ``spells / spell ticks``. Both are given per hour of
spell. A hazard that falls with age means a long spell is likely to last longer: memory a policy
that knows the current spell's age could use (docs/simulator.md, *Seventh round*).

``python -m airflow_deadline_batch.sim.spells`` prints one table per synthetic family (the semi-Markov
set, the tuning set's families, a Markov control); ``--traces DIR`` one per family of the shared
files (``1-node``, ``4-node``, ``16-node``: the directory above the date), for reporting only.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from airflow_deadline_batch.sim import traces
from airflow_deadline_batch.sim.traces import Trace, load_trace

#: lower edges of the age buckets, hours
AGE_EDGES_H = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)


def spell_lengths(trace: Trace) -> tuple[list[int], list[int]]:
    """Lengths in ticks of the spells of Spot present and absent; the first and the last spell of
    the trace are left out (cut by its ends, their lengths are not known)."""
    present: list[int] = []
    absent: list[int] = []
    runs: list[tuple[bool, int]] = []
    for cap in trace.capacity:
        there = cap > 0
        if runs and runs[-1][0] == there:
            runs[-1] = (there, runs[-1][1] + 1)
        else:
            runs.append((there, 1))
    for there, length in runs[1:-1]:
        (present if there else absent).append(length)
    return present, absent


def succession(trace: Trace) -> tuple[float | None, int]:
    """How much a spell's length says about the next spell of its kind: the correlation of the log
    lengths of successive present spells and of successive absent spells (each kind centred on its
    own mean, the pairs pooled), and the number of pairs. Near 0 for a semi-Markov process, whose
    spells are independent; above 0 where long spells come in runs (regimes: docs/simulator.md,
    *Ninth round*). ``None`` with fewer than 3 pairs."""
    xs: list[float] = []
    ys: list[float] = []
    for lengths in spell_lengths(trace):
        logs = [math.log(n) for n in lengths]
        if len(logs) < 2:
            continue
        mean = math.fsum(logs) / len(logs)
        xs += [a - mean for a in logs[:-1]]
        ys += [b - mean for b in logs[1:]]
    if len(xs) < 3:
        return None, len(xs)
    sxy = math.fsum(a * b for a, b in zip(xs, ys, strict=True))
    sxx, syy = math.fsum(a * a for a in xs), math.fsum(b * b for b in ys)
    return (sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None), len(xs)


@dataclass
class Hazard:
    """Spell ends and ticks at risk per age bucket, for one kind of spell, pooled over traces."""

    edges_h: tuple[float, ...] = AGE_EDGES_H
    ends: list[int] = field(default_factory=list)
    at_risk: list[float] = field(default_factory=list)
    spells: int = 0
    ticks: int = 0
    hours: float = 0.0

    def __post_init__(self) -> None:
        self.ends = [0] * len(self.edges_h)
        self.at_risk = [0.0] * len(self.edges_h)

    def _bucket(self, age_h: float) -> int:
        return max(i for i, edge in enumerate(self.edges_h) if age_h >= edge - 1e-9)

    def add(self, lengths: Iterable[int], gap_s: float) -> None:
        """Fold spells of ``lengths`` ticks: at risk at each tick age ``0 … L − 1``, ending at ``L − 1``."""
        gap_h = gap_s / 3600.0
        for length in lengths:
            self.spells += 1
            self.ticks += length
            self.hours += length * gap_h
            for age in range(length):
                self.at_risk[self._bucket(age * gap_h)] += gap_h
            self.ends[self._bucket((length - 1) * gap_h)] += 1

    def memoryless_per_h(self) -> float | None:
        """The Markov fit's hazard per hour of spell: spells ended / hours in spells."""
        return self.spells / self.hours if self.hours > 0 else None

    def per_h(self) -> list[float | None]:
        """The empirical hazard per hour of spell in each age bucket (``None``: no spell that old)."""
        return [e / h if h > 0 else None for e, h in zip(self.ends, self.at_risk, strict=True)]


def measure(trace_list: Sequence[Trace]) -> tuple[Hazard, Hazard]:
    """The hazards of the present and the absent spells of ``trace_list``, pooled."""
    up, down = Hazard(), Hazard()
    for trace in trace_list:
        present, absent = spell_lengths(trace)
        up.add(present, trace.gap_s)
        down.add(absent, trace.gap_s)
    return up, down


def table(title: str, trace_list: Sequence[Trace]) -> str:
    """One markdown table: per age bucket, each kind's hazard per hour and its ratio to the fit."""
    up, down = measure(trace_list)
    edges = AGE_EDGES_H
    labels = [f"{a:g}–{b:g} h" for a, b in zip(edges, edges[1:], strict=False)] + [f">= {edges[-1]:g} h"]

    def cell(h: Hazard, i: int) -> str:
        rate, fit = h.per_h()[i], h.memoryless_per_h()
        if rate is None or fit is None:
            return "–"
        return f"{rate:.2f} ({rate / fit:.2f}, {h.ends[i]})"

    lines = [
        f"**{title}** ({len(trace_list)} traces; present: {up.spells} spells, mean "
        f"{up.hours / max(up.spells, 1):.2f} h, fit {up.memoryless_per_h() or 0:.2f}/h; absent: "
        f"{down.spells} spells, mean {down.hours / max(down.spells, 1):.2f} h, fit "
        f"{down.memoryless_per_h() or 0:.2f}/h)",
        "",
        "| spell age | present: hazard /h (÷ fit, ends) | absent: hazard /h (÷ fit, ends) |",
        "|---|---|---|",
    ]
    lines += [f"| {label} | {cell(up, i)} | {cell(down, i)} |" for i, label in enumerate(labels)]
    return "\n".join(lines)


def synthetic_families() -> list[tuple[str, list[Trace]]]:
    """The synthetic families: the semi-Markov set, the tuning set's, and a Markov control."""
    return [
        ("semi-Markov set (`semi_markov_suite(800)`)", traces.semi_markov_suite(800)),
        (
            "regimes (`regime_switching`, tuning seeds)",
            [t for t in traces.synthetic_suite(500) if t.name.startswith("regime")],
        ),
        ("gangs (`multi_gpu_suite(550, capacity=1)`)", traces.multi_gpu_suite(550, capacity=1)),
        ("Markov control (`markov(0.5, 0.5)`, 10-min ticks)", [traces.markov(0.5, 0.5, 2000.0, seed=1)]),
    ]


def shared_families(root: Path) -> list[tuple[str, list[Trace]]]:
    """The shared files grouped by the directory above their date (``1-node``, ``16-node`` …)."""
    groups: dict[str, list[Trace]] = {}
    for path in sorted(root.rglob("*.json")):
        groups.setdefault(path.parent.parent.name, []).append(load_trace(path))
    return sorted(groups.items(), key=lambda item: int(item[0].split("-")[0]) if item[0][0].isdigit() else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_deadline_batch.sim.spells")
    parser.add_argument("--traces", type=Path, help="a directory of shared trace files (reporting only)")
    args = parser.parse_args(argv)
    if args.traces is not None and not args.traces.is_dir():
        raise SystemExit(f"--traces {str(args.traces)!r} is not a directory; pass ../shared/spot-traces")
    families = synthetic_families() if args.traces is None else shared_families(args.traces)
    print("\n\n".join(table(title, group) for title, group in families))
    return 0


if __name__ == "__main__":
    sys.exit(main())
