"""Predicted throughput of an EPLB configuration: the cost model the simulator and tuner share.

Everything here is relative: ``1.0`` is an engine whose MoE layers are perfectly balanced, that
never rearranges and that spends no memory on redundant experts. Three factors multiply:

1. **Imbalance.** A step's MoE time is set by the busiest GPU of each MoE layer. With ``f`` the MoE
   share of a perfectly balanced step (``moe_time_share``), a bucket of ``n`` steps takes
   ``n * s0 * ((1 - f) + f * sum_l max_gpu(load) / sum_l mean_gpu(load))`` seconds, ``s0`` the
   balanced step time (``seconds_per_step``). Ideal time is ``n * s0``.
2. **Rearrangement overhead**, added to the time: sync mode (``use_async=False``) stalls every GPU
   for ``sync_stall_s`` per rearrangement; async mode (vLLM >= 0.24 default) copies weights in the
   background and costs ``async_s_per_moved_byte`` per byte of expert weights a GPU receives
   (moved replicas / ep x bytes_per_expert; the ranks copy in parallel).
3. **KV-cache memory.** Each GPU holds ``R / ep`` extra experts in every MoE layer,
   ``L * bytes_per_expert * R / ep`` bytes taken from the KV cache (``kv_cache_bytes_per_gpu``).
   Fewer concurrent sequences cost throughput: the factor is
   ``1 - kv_throughput_elasticity * redundant_bytes / kv_cache_bytes_per_gpu``.

   With the deployment's KV telemetry (:mod:`moe_eplb.eplb.tuning.calibrate` sets ``kv_demand``) the
   factor is instead the **memory model** (:meth:`CostModel.memory`): per recorded bucket b with
   KV demand ``d_b`` (cache the running requests want, in caches without redundant experts) a
   cache left at ``c = 1 - redundant_bytes / kv_cache_bytes_per_gpu`` of its size

   - caps the batch once the running requests no longer fit: ``batch_b = min(1, u c / d_b) **
     kv_batch_elasticity`` (``u = kv_full_usage``, where vLLM starts preempting);
   - keeps prefixes only in the part no running request holds, ``free_b = c - min(d_b, u c)``,
     with hit rate ``h_b = prefix_hit_max (1 - exp(-free_b / prefix_working_set))``;
   - and every prefix miss is recomputed: step time ``~ 1 - prefix_prefill_share * h_b``
     (``prefix_prefill_share``: the share of a step the queried prompt tokens would take if none
     hit).

   The factor is the step-weighted mean over buckets of ``batch_b(c) / batch_b(1) * (1 - s
   h_b(1)) / (1 - s h_b(c))``: 1 without redundancy, below 1 as soon as the redundant experts eat
   into the prefix cache -- long before any preemption.

4. **Shared-expert overlap** (EPLB on only). vLLM runs a model's shared experts overlapped with the
   routed experts' dispatch and combine, but turns that overlap off with EPLB on most all2all
   backends (:func:`moe_eplb.api.wide_ep.eplb_drops_shared_overlap`). Where it does
   (``overlap_dropped``), every EPLB-on step takes ``overlap_loss = f * shared_expert_ratio *
   overlap_hidden`` of the balanced step time more: the shared experts' compute (``shared_expert_ratio``
   of the routed experts', from the model catalog: DeepSeek-V3 1/8) that the overlap used to hide
   (``overlap_hidden``, the share hidden: how much of it ran under the all2all's communication; 0.5 a
   prior, the range 0-1, measured from EPLB-on against EPLB-off step times where they exist:
   :mod:`moe_eplb.eplb.tuning.overlap`). A bucket of ``n`` steps then takes ``n * s0 * ((1 - f) + f *
   x + overlap_loss)``; without EPLB (vLLM's static placement) no such term.

Default parameters and where they come from (numbers from ``shared/notes/vllm-eplb.md``):

- ``moe_time_share = 0.35``: the value that makes this model reproduce SGLang's reported 1.49x
  prefill gain from EPLB on DeepSeek-V3 given TensorRT-LLM's measured per-rank imbalance on
  DeepSeek-R1 ((max-mean)/mean 1.564 without EPLB, 0.109 with it):
  ``(1 + 1.564 f) / (1 + 0.109 f) = 1.49`` gives ``f = 0.35``.
- ``sync_stall_s = 0.91``: mean sync rearrangement stall, DeepSeek-R1 NVFP4 on 32 GB200
  (0.65-1.70 s reported).
- ``async_s_per_moved_byte = 3.9e-11`` (0.0017 s per 44 MB DeepSeek expert): the sync stall
  spread over the replicas such a rearrangement moves per rank (about half of 58 layers x 9 slots,
  i.e. ~260, so ~3.5 ms each), halved because async copies overlap compute. An assumption, not a
  measurement. When the expert size is unknown a moved replica counts as a DeepSeek one.
- ``seconds_per_step = 0.05`` (20 engine steps/s, the issue's one-hour DeepSeek-V3 trace) when the
  trace does not say (``bucket_seconds / bucket_steps``).
- ``bytes_per_expert``: per MoE layer per expert. DeepSeek-V3 (58 x 256, FP8): 3 x 7168 x 2048 B
  = 44 MB, i.e. ~2.5 GB per redundant expert per rank over 58 layers, matching vLLM's "about
  2.4 GB". Qwen3-VL-30B-A3B (48 x 128, BF16): 3 x 2048 x 768 x 2 B = 9.4 MB. Other shapes: give it
  (unknown -> no memory penalty, reported as such).
- ``kv_cache_bytes_per_gpu = 40 GiB`` and ``kv_throughput_elasticity = 0.5`` (losing 10 % of the
  KV cache loses 5 % throughput: decode throughput grows sub-linearly with batch size).
  Assumptions; set them from the deployment when known.
- ``restart_s = 300`` (a new engine pod: schedule, load weights, warm up) and ``horizon_s = 6 h``
  (how long a new configuration is expected to stay): a change must gain more than
  ``restart_s / horizon_s`` of throughput to pay for itself. Assumptions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

#: (num_layers, num_experts) -> bytes per expert per MoE layer, for the shapes the project ships.
KNOWN_BYTES_PER_EXPERT = {
    (58, 256): 3 * 7168 * 2048,  # DeepSeek-V3/R1, FP8: 44.0 MB
    (48, 128): 3 * 2048 * 768 * 2,  # Qwen3-VL-30B-A3B / Qwen3-30B-A3B, BF16: 9.4 MB
}

GIB = 1024**3
#: ``overlap_hidden`` where nothing measured it: the overlap may have hidden none to all of the shared
#: experts' time (how much ran under the all2all's communication depends on the batch, the EP size and
#: the network); the point estimate is the middle.
OVERLAP_HIDDEN_PRIOR = (0.0, 1.0)
#: The memory model's fields (used only when ``kv_demand`` is set).
MEMORY_FIELDS = ("kv_demand", "kv_full_usage", "kv_batch_elasticity", "prefix_hit_max", "prefix_working_set",
                 "prefix_prefill_share", "kv_bytes_per_token")


@dataclass(frozen=True)
class CostModel:
    """Parameters of the throughput model (see the module docstring for sources)."""

    moe_time_share: float = 0.35
    seconds_per_step: float | None = None
    use_async: bool = True
    sync_stall_s: float = 0.91
    async_s_per_moved_byte: float = 0.0017 / (3 * 7168 * 2048)
    bytes_per_expert: float | None = None
    kv_cache_bytes_per_gpu: float = 40 * GIB
    kv_throughput_elasticity: float = 0.5
    restart_s: float = 300.0
    horizon_s: float = 6 * 3600.0
    # the memory model (used when kv_demand is set; see the module docstring)
    kv_demand: tuple[float, ...] | None = None
    kv_full_usage: float = 0.95
    kv_batch_elasticity: float = 1.0
    prefix_hit_max: float = 0.0
    prefix_working_set: float = 0.5
    prefix_prefill_share: float = 0.0
    kv_bytes_per_token: float | None = None
    # the shared-expert overlap EPLB on loses (module docstring, factor 4)
    shared_expert_ratio: float = 0.0
    overlap_dropped: bool = False
    overlap_hidden: float = 0.5

    def __post_init__(self) -> None:
        checks = {
            "moe_time_share": 0 <= self.moe_time_share <= 1,
            "seconds_per_step": self.seconds_per_step is None or self.seconds_per_step > 0,
            "sync_stall_s": self.sync_stall_s >= 0,
            "async_s_per_moved_byte": self.async_s_per_moved_byte >= 0,
            "bytes_per_expert": self.bytes_per_expert is None or self.bytes_per_expert >= 0,
            "kv_cache_bytes_per_gpu": self.kv_cache_bytes_per_gpu > 0,
            "kv_throughput_elasticity": self.kv_throughput_elasticity >= 0,
            "restart_s": self.restart_s >= 0,
            "horizon_s": self.horizon_s > 0,
            "kv_demand": self.kv_demand is None or (len(self.kv_demand) > 0 and all(d >= 0 for d in self.kv_demand)),
            "kv_full_usage": 0 < self.kv_full_usage <= 1,
            "kv_batch_elasticity": self.kv_batch_elasticity >= 0,
            "prefix_hit_max": 0 <= self.prefix_hit_max <= 1,
            "prefix_working_set": self.prefix_working_set > 0,
            "prefix_prefill_share": 0 <= self.prefix_prefill_share < 1,
            "kv_bytes_per_token": self.kv_bytes_per_token is None or self.kv_bytes_per_token > 0,
            "shared_expert_ratio": 0 <= self.shared_expert_ratio <= 4,
            "overlap_hidden": 0 <= self.overlap_hidden <= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"CostModel.{name}: invalid value {getattr(self, name)!r}")

    def with_(self, **changes) -> CostModel:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Every field; the memory model's only when it is in use (``kv_demand`` set)."""
        out = asdict(self)
        if self.kv_demand is None:
            for name in MEMORY_FIELDS:
                out.pop(name)
        else:
            out["kv_demand"] = list(self.kv_demand)
        return out

    # --- the factors ---------------------------------------------------------------------------

    @property
    def overlap_loss(self) -> float:
        """Share of the balanced step time every EPLB-on step adds because vLLM no longer overlaps the
        shared experts: ``moe_time_share * shared_expert_ratio * overlap_hidden`` where the backend
        drops the overlap (``overlap_dropped``), else 0."""
        if not self.overlap_dropped:
            return 0.0
        return self.moe_time_share * self.shared_expert_ratio * self.overlap_hidden

    def resolve_bytes_per_expert(self, num_layers: int, num_experts: int) -> float | None:
        """Bytes per expert per MoE layer: the given value, else the known shape's, else None."""
        if self.bytes_per_expert is not None:
            return float(self.bytes_per_expert)
        known = KNOWN_BYTES_PER_EXPERT.get((num_layers, num_experts))
        return float(known) if known is not None else None

    def redundant_bytes_per_gpu(
        self, num_layers: int, num_experts: int, num_redundant: int, ep_size: int
    ) -> float:
        """Memory each GPU spends on redundant experts: ``L * bytes_per_expert * R / ep``."""
        per_expert = self.resolve_bytes_per_expert(num_layers, num_experts) or 0.0
        return num_layers * per_expert * num_redundant / ep_size

    def kv_factor(self, redundant_bytes_per_gpu: float) -> float:
        """Throughput factor (<= 1) from KV-cache memory taken by redundant experts: the memory
        model's (:meth:`memory`) when ``kv_demand`` is known, else the elasticity rule."""
        if self.kv_demand is not None:
            return self.memory(redundant_bytes_per_gpu)["factor"]
        share = redundant_bytes_per_gpu / self.kv_cache_bytes_per_gpu
        return max(0.0, 1.0 - self.kv_throughput_elasticity * share)

    def memory(self, redundant_bytes_per_gpu: float) -> dict:
        """What redundancy taking ``redundant_bytes_per_gpu`` costs in KV cache (module docstring):
        ``capacity`` (share of the cache left), ``kv_tokens_lost`` (per GPU, when the bytes per token
        are known), ``prefix_hit_rate`` (mean over buckets) with and without the redundancy,
        ``batch_factor``, ``prefix_factor`` and their product ``factor``."""
        c = max(1e-6, 1.0 - redundant_bytes_per_gpu / self.kv_cache_bytes_per_gpu)
        d = np.asarray(self.kv_demand if self.kv_demand is not None else (0.0,), np.float64)

        def state(cap: float) -> tuple[np.ndarray, np.ndarray]:
            u = self.kv_full_usage * cap
            with np.errstate(divide="ignore", invalid="ignore"):
                batch = np.where(d > u, u / np.where(d > 0, d, 1.0), 1.0) ** self.kv_batch_elasticity
            free = np.maximum(cap - np.minimum(d, u), 0.0)
            hit = self.prefix_hit_max * (1.0 - np.exp(-free / self.prefix_working_set))
            return batch, hit

        b1, h1 = state(1.0)
        bc, hc = state(c)
        s_ = self.prefix_prefill_share
        batch = float(np.mean(bc / b1))
        prefix = float(np.mean((1.0 - s_ * h1) / (1.0 - s_ * hc)))
        factor = float(np.mean(bc / b1 * (1.0 - s_ * h1) / (1.0 - s_ * hc)))
        lost = (redundant_bytes_per_gpu / self.kv_bytes_per_token) if self.kv_bytes_per_token else None
        return {"capacity": c, "kv_tokens_lost": lost, "prefix_hit_rate": float(hc.mean()),
                "prefix_hit_rate_without_redundancy": float(h1.mean()), "batch_factor": batch,
                "prefix_factor": prefix, "factor": factor}

    def overhead_seconds(
        self, rearrangements, moved_experts, ep_size: int, num_layers: int, num_experts: int
    ):
        """Time lost to rearrangements (scalars or arrays): the sync stall per rearrangement, or in
        async mode the copy overhead of the bytes each GPU receives."""
        if self.use_async:
            per_expert = self.resolve_bytes_per_expert(num_layers, num_experts)
            if per_expert is None:
                per_expert = KNOWN_BYTES_PER_EXPERT[(58, 256)]
            return self.async_s_per_moved_byte * per_expert * moved_experts / ep_size
        return self.sync_stall_s * rearrangements

    def step_seconds(self, bucket_seconds: float | None, mean_steps_per_bucket: float) -> float:
        """Balanced step time s0: given, else from the trace, else 0.05 s (20 steps/s)."""
        if self.seconds_per_step is not None:
            return float(self.seconds_per_step)
        if bucket_seconds and mean_steps_per_bucket > 0:
            return float(bucket_seconds) / mean_steps_per_bucket
        return 0.05

    def change_threshold(self, min_gain: float) -> float:
        """Relative gain a new configuration needs before a restart is worth it."""
        return min_gain + self.restart_s / self.horizon_s
