"""What a calibration is: :class:`Calibration` (each calibrated cost-model field a
:class:`Parameter`, measured or default, with its uncertainty), :class:`CalibrationError` and the
thresholds the fits are refused below."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from moe_eplb.eplb.replay.costmodel import CostModel

MEASURED, DEFAULT = "measured", "default"
#: The calibrated cost-model fields (``CostModel`` attribute names), in report order.
PARAMETERS = ("moe_time_share", "seconds_per_step", "sync_stall_s", "async_s_per_moved_byte",
              "kv_throughput_elasticity", "kv_cache_bytes_per_gpu")

#: Fewest buckets (with steps, a step time and load) the step-time fit runs on.
MIN_FIT_BUCKETS = 20
#: Narrowest served-imbalance range (5th to 95th percentile) the share is fitted on.
MIN_IMBALANCE_SPREAD = 0.02
#: A fitted share less certain than this (one standard error) is not used.
MAX_SHARE_UNCERTAINTY = 0.1
#: Fewest observed rearrangements a rearrangement cost is measured from.
MIN_REARRANGEMENTS = 3
#: Mean KV-cache usage from which a bucket can be KV-bound.
KV_FULL_USAGE = 0.9
#: Elasticity when the KV cache is always the bottleneck.
FULL_KV_ELASTICITY = 1.0


class CalibrationError(ValueError):
    """A trace that cannot be calibrated on; the message names the key and the fix."""


@dataclass(frozen=True)
class Parameter:
    """One calibrated parameter: its value, one standard error (None for a default), its source
    (``measured`` or ``default``) and a note (how it was measured, or why the default stays)."""

    value: float
    uncertainty: float | None
    source: str
    note: str = ""

    def to_dict(self) -> dict:
        return {"value": self.value, "uncertainty": self.uncertainty, "source": self.source, "note": self.note}


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` found: every name of :data:`PARAMETERS`, the recorded mode
    (``use_async``, None when not recorded) and the fit's diagnostics."""

    parameters: dict[str, Parameter]
    use_async: bool | None = None
    fit: dict = field(default_factory=dict)
    #: the ranges a robust decision holds over (:mod:`moe_eplb.eplb.tuning.robust`), by cost-model field
    ranges: dict = field(default_factory=dict)
    #: the memory model fitted on KV usage and the prefix cache, or None without KV usage
    memory: MemoryFit | None = None

    @property
    def measured(self) -> tuple[str, ...]:
        """Names of the measured parameters."""
        return tuple(n for n, p in self.parameters.items() if p.source == MEASURED)

    def apply(self, cost: CostModel) -> CostModel:
        """``cost`` with the measured values (and the recorded async/sync mode) in place."""
        changes = {n: self.parameters[n].value for n in self.measured}
        if self.use_async is not None:
            changes["use_async"] = self.use_async
        if self.memory is not None:
            changes.update(self.memory.values)
        return replace(cost, **changes)

    def cost_at(self, cost: CostModel, values: dict) -> CostModel:
        """``cost`` with ``values`` (a scenario of :attr:`ranges`) in place; a working set without
        its own hit max takes the one that reproduces the observed hit rate."""
        values = dict(values)
        m = self.memory
        if (m is not None and m.prefix_measured and m.hit_rate and "prefix_working_set" in values
                and "prefix_hit_max" not in values):
            values["prefix_hit_max"] = _hit_max(m.hit_rate, m.free, values["prefix_working_set"])
        return replace(cost, **values)

    def robustness(self):
        """The ranges a tuner decision should hold over (:class:`moe_eplb.eplb.tuning.robust.Robustness`)."""
        from moe_eplb.eplb.tuning.robust import Robustness

        return Robustness(self.ranges, self.cost_at)

    def to_dict(self) -> dict:
        return {
            "parameters": {n: p.to_dict() for n, p in self.parameters.items()},
            "measured": list(self.measured),
            "use_async": self.use_async,
            "fit": self.fit,
            "ranges": {n: r.to_dict() for n, r in self.ranges.items()},
            "memory": None if self.memory is None else {
                "values": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.memory.values.items()},
                "prefix_hit_rate": self.memory.hit_rate, "free_cache": self.memory.free,
                "prefix_working_set_se": self.memory.working_set_se,
                "prefix_measured": self.memory.prefix_measured, "notes": self.memory.notes},
        }


@dataclass(frozen=True)
class MemoryFit:
    """The memory model's values (:class:`CostModel` field -> value) and what pins them: ``hit_rate``
    the observed (queries-weighted) prefix hit rate, ``free`` the median free cache it was seen at
    (in caches without redundant experts), ``working_set`` the fitted K with its standard error
    (None when the prior range stands), ``notes`` by field."""

    values: dict
    hit_rate: float | None
    free: float | None
    working_set_se: float | None
    prefix_measured: bool
    notes: dict


def _hit_max(hit: float, free: float, k: float) -> float:
    return float(min(1.0, hit / max(1.0 - math.exp(-free / k), 1e-9))) if hit > 0 else 0.0
