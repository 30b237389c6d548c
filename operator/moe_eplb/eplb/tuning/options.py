"""What the tuner searches and how it decides: :class:`TuneOptions`, one typed, documented object.

The one settings type of :func:`moe_eplb.eplb.tuning.tuner.tune`: ``moe-eplb tune`` builds it from its
flags (``cli/tune_args.py``), the operator from the resource and its own search (``AutotuneSettings.search``
with the resource's deployment filled in), the benchmarks and tests directly. Beside it ``tune`` takes only
the trace and what was measured or is running (``current``, the cost model, the calibrated ranges)
and a progress callback. Frozen: a changed copy is ``dataclasses.replace(options, ...)``.

Fields are documented where they are declared (shape and unit with each), the way vLLM documents
``EPLBConfig`` (``vllm/config/parallel.py``). Values are checked by ``tune`` (a bad one raises
``TuneError`` naming the field), not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_eplb.api.knobs import Bounds
from moe_eplb.eplb.tuning.overlap import OverlapContext

#: Least data to tune on: engine steps in the trace (the autotune loop's ``InsufficientData``
#: threshold too) and buckets (a single bucket has no time structure to judge "consistently" by).
MIN_TUNE_STEPS = 2000
MIN_TUNE_BUCKETS = 2
#: The tuner's ladders of windows and intervals, in engine steps (cut to the bounds).
DEFAULT_WINDOWS = (500, 1000, 2000, 3000, 5000)
DEFAULT_INTERVALS = (1000, 2000, 3000, 5000, 10000)
#: How long a trial runs when the caller does not say (the exposure term of ``tuner.trial_cost``).
DEFAULT_TRIAL_SECONDS = 1800.0


@dataclass(frozen=True)
class TuneOptions:
    """The deployment the tuner plans for, the search it runs and the rules it decides by."""

    # --- the deployment -----------------------------------------------------------------------------
    ep_size: int = 1
    """Expert-parallel size: the GPUs (EP ranks) one engine spreads its experts over, a whole number
    >= 1 and at most the model's experts per layer. The CLI's ``--ep-size``, the operator's
    ``spec.parallelism``; 1 (one GPU holds every expert) only where nothing says otherwise."""

    num_nodes: int = 1
    """Nodes the EP ranks are spread over, a divisor of ``ep_size`` (every node holds
    ``ep_size / num_nodes`` GPUs); vLLM's policy places replicas node by node."""

    num_groups: int = 1
    """Expert groups of the model (DeepSeek-V3: 8, models without groups: 1): vLLM's hierarchical
    policy packs groups onto nodes first."""

    memory_budget_bytes: float | None = None
    """Bytes per GPU the redundant experts may take, summed over the MoE layers (>= 0); None: no
    limit. Redundancy levels above it are not searched."""

    bytes_per_expert: float | None = None
    """Bytes of one expert of one MoE layer as served (>= 0); None: the cost model's value, else the
    known model shape's. Needed with ``memory_budget_bytes``; sets what a moved replica costs."""

    bounds: Bounds = Bounds()
    """Inclusive ranges the search stays in: ``window`` and ``interval`` in engine steps,
    ``redundant`` in experts (each ``(low, high)``, an end None = open)."""

    overlap: OverlapContext | None = None
    """The deployment's shared-expert overlap (:class:`~moe_eplb.eplb.tuning.overlap.OverlapContext`:
    the model's shared experts, the all2all backend, the vLLM release): its loss while EPLB runs is
    priced in the cost model (:meth:`~moe_eplb.eplb.tuning.overlap.OverlapContext.apply`) and its
    overlap-safe backends are named in ``TuneResult.advice``. None: no overlap is lost."""

    replicas: int = 1
    """Replicas (or replica groups) sharing the traffic, >= 1: a trial runs on one of them, so its
    risk is ``1 / replicas`` of the traffic (``tuner.trial_cost``)."""

    # --- the decision -------------------------------------------------------------------------------
    min_gain: float = 0.005
    """Relative throughput gain (a fraction: 0.005 = 0.5 %) a change must bring beyond its restart
    (``restart_s / horizon_s`` of the cost model): the model's error margin."""

    prior_margin: float = 0.002
    """Without parameter ranges: a searched configuration must beat the best known one (vLLM's
    defaults, the seed's 3000/1000/8, ``current``) by this fraction -- the lower bound (mean - 1
    standard error) of its paired per-segment gain. With ranges, ``max(prior_margin, min_gain)`` is
    the band of largest regrets inside which the running or a known configuration is preferred."""

    tie_tolerance: float = 1e-3
    """Scores (relative throughput, 1.0 = balanced, free, no redundancy) closer than this are ties,
    broken by the full-history mean."""

    live: bool = False
    """The engines take changes of window and interval live (the exporter's live apply,
    :mod:`moe_eplb.controller.live`): such a change is charged no restart (a change of redundancy
    still is)."""

    allow_off: bool = True
    """EPLB off (vLLM's static placement) is a candidate like any setting: where it wins (the
    predicted gain of every EPLB-on setting does not pay for the shared-expert overlap loss and the
    rearrangements), ``TuneResult.enabled`` is False, ``decision``/``reason`` are about turning EPLB
    off and ``recommendation`` is the best EPLB-on setting (what to run where EPLB must stay on; its
    own verdict in ``on_decision``/``on_reason``). False: only EPLB-on settings are searched."""

    trial_seconds: float = DEFAULT_TRIAL_SECONDS
    """Seconds a trial on one replica runs: its exposure to the candidate's worst case."""

    # --- the search ---------------------------------------------------------------------------------
    windows: tuple[int, ...] = DEFAULT_WINDOWS
    """Window sizes to try, in engine steps (cut to ``bounds.window``; its ends are added)."""

    intervals: tuple[int, ...] = DEFAULT_INTERVALS
    """Rearrangement intervals to try, in engine steps (cut to ``bounds.interval``; its ends added)."""

    max_redundancy_levels: int = 5
    """Most redundancy values searched: the valid ones (``(experts + R) % ep_size == 0``, within the
    bounds and the budget) thinned evenly, the smallest and the largest kept."""

    segments: int = 6
    """Contiguous time pieces of the history, equal in buckets: the score is the mean of the worst
    half of them (CVaR-50 over time)."""

    screen_layers: int | None = 16
    """Screen every candidate on about this many MoE layers (every k-th), then replay the
    ``finalists`` best (and the known configurations) on every layer; None (or a model with few
    layers): every candidate on every layer."""

    finalists: int = 12
    """Candidates re-scored on every layer after the screening."""

    min_steps: int = MIN_TUNE_STEPS
    """Fewest engine steps in the trace to tune on (with fewer, or fewer than two buckets:
    ``TuneError``, the operator's ``NoData``)."""

    workers: int | None = None
    """Processes for the policy calls (None or 1: none beside the caller's; more: spawned
    processes, so a script needs the ``if __name__ == "__main__":`` guard)."""
