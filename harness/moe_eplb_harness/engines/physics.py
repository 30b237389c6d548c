"""SIMULATED deployment physics: the true cost parameters of a deployment and what they make it measure.

The operator and the tuner never see :class:`TrueCost`: tests, the benchmark and the demo give it to
the simulated engines (:class:`moe_eplb_harness.engines.engine.SimulatedEngine`) or to
:func:`moe_eplb_harness.engines.recording.record`, which turn
it into what a real deployment would measure -- step times, rearrangement durations, KV-cache usage,
preemptions and waiting requests -- and the calibration (:mod:`moe_eplb.eplb.tuning.calibrate`) has to find
the parameters again from those measurements alone.

The forward model (one engine, per bucket of ``n`` steps with ``tok`` tokens per step):

- balanced step time ``s0(tok) = step_base_s + step_per_token_s * tok``; a step with served
  imbalance ``x`` (``sum_l max_rank / sum_l mean_rank``) takes ``s0 * ((1 - f) + f * x + overlap_loss)``
  (``overlap_loss``: the shared experts' time an EPLB-on engine no longer overlaps on its all2all backend)
  (``f = moe_time_share``); the bucket's mean step time gets log-normal noise (``step_noise``) and,
  in a share ``outlier_share`` of buckets, a 20-60 % outlier (a GC pause, a burst of long prefills);
- a rearrangement costs ``sync_stall_s`` (sync; log-normal ``stall_noise``; the stall is part of
  one step, so of the bucket's mean step time) or ``async_s_per_moved_byte`` per byte a GPU
  receives (async; spread over the bucket's steps). Its recorded duration is the stall (sync) or
  the time the copies ran, one layer per step (async);
- the KV cache holds ``kv_demand * tok / tok_ref`` of its size (``tok_ref``: the trace's median
  tokens per step) on a cache shrunk by the redundant experts; above 97 % the excess
  requests wait and some are preempted;
- ``bytes_per_expert``: the expert size (None: the known shapes' or 0), for the async copy cost and
  the cache the redundant experts take;
- ``kv_throughput_elasticity`` is the throughput lost per share of cache lost (the truth the
  benchmark scores with; 0 for a cache with room to spare, 1 when the cache is the bottleneck);
- the prefix cache (:meth:`TrueCost.prefix_hit_rate`): the part of the cache no running request
  holds keeps prefixes; of the prompt tokens (``prompt_share`` of all tokens a step would compute
  without a cache) a share ``prefix_reuse`` could be served from it, reached as a power law of the
  free cache over the reused prefixes' working set (``prefix_working_set``, in caches without
  redundant experts): ``hit = prefix_reuse * min(1, (free / working_set) ** 0.7)``. Queried prompt
  tokens and the hit rate are recorded per bucket (vLLM's ``prefix_cache_queries`` / ``_hits``), the
  cache's size in blocks of ``kv_block_size`` tokens (``kv_bytes_per_token`` bytes each);
- what real clusters add to an ideal engine (all opt-in: 0 keeps the ideal engine the older tests
  and benchmarks were written against): a fixed speed per pod (``pod_speed_sd``: its GPUs, NICs,
  neighbours; a log-normal factor drawn once per pod key, :meth:`TrueCost.pod_traits`); a cold prefix
  cache after a start (``cold_start_penalty``: extra step time at the start, decaying with
  ``cold_start_tau_s``, :meth:`TrueCost.cold_factor`); step-time noise correlated from one trace
  bucket to the next (``noise_autocorr``: the lag-1 autocorrelation of an AR(1) process with the
  marginal sd ``step_noise``); and a cache-affine router's uneven split of the traffic
  (``router_skew_sd``: a fixed log-normal factor on a pod's share, plus a slow AR(1) drift of
  ``router_drift_sd`` with correlation time ``router_drift_tau_s``). ``planted_gain`` plants a known
  effect of a setting (step time / (1 + gain) while those knobs run): what a benchmark of the
  experiment judge must find;
- :meth:`TrueCost.memory_factor` is the truth the judge (``bench/bench_judge.py``) scores a
  redundancy with: per bucket, the batch capped by a cache too small for the running requests
  (throughput ~ capacity ** ``kv_throughput_elasticity`` beyond ``FULL_USAGE``) and the prefill of
  the prefix hits lost (a prompt token costing ``prefill_cost_ratio`` times an average token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_eplb.api.knobs import Knobs
from moe_eplb.eplb.replay.costmodel import GIB, CostModel
from moe_eplb.eplb.workload.trace import LoadTrace

__all__ = ["TrueCost", "tokens_per_step"]

#: Usage at which a simulated KV cache counts as full (requests queue beyond it).
FULL_USAGE = 0.97


def tokens_per_step(trace: LoadTrace) -> np.ndarray:
    """``[T]`` tokens per engine step (routed per layer / top_k / steps; top_k 1 when unknown)."""
    routed = trace.load.sum(axis=2).mean(axis=1) / float(trace.top_k or 1)
    steps = trace.bucket_steps.astype(np.float64)
    return np.divide(routed, steps, out=np.zeros_like(routed), where=steps > 0)


@dataclass(frozen=True)
class TrueCost:
    """A deployment's true cost parameters (hidden from the operator; see the module docstring)."""

    moe_time_share: float = 0.35
    step_base_s: float = 0.012
    step_per_token_s: float = 8e-6
    use_async: bool = True
    sync_stall_s: float = 0.91
    async_s_per_moved_byte: float = CostModel().async_s_per_moved_byte
    kv_cache_bytes_per_gpu: float = 40 * GIB
    kv_demand: float = 0.6
    kv_throughput_elasticity: float = 0.0
    bytes_per_expert: float | None = None
    step_noise: float = 0.02
    outlier_share: float = 0.02
    stall_noise: float = 0.15
    prefix_reuse: float = 0.0
    prefix_working_set: float = 0.5
    prompt_share: float = 0.7
    prefill_cost_ratio: float = 1.0
    kv_bytes_per_token: float = 70_272.0  # DeepSeek-V3 MLA: (512 + 64) x 61 layers x 2 bytes
    kv_block_size: int = 16
    #: share of the balanced step time an EPLB-on engine loses because vLLM runs the shared experts
    #: without overlap on its all2all backend (0: none, or a backend that keeps the overlap)
    overlap_loss: float = 0.0

    # what real clusters add (opt-in; see the module docstring)
    pod_speed_sd: float = 0.0
    cold_start_penalty: float = 0.0
    cold_start_tau_s: float = 180.0
    noise_autocorr: float = 0.0
    router_skew_sd: float = 0.0
    router_drift_sd: float = 0.0
    router_drift_tau_s: float = 900.0
    planted_gain: tuple[tuple[Knobs, float], ...] = ()

    def pod_traits(self, key: int) -> tuple[float, float]:
        """``(speed, traffic factor)`` of the pod with ``key`` (fixed for the key: the same GPUs give
        the same pod the same speed): its steps take ``1 / speed`` of the ideal time and it gets
        ``traffic factor`` times its even share of the requests (1.0, 1.0 with the defaults)."""
        rng = np.random.default_rng([int(key), 104_729])
        speed, skew = rng.normal(0.0, 1.0, 2)
        return float(np.exp(self.pod_speed_sd * speed)), float(np.exp(self.router_skew_sd * skew))

    def cold_factor(self, age_s: float) -> float:
        """Step time of a pod ``age_s`` seconds after it started serving, over a warm pod's (its
        prefix cache refills: ``1 + cold_start_penalty * exp(-age / cold_start_tau_s)``)."""
        if self.cold_start_penalty <= 0:
            return 1.0
        return 1.0 + self.cold_start_penalty * float(np.exp(-max(0.0, age_s) / max(self.cold_start_tau_s, 1e-9)))

    def gain_of(self, knobs: Knobs) -> float:
        """The planted gain of running ``knobs`` (0 where none is planted)."""
        return next((float(g) for k, g in self.planted_gain if k == knobs), 0.0)

    def kv_capacity(self, redundant_bytes: float) -> float:
        """The cache left by ``redundant_bytes`` per GPU, as a share of the cache without them."""
        return max(1e-6, 1.0 - redundant_bytes / self.kv_cache_bytes_per_gpu)

    def kv_demand_share(self, tokens: np.ndarray, tokens_ref: float) -> np.ndarray:
        """``[T]`` cache the running requests want, in caches without redundant experts."""
        return self.kv_demand * np.asarray(tokens, np.float64) / max(tokens_ref, 1e-9)

    def prefix_hit_rate(self, demand: np.ndarray, capacity: float) -> np.ndarray:
        """``[T]`` prefix-cache hit rate with ``demand`` (:meth:`kv_demand_share`) on a cache of
        ``capacity`` (:meth:`kv_capacity`)."""
        free = np.maximum(capacity - np.minimum(np.asarray(demand, np.float64), FULL_USAGE * capacity), 0.0)
        return self.prefix_reuse * np.minimum(1.0, (free / max(self.prefix_working_set, 1e-9)) ** 0.7)

    def memory_factor(self, trace: LoadTrace, redundant_bytes: float) -> float:
        """True relative throughput of a cache shrunk by ``redundant_bytes`` per GPU against the
        same deployment without redundant experts, over ``trace`` (step-weighted)."""
        tok = tokens_per_step(trace)
        n = trace.bucket_steps.astype(np.float64)
        ref = float(np.median(tok[n > 0])) if np.any(n > 0) else 1.0
        demand = self.kv_demand_share(tok, ref)

        def throughput(capacity: float) -> np.ndarray:
            with np.errstate(divide="ignore", invalid="ignore"):
                batch = np.where(demand > 0, np.minimum(1.0, FULL_USAGE * capacity / demand), 1.0)
            hit = self.prefix_hit_rate(demand, capacity)
            # time per step ~ base + per_token * (decode + prompt * (1 - hit) * ratio); tokens as if uncached
            base = self.step_base_s / np.maximum(self.step_per_token_s * tok, 1e-12)
            work = base + (1 - self.prompt_share) + self.prompt_share * self.prefill_cost_ratio * (1 - hit)
            return batch ** self.kv_throughput_elasticity / work

        ratio = throughput(self.kv_capacity(redundant_bytes)) / throughput(1.0)
        return float(np.average(ratio, weights=n)) if n.sum() > 0 else 1.0

    def prefix_state(self, tokens: np.ndarray, tokens_ref: float, redundant_bytes: float, steps: np.ndarray,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``(queried prompt tokens, hit rate)`` per bucket (the hit rate with 1 % noise; NaN where
        nothing was queried)."""
        demand = self.kv_demand_share(tokens, tokens_ref)
        hit = self.prefix_hit_rate(demand, self.kv_capacity(redundant_bytes))
        computed = np.asarray(tokens, np.float64) * np.asarray(steps, np.float64)
        # computed = queried * (1 - hit) + decode, with queried = prompt_share of the uncached tokens
        uncached = computed / np.maximum(1.0 - self.prompt_share * hit, 1e-9)
        queried = np.round(self.prompt_share * uncached)
        noisy = np.clip(hit + rng.normal(0.0, 0.01, hit.shape) * (hit > 0), 0.0, 1.0)
        return queried, np.where(queried > 0, noisy, np.nan)

    def kv_cache_blocks(self, redundant_bytes: float) -> int:
        """KV-cache blocks of one engine's worker with ``redundant_bytes`` taken per GPU."""
        tokens = (self.kv_cache_bytes_per_gpu - redundant_bytes) / self.kv_bytes_per_token
        return max(1, int(tokens // self.kv_block_size))

    def expert_bytes(self, num_layers: int, num_experts: int) -> float:
        """Bytes of one expert of one MoE layer: ``bytes_per_expert``, else the known shape's, else 0."""
        return CostModel(bytes_per_expert=self.bytes_per_expert).resolve_bytes_per_expert(num_layers, num_experts) or 0.0

    def balanced_step_s(self, tokens: np.ndarray | float) -> np.ndarray | float:
        """Balanced step time (s) at ``tokens`` per step."""
        return self.step_base_s + self.step_per_token_s * np.asarray(tokens, np.float64)

    def step_seconds(self, tokens: np.ndarray, imbalance: np.ndarray, overhead_s: np.ndarray, steps: np.ndarray,
                     rng: np.random.Generator, *, factor: float = 1.0,
                     log_noise: np.ndarray | None = None) -> np.ndarray:
        """Measured mean step time ``[T]`` (s; NaN where ``steps`` is 0) for buckets with ``tokens``
        per step, served ``imbalance``, ``overhead_s`` seconds of rearrangement in the bucket.
        ``factor``: the pod's own slowness (speed, cold cache, planted gain) on the step time;
        ``log_noise``: the buckets' log noise where the caller draws it (correlated in time),
        else drawn here, independent per bucket."""
        tokens, imbalance = np.asarray(tokens, np.float64), np.asarray(imbalance, np.float64)
        n = np.asarray(steps, np.float64)
        x = np.where(np.isfinite(imbalance), imbalance, 1.0)
        step = self.balanced_step_s(tokens) * (1.0 + self.moe_time_share * (x - 1.0) + self.overlap_loss) * factor
        noise = rng.normal(0.0, self.step_noise, step.shape) if log_noise is None else np.asarray(log_noise)
        step = step * np.exp(noise)
        out = rng.random(step.shape) < self.outlier_share
        step = np.where(out, step * rng.uniform(1.2, 1.6, step.shape), step)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, step + np.asarray(overhead_s, np.float64) / np.maximum(n, 1), np.nan)

    def rearrangement(self, moved_replicas: int, ep_size: int, num_layers: int, bytes_per_expert: float,
                      step_s: float, rng: np.random.Generator) -> tuple[float, float]:
        """``(seconds of step time lost, recorded duration)`` of one rearrangement that makes the GPUs
        receive ``moved_replicas`` replicas in all."""
        if not self.use_async:
            stall = float(self.sync_stall_s * np.exp(rng.normal(0.0, self.stall_noise)))
            return stall, stall
        lost = self.async_s_per_moved_byte * bytes_per_expert * moved_replicas / ep_size
        return float(lost), float(num_layers * step_s * np.exp(rng.normal(0.0, self.stall_noise)))

    def kv_state(self, tokens: np.ndarray, tokens_ref: float, redundant_bytes: float, steps: np.ndarray,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(usage, preemptions, waiting)`` per bucket for ``tokens`` per step, on a cache shrunk by
        ``redundant_bytes`` per GPU."""
        capacity = max(1e-6, 1.0 - redundant_bytes / self.kv_cache_bytes_per_gpu)
        want = self.kv_demand * np.asarray(tokens, np.float64) / max(tokens_ref, 1e-9) / capacity
        usage = np.clip(np.minimum(want, FULL_USAGE) + rng.normal(0.0, 0.01, want.shape), 0.0, 1.0)
        excess = np.maximum(want - FULL_USAGE, 0.0)
        preempt = rng.poisson(np.asarray(steps, np.float64) * 0.01 * excess).astype(np.float64)
        waiting = np.round(100.0 * excess * np.exp(rng.normal(0.0, 0.2, want.shape)), 1)
        return usage, preempt, waiting

    def cost_model(self, trace: LoadTrace, bytes_per_expert: float | None = None) -> CostModel:
        """The truth as the simulator's :class:`CostModel` on ``trace`` (balanced step time at the
        trace's step-weighted mean batch)."""
        tok = tokens_per_step(trace)
        n = trace.bucket_steps.astype(np.float64)
        s0 = float(self.balanced_step_s(np.average(tok, weights=n) if n.sum() > 0 else 0.0))
        loss = {}
        if self.overlap_loss > 0:  # the cost model's f x ratio x hidden, with all of it hidden
            loss = dict(overlap_dropped=True, overlap_hidden=1.0,
                        shared_expert_ratio=self.overlap_loss / max(self.moe_time_share, 1e-9))
        return CostModel(moe_time_share=self.moe_time_share, seconds_per_step=s0, use_async=self.use_async,
                         sync_stall_s=self.sync_stall_s, async_s_per_moved_byte=self.async_s_per_moved_byte,
                         bytes_per_expert=self.bytes_per_expert if bytes_per_expert is None else bytes_per_expert,
                         kv_cache_bytes_per_gpu=self.kv_cache_bytes_per_gpu,
                         kv_throughput_elasticity=self.kv_throughput_elasticity, **loss)
