"""Pod side: turn the workers' snapshot files into Prometheus series (one process per pod serves them).

Aggregation over the pod's workers (one per EP rank), per model:

* ``expert_tokens`` and ``rank_tokens`` are **summed**: each worker counts only the tokens its own
  router dispatched, so the sum over workers (and, in PromQL, over pods) is the engine's load with
  nothing counted twice;
* engine steps, rearrangements, their durations, the replica map and the config are the same
  engine-wide quantity on every rank (ranks step in lockstep), so they are taken once (never
  summed), from the pod's most advanced rank (most steps, then most rearrangements, then the lowest
  rank): ranks write their snapshots at slightly different moments, and taking a fixed rank would
  make a counter go DOWN when that rank's first snapshot lands after another's -- which Prometheus
  and the load reader take for a restart (seen on the real engine);
* vLLM's own health signals (vLLM >= 0.34, :mod:`.health`): async worker failures are raised on
  every rank, so the most any rank counted is taken (never the sum); async cycle durations are
  logged by EP rank 0 only, so they come from the rank that has them;
* step durations, tokens per step and the KV-cache size are per rank: exported per rank (label
  ``rank`` = the worker's own EP rank), never summed;
* balancedness per layer = mean over ranks / max over ranks of the tokens each rank processed in the
  last ``window`` seconds. It is exported only when this pod holds every EP rank (then its
  rank counters are complete); for engines spanning pods use the PromQL in docs/exporter.md.

Modes: ``full`` exports one replica gauge per (layer, expert); ``reduced`` exports the replica gauge
only for experts with more than one replica (absent = 1), which keeps a DeepSeek-V3 pod
(58 x 256, EP 32, 32 redundant) under 20 000 series.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from moe_eplb.contracts import metric_names
from moe_eplb.contracts.vllm_facts import balancedness_per_layer
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.group import GroupMerge, GroupRole

log = logging.getLogger("moe_eplb.exporter")


@dataclass
class PodModel:
    """One model's counters summed over the pod's workers."""

    name: str
    ep_size: int
    ranks: set[int]
    expert_tokens: np.ndarray  # float64 [L, E]
    rank_tokens: np.ndarray  # float64 [L, EP]
    replicas: np.ndarray  # int64 [L, E]
    steps: int
    rearrangements: int
    duration_buckets: np.ndarray  # int64 [B+1], per bucket (not cumulative)
    duration_sum: float
    window_size: int | None
    step_interval: int | None
    num_redundant_experts: int | None
    use_async: bool | None
    start_time: float
    balancedness: dict[int, float] = field(default_factory=dict)
    per_rank: list[snap.ModelSnapshot] = field(default_factory=list)  # this pod's workers, by EP rank
    rebalance_failures: int | None = None  # async worker failures (max over ranks; None: not reported)
    async_duration_buckets: np.ndarray | None = None  # vLLM's async cycle timings (its rank 0's)
    async_duration_sum: float = 0.0
    #: False on a worker pod of a replica group: its expert counts are in its leader's counter
    #: (:mod:`.group`), so it exports neither the L x E counters nor the replica gauges
    export_experts: bool = True
    #: pods whose expert counts this pod's counter holds (leader: 1 + workers heard; worker: 0);
    #: None on a pod outside a group (no series)
    group_pods: int | None = None

    @property
    def complete(self) -> bool:
        """True when this pod serves every EP rank of the engine."""
        return self.ranks == set(range(self.ep_size))


def aggregate(snapshots: Iterable[snap.WorkerSnapshot]) -> dict[str, PodModel]:
    """Sum the per-rank load over workers; take engine-wide values from the most advanced rank."""
    by_model: dict[str, list[snap.ModelSnapshot]] = {}
    for ws in snapshots:
        for m in ws.models:
            by_model.setdefault(m.name, []).append(m)
    out = {}
    for name, parts in by_model.items():
        parts.sort(key=lambda m: m.ep_rank)
        first = parts[0]
        same = [m for m in parts if m.expert_tokens.shape == first.expert_tokens.shape
                and m.rank_tokens.shape == first.rank_tokens.shape and m.ep_size == first.ep_size]
        if len(same) != len(parts):
            log.warning("moe-eplb exporter: model %s: %d worker(s) disagree on shapes; ignoring them",
                        name, len(parts) - len(same))
        lead = max(same, key=lambda m: (m.steps, m.rearrangements, -m.ep_rank))
        failures = [m.rebalance_failures for m in same if m.rebalance_failures is not None]
        timed = [m for m in same if m.async_duration_buckets is not None]
        timer = max(timed, key=lambda m: (int(np.sum(m.async_duration_buckets)), -m.ep_rank)) if timed else None
        out[name] = PodModel(
            name=name,
            ep_size=first.ep_size,
            ranks={m.ep_rank for m in same},
            expert_tokens=np.sum([m.expert_tokens for m in same], axis=0),
            rank_tokens=np.sum([m.rank_tokens for m in same], axis=0),
            replicas=lead.replicas,
            steps=lead.steps,
            rearrangements=lead.rearrangements,
            duration_buckets=lead.duration_buckets,
            duration_sum=lead.duration_sum,
            window_size=lead.window_size,
            step_interval=lead.step_interval,
            num_redundant_experts=lead.num_redundant_experts,
            use_async=lead.use_async,
            start_time=min(m.start_time for m in same),
            per_rank=same,
            # every rank raises the same failure: the most any rank saw, never the sum
            rebalance_failures=max(failures) if failures else None,
            # vLLM times async cycles on EP rank 0 only: the rank that has the timings
            async_duration_buckets=None if timer is None else timer.async_duration_buckets,
            async_duration_sum=0.0 if timer is None else timer.async_duration_sum,
        )
    return out


def balancedness(rank_tokens: np.ndarray) -> dict[int, float]:
    """Per layer ``mean_r / max_r`` of tokens per rank (``rank_tokens``: [L, EP]) as
    :func:`moe_eplb.contracts.vllm_facts.balancedness_per_layer` defines it; layers without tokens are left out."""
    per_layer = balancedness_per_layer(rank_tokens)
    return {int(l): float(per_layer[l]) for l in np.flatnonzero(np.isfinite(per_layer))}


class BalancednessWindow:
    """Remembers recent rank-token totals so the gauge covers the last ``seconds`` only."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._history: dict[str, deque] = {}

    def update(self, now: float, model: PodModel) -> dict[int, float]:
        hist = self._history.setdefault(model.name, deque())
        if hist and hist[-1][1].shape != model.rank_tokens.shape:
            hist.clear()
        hist.append((now, model.rank_tokens.copy()))
        # keep one sample at or before now - seconds as the baseline
        while len(hist) > 2 and hist[1][0] <= now - self.seconds:
            hist.popleft()
        base = hist[0][1] if len(hist) > 1 else np.zeros_like(model.rank_tokens)
        delta = model.rank_tokens - base
        if np.any(delta < 0):  # a worker restarted: start the window again
            hist.clear()
            hist.append((now, model.rank_tokens.copy()))
            delta = model.rank_tokens
        return balancedness(delta)


def families(models: dict[str, PodModel], mode: str = "full", live: Iterable = ()) -> list:
    """Prometheus metric families for the pod (names from :mod:`moe_eplb.contracts.metric_names`);
    ``live``: the ranks' live-apply statuses (:class:`moe_eplb.contracts.live_protocol.RankStatus`)."""
    f = _Families(mode)
    for pm in models.values():
        _add_model(f, pm, mode)
    settings = settings_families(models, live)
    # the group gauge only on a replica group's pods (a pod on its own exports what it always did)
    return [f.expert, f.rank, f.replicas, f.rearr, f.hist, f.steps, f.bal, f.info, f.start, f.ranks, f.step_s,
            f.step_t, f.kv, f.fails, f.async_h, *([f.group] if f.group.samples else []), *settings]


def settings_families(models: dict[str, PodModel], live: Iterable) -> list:
    """The EPLB settings in force on each EP rank of the pod, with the engine step they took effect
    (``since_step``: 0 = since the engine started), from the ranks' live-apply statuses; none where
    no rank reports one. Per model of the pod (the settings are the engine's, the same for each)."""
    M, RK = metric_names.LABEL_MODEL, metric_names.LABEL_RANK
    window = GaugeMetricFamily(metric_names.SETTINGS_WINDOW_SIZE, "EPLB load window (engine steps) in force on the "
                               "EP rank (changed live or from the operator's live settings at start).", labels=[M, RK])
    interval = GaugeMetricFamily(metric_names.SETTINGS_STEP_INTERVAL, "EPLB rearrangement interval (engine steps) "
                                 "in force on the EP rank.", labels=[M, RK])
    since = GaugeMetricFamily(metric_names.SETTINGS_SINCE_STEP, "Engine step from which the rank's window and "
                              "interval are in force (0: since the engine started).", labels=[M, RK])
    for status in live:
        if status.ep_rank is None or status.window_size is None or status.step_interval is None:
            continue
        for name in models:
            r = str(status.ep_rank)
            window.add_metric([name, r], float(status.window_size))
            interval.add_metric([name, r], float(status.step_interval))
            since.add_metric([name, r], float(status.since_step))
    return [window, interval, since] if window.samples else []


class _Families:
    """The empty metric families of one scrape."""

    def __init__(self, mode: str):
        M, LY, EX, RK = metric_names.LABEL_MODEL, metric_names.LABEL_LAYER, metric_names.LABEL_EXPERT, metric_names.LABEL_RANK
        self.expert = CounterMetricFamily(metric_names.EXPERT_TOKENS, "Tokens routed to each logical expert of each MoE layer "
                                     "(one per token and top-k slot), counted by the routing rank.", labels=[M, LY, EX])
        self.rank = CounterMetricFamily(metric_names.RANK_TOKENS, "Tokens dispatched to the experts held by each EP rank, "
                                   "per MoE layer.", labels=[M, LY, RK])
        self.replicas = GaugeMetricFamily(metric_names.EXPERT_REPLICAS, "Physical replicas of each logical expert in the current "
                                     "EPLB map" + (" (only experts with more than one; absent = 1)." if mode == "reduced"
                                                   else "."), labels=[M, LY, EX])
        self.rearr = CounterMetricFamily(metric_names.REARRANGEMENTS, "EPLB rearrangements started.", labels=[M])
        self.steps = CounterMetricFamily(metric_names.ENGINE_STEPS, "Engine steps seen by EPLB (dummy steps included).",
                                         labels=[M])
        self.bal = GaugeMetricFamily(metric_names.BALANCEDNESS, "Mean over EP ranks / max over EP ranks of tokens per rank, "
                                "per MoE layer, over the balancedness window.", labels=[M, LY])
        self.info = GaugeMetricFamily(metric_names.CONFIG_INFO, "Running EPLB configuration (value 1).",
                                 labels=[M, *metric_names.CONFIG_INFO_LABELS])
        self.start = GaugeMetricFamily(metric_names.EXPORTER_START_TIME, "Unix time at which this pod's counters started at 0.",
                                  labels=[M])
        self.ranks = GaugeMetricFamily(metric_names.EXPORTER_RANKS, "EP ranks whose counters this pod serves.", labels=[M])
        self.hist = HistogramMetricFamily(metric_names.REARRANGEMENT_SECONDS,
                                     "Duration of EPLB rearrangements (sync: the call; async: until the last "
                                     "layer is committed).", labels=[M])
        self.step_s = HistogramMetricFamily(metric_names.STEP_SECONDS, "Wall time of the engine steps of each EP rank "
                                       "(end of one EPLB step to the end of the next; waits for work excluded).",
                                       labels=[M, RK])
        self.step_t = HistogramMetricFamily(metric_names.STEP_TOKENS, "Real (unpadded) tokens the rank's router dispatched "
                                       "per engine step (each to top_k experts; dummy steps count 0).", labels=[M, RK])
        self.kv = GaugeMetricFamily(metric_names.KV_CACHE_BYTES, "Bytes of KV cache the EP rank allocated.", labels=[M, RK])
        self.fails = CounterMetricFamily(metric_names.REBALANCE_FAILURES, "Async EPLB worker failures vLLM raised (vLLM >= 0.34: "
                                    "'Async EPLB worker failed on at least one rank').", labels=[M])
        self.async_h = HistogramMetricFamily(metric_names.ASYNC_REARRANGEMENT_SECONDS, "Async EPLB rearrangement cycles as vLLM "
                                        "times them (vLLM >= 0.34, its 'Async EPLB rearranged N/M layers' line).",
                                        labels=[M])
        self.group = GaugeMetricFamily(metric_names.EXPORTER_GROUP_PODS, "Pods of the replica group whose expert "
                                       "counts this pod's moe_eplb_expert_tokens_total holds (the leader: itself and "
                                       "each worker it hears from; a worker: 0, its counts are in the leader's).",
                                       labels=[M])


def _add_model(f: _Families, pm: PodModel, mode: str) -> None:
    """Add one model's samples to the families (a group's worker pod: no L x E families)."""
    L, E = pm.expert_tokens.shape
    layer_s = [str(l) for l in range(L)]
    expert_s = [str(e) for e in range(E)]
    if pm.export_experts:
        et = pm.expert_tokens
        for l in range(L):
            ls = layer_s[l]
            row = et[l]
            for e in range(E):
                f.expert.add_metric([pm.name, ls, expert_s[e]], row[e])
        if mode == "reduced":
            for l, e in zip(*np.nonzero(pm.replicas != 1)):
                f.replicas.add_metric([pm.name, layer_s[l], expert_s[e]], float(pm.replicas[l, e]))
        else:
            for l in range(L):
                for e in range(E):
                    f.replicas.add_metric([pm.name, layer_s[l], expert_s[e]], float(pm.replicas[l, e]))
    for l in range(L):
        for r in range(pm.rank_tokens.shape[1]):
            f.rank.add_metric([pm.name, layer_s[l], str(r)], pm.rank_tokens[l, r])
    f.rearr.add_metric([pm.name], pm.rearrangements)
    f.steps.add_metric([pm.name], pm.steps)
    for l, b in sorted(pm.balancedness.items()):
        f.bal.add_metric([pm.name, layer_s[l]], b)
    f.info.add_metric([pm.name, _s(pm.window_size), _s(pm.step_interval), _s(pm.num_redundant_experts),
                       str(pm.ep_size), "" if pm.use_async is None else str(pm.use_async).lower()], 1.0)
    f.start.add_metric([pm.name], pm.start_time)
    f.ranks.add_metric([pm.name], float(len(pm.ranks)))
    cum = np.cumsum(pm.duration_buckets)
    bounds = [repr(float(b)) for b in snap.DURATION_BUCKETS] + ["+Inf"]
    f.hist.add_metric([pm.name], list(zip(bounds, [float(c) for c in cum])), sum_value=pm.duration_sum)
    for m in pm.per_rank:
        r = str(m.ep_rank)
        f.step_s.add_metric([pm.name, r], _buckets(metric_names.STEP_SECONDS_BUCKETS, m.step_seconds_buckets),
                            sum_value=m.step_seconds_sum)
        f.step_t.add_metric([pm.name, r], _buckets(metric_names.STEP_TOKENS_BUCKETS, m.step_tokens_buckets),
                            sum_value=m.step_tokens_sum)
        if m.kv_cache_bytes:
            f.kv.add_metric([pm.name, r], float(m.kv_cache_bytes))
    if pm.rebalance_failures is not None:
        f.fails.add_metric([pm.name], float(pm.rebalance_failures))
    if pm.async_duration_buckets is not None:
        f.async_h.add_metric([pm.name], _buckets(snap.DURATION_BUCKETS, pm.async_duration_buckets),
                             sum_value=pm.async_duration_sum)
    if pm.group_pods is not None:
        f.group.add_metric([pm.name], float(pm.group_pods))


def _buckets(bounds, counts) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs of a histogram from per-bucket counts (last = +Inf)."""
    cum = np.cumsum(np.asarray(counts, np.int64))
    les = [repr(float(b)) for b in bounds] + ["+Inf"]
    return list(zip(les, [float(c) for c in cum]))


def _s(v) -> str:
    return "" if v is None else str(v)


class PodCollector:
    """prometheus_client collector reading the pod's exporter directory at each scrape."""

    def __init__(self, directory: str, mode: str = "full", balancedness_window_seconds: float = 60.0,
                 clock=time.monotonic, role: GroupRole | None = None, merge: GroupMerge | None = None):
        self.directory = directory
        self.mode = mode
        self.window = BalancednessWindow(balancedness_window_seconds)
        self.clock = clock
        self.role = role or GroupRole()
        self.merge = merge  # the leader's: its workers' counts (:class:`~moe_eplb.exporter.group.PeerPoller`)

    def own(self) -> dict[str, tuple[float, np.ndarray]]:
        """This pod's own expert totals per model, as a worker serves them to its leader."""
        return {n: (pm.start_time, pm.expert_tokens) for n, pm in aggregate(snap.read_all(self.directory)).items()}

    def models(self) -> dict[str, PodModel]:
        models = aggregate(snap.read_all(self.directory))
        now = self.clock()
        for pm in models.values():
            bal = self.window.update(now, pm)
            pm.balancedness = bal if pm.complete else {}
            if self.role.role == "worker":
                pm.export_experts, pm.group_pods = False, 0
            elif self.role.role == "leader":
                if self.merge is not None:
                    pm.expert_tokens = self.merge.merged(pm.name, pm.expert_tokens)
                pm.group_pods = self.merge.pods(pm.name) if self.merge is not None else 1
        return models

    def collect(self):
        from moe_eplb.exporter.live_control import rank_statuses

        yield from families(self.models(), self.mode, rank_statuses(self.directory))
