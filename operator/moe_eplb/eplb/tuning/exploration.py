"""What an experiment is about and what it measured: the types the tuner, the learning step and the
autotune loop's experiments share (no behaviour here).

- :class:`Exploration`: the tuner's case for trying a candidate on part of the replicas although the
  point estimate alone would not switch: the choice hinges on a parameter the calibration could not
  pin (its range is a prior) and the regret at stake exceeds what a trial costs;
- :class:`ArmObservation`: one arm of an experiment (trial or control) as read from vLLM's own
  metrics of its pods over the experiment;
- :class:`LearnedRange`: a parameter range narrowed by an experiment, kept for later decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_eplb.api.knobs import Knobs


@dataclass(frozen=True)
class Exploration:
    """Run ``candidate`` as a trial: ``parameter`` (a cost-model field whose range is a prior) decides
    between it and the running setting; ``regret_at_stake`` (fraction of throughput) is what keeping
    the running setting may lose across that range, ``trial_cost`` (fraction) what the trial costs."""

    candidate: Knobs
    parameter: str
    regret_at_stake: float
    trial_cost: float
    reason: str


@dataclass(frozen=True)
class ArmObservation:
    """One arm over an experiment, from vLLM's metrics of its pods (None where not exported)."""

    knobs: Knobs
    pods: int
    seconds: float
    step_seconds: float | None = None  # mean engine step (inter-token) time
    tokens_per_step: float | None = None  # mean batch size in tokens
    tokens_per_second_per_gpu: float | None = None
    balancedness: float | None = None  # served balancedness (mean over EP ranks / max)
    #: served imbalance as the cost model has it (sum over layers of max / sum of mean tokens per EP
    #: rank); None: not measured (then 1 / balancedness stands in, which understates it)
    imbalance: float | None = None
    prefix_hit_rate: float | None = None
    kv_cache_usage: float | None = None
    eplb: bool = True  # False: the arm (or period) ran with EPLB off (no expert load counted: balancedness None)

    def cost_imbalance(self) -> float:
        """The served imbalance the cost model's ``x`` is (each layer waits for its busiest rank):
        :attr:`imbalance` where measured, else 1 / :attr:`balancedness` (vLLM's mean over layers of
        mean/max), which understates it where the layers differ and so overstates a MoE share solved
        against it (layers spread 1.0-2.0 against 1.0-1.15: 0.38-0.44 for a true 0.35,
        tests/eplb/test_decide.py). The learning steps weigh step times by it."""
        if self.imbalance is not None and math.isfinite(self.imbalance) and self.imbalance >= 1.0:
            return float(self.imbalance)
        return 1.0 / min(1.0, float(self.balancedness))


@dataclass(frozen=True)
class LearnedRange:
    """``parameter``'s range narrowed from the prior ``[prior_low, prior_high]`` to ``[low, high]`` by
    the experiment ``source`` names."""

    parameter: str
    low: float
    high: float
    prior_low: float
    prior_high: float
    source: str
