"""Expert-load traces: the one in-memory type every part of moe-eplb exchanges (``LoadTrace`` and the
records beside it: ``Telemetry``, ``Rearrangement``, ``RecordedConfig``).

A trace is a sequence of T time buckets. For each bucket it holds how many engine steps ran
(``bucket_steps[t]``) and how many tokens were routed to each logical expert of each MoE layer
during those steps (``load[t, l, e]``, counted once per (token, top-k slot) as vLLM counts).

Reading and writing files and the real routing data: :mod:`moe_eplb.eplb.workload.tracefile` (``load_trace``,
``save_trace``, ``trace_from_dict``, ``trace_to_dict``); from Prometheus or the pods:
:mod:`moe_eplb.metrics`; synthetic traces: :mod:`moe_eplb.eplb.workload.synth`. The file format is the
contract :mod:`moe_eplb.contracts.trace_format` (docs/traces.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from moe_eplb.api.knobs import Knobs
from moe_eplb.contracts import vllm_facts
from moe_eplb.contracts.trace_format import TELEMETRY_KEYS as TRACE_KEYS_TELEMETRY
from moe_eplb.contracts.trace_format import TraceError


def served_imbalance(rank_load: np.ndarray) -> np.ndarray:
    """float64 ``[T]``: ``sum_l max_rank / sum_l mean_rank`` of ``rank_load [T, L, ep]`` (tokens each
    EP rank served per MoE layer), the factor the busiest rank stretches a bucket's MoE time by
    (1 = perfectly balanced; the inverse of vLLM's balancedness); NaN for a bucket without load."""
    rl = np.asarray(rank_load, np.float64)
    mx, mean = rl.max(axis=2).sum(axis=1), rl.mean(axis=2).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, mx / np.where(mean > 0, mean, 1.0), np.nan)


@dataclass(frozen=True)
class Rearrangement:
    """One observed EPLB rearrangement: the bucket it happened in and how long it took (seconds)."""

    bucket: int
    seconds: float

    def to_dict(self) -> dict:
        return {"bucket": int(self.bucket), "seconds": float(self.seconds)}


@dataclass(frozen=True)
class RecordedConfig:
    """The EPLB settings that ran while a trace was recorded (trace key ``config``). ``ep_size`` and
    ``use_async`` are None when the source did not say."""

    knobs: Knobs
    ep_size: int | None = None
    use_async: bool | None = None

    def to_dict(self) -> dict:
        return {**self.knobs.to_dict(), "ep_size": self.ep_size, "use_async": self.use_async}


def _per_bucket(name: str, value: np.ndarray | None, T: int) -> np.ndarray | None:
    if value is None:
        return None
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 1 or arr.shape[0] != T:
        raise TraceError(f"{name}: expected {T} numbers (one per bucket), got shape {arr.shape}")
    return arr


def _bad_index(mask: np.ndarray) -> str:
    idx = np.argwhere(mask)[0]
    return ", ".join(f"{axis} {int(i)}" for axis, i in zip(("bucket", "layer", "rank"), idx))


def _check_prefix(tel: Telemetry, T: int) -> dict:
    """The prefix-cache keys of ``tel`` validated (see :meth:`Telemetry.check`)."""
    out: dict = {}
    q = _per_bucket("prefix_cache_queries", tel.prefix_cache_queries, T)
    if q is not None:
        if not np.all(np.isfinite(q)) or np.any(q < 0):
            t = int(np.argmax(~np.isfinite(q) | (q < 0)))
            raise TraceError(f"prefix_cache_queries: must be a number >= 0 (tokens), got {q[t]} at bucket {t}")
        out["prefix_cache_queries"] = q
    h = _per_bucket("prefix_cache_hit_rate", tel.prefix_cache_hit_rate, T)
    if h is not None:
        with np.errstate(invalid="ignore"):
            bad = np.isinf(h) | (h < 0) | (h > 1)
        if bad.any():
            t = int(np.argmax(bad))
            raise TraceError(f"prefix_cache_hit_rate: must be in [0, 1] (hits / queries), got {h[t]} at bucket {t}"
                             + (" (a fraction, not a percentage)" if h[t] > 1 else ""))
        if q is not None and np.any(np.isnan(h) & (q > 0)):
            t = int(np.argmax(np.isnan(h) & (q > 0)))
            raise TraceError(f"prefix_cache_hit_rate: no value at bucket {t}, which has {q[t]:g} queried tokens "
                             "(null only where nothing was queried)")
        out["prefix_cache_hit_rate"] = h
    for name in ("kv_cache_blocks", "kv_block_size"):
        v = getattr(tel, name)
        if v is None:
            continue
        if isinstance(v, bool) or not np.isfinite(float(v)) or float(v) != int(v) or int(v) <= 0:
            raise TraceError(f"{name}: must be a whole number > 0, got {v!r}")
        out[name] = int(v)
    return out


@dataclass(frozen=True, eq=False)
class Telemetry:
    """What the deployment measured while the load was recorded (the optional trace keys of
    :data:`TRACE_KEYS_TELEMETRY`; every field None when its source was missing -- never invented).

    Attributes:
        step_seconds: float64 ``[T]``, mean wall time of one engine step (s), including any
            rearrangement time spent inside a step; NaN exactly where ``bucket_steps`` is 0.
        rank_load: float64 ``[T, L, ep]``, tokens each EP rank served per MoE layer under the running
            placement (one per (token, top-k slot)).
        kv_cache_usage: float64 ``[T]`` in [0, 1], mean KV-cache usage (``vllm:kv_cache_usage_perc``);
            NaN allowed only where ``bucket_steps`` is 0 (no engine ran, no sample).
        preemptions: float64 ``[T]`` >= 0, preemptions in the bucket (``vllm:num_preemptions_total``).
        requests_waiting: float64 ``[T]`` >= 0, mean waiting requests (``vllm:num_requests_waiting``);
            NaN allowed as for ``kv_cache_usage``.
        rearrangements: each observed rearrangement (bucket, seconds), in bucket order.
        config: the EPLB settings that ran.
        kv_cache_bytes_per_gpu: KV-cache bytes of one GPU.
        prefix_cache_queries: float64 ``[T]`` >= 0, prompt tokens looked up in the prefix cache in the
            bucket (``vllm:prefix_cache_queries``), summed over engines.
        prefix_cache_hit_rate: float64 ``[T]`` in [0, 1], hits / queries of the prefix cache in the
            bucket; NaN where nothing was queried.
        kv_cache_blocks: KV-cache blocks of one engine (vLLM's ``num_gpu_blocks``).
        kv_block_size: tokens per KV-cache block (vLLM's ``block_size``).
    """

    step_seconds: np.ndarray | None = None
    rank_load: np.ndarray | None = None
    kv_cache_usage: np.ndarray | None = None
    preemptions: np.ndarray | None = None
    requests_waiting: np.ndarray | None = None
    rearrangements: tuple[Rearrangement, ...] | None = None
    config: RecordedConfig | None = None
    kv_cache_bytes_per_gpu: float | None = None
    prefix_cache_queries: np.ndarray | None = None
    prefix_cache_hit_rate: np.ndarray | None = None
    kv_cache_blocks: int | None = None
    kv_block_size: int | None = None

    def keys(self) -> tuple[str, ...]:
        """The trace keys present, in :data:`TRACE_KEYS_TELEMETRY` order."""
        return tuple(k for k in TRACE_KEYS_TELEMETRY if getattr(self, k) is not None)

    def check(self, bucket_steps: np.ndarray, num_layers: int, num_experts: int) -> Telemetry:
        """This telemetry validated against its trace (T buckets, L layers, E experts) and with
        plain NumPy types; raises :class:`TraceError` naming the key, the place and the fix."""
        T = int(bucket_steps.shape[0])
        out: dict = {}
        step = _per_bucket("step_seconds", self.step_seconds, T)
        if step is not None:
            idle = bucket_steps == 0
            if np.any(np.isinf(step)):
                raise TraceError("step_seconds: contains infinite values")
            missing = np.isnan(step) & ~idle
            if missing.any():
                raise TraceError(f"step_seconds: no value at bucket {int(np.argmax(missing))}, which ran "
                                 f"{int(bucket_steps[np.argmax(missing)])} steps (null only where bucket_steps is 0)")
            if np.any(step[~np.isnan(step)] <= 0):
                t = int(np.argmax(~np.isnan(step) & (step <= 0)))
                raise TraceError(f"step_seconds: must be > 0, got {step[t]} at bucket {t}")
            out["step_seconds"] = np.where(idle, np.nan, step)
        if self.rank_load is not None:
            rl = np.asarray(self.rank_load, dtype=np.float64)
            if rl.ndim != 3 or rl.shape[0] != T or rl.shape[1] != num_layers or rl.shape[2] == 0:
                raise TraceError(f"rank_load: expected T x L x ep = {T} x {num_layers} x ep numbers, got shape "
                                 f"{rl.shape}")
            if not np.all(np.isfinite(rl)):
                raise TraceError(f"rank_load: NaN or infinite value at {_bad_index(~np.isfinite(rl))}")
            if np.any(rl < 0):
                raise TraceError(f"rank_load: negative value at {_bad_index(rl < 0)}")
            out["rank_load"] = rl
        for name, lo, hi in (("kv_cache_usage", 0.0, 1.0), ("preemptions", 0.0, None),
                             ("requests_waiting", 0.0, None)):
            arr = _per_bucket(name, getattr(self, name), T)
            if arr is None:
                continue
            # a gauge has no sample where no engine ran: null there (only there)
            bad = ~np.isfinite(arr) & ~(np.isnan(arr) & (bucket_steps == 0) & (name != "preemptions"))
            if bad.any():
                t = int(np.argmax(bad))
                what = "NaN or infinite value" if not np.isnan(arr[t]) or name == "preemptions" else "no value"
                raise TraceError(f"{name}: {what} "
                                 f"at bucket {t}" + ("" if name == "preemptions" else
                                                     " (null only where bucket_steps is 0)"))
            arr = np.where(np.isfinite(arr), arr, np.nan)
            with np.errstate(invalid="ignore"):
                bad = (arr < lo) | ((arr > hi) if hi is not None else False)
            if np.any(bad):
                t = int(np.argmax(bad))
                want = f"in [{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
                raise TraceError(f"{name}: must be {want}, got {arr[t]} at bucket {t}"
                                 + (" (a fraction, not a percentage)" if name == "kv_cache_usage" and arr[t] > 1 else ""))
            out[name] = arr
        if self.rearrangements is not None:
            events = []
            for i, ev in enumerate(self.rearrangements):
                if not 0 <= int(ev.bucket) < T:
                    raise TraceError(f"rearrangements[{i}].bucket: {ev.bucket} is not a bucket index 0..{T - 1}")
                if not (np.isfinite(ev.seconds) and ev.seconds >= 0):
                    raise TraceError(f"rearrangements[{i}].seconds: must be a duration >= 0, got {ev.seconds!r}")
                events.append(Rearrangement(int(ev.bucket), float(ev.seconds)))
            out["rearrangements"] = tuple(sorted(events, key=lambda e: e.bucket))
        if self.config is not None:
            cfg = self.config
            ep = cfg.ep_size
            problem = vllm_facts.redundant_problem(num_experts, ep, cfg.knobs.num_redundant_experts)
            if problem:
                raise TraceError(f"config: {problem}")
            if ep is not None and "rank_load" in out and out["rank_load"].shape[2] != ep:
                raise TraceError(f"config.ep_size: is {ep} but rank_load has {out['rank_load'].shape[2]} ranks")
            out["config"] = cfg
        if self.kv_cache_bytes_per_gpu is not None:
            kv = float(self.kv_cache_bytes_per_gpu)
            if not (np.isfinite(kv) and kv > 0):
                raise TraceError(f"kv_cache_bytes_per_gpu: must be a number > 0, got {self.kv_cache_bytes_per_gpu!r}")
            out["kv_cache_bytes_per_gpu"] = kv
        out.update(_check_prefix(self, T))
        return Telemetry(**out)

    @property
    def kv_cache_tokens(self) -> int | None:
        """Tokens the KV cache of one engine holds (``kv_cache_blocks * kv_block_size``), or None."""
        if self.kv_cache_blocks is None or self.kv_block_size is None:
            return None
        return int(self.kv_cache_blocks) * int(self.kv_block_size)

    @property
    def ep_size(self) -> int | None:
        """EP ranks: from ``rank_load`` or ``config.ep_size``."""
        if self.rank_load is not None:
            return int(self.rank_load.shape[2])
        return self.config.ep_size if self.config is not None else None

    def served_imbalance(self) -> np.ndarray | None:
        """``[T]`` served imbalance of ``rank_load`` (:func:`served_imbalance`), or None."""
        return None if self.rank_load is None else served_imbalance(self.rank_load)

    def rearrangements_per_bucket(self, num_buckets: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``(count [T], seconds [T])`` of the observed rearrangements per bucket, or None."""
        if self.rearrangements is None:
            return None
        count, secs = np.zeros(num_buckets), np.zeros(num_buckets)
        for ev in self.rearrangements:
            count[ev.bucket] += 1
            secs[ev.bucket] += ev.seconds
        return count, secs

    def slice(self, start: int, stop: int, num_buckets: int) -> Telemetry:
        """Buckets ``[start, stop)`` (rearrangements renumbered from ``start``)."""
        lo, hi, _ = slice(start, stop).indices(num_buckets)
        cut = {k: getattr(self, k)[lo:hi] for k in ("step_seconds", "rank_load", "kv_cache_usage",
                                                     "preemptions", "requests_waiting", "prefix_cache_queries",
                                                     "prefix_cache_hit_rate")
               if getattr(self, k) is not None}
        if self.rearrangements is not None:
            cut["rearrangements"] = tuple(Rearrangement(e.bucket - lo, e.seconds) for e in self.rearrangements
                                          if lo <= e.bucket < hi)
        return replace(self, **cut)

    def summary(self) -> dict:
        """Plain-number overview of what was measured (``moe-eplb trace info``)."""
        def spread(a: np.ndarray | None) -> dict | None:
            if a is None or not np.any(np.isfinite(a)):
                return None
            return {"min": float(np.nanmin(a)), "median": float(np.nanmedian(a)), "max": float(np.nanmax(a))}

        out: dict = {"telemetry": list(self.keys())}
        if self.step_seconds is not None:
            out["step_seconds"] = spread(self.step_seconds)
        if self.rank_load is not None:
            out["served_imbalance"] = spread(self.served_imbalance())
            out["ep_size"] = self.ep_size
        if self.kv_cache_usage is not None:
            out["kv_cache_usage"] = spread(self.kv_cache_usage)
        if self.preemptions is not None:
            out["preemptions_total"] = float(self.preemptions.sum())
        if self.requests_waiting is not None:
            out["requests_waiting"] = spread(self.requests_waiting)
        if self.rearrangements is not None:
            secs = [e.seconds for e in self.rearrangements]
            out["rearrangements"] = {"count": len(secs), "median_seconds": float(np.median(secs)) if secs else None}
        if self.config is not None:
            out["config"] = self.config.to_dict()
        if self.kv_cache_bytes_per_gpu is not None:
            out["kv_cache_bytes_per_gpu"] = self.kv_cache_bytes_per_gpu
        if self.prefix_cache_hit_rate is not None:
            out["prefix_cache_hit_rate"] = spread(self.prefix_cache_hit_rate)
        if self.prefix_cache_queries is not None:
            out["prefix_cache_queries_total"] = float(self.prefix_cache_queries.sum())
        if self.kv_cache_tokens is not None:
            out["kv_cache_tokens"] = self.kv_cache_tokens
        return out


@dataclass(frozen=True)
class LoadTrace:
    """Per-bucket expert load.

    Attributes:
        load: float64 array ``[T, L, E]``, tokens routed to logical expert e of layer l in bucket t.
        bucket_steps: int64 array ``[T]``, engine steps in bucket t.
        bucket_seconds: wall-clock seconds per bucket, if known.
        top_k: experts per token, if known.
        model: model name, if known.
        telemetry: what the deployment measured alongside the load (:class:`Telemetry`), or None.
    """

    load: np.ndarray
    bucket_steps: np.ndarray
    bucket_seconds: float | None = None
    top_k: int | None = None
    model: str | None = None
    meta: dict = field(default_factory=dict, compare=False)
    telemetry: Telemetry | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        load = np.asarray(self.load, dtype=np.float64)
        steps = np.asarray(self.bucket_steps)
        if load.ndim != 3:
            raise TraceError(f"load: expected a T x L x E array, got {load.ndim} dimension(s)")
        if load.shape[0] == 0:
            raise TraceError("load: the trace is empty (0 buckets); record at least one bucket")
        if load.shape[1] == 0 or load.shape[2] == 0:
            raise TraceError(f"load: shape {load.shape} has no layers or no experts")
        if not np.all(np.isfinite(load)):
            raise TraceError("load: contains NaN or infinite values")
        if np.any(load < 0):
            t, l, e = np.argwhere(load < 0)[0]
            raise TraceError(f"load: negative value {load[t, l, e]} at bucket {t}, layer {l}, expert {e}")
        if steps.ndim != 1 or steps.shape[0] != load.shape[0]:
            raise TraceError(
                f"bucket_steps: length {steps.shape[0] if steps.ndim == 1 else steps.shape} "
                f"does not match the {load.shape[0]} buckets of load"
            )
        if not np.all(np.isfinite(steps.astype(np.float64))) or np.any(steps < 0):
            raise TraceError("bucket_steps: must be finite and >= 0")
        if np.any(steps != np.round(steps)):
            raise TraceError("bucket_steps: must be whole numbers of engine steps")
        if self.bucket_seconds is not None and not (float(self.bucket_seconds) > 0):
            raise TraceError(f"bucket_seconds: must be > 0, got {self.bucket_seconds}")
        if self.top_k is not None and int(self.top_k) <= 0:
            raise TraceError(f"top_k: must be > 0, got {self.top_k}")
        object.__setattr__(self, "load", load)
        object.__setattr__(self, "bucket_steps", steps.astype(np.int64))
        if self.telemetry is not None:
            tel = self.telemetry.check(self.bucket_steps, load.shape[1], load.shape[2])
            object.__setattr__(self, "telemetry", tel if tel.keys() else None)

    @property
    def num_buckets(self) -> int:
        return int(self.load.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.load.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.load.shape[2])

    @property
    def total_steps(self) -> int:
        return int(self.bucket_steps.sum())

    @property
    def duration_seconds(self) -> float | None:
        """Wall-clock length ``T * bucket_seconds``, if ``bucket_seconds`` is known."""
        return None if self.bucket_seconds is None else self.num_buckets * float(self.bucket_seconds)

    def popularity(self) -> np.ndarray:
        """float64 ``[L, E]``: each expert's share of its layer's load over the whole trace
        (rows sum to 1; a layer without load gets equal shares)."""
        total = self.load.sum(axis=0)
        sums = total.sum(axis=1, keepdims=True)
        return np.divide(total, sums, out=np.full_like(total, 1.0 / self.num_experts), where=sums > 0)

    def imbalance(self) -> np.ndarray:
        """float64 ``[T, L]``: max over experts / mean over experts of each bucket's load
        (1 = perfectly even; NaN where a layer has no load in that bucket)."""
        mean = self.load.mean(axis=2)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(mean > 0, self.load.max(axis=2) / np.where(mean > 0, mean, 1.0), np.nan)

    def summary(self) -> dict:
        """Plain-number overview: shape, steps, tokens, and the expert imbalance (max/mean over
        experts) per layer, over the whole trace and per bucket."""
        per_layer = self.popularity().max(axis=1) * self.num_experts  # [L]
        per_bucket = self.imbalance()
        tokens = float(self.load.sum(axis=2).mean(axis=1).sum())  # (token, top-k slot) pairs per layer
        out: dict = {
            "model": self.model,
            "num_buckets": self.num_buckets,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "bucket_seconds": self.bucket_seconds,
            "duration_seconds": self.duration_seconds,
            "total_steps": self.total_steps,
            "steps_per_bucket": {
                "min": int(self.bucket_steps.min()),
                "mean": float(self.bucket_steps.mean()),
                "max": int(self.bucket_steps.max()),
            },
            "routed_per_layer": tokens,
            "tokens_per_step": (tokens / self.top_k / self.total_steps)
            if self.top_k and self.total_steps
            else None,
            "imbalance_per_layer": {
                "min": float(per_layer.min()),
                "median": float(np.median(per_layer)),
                "max": float(per_layer.max()),
                "argmax_layer": int(per_layer.argmax()),
            },
            "imbalance_per_bucket": {
                "median": float(np.nanmedian(per_bucket)) if np.any(np.isfinite(per_bucket)) else None,
                "p95": float(np.nanpercentile(per_bucket, 95)) if np.any(np.isfinite(per_bucket)) else None,
                "max": float(np.nanmax(per_bucket)) if np.any(np.isfinite(per_bucket)) else None,
            },
        }
        if self.telemetry is not None:
            out.update(self.telemetry.summary())
        return out

    def slice(self, start: int, stop: int) -> LoadTrace:
        """Buckets ``[start, stop)`` as a new trace."""
        return LoadTrace(
            load=self.load[start:stop],
            bucket_steps=self.bucket_steps[start:stop],
            bucket_seconds=self.bucket_seconds,
            top_k=self.top_k,
            model=self.model,
            telemetry=None if self.telemetry is None else self.telemetry.slice(start, stop, self.num_buckets),
        )
