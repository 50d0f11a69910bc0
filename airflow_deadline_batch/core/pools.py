"""GPU pool definitions: what the planner, the placement policy and the shard operator know of a pool."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class PoolKind(str, enum.Enum):
    """Interruptible (Spot / preemptible) or dependable (on-demand / reserved) capacity."""

    SPOT = "spot"
    ON_DEMAND = "on_demand"


@dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """One node pool a shard can be placed on.

    Rates are per GPU, nominal for the job's model: the planner prices the work at them, and they
    are the prior of :mod:`core.calibration`. They are never changed here; while a job runs,
    :mod:`core.job_view` learns each pool's rate from the committed microbatches and takes predicted
    finish, slack and placement from the learned rates. ``node_selector``, ``tolerations`` and
    ``labels`` are passed to the pod as they are.
    """

    name: str
    kind: PoolKind
    gpus: int = 1
    price_per_gpu_hour: float = 1.0
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 1_500.0
    startup_seconds: float = 120.0
    queue_wait_seconds: float = 0.0
    preemptions_per_hour: float = 0.0
    preemption_notice_seconds: float = 0.0
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("pool name must not be empty")
        object.__setattr__(self, "kind", PoolKind(self.kind))
        if not self.gpus >= 1:  # `not >=` refuses NaN too, which passes every comparison
            raise ValueError(f"pool {self.name!r}: gpus must be >= 1, got {self.gpus}")
        # NaN or infinity (pools given in Python) would price a job at NaN, which passes any budget
        for attr in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            if not (getattr(self, attr) > 0 and math.isfinite(getattr(self, attr))):
                raise ValueError(
                    f"pool {self.name!r}: {attr} must be a finite number > 0, got {getattr(self, attr)}"
                )
        for attr in (
            "price_per_gpu_hour",
            "startup_seconds",
            "queue_wait_seconds",
            "preemptions_per_hour",
            "preemption_notice_seconds",
        ):
            if not (getattr(self, attr) >= 0 and math.isfinite(getattr(self, attr))):
                raise ValueError(
                    f"pool {self.name!r}: {attr} must be a finite number >= 0, got {getattr(self, attr)}"
                )
        object.__setattr__(self, "tolerations", tuple(dict(t) for t in self.tolerations))

    @property
    def interruptible(self) -> bool:
        return self.kind is PoolKind.SPOT

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (for XCom, the store and pod annotations)."""
        return {
            "name": self.name,
            "kind": self.kind.value,
            "gpus": self.gpus,
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "startup_seconds": self.startup_seconds,
            "queue_wait_seconds": self.queue_wait_seconds,
            "preemptions_per_hour": self.preemptions_per_hour,
            "preemption_notice_seconds": self.preemption_notice_seconds,
            "node_selector": dict(self.node_selector),
            "tolerations": [dict(t) for t in self.tolerations],
            "labels": dict(self.labels),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolSpec:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown pool field(s) {sorted(unknown)}; allowed: {sorted(known)}")
        values = dict(data)
        values["tolerations"] = tuple(values.get("tolerations", ()))
        return cls(**values)


#: rough per-worker rates of the embedded engines on a laptop CPU: (prefill, decode) tokens/s, startup s
_LOCAL_RATES = {
    "transformers": (2_000.0, 60.0, 20.0),
    "echo": (1_000_000.0, 200_000.0, 1.0),
}


def default_local_pools(engine: str = "transformers") -> tuple[PoolSpec, ...]:
    """The embedded default: a laptop's CPU 'pools', a Spot-like one and a dependable one.

    Rates are rough CPU figures for the engine (the small default model for ``transformers``);
    once microbatches commit, the job view uses the rates measured from them instead.
    """
    prefill, decode, startup = _LOCAL_RATES.get(engine, _LOCAL_RATES["transformers"])
    return (
        PoolSpec(
            name="local-spot",
            kind=PoolKind.SPOT,
            gpus=4,
            price_per_gpu_hour=1.0,
            prefill_tokens_per_s=prefill,
            decode_tokens_per_s=decode,
            startup_seconds=startup,
            preemptions_per_hour=6.0,
            preemption_notice_seconds=5.0,
        ),
        PoolSpec(
            name="local-on-demand",
            kind=PoolKind.ON_DEMAND,
            gpus=4,
            price_per_gpu_hour=3.0,
            prefill_tokens_per_s=prefill,
            decode_tokens_per_s=decode,
            startup_seconds=startup,
        ),
    )
