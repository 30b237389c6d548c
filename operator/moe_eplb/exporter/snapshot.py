"""Per-worker snapshot files: how worker processes hand their counters to the pod's exporter.

Each vLLM worker process (one per GPU / EP rank) owns one file ``worker-<pid>.npz`` in the pod's
exporter directory and rewrites it atomically (write to a temporary name, ``os.replace``) after each
read-back of its GPU counters. The process that serves the port reads every file at scrape time.

This replaces prometheus_client's multiprocess mode (see docs/exporter.md for why): one vectorised
write of a few arrays per flush instead of one locked mmap write per series (about 30 000 for
DeepSeek-V3), and no change to how vLLM's own metrics are collected.

Keys of one file, for each model ``i`` the worker serves (main model, MTP/EAGLE drafter):

==========================  ================  ====================================================
key                         shape / type      meaning
==========================  ================  ====================================================
``meta``                    JSON string       ``{"pid", "time", "vllm", "layout", "models": [...]}``
``m{i}_expert_tokens``      float64 [L, E]    tokens this rank routed to each logical expert (cumulative)
``m{i}_rank_tokens``        float64 [L, EP]   tokens this rank sent to each EP rank (cumulative)
``m{i}_replicas``           int64 [L, E]      replicas of each logical expert (current map)
``m{i}_duration_buckets``   int64 [B]         rearrangement durations per histogram bucket (not cumulative)
``m{i}_step_seconds``       int64 [S]         engine-step durations of this rank per bucket of
                                              ``metric_names.STEP_SECONDS_BUCKETS`` (+Inf last)
``m{i}_step_tokens``        int64 [T]         tokens per engine step of this rank per bucket of
                                              ``metric_names.STEP_TOKENS_BUCKETS`` (+Inf last)
``m{i}_async_duration``     int64 [B]         async rearrangement cycles as vLLM timed them, per
                                              duration bucket (only where vLLM reports them)
==========================  ================  ====================================================

``models[i]`` holds ``name, ep_rank, ep_size, num_layers, num_experts, num_physical_experts,
window_size, step_interval, num_redundant_experts, use_async, steps, rearrangements, duration_sum,
start_time, step_seconds_sum, step_tokens_sum, top_k, kv_cache_bytes, rebalance_failures (None: vLLM
does not report them), async_duration_sum``; ``meta`` also holds
``exporter_seconds`` (time the worker spent in the exporter's per-step code) and
``recorded_steps``.
"""

from __future__ import annotations

import glob
import io
import json
import os
from dataclasses import dataclass, field

import numpy as np

from moe_eplb.contracts import metric_names

# Upper bounds (seconds) of the rearrangement-duration histogram; +Inf is implied.
DURATION_BUCKETS = metric_names.REARRANGEMENT_SECONDS_BUCKETS


@dataclass
class ModelSnapshot:
    """One model's cumulative counters in one worker (one EP rank)."""

    name: str
    ep_rank: int
    ep_size: int
    expert_tokens: np.ndarray  # float64 [L, E]
    rank_tokens: np.ndarray  # float64 [L, EP]
    replicas: np.ndarray  # int64 [L, E]
    steps: int = 0
    rearrangements: int = 0
    duration_buckets: np.ndarray = field(default_factory=lambda: np.zeros(len(DURATION_BUCKETS) + 1, np.int64))
    duration_sum: float = 0.0
    window_size: int | None = None
    step_interval: int | None = None
    num_redundant_experts: int | None = None
    use_async: bool | None = None  # EPLB's rearrangement mode (None: not known)
    num_physical_experts: int | None = None
    start_time: float = 0.0
    step_seconds_buckets: np.ndarray = field(
        default_factory=lambda: np.zeros(len(metric_names.STEP_SECONDS_BUCKETS) + 1, np.int64))
    step_seconds_sum: float = 0.0
    step_tokens_buckets: np.ndarray = field(
        default_factory=lambda: np.zeros(len(metric_names.STEP_TOKENS_BUCKETS) + 1, np.int64))
    step_tokens_sum: float = 0.0
    top_k: int | None = None
    kv_cache_bytes: int | None = None  # this rank's KV cache, when the worker could see it
    rebalance_failures: int | None = None  # async EPLB worker failures seen (None: vLLM has no such signal)
    async_duration_buckets: np.ndarray | None = None  # async cycles vLLM timed, per bucket (None: none reported)
    async_duration_sum: float = 0.0

    @property
    def num_layers(self) -> int:
        return int(self.expert_tokens.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.expert_tokens.shape[1])


@dataclass
class WorkerSnapshot:
    pid: int
    time: float
    models: list[ModelSnapshot]
    vllm: str = ""
    layout: str = ""
    exporter_seconds: float = 0.0
    recorded_steps: int = 0


def encode(snapshot: WorkerSnapshot) -> bytes:
    """Serialise to ``.npz`` bytes (uncompressed: a few hundred kB for DeepSeek-V3)."""
    meta = {"pid": snapshot.pid, "time": snapshot.time, "vllm": snapshot.vllm, "layout": snapshot.layout,
            "exporter_seconds": float(snapshot.exporter_seconds), "recorded_steps": int(snapshot.recorded_steps),
            "models": []}
    arrays: dict[str, np.ndarray] = {}
    for i, m in enumerate(snapshot.models):
        meta["models"].append(
            {
                "name": m.name,
                "ep_rank": m.ep_rank,
                "ep_size": m.ep_size,
                "steps": int(m.steps),
                "rearrangements": int(m.rearrangements),
                "duration_sum": float(m.duration_sum),
                "window_size": m.window_size,
                "step_interval": m.step_interval,
                "num_redundant_experts": m.num_redundant_experts,
                "use_async": m.use_async,
                "num_physical_experts": m.num_physical_experts,
                "start_time": m.start_time,
                "step_seconds_sum": float(m.step_seconds_sum),
                "step_tokens_sum": float(m.step_tokens_sum),
                "top_k": m.top_k,
                "kv_cache_bytes": m.kv_cache_bytes,
                "rebalance_failures": m.rebalance_failures,
                "async_duration_sum": float(m.async_duration_sum),
            }
        )
        if m.async_duration_buckets is not None:
            arrays[f"m{i}_async_duration"] = np.asarray(m.async_duration_buckets, np.int64)
        arrays[f"m{i}_expert_tokens"] = np.asarray(m.expert_tokens, np.float64)
        arrays[f"m{i}_rank_tokens"] = np.asarray(m.rank_tokens, np.float64)
        arrays[f"m{i}_replicas"] = np.asarray(m.replicas, np.int64)
        arrays[f"m{i}_duration_buckets"] = np.asarray(m.duration_buckets, np.int64)
        arrays[f"m{i}_step_seconds"] = np.asarray(m.step_seconds_buckets, np.int64)
        arrays[f"m{i}_step_tokens"] = np.asarray(m.step_tokens_buckets, np.int64)
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return buf.getvalue()


def decode(data: bytes) -> WorkerSnapshot:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        models = []
        for i, mm in enumerate(meta["models"]):
            models.append(
                ModelSnapshot(
                    name=mm["name"],
                    ep_rank=int(mm["ep_rank"]),
                    ep_size=int(mm["ep_size"]),
                    expert_tokens=z[f"m{i}_expert_tokens"],
                    rank_tokens=z[f"m{i}_rank_tokens"],
                    replicas=z[f"m{i}_replicas"],
                    steps=int(mm["steps"]),
                    rearrangements=int(mm["rearrangements"]),
                    duration_buckets=z[f"m{i}_duration_buckets"],
                    duration_sum=float(mm["duration_sum"]),
                    window_size=mm.get("window_size"),
                    step_interval=mm.get("step_interval"),
                    num_redundant_experts=mm.get("num_redundant_experts"),
                    use_async=mm.get("use_async"),
                    num_physical_experts=mm.get("num_physical_experts"),
                    start_time=float(mm.get("start_time") or 0.0),
                    step_seconds_buckets=z[f"m{i}_step_seconds"],
                    step_seconds_sum=float(mm.get("step_seconds_sum") or 0.0),
                    step_tokens_buckets=z[f"m{i}_step_tokens"],
                    step_tokens_sum=float(mm.get("step_tokens_sum") or 0.0),
                    top_k=mm.get("top_k"),
                    kv_cache_bytes=mm.get("kv_cache_bytes"),
                    rebalance_failures=mm.get("rebalance_failures"),
                    async_duration_buckets=z[f"m{i}_async_duration"] if f"m{i}_async_duration" in z.files else None,
                    async_duration_sum=float(mm.get("async_duration_sum") or 0.0),
                )
            )
    return WorkerSnapshot(pid=int(meta["pid"]), time=float(meta["time"]), models=models,
                          vllm=meta.get("vllm", ""), layout=meta.get("layout", ""),
                          exporter_seconds=float(meta.get("exporter_seconds") or 0.0),
                          recorded_steps=int(meta.get("recorded_steps") or 0))


def snapshot_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"worker-{pid}.npz")


def write(directory: str, snapshot: WorkerSnapshot) -> str:
    """Atomically replace this worker's file; returns its path."""
    path = snapshot_path(directory, snapshot.pid)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(encode(snapshot))
    os.replace(tmp, path)
    return path


def read_all(directory: str) -> list[WorkerSnapshot]:
    """Every worker's latest snapshot in ``directory`` (unreadable files are skipped)."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "worker-*.npz"))):
        try:
            with open(path, "rb") as f:
                out.append(decode(f.read()))
        except (OSError, ValueError, KeyError):
            continue  # a file replaced or removed while we read it; the next scrape sees it
    return out


def clear(directory: str) -> None:
    """Remove leftover snapshots (a previous server in the same directory)."""
    for path in glob.glob(os.path.join(directory, "worker-*.npz*")):
        try:
            os.remove(path)
        except OSError:
            pass
