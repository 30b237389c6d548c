"""Replay vLLM's EPLB over a recorded load trace and predict what a configuration would give.

What is replayed (vLLM 0.32 ``EplbState.step`` / ``rearrange``, see ``docs/tuner.md``):

- Engine steps are numbered 0..N-1, N = ``trace.total_steps``. Bucket t covers steps
  ``[S_t, S_t + bucket_steps[t])``. **Load inside a bucket is taken as uniform over its steps**
  (the trace has no finer resolution): a part of a bucket carries the same share of its load.
- A rearrangement happens after step ``k`` for ``k = max(I // 4, 1) + j * I < N`` (vLLM starts its
  counter at ``I - I // 4``; :func:`moe_eplb.contracts.vllm_facts.rearrangement_steps`), from the logical
  load of steps ``[max(0, k - W), k)`` (its ring buffer
  of the last W recorded steps; fewer at the start), computed by the project's policy, which gives
  vLLM's placements. The new placement serves from step ``k`` on.
- Before the first rearrangement the placement is vLLM's initial one: slots ``0..E-1`` hold experts
  ``0..E-1``, redundant slots ``E..E+R-1`` hold experts ``0..R-1`` (``i % E``).
- Tokens of an expert are split evenly over its replicas; slots are GPU-major (GPU g holds slots
  ``g*S .. (g+1)*S-1``, S = (E + R) / ep). A GPU's load in a layer is the sum over its slots.
- Experts moved: for each rearrangement, layer and GPU, the replicas the GPU must receive (new
  experts not already on it; vLLM keeps a staying expert in its slot). Equals the slots whose
  logical expert changed after vLLM's ``preserve_intragpu_slots``.
- "No EPLB" is vLLM's static expert-parallel placement: expert e on GPU ``e // (E / ep)``
  (contiguous ranges; the first ``E % ep`` GPUs take one more when E is not divisible).

``balancedness = sum_{t,l} mean_gpu(load) / sum_{t,l} max_gpu(load)`` (ideal MoE time over actual),
also per layer (sum over t) and per bucket (sum over l). Throughput comes from
:mod:`moe_eplb.eplb.replay.costmodel`.

Shapes: T buckets, L MoE layers, E logical experts, P = E + R physical slots, G = ep GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_eplb.api.knobs import Knobs, KnobsError
from moe_eplb.contracts import vllm_facts
from moe_eplb.eplb.replay import kernels
from moe_eplb.eplb.replay.costmodel import CostModel
from moe_eplb.eplb.replay.policy import PolicyError, check_layout, rebalance_batch
from moe_eplb.eplb.workload.trace import LoadTrace

__all__ = [
    "Topology",
    "SimError",
    "Throughput",
    "SimResult",
    "Replay",
    "simulate",
    "simulate_static",
    "simulate_clairvoyant",
]

# Rows (windows x layers) per policy call: big enough to amortise the policy's per-item Python
# loop, small enough for memory (~6 MB of float32 load for 256 experts).
_POLICY_ROWS = 48 * 58
_POLICY_CHUNK = 48  # buckets per call in the clairvoyant replay


class SimError(ValueError):
    """Arguments the simulator cannot work with; the message names the argument and the fix."""


def _whole(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SimError(f"{name}: must be a whole number, got {value!r}")
    if value < minimum:
        raise SimError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


@dataclass(frozen=True)
class Topology:
    """Where the experts live: ep_size GPUs (EP ranks) on num_nodes nodes; num_groups expert groups
    (DeepSeek-V3: 8, models without groups: 1)."""

    ep_size: int
    num_nodes: int = 1
    num_groups: int = 1

    def __post_init__(self) -> None:
        _whole("ep_size", self.ep_size, 1)
        _whole("num_nodes", self.num_nodes, 1)
        _whole("num_groups", self.num_groups, 1)
        if self.ep_size % self.num_nodes:
            raise SimError(f"num_nodes: {self.num_nodes} nodes do not divide ep_size {self.ep_size}: every node "
                           "holds the same number of GPUs (EP ranks); use a divisor of the EP size")

    def check_experts(self, num_experts: int) -> None:
        """Raise SimError when the model has fewer experts than GPUs (each needs one of its own)."""
        if num_experts < self.ep_size:
            raise SimError(f"ep_size: {self.ep_size} GPUs but the model has {num_experts} experts per layer; "
                           "every GPU needs at least one expert: use an EP size <= the number of experts")

    def check(self, num_experts: int, num_redundant: int) -> None:
        """Raise SimError unless vLLM would start with this layout."""
        self.check_experts(num_experts)
        problem = vllm_facts.redundant_problem(None, None, num_redundant)
        if problem is not None:
            raise SimError(f"num_redundant_experts: {problem} (vLLM's limit)")
        slots = num_experts + num_redundant
        if slots % self.ep_size:
            smallest = (self.ep_size - num_experts % self.ep_size) % self.ep_size
            raise SimError(
                f"num_redundant_experts: {num_experts} experts + {num_redundant} redundant = {slots} "
                f"slots do not divide over ep_size {self.ep_size}; vLLM refuses to start. Use a "
                f"value with (E + R) % ep == 0, e.g. {smallest} or {smallest + self.ep_size}"
            )
        try:
            check_layout(num_experts, slots, self.num_groups, self.num_nodes, self.ep_size)
        except PolicyError as exc:
            name = {"num_gpus": "ep_size", "num_replicas": "num_redundant_experts"}.get(
                exc.param, exc.param
            )
            raise SimError(f"{name}: {exc.reason}") from None

    def to_dict(self) -> dict:
        return {"ep_size": self.ep_size, "num_nodes": self.num_nodes, "num_groups": self.num_groups}


@dataclass(frozen=True)
class Throughput:
    """Predicted relative throughput and its breakdown (1.0 = balanced, free, no redundancy)."""

    relative: float
    imbalance_factor: float
    overhead_factor: float
    kv_factor: float
    ideal_seconds: float
    compute_seconds: float
    overhead_seconds: float
    redundant_bytes_per_gpu: float
    memory_penalty_known: bool
    overlap_factor: float = 1.0
    overlap_seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "relative": self.relative,
            "imbalance_factor": self.imbalance_factor,
            "overhead_factor": self.overhead_factor,
            "kv_factor": self.kv_factor,
            "ideal_seconds": self.ideal_seconds,
            "compute_seconds": self.compute_seconds,
            "overhead_seconds": self.overhead_seconds,
            "redundant_bytes_per_gpu": self.redundant_bytes_per_gpu,
            "memory_penalty_known": self.memory_penalty_known,
            "overlap_factor": self.overlap_factor,
            "overlap_seconds": self.overlap_seconds,
        }


@dataclass(frozen=True)
class SimResult:
    """One replay. Arrays: ``balancedness_per_layer [L]``, ``balancedness_over_time [T]`` (NaN for
    buckets without load), ``bucket_ideal_s [T]``, ``bucket_time_s [T]`` (compute + overhead),
    ``rearrangement_steps [n]`` and ``moved_per_rearrangement [n]``."""

    mode: str  # "eplb", "static" or "clairvoyant"
    knobs: Knobs | None
    topology: Topology
    balancedness: float
    balancedness_per_layer: np.ndarray
    balancedness_over_time: np.ndarray
    rearrangements: int
    experts_moved: int
    rearrangement_steps: np.ndarray
    moved_per_rearrangement: np.ndarray
    throughput: Throughput
    bucket_ideal_s: np.ndarray = field(repr=False)
    bucket_time_s: np.ndarray = field(repr=False)

    def segment_throughput(self, edges: np.ndarray) -> np.ndarray:
        """Relative throughput on bucket ranges ``[edges[i], edges[i+1])`` (kv factor included)."""
        ideal = np.add.reduceat(self.bucket_ideal_s, edges[:-1])
        time = np.add.reduceat(self.bucket_time_s, edges[:-1])
        with np.errstate(invalid="ignore", divide="ignore"):
            out = np.where(time > 0, ideal / time, 1.0)
        return out * self.throughput.kv_factor

    def to_dict(self, *, series: bool = True) -> dict:
        def floats(a: np.ndarray) -> list:
            return [None if not np.isfinite(x) else round(float(x), 6) for x in a]

        out = {
            "mode": self.mode,
            "config": self.knobs.to_dict() if self.knobs else None,
            "topology": self.topology.to_dict(),
            "balancedness": round(self.balancedness, 6),
            "rearrangements": self.rearrangements,
            "experts_moved": self.experts_moved,
            "predicted_throughput": self.throughput.relative,
            "throughput": self.throughput.to_dict(),
        }
        if series:
            out["balancedness_per_layer"] = floats(self.balancedness_per_layer)
            out["balancedness_over_time"] = floats(self.balancedness_over_time)
            out["rearrangement_steps"] = [int(x) for x in self.rearrangement_steps]
            out["moved_per_rearrangement"] = [int(x) for x in self.moved_per_rearrangement]
        return out


def _compiled_ints(placements: np.ndarray) -> np.ndarray:
    """Placements as one of the two integer types the kernels are compiled for, C-contiguous."""
    return np.ascontiguousarray(placements, dtype=np.int16 if placements.dtype == np.int16 else np.int64)


def _policy_chunk(weights: np.ndarray, replicas: int, groups: int, nodes: int, gpus: int) -> np.ndarray:
    """``[B, L, E]`` window loads -> ``[B, L, P]`` int16 placements (top level: picklable)."""
    phy2log, _ = rebalance_batch(weights, replicas, groups, nodes, gpus, with_logcnt=False)
    return phy2log.astype(np.int16)


def _load_error(exc: PolicyError, wins: list[tuple[int, int]], layer_stride: int) -> SimError:
    """A load the policy refuses (sums past float32), as a SimError naming the trace's steps."""
    if exc.where is None:
        return SimError(f"load: {exc.reason}")
    b, layer = exc.where
    start, end = wins[b]
    detail = exc.reason.split(": ", 1)[-1] if exc.reason.startswith(("layer", "matrix")) else exc.reason
    return SimError(f"load: the window of engine steps {start}..{end}, MoE layer {layer * layer_stride}: {detail}")


class Replay:
    """A trace prepared for many replays on one topology (prefix sums, transposed load).

    Build once, then call :meth:`run` for many configurations; placements computed by the policy
    are cached by ``(window start step, window end step, R)``, so configurations that share a
    rearrangement window share the policy call.
    """

    def __init__(
        self,
        trace: LoadTrace,
        topology: Topology,
        cost: CostModel = CostModel(),
        *,
        layer_stride: int = 1,
    ) -> None:
        """``layer_stride > 1`` replays only every stride-th MoE layer (a fast estimate used to
        screen candidates): balancedness is over those layers, moves and memory are scaled to
        all layers."""
        if not isinstance(trace, LoadTrace):
            raise SimError(f"trace: expected a LoadTrace, got {type(trace).__name__}")
        self.L_full = trace.num_layers
        if layer_stride > 1:
            trace = trace.__class__(
                load=trace.load[:, ::layer_stride],
                bucket_steps=trace.bucket_steps,
                bucket_seconds=trace.bucket_seconds,
                top_k=trace.top_k,
                model=trace.model,
            )
        self.layer_stride = layer_stride
        self.trace = trace
        self.topology = topology
        self.cost = cost
        self.T, self.L, self.E = trace.load.shape
        self._layer_scale = self.L_full / self.L
        self.G = topology.ep_size
        steps = trace.bucket_steps.astype(np.int64)
        self.steps = steps
        self.S = np.concatenate([[0], np.cumsum(steps)])  # [T+1] first step of each bucket
        self.N = int(self.S[-1])
        if self.N <= 0:
            raise SimError("bucket_steps: the trace has 0 engine steps in total; nothing to replay")
        self.prefix = np.concatenate(
            [np.zeros((1, self.L, self.E)), np.cumsum(trace.load, axis=0)]
        )  # [T+1, L, E]
        self._load = np.ascontiguousarray(trace.load)  # a copy only for layer_stride > 1
        self.XL = np.ascontiguousarray(trace.load.transpose(1, 0, 2), dtype=np.float32)  # [L, T, E]
        self._xflat = self.XL.reshape(-1)
        self.mean_gpu = trace.load.sum(axis=2) / self.G  # [T, L]
        self.s0 = cost.step_seconds(trace.bucket_seconds, self.N / self.T)
        self._cache: dict[tuple[int, int, int], np.ndarray] = {}

    # --- time ---------------------------------------------------------------------------------

    def instants(self, step_interval: int) -> np.ndarray:
        """Steps after which vLLM rearranges (first after I // 4, then every I), all < N."""
        return vllm_facts.rearrangement_steps(step_interval, self.N)

    def windows(self, knobs: Knobs) -> list[tuple[int, int]]:
        """``(start, end)`` step range of the load each rearrangement of ``knobs`` uses."""
        ks = self.instants(knobs.step_interval)
        starts = np.maximum(ks - knobs.window_size, 0)
        return list(zip(starts.tolist(), ks.tolist()))

    def _bucket_frac(self, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The bucket holding step s (the last for s >= N) and the share of it before s."""
        s = np.asarray(s, dtype=np.int64)
        b = np.clip(np.searchsorted(self.S, s, side="right") - 1, 0, self.T - 1)
        steps = self.steps[b]
        frac = np.where(steps > 0, (s - self.S[b]) / np.maximum(steps, 1), 0.0)
        return b, np.where(s >= self.N, 1.0, frac)

    def cumulative(self, s: np.ndarray) -> np.ndarray:
        """Load of steps ``[0, s)`` for each s: ``[n, L, E]`` (uniform inside a bucket)."""
        b, frac = self._bucket_frac(s)  # s >= N: b = T - 1, frac = 1
        return self.prefix[b] + frac[:, None, None] * self.trace.load[b]

    def window_loads(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """float32 ``[n, L, E]``: load of steps ``[starts[i], ends[i])``, as the policy reads it."""
        if kernels.enabled():
            b0, f0 = self._bucket_frac(starts)
            b1, f1 = self._bucket_frac(ends)
            return kernels.window_loads(self.prefix, self._load, b0, f0, b1, f1)
        return (self.cumulative(ends) - self.cumulative(starts)).astype(np.float32)

    # --- placements ---------------------------------------------------------------------------

    def prepare(self, keys: set[tuple[int, int, int]], *, workers: int = 1, progress=None) -> None:
        """Run the policy for every ``(start, end, R)`` window not cached yet, batched by R.

        ``progress(done, total)`` is called after each batch.
        """
        todo = sorted(k for k in keys if k not in self._cache)
        by_r: dict[int, list[tuple[int, int]]] = {}
        for start, end, r in todo:
            by_r.setdefault(r, []).append((start, end))
        jobs = []
        chunk = max(1, _POLICY_ROWS // self.L)
        for r, wins in by_r.items():
            for i in range(0, len(wins), chunk):
                jobs.append((r, wins[i : i + chunk]))
        total = len(todo)
        done = 0
        tp = self.topology

        def weights_of(wins):
            arr = np.array(wins, dtype=np.int64)
            return self.window_loads(arr[:, 0], arr[:, 1])

        def store(r, wins, placements):
            nonlocal done
            for (start, end), p in zip(wins, placements):
                self._cache[(start, end, r)] = p
            done += len(wins)
            if progress is not None:
                progress(done, total)

        if workers > 1 and len(jobs) > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            ctx = mp.get_context("spawn")  # no fork: callers may run threads or an event loop
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                futures = [
                    (r, wins, pool.submit(_policy_chunk, weights_of(wins), self.E + r,
                                          tp.num_groups, tp.num_nodes, tp.ep_size))
                    for r, wins in jobs
                ]
                for r, wins, fut in futures:
                    try:
                        store(r, wins, fut.result())
                    except PolicyError as exc:
                        raise _load_error(exc, wins, self.layer_stride) from None
        else:
            for r, wins in jobs:
                try:
                    placements = _policy_chunk(weights_of(wins), self.E + r, tp.num_groups, tp.num_nodes, tp.ep_size)
                except PolicyError as exc:
                    raise _load_error(exc, wins, self.layer_stride) from None
                store(r, wins, placements)

    def replica_share(self, phy2log: np.ndarray) -> np.ndarray:
        """``[L, P]`` float32: share of its expert's tokens each slot takes (1 / replica count)."""
        L, P = phy2log.shape
        idx = np.arange(L)[:, None] * self.E + phy2log.astype(np.int64)
        cnt = np.bincount(idx.ravel(), minlength=L * self.E)
        return (1.0 / cnt[idx]).astype(np.float32)

    def initial_placement(self, num_redundant: int) -> np.ndarray:
        """vLLM's start-up placement ``[L, E+R]``: experts 0..E-1, then redundant ``i % E``."""
        p = np.concatenate([np.arange(self.E), np.arange(num_redundant) % self.E])
        return np.broadcast_to(p.astype(np.int16), (self.L, p.size))

    def static_counts(self) -> np.ndarray:
        """Expert parallelism without EPLB: ``[L, E, G]`` 0/1, contiguous expert ranges per GPU
        (the first ``E % ep`` GPUs take one more expert when E is not divisible)."""
        base, extra = divmod(self.E, self.G)
        sizes = np.full(self.G, base) + (np.arange(self.G) < extra)
        gpu = np.repeat(np.arange(self.G), sizes)
        counts = np.zeros((self.L, self.E, self.G), dtype=np.float32)
        counts[:, np.arange(self.E), gpu] = 1
        return counts

    def moved(self, old: np.ndarray, new: np.ndarray) -> int:
        """Replicas GPUs must receive going from placement ``old`` to ``new`` (both ``[L, P]``):
        per layer and GPU, slots minus the multiset intersection of old and new experts."""
        L, P = new.shape
        S = P // self.G
        o = old.reshape(L * self.G, S)
        n = new.reshape(L * self.G, S)
        found = n == o[:, :1]  # new slot's expert is somewhere in the old GPU's slots
        for j in range(1, S):
            found |= n == o[:, j : j + 1]
        kept = int(np.count_nonzero(found))
        if P == self.E:  # no redundancy: an expert is on one GPU once, nothing to correct
            return L * P - kept
        ns = np.sort(n, axis=1)
        dup = np.flatnonzero((ns[:, 1:] == ns[:, :-1]).any(axis=1))
        if dup.size:  # an expert twice on one GPU: count min(copies in new, copies in old)
            nd = n[dup]
            ed = nd[:, :, None] == o[dup][:, None, :]
            same_new = (nd[:, :, None] == nd[:, None, :]).sum(axis=2)
            same_old = ed.sum(axis=2)
            exact = (np.minimum(same_new, same_old) / same_new).sum()
            kept += int(round(float(exact))) - int(np.count_nonzero(found[dup]))
        return L * P - kept

    def moved_many(self, placements: np.ndarray) -> np.ndarray:
        """``[n-1]`` int64: :meth:`moved` for each consecutive pair of ``placements [n, L, P]``, in
        one pass (the same counts, without a Python call per rearrangement)."""
        n, L, P = placements.shape
        if n < 2:
            return np.zeros(0, dtype=np.int64)
        if kernels.enabled():
            return L * P - kernels.kept_many(_compiled_ints(placements), self.G, self.E)
        S = P // self.G
        o = placements[:-1].reshape(-1, S)
        new = placements[1:].reshape(-1, S)
        # Slot-major copies: each comparison then runs over all (pair, layer, GPU) rows at once
        # (row-major, the broadcast over S columns costs several times more).
        o_t, new_t = np.ascontiguousarray(o.T), np.ascontiguousarray(new.T)
        found_t = new_t == o_t[0]
        for j in range(1, S):
            found_t |= new_t == o_t[j]
        kept = np.count_nonzero(found_t.reshape(S, n - 1, -1), axis=(0, 2))
        if P != self.E:  # an expert twice on one GPU: count min(copies in new, copies in old)
            twice = np.zeros(new_t.shape[1], dtype=bool)
            for i in range(1, S):
                for j in range(i):
                    twice |= new_t[i] == new_t[j]
            dup = np.flatnonzero(twice)
            if dup.size:  # per new slot: copies of its expert in new / in old on that GPU
                nd, od = new_t[:, dup], o_t[:, dup]
                exact = -found_t[:, dup].sum(axis=0).astype(np.float64)
                for i in range(S):
                    same_new = sum((nd[i] == nd[j]).astype(np.int64) for j in range(S))
                    same_old = sum((nd[i] == od[j]).astype(np.int64) for j in range(S))
                    exact += np.minimum(same_new, same_old) / same_new
                pair = dup // (L * self.G)
                kept = kept + np.round(np.bincount(pair, weights=exact, minlength=n - 1)).astype(np.int64)
        return L * P - kept

    # --- replay -------------------------------------------------------------------------------

    def _overlaps(self, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_overlap` for many step ranges at once: (segment, bucket, share) of every
        touched (segment, bucket) pair, segment-major."""
        lo, hi = self.S[:-1][None, :], self.S[1:][None, :]
        start, end = starts[:, None], ends[:, None]
        ov = np.clip(np.minimum(end, hi) - np.maximum(start, lo), 0, None).astype(np.float64)
        frac = np.where(self.steps > 0, ov / np.maximum(self.steps, 1), 0.0)
        zero = self.steps == 0
        frac = np.where(zero & (lo >= start) & ((lo < end) | ((end == self.N) & (lo == end))), 1.0, frac)
        seg, bucket = np.nonzero(frac > 0)
        return seg, bucket, frac[seg, bucket]

    def _replay_placements(self, bounds: np.ndarray, placements: np.ndarray) -> np.ndarray:
        """``[T, L]`` busiest-GPU load when ``placements[j] [L, P]`` serves steps
        ``[bounds[j], bounds[j+1])``: the sum :meth:`_replay` forms, for all segments at once."""
        n, L, P = placements.shape
        seg, bucket, frac = self._overlaps(bounds[:-1], bounds[1:])
        if kernels.enabled():
            ints = _compiled_ints(placements)
            M = np.zeros((self.T, L))
            kernels.busiest_gpu(self._xflat, self.T, self.E, self.G, ints, kernels.replica_shares(ints, self.E),
                                seg, bucket, frac, M)
            return M
        idx = np.arange(L)[None, :, None] * self.E + placements.astype(np.intp)  # [n, L, P]
        cnt = np.bincount((idx + (np.arange(n) * L * self.E)[:, None, None]).ravel(), minlength=n * L * self.E)
        share = (1.0 / cnt.reshape(n, L * self.E)[np.arange(n)[:, None, None], idx]).astype(np.float32)
        M = np.zeros((self.T, L))
        S = P // self.G
        ones = np.ones(S, dtype=np.float32)
        step = max(1, (1 << 16) // (L * P))  # (segment, bucket) pairs per pass: ~256 kB of float32
        for a in range(0, seg.size, step):
            sg, bk = seg[a : a + step], bucket[a : a + step]
            gidx = ((np.arange(L)[None, :] * self.T + bk[:, None]) * self.E)[:, :, None] + placements[sg]
            slot = self._xflat[gidx]  # [m, L, P]
            slot *= share[sg]
            per_gpu = slot.reshape(-1, S) @ ones
            mx = per_gpu.reshape(sg.size, L, self.G).max(axis=2)
            np.add.at(M, bk, frac[a : a + step, None] * mx)
        return M


    def _max_gpu(self, phy2log: np.ndarray, b0: int, b1: int) -> np.ndarray:
        """``[L, b1-b0]`` busiest-GPU load of buckets b0..b1-1 under ``phy2log [L, P]``."""
        L, P = phy2log.shape
        share = self.replica_share(phy2log)  # [L, P]
        base = (np.arange(L, dtype=np.intp) * self.T)[:, None] + np.arange(b0, b1, dtype=np.intp)
        idx = (base * self.E)[:, :, None] + phy2log.astype(np.intp)[:, None, :]  # [L, nb, P]
        slot = self._xflat[idx]
        slot *= share[:, None, :]
        per_gpu = slot.reshape(-1, P // self.G) @ np.ones(P // self.G, dtype=np.float32)
        return per_gpu.reshape(L, b1 - b0, self.G).max(axis=2)

    def _max_gpu_dense(self, counts: np.ndarray, b0: int, b1: int) -> np.ndarray:
        """Same as :meth:`_max_gpu` for a placement given as ``[L, E, G]`` replica shares."""
        share = counts / np.maximum(counts.sum(axis=2, keepdims=True), 1)
        return np.matmul(self.XL[:, b0:b1, :], share.astype(np.float32)).max(axis=2)

    def _overlap(self, start: int, end: int) -> tuple[int, int, np.ndarray]:
        """Buckets b0..b1-1 touched by steps [start, end) and the share of each bucket."""
        lo, hi = self.S[:-1], self.S[1:]
        ov = np.clip(np.minimum(end, hi) - np.maximum(start, lo), 0, None).astype(np.float64)
        frac = np.where(self.steps > 0, ov / np.maximum(self.steps, 1), 0.0)
        zero = self.steps == 0  # a bucket without steps belongs to the placement serving its start
        frac = np.where(zero & (lo >= start) & ((lo < end) | ((end == self.N) & (lo == end))),
                        1.0, frac)
        nz = np.flatnonzero(frac > 0)
        if nz.size == 0:
            return 0, 0, frac[:0]
        return int(nz[0]), int(nz[-1]) + 1, frac[nz[0] : nz[-1] + 1]

    def _replay(self, segments: list[tuple[int, int, np.ndarray]], dense: bool = False) -> np.ndarray:
        """``[T, L]`` busiest-GPU load; segments = (start step, end step, phy2log [L, P]), or
        ``[L, E, G]`` replica counts when ``dense``."""
        M = np.zeros((self.T, self.L))
        fn = self._max_gpu_dense if dense else self._max_gpu
        for start, end, placement in segments:
            b0, b1, frac = self._overlap(start, end)
            if b1 > b0:
                M[b0:b1] += frac[:, None] * fn(placement, b0, b1).T
        return M

    def _result(self, mode, knobs, M, ks, moved, num_redundant) -> SimResult:
        cost = self.cost
        if self._layer_scale != 1.0:
            moved = np.round(np.asarray(moved) * self._layer_scale).astype(np.int64)
        I = self.mean_gpu
        Mt, It = M.sum(axis=1), I.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            over_time = np.where(Mt > 0, It / Mt, np.nan)
            per_layer = np.where(M.sum(0) > 0, I.sum(0) / M.sum(0), np.nan)
            ratio = np.where(It > 0, Mt / It, 1.0)
        total_m = Mt.sum()
        balancedness = float(It.sum() / total_m) if total_m > 0 else 1.0
        ideal = self.steps * self.s0
        f = cost.moe_time_share
        compute = ideal * ((1.0 - f) + f * ratio)
        overlap = ideal * cost.overlap_loss if mode == "eplb" else np.zeros(self.T)
        overhead = np.zeros(self.T)
        if len(ks):
            b = np.clip(np.searchsorted(self.S, ks, side="right") - 1, 0, self.T - 1)
            per = cost.overhead_seconds(np.ones(len(ks)), np.asarray(moved, dtype=np.float64),
                                        self.G, self.L_full, self.E)
            np.add.at(overhead, b, per)
        red_bytes = cost.redundant_bytes_per_gpu(self.L_full, self.E, num_redundant, self.G)
        kv = cost.kv_factor(red_bytes)
        ideal_s, compute_s, overhead_s = float(ideal.sum()), float(compute.sum()), float(overhead.sum())
        overlap_s = float(overlap.sum())
        imb = ideal_s / compute_s if compute_s > 0 else 1.0
        olf = compute_s / (compute_s + overlap_s) if compute_s + overlap_s > 0 else 1.0
        busy = compute_s + overlap_s
        ovf = busy / (busy + overhead_s) if busy + overhead_s > 0 else 1.0
        thr = Throughput(
            relative=imb * olf * ovf * kv,
            imbalance_factor=imb,
            overhead_factor=ovf,
            kv_factor=kv,
            ideal_seconds=ideal_s,
            compute_seconds=compute_s,
            overhead_seconds=overhead_s,
            redundant_bytes_per_gpu=red_bytes,
            memory_penalty_known=num_redundant == 0
            or cost.resolve_bytes_per_expert(self.L_full, self.E) is not None,
            overlap_factor=olf,
            overlap_seconds=overlap_s,
        )
        return SimResult(
            mode=mode,
            knobs=knobs,
            topology=self.topology,
            balancedness=balancedness,
            balancedness_per_layer=per_layer,
            balancedness_over_time=over_time,
            rearrangements=int(len(ks)),
            experts_moved=int(np.sum(moved)),
            rearrangement_steps=np.asarray(ks, dtype=np.int64),
            moved_per_rearrangement=np.asarray(moved, dtype=np.int64),
            throughput=thr,
            bucket_ideal_s=ideal,
            bucket_time_s=compute + overlap + overhead,
        )

    def run(self, knobs: Knobs) -> SimResult:
        """Replay vLLM with EPLB on and these knobs (runs the policy for windows not cached)."""
        r = knobs.num_redundant_experts
        self.topology.check(self.E, r)
        wins = self.windows(knobs)
        keys = [(s, e, r) for s, e in wins]
        self.prepare(set(keys))
        placements = np.stack([self.initial_placement(r)] + [self._cache[k] for k in keys])
        ks = np.array([e for _, e in wins], dtype=np.int64)
        bounds = np.concatenate([[0], ks, [self.N]])
        M = self._replay_placements(bounds, placements)
        return self._result("eplb", knobs, M, ks, self.moved_many(placements), r)

    def run_static(self) -> SimResult:
        """Replay expert parallelism without EPLB (static contiguous placement, no redundancy)."""
        M = self._replay([(0, self.N, self.static_counts())], dense=True)
        return self._result("static", None, M, np.zeros(0, np.int64), np.zeros(0, np.int64), 0)

    def run_clairvoyant(self, num_redundant: int) -> SimResult:
        """Upper bound: each bucket placed by the policy from that bucket's own load, for free."""
        self.topology.check(self.E, num_redundant)
        tp = self.topology
        M = np.zeros((self.T, self.L))
        for b0 in range(0, self.T, _POLICY_CHUNK):
            b1 = min(self.T, b0 + _POLICY_CHUNK)
            p = _policy_chunk(self.trace.load[b0:b1].astype(np.float32), self.E + num_redundant,
                              tp.num_groups, tp.num_nodes, tp.ep_size)
            for i, b in enumerate(range(b0, b1)):
                M[b] = self._max_gpu(p[i], b, b + 1)[:, 0]
        res = self._result("clairvoyant", None, M, np.zeros(0, np.int64), np.zeros(0, np.int64),
                           num_redundant)
        return res


def simulate(
    trace: LoadTrace,
    *,
    ep_size: int,
    num_nodes: int = 1,
    num_groups: int = 1,
    window_size: int,
    step_interval: int,
    num_redundant_experts: int,
    cost: CostModel = CostModel(),
) -> SimResult:
    """Replay vLLM with EPLB (window W steps, interval I steps, R redundant experts) over a trace.

    Raises:
        SimError: bad arguments (e.g. (E + R) % ep_size != 0), naming the argument.
    """
    topo = Topology(ep_size, num_nodes, num_groups)
    try:
        knobs = Knobs(window_size, step_interval, num_redundant_experts)
    except KnobsError as exc:
        raise SimError(str(exc)) from None
    return Replay(trace, topo, cost).run(knobs)


def simulate_static(
    trace: LoadTrace,
    *,
    ep_size: int,
    num_nodes: int = 1,
    num_groups: int = 1,
    cost: CostModel = CostModel(),
) -> SimResult:
    """Replay the same deployment without EPLB (static placement, no redundant experts)."""
    return Replay(trace, Topology(ep_size, num_nodes, num_groups), cost).run_static()


def simulate_clairvoyant(
    trace: LoadTrace,
    *,
    ep_size: int,
    num_nodes: int = 1,
    num_groups: int = 1,
    num_redundant_experts: int,
    cost: CostModel = CostModel(),
) -> SimResult:
    """Bound: rearrange before every bucket with that bucket's own load, at no cost."""
    topo = Topology(ep_size, num_nodes, num_groups)
    return Replay(trace, topo, cost).run_clairvoyant(num_redundant_experts)
