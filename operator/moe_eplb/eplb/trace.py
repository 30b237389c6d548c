"""Expert-load traces: the one in-memory type every part of moe-eplb exchanges.

A trace is a sequence of T time buckets. For each bucket it holds how many engine steps ran
(``bucket_steps[t]``) and how many tokens were routed to each logical expert of each MoE layer
during those steps (``load[t, l, e]``, counted once per (token, top-k slot) as vLLM counts).

Reading and writing files and the real routing data: :mod:`moe_eplb.eplb.tracefile` (``load_trace``,
``save_trace``, ``trace_from_dict``, ``trace_to_dict``); from Prometheus or the pods:
:mod:`moe_eplb.metrics`; synthetic traces: :mod:`moe_eplb.eplb.synth`. The file format is the
contract :mod:`moe_eplb.trace_format` (docs/traces.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_eplb.trace_format import OPTIONAL_KEYS as TRACE_KEYS_OPTIONAL
from moe_eplb.trace_format import REQUIRED_KEYS as TRACE_KEYS_REQUIRED
from moe_eplb.trace_format import TraceError

__all__ = ["LoadTrace", "TraceError", "TRACE_KEYS_REQUIRED", "TRACE_KEYS_OPTIONAL"]


@dataclass(frozen=True)
class LoadTrace:
    """Per-bucket expert load.

    Attributes:
        load: float64 array ``[T, L, E]``, tokens routed to logical expert e of layer l in bucket t.
        bucket_steps: int64 array ``[T]``, engine steps in bucket t.
        bucket_seconds: wall-clock seconds per bucket, if known.
        top_k: experts per token, if known.
        model: model name, if known.
    """

    load: np.ndarray
    bucket_steps: np.ndarray
    bucket_seconds: float | None = None
    top_k: int | None = None
    model: str | None = None
    meta: dict = field(default_factory=dict, compare=False)

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
        return out

    def slice(self, start: int, stop: int) -> "LoadTrace":
        """Buckets ``[start, stop)`` as a new trace."""
        return LoadTrace(
            load=self.load[start:stop],
            bucket_steps=self.bucket_steps[start:stop],
            bucket_seconds=self.bucket_seconds,
            top_k=self.top_k,
            model=self.model,
        )
