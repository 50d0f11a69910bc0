"""Capacity math for a plan report: tokens, GPU-hours per pool, and the GPUs a window needs.

Admission (:mod:`~airflow_deadline_batch.core.feasibility`) answers "does this job fit on these
pools by the deadline"; this answers the operator's next questions with the same rates and
policy: how much work is it on each pool, and how many GPUs would finish it in the window, or in
half of it.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.estimate import WorkSummary
from airflow_deadline_batch.core.feasibility import (
    AdmissionPolicy,
    format_duration,
    preemption_loss_fraction,
    work_seconds_on,
)
from airflow_deadline_batch.core.packing import target_shard_seconds
from airflow_deadline_batch.core.pools import PoolSpec

__all__ = ["Capacity", "PoolCapacity", "capacity", "gpus_needed"]


@dataclass(frozen=True, kw_only=True)
class PoolCapacity:
    """The batch on one pool: its GPU-hours, the GPUs for the window and for half of it.

    None: no number of GPUs will do (the queue wait and startup alone take longer).
    """

    pool: str
    kind: str
    gpus: int
    gpu_hours: float
    gpus_for_window: int | None
    gpus_for_half_window: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "kind": self.kind,
            "gpus": self.gpus,
            "gpu_hours": self.gpu_hours,
            "gpus_for_window": self.gpus_for_window,
            "gpus_for_half_window": self.gpus_for_half_window,
        }


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """Tokens in and out, the window, and each pool's numbers."""

    prompt_tokens: int
    output_tokens: int
    window_s: float
    pools: tuple[PoolCapacity, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "window_s": self.window_s,
            "pools": [p.to_dict() for p in self.pools],
        }

    def lines(self) -> list[str]:
        """Text lines for the plan report."""
        half = format_duration(self.window_s / 2)
        out = [
            f"capacity: {self.prompt_tokens:,} tokens in, {self.output_tokens:,} tokens out; "
            f"window {format_duration(self.window_s)}"
        ]
        for p in self.pools:
            out.append(
                f"  {p.pool} ({p.kind}, {p.gpus} GPUs): {p.gpu_hours:,.2f} GPU-hours; "
                f"needs {_gpus(p.gpus_for_window)} for the window, "
                f"{_gpus(p.gpus_for_half_window)} to finish in half of it ({half})"
            )
        return out


def _gpus(n: int | None) -> str:
    if n is None:
        return "more than any number of GPUs (the queue and startup alone take longer)"
    return f"{n} GPU{'s' if n != 1 else ''}"


def gpus_needed(work_s: float, pool: PoolSpec, window_s: float, policy: AdmissionPolicy) -> int | None:
    """The fewest GPUs of ``pool`` that finish ``work_s`` GPU-seconds within ``window_s``.

    As admission counts a plan: the queue wait and startup first, the work at the policy's
    efficiency less the pool's expected preemption losses, then the recovery reserve
    (``max(min, fraction × run)``). None when the window is too short for any number of GPUs.
    """
    lead = pool.queue_wait_seconds + pool.startup_seconds
    run_max = min(
        window_s - lead - policy.min_recovery_reserve_s,
        (window_s - lead) / (1.0 + policy.recovery_reserve_fraction),
    )
    if work_s <= 0:
        return 0 if run_max >= 0 else None
    if run_max <= 0:
        return None
    mtbi = 3600.0 / pool.preemptions_per_hour if pool.preemptions_per_hour > 0 else math.inf
    shard = target_shard_seconds(
        checkpoint_cost_s=policy.checkpoint_cost_s,
        mtbi_s=mtbi,
        recovery_reserve_s=policy.recovery_reserve(run_max),
    )
    useful = policy.efficiency * (1.0 - preemption_loss_fraction(pool, shard))
    if useful <= 0:
        return None
    return max(1, math.ceil(work_s / (useful * run_max) - 1e-9))


def capacity(
    work: WorkSummary,
    pools: Sequence[PoolSpec],
    *,
    now: dt.datetime,
    deadline: dt.datetime,
    policy: AdmissionPolicy | None = None,
) -> Capacity:
    """The capacity numbers of ``work`` on each of ``pools`` for the window from ``now`` to ``deadline``."""
    policy = policy or AdmissionPolicy()
    window = (ensure_aware(deadline, "deadline") - ensure_aware(now, "now")).total_seconds()
    rows = []
    for pool in pools:
        seconds = work_seconds_on(work, pool, policy.per_record_overhead_s)
        rows.append(
            PoolCapacity(
                pool=pool.name,
                kind=pool.kind.value,
                gpus=pool.gpus,
                gpu_hours=seconds / 3600.0,
                gpus_for_window=gpus_needed(seconds, pool, window, policy),
                gpus_for_half_window=gpus_needed(seconds, pool, window / 2, policy),
            )
        )
    return Capacity(
        prompt_tokens=work.prompt_tokens,
        output_tokens=work.output_tokens,
        window_s=window,
        pools=tuple(rows),
    )
