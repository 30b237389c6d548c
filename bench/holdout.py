"""Judge the tuner without peeking: tune on the first part of a trace, score on the rest.

Every configuration is scored by replaying the held-out part from a cold start (a new
configuration means a restarted engine: vLLM's initial placement until the first rearrangement),
so all six rows are comparable:

=================  ============================================================================
row                what
=================  ============================================================================
``no_eplb``        static expert parallelism, no redundancy
``vllm_defaults``  window 1000 / interval 3000 / R 0
``seed``           the seed change's hand-picked window 3000 / interval 1000 / R 8
``tuner``          what :func:`~moe_eplb.eplb.tuning.tuner.tune` recommends from the first part only
``hindsight``      the best configuration of the same grid, chosen on the held-out part itself
``clairvoyant``    rearranged before every bucket with that bucket's own load, at no cost, with
                   the largest redundancy the search allowed (a bound on balancedness; its
                   throughput still pays that redundancy's KV-cache memory)
=================  ============================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_eplb.api.knobs import Knobs
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.replay.simulator import Replay, SimError, SimResult, Topology
from moe_eplb.eplb.tuning.tuner import SEED_CONFIG, VLLM_DEFAULTS, TuneOptions, TuneResult, tune
from moe_eplb.eplb.workload.trace import LoadTrace

ROWS = ("no_eplb", "vllm_defaults", "seed", "tuner", "hindsight", "clairvoyant")


@dataclass
class HoldoutRow:
    name: str
    knobs: Knobs | None
    result: SimResult | None  # None: the configuration is not valid for this topology
    note: str = ""

    @property
    def throughput(self) -> float | None:
        return None if self.result is None else self.result.throughput.relative

    @property
    def balancedness(self) -> float | None:
        return None if self.result is None else self.result.balancedness


@dataclass
class Holdout:
    rows: dict[str, HoldoutRow]
    tune_result: TuneResult
    split: int

    def ratio_to_hindsight(self) -> float:
        return self.rows["tuner"].throughput / self.rows["hindsight"].throughput

    def not_worse_than(self, name: str) -> bool | None:
        other = self.rows[name].throughput
        return None if other is None else self.rows["tuner"].throughput >= other


def evaluate_holdout(
    trace: LoadTrace,
    *,
    ep_size: int,
    num_nodes: int = 1,
    num_groups: int = 1,
    cost: CostModel = CostModel(),
    split: float = 0.5,
    **tune_kwargs,
) -> Holdout:
    """Tune on buckets ``[0, split*T)``, then score every row on ``[split*T, T)``."""
    cut = int(round(trace.num_buckets * split))
    if not 0 < cut < trace.num_buckets:
        raise ValueError(f"split: {split} leaves no history or no future in {trace.num_buckets} buckets")
    history, future = trace.slice(0, cut), trace.slice(cut, trace.num_buckets)
    tuned = tune(history, TuneOptions(ep_size=ep_size, num_nodes=num_nodes, num_groups=num_groups, **tune_kwargs),
                 cost=cost)
    replay = Replay(future, Topology(ep_size, num_nodes, num_groups), tuned.cost)

    def run(knobs: Knobs) -> SimResult | None:
        try:
            return replay.run(knobs)
        except SimError:
            return None

    rows = {"no_eplb": HoldoutRow("no_eplb", None, replay.run_static())}
    for name, knobs in (("vllm_defaults", VLLM_DEFAULTS), ("seed", SEED_CONFIG)):
        res = run(knobs)
        rows[name] = HoldoutRow(name, knobs, res, "" if res else "not valid: (E + R) % ep != 0")
    rows["tuner"] = HoldoutRow("tuner", tuned.recommendation, run(tuned.recommendation))
    grid = [c.knobs for c in tuned.candidates]
    scored = [(r.throughput.relative, k, r) for k in grid if (r := run(k)) is not None]
    best = max(scored, key=lambda x: x[0])
    rows["hindsight"] = HoldoutRow("hindsight", best[1], best[2], f"best of {len(scored)} on the future")
    r_max = max(tuned.stats["redundancy_levels"])
    rows["clairvoyant"] = HoldoutRow("clairvoyant", Knobs(1, 1, r_max), replay.run_clairvoyant(r_max),
                                     f"every bucket, own load, R={r_max}, free")
    return Holdout(rows, tuned, cut)


# --------------------------------------------------------------------------------------------------
# calibration: tune on telemetry recorded under true cost parameters, score with the truth
# --------------------------------------------------------------------------------------------------

CALIBRATED_ROWS = ("no_eplb", "vllm_defaults", "constant", "calibrated", "hindsight")


@dataclass
class CalibratedHoldout:
    """Rows scored on the held-out part with the TRUE cost; ``calibration`` is what the tuner
    measured on the first part, ``true`` the cost model of the truth on the held-out part."""

    rows: dict[str, HoldoutRow]
    calibration: object
    constant: TuneResult
    calibrated: TuneResult
    true: CostModel

    def ratio(self, row: str) -> float:
        return self.rows[row].throughput / self.rows["hindsight"].throughput


def evaluate_calibrated_holdout(history: LoadTrace, future: LoadTrace, true_cost: CostModel, *, ep_size: int,
                                num_nodes: int = 1, num_groups: int = 1, **tune_kwargs) -> CalibratedHoldout:
    """``history`` carries telemetry recorded under the true parameters (its ``config`` is the
    running configuration). Tune on it twice -- with today's constant cost model and with the
    calibrated one (:func:`moe_eplb.eplb.tuning.calibrate.calibrate`) -- and replay both picks, vLLM's
    defaults, no EPLB and every configuration of the grid on ``future`` with ``true_cost``; the
    hindsight row is the grid's best there."""
    from moe_eplb.eplb.tuning.calibrate import calibrate

    tel = history.telemetry
    current = tel.config.knobs if tel is not None and tel.config is not None else None
    options = TuneOptions(ep_size=ep_size, num_nodes=num_nodes, num_groups=num_groups, **tune_kwargs)
    constant = tune(history, options, current=current)
    cal = calibrate(history, num_nodes=num_nodes, num_groups=num_groups)
    calibrated = tune(history, options, current=current, cost=cal.apply(CostModel()))
    replay = Replay(future, Topology(ep_size, num_nodes, num_groups), true_cost)

    def run(knobs: Knobs) -> SimResult | None:
        try:
            return replay.run(knobs)
        except SimError:
            return None

    rows = {"no_eplb": HoldoutRow("no_eplb", None, replay.run_static()),
            "vllm_defaults": HoldoutRow("vllm_defaults", VLLM_DEFAULTS, run(VLLM_DEFAULTS)),
            "constant": HoldoutRow("constant", constant.recommendation, run(constant.recommendation),
                                   f"today's constant cost model ({constant.decision})"),
            "calibrated": HoldoutRow("calibrated", calibrated.recommendation, run(calibrated.recommendation),
                                     f"calibrated cost model ({calibrated.decision})")}
    grid = list(dict.fromkeys([c.knobs for c in calibrated.candidates] + [c.knobs for c in constant.candidates]))
    scored = [(r.throughput.relative, k, r) for k in grid if (r := run(k)) is not None]
    best = max(scored, key=lambda x: x[0])
    rows["hindsight"] = HoldoutRow("hindsight", best[1], best[2], f"best of {len(scored)} on the future, true cost")
    return CalibratedHoldout(rows, cal, constant, calibrated, true_cost)
