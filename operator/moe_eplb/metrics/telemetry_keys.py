"""Raw samples -> a trace's telemetry (:class:`~moe_eplb.eplb.workload.trace.Telemetry`; pure, no I/O).

The telemetry the calibration (:mod:`moe_eplb.eplb.tuning.calibrate`) fits on comes from the exporter's and
vLLM's own series of the MoEInference, on the load trace's bucket grid (``grid`` [T+1] edges; bucket
k holds samples with ``grid[k] < t <= grid[k+1]``, :mod:`moe_eplb.metrics.increments`):

================================  =======================================================================
trace key                         from
================================  =======================================================================
``step_seconds``                  ``moe_eplb_step_duration_seconds_sum`` / ``_count`` increments, summed
                                  over ranks and pods (mean wall time of one step)
``rank_load``                     ``moe_eplb_rank_tokens_total{layer, rank}`` increments summed over pods
``rearrangements``                ``moe_eplb_rearrangement_duration_seconds_count`` / ``_sum`` increments:
                                  count / pods_per_engine events per bucket, each with the bucket's mean
``config``                        the newest ``moe_eplb_config_info`` labels (``use_async`` when present)
``kv_cache_bytes_per_gpu``        median over ranks of the newest ``moe_eplb_kv_cache_bytes``
``kv_cache_usage``                ``vllm:kv_cache_usage_perc``: per series the mean of its samples in
                                  the bucket (else its last earlier sample within 5 minutes, Prometheus'
                                  lookback), averaged over engines
``preemptions``                   ``vllm:num_preemptions_total`` increments summed over engines
``requests_waiting``              ``vllm:num_requests_waiting``, as usage but summed over engines
``prefix_cache_queries``          ``vllm:prefix_cache_queries_total`` increments summed over engines (the
                                  older ``vllm:gpu_prefix_cache_queries_total`` when the new name is absent)
``prefix_cache_hit_rate``         ``vllm:prefix_cache_hits_total`` increments / the queries' (NaN where
                                  nothing was queried; same fallback)
``kv_cache_blocks``,              labels ``num_gpu_blocks`` and ``block_size`` of the newest
``kv_block_size``                 ``vllm:cache_config_info``
================================  =======================================================================

A key whose series are missing, incomplete (a bucket with engine steps but no step-duration count, a
layer without rank series, a bucket without a gauge value) or inconsistent is left out -- never
filled in; :attr:`TelemetryRead.skipped` says why. Counters follow the load reader's rules (restarts
by the exporter start time, scrape gaps spread by time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moe_eplb.api.knobs import Knobs, KnobsError
from moe_eplb.contracts import metric_names, vllm_facts
from moe_eplb.eplb.workload.trace import Rearrangement, RecordedConfig, Telemetry
from moe_eplb.metrics.errors import LoadReadError
from moe_eplb.metrics.grid import LOOKBACK_SECONDS, edge_matrix, max_gap_for, starts_at
from moe_eplb.metrics.increments import counter_increments
from moe_eplb.metrics.scrape import Round, sample_time
from moe_eplb.metrics.series import Series

LABEL_USE_ASYNC = metric_names.LABEL_USE_ASYNC

#: trace key -> the sample names it is built from (what direct scraping keeps of a /metrics body)
SAMPLE_NAMES = {
    "step_sum": metric_names.STEP_SECONDS + "_sum",
    "step_count": metric_names.STEP_SECONDS + "_count",
    "rank_tokens": metric_names.RANK_TOKENS,
    "rearrangement_sum": metric_names.REARRANGEMENT_SECONDS + "_sum",
    "rearrangement_count": metric_names.REARRANGEMENT_SECONDS + "_count",
    "config_info": metric_names.CONFIG_INFO,
    "kv_bytes": metric_names.KV_CACHE_BYTES,
    "kv_usage": vllm_facts.KV_CACHE_USAGE,
    "preemptions": vllm_facts.PREEMPTIONS,
    "waiting": vllm_facts.REQUESTS_WAITING,
    "prefix_queries": vllm_facts.PREFIX_CACHE_QUERIES,
    "prefix_hits": vllm_facts.PREFIX_CACHE_HITS,
    "prefix_queries_old": vllm_facts.PREFIX_CACHE_QUERIES_OLD,
    "prefix_hits_old": vllm_facts.PREFIX_CACHE_HITS_OLD,
    "cache_config": vllm_facts.CACHE_CONFIG_INFO,
}
#: Sources vLLM exports without a ``model_name`` label (its CacheConfig info gauge): read for the
#: MoEInference as a whole, a series without the label belongs to every model.
NO_MODEL_LABEL = frozenset({"cache_config"})


@dataclass
class TelemetrySeries:
    """Raw samples (plus one baseline at or before ``grid[0]``) of each source, by the names of
    :data:`SAMPLE_NAMES`; an empty list is a missing source."""

    step_sum: list[Series] = field(default_factory=list)
    step_count: list[Series] = field(default_factory=list)
    rank_tokens: list[Series] = field(default_factory=list)
    #: the regular pods' rank tokens summed at the grid edges by (model_name, layer, rank)
    #: (:func:`moe_eplb.metrics.reader.edge_family`); their raw series are then not in rank_tokens
    rank_edge_sums: list[Series] = field(default_factory=list)
    rearrangement_sum: list[Series] = field(default_factory=list)
    rearrangement_count: list[Series] = field(default_factory=list)
    config_info: list[Series] = field(default_factory=list)
    kv_bytes: list[Series] = field(default_factory=list)
    kv_usage: list[Series] = field(default_factory=list)
    preemptions: list[Series] = field(default_factory=list)
    waiting: list[Series] = field(default_factory=list)
    prefix_queries: list[Series] = field(default_factory=list)
    prefix_hits: list[Series] = field(default_factory=list)
    prefix_queries_old: list[Series] = field(default_factory=list)
    prefix_hits_old: list[Series] = field(default_factory=list)
    cache_config: list[Series] = field(default_factory=list)


@dataclass
class TelemetryRead:
    """The telemetry built (None when no key could be) and why each missing key is missing."""

    telemetry: Telemetry | None
    skipped: dict[str, str]


def _of_model(series: Sequence[Series], model: str | None) -> list[Series]:
    if model is None:
        return list(series)
    return [s for s in series if s.label(metric_names.LABEL_MODEL, model) == model]


def counter_sum(series: Sequence[Series], grid: np.ndarray, starts: dict[tuple, Series] | None = None) -> np.ndarray:
    """``[T]`` increments of counters on ``grid``, summed over ``series``."""
    T = grid.shape[0] - 1
    out = np.zeros(T)
    bucket = float(grid[1] - grid[0])
    for s in series:
        st = starts_at(starts[s.pod], s.ts) if starts and s.pod in starts else None
        out += counter_increments(grid, s.ts, s.vs[None, :], st, max_gap=max_gap_for(s.ts, bucket)).values[0]
    return out


def gauge_mean(series: Sequence[Series], grid: np.ndarray, combine: str = "mean") -> np.ndarray:
    """``[T]`` per series the mean of its samples in each bucket (else its last earlier sample within
    :data:`LOOKBACK_SECONDS`), combined over series (``mean`` or ``sum``); NaN where a bucket has no
    value from any series."""
    T = grid.shape[0] - 1
    rows = []
    for s in series:
        b = np.searchsorted(grid, s.ts, side="left") - 1
        inside = (b >= 0) & (b < T)
        tot = np.bincount(b[inside], weights=s.vs[inside], minlength=T)
        cnt = np.bincount(b[inside], minlength=T).astype(np.float64)
        row = np.divide(tot, cnt, out=np.full(T, np.nan), where=cnt > 0)
        for k in np.flatnonzero(cnt == 0):  # carried over from the newest earlier sample
            j = np.searchsorted(s.ts, grid[k + 1], side="right") - 1
            if j >= 0 and grid[k + 1] - s.ts[j] <= LOOKBACK_SECONDS:
                row[k] = s.vs[j]
        rows.append(row)
    if not rows:
        return np.full(T, np.nan)
    stack = np.stack(rows)
    seen = np.isfinite(stack).any(axis=0)
    filled = np.where(np.isfinite(stack), stack, 0.0)
    comb = filled.sum(axis=0)
    if combine == "mean":
        comb = comb / np.maximum(np.isfinite(stack).sum(axis=0), 1)
    return np.where(seen, comb, np.nan)


def _newest(series: Sequence[Series]) -> Series | None:
    have = [s for s in series if s.ts.size]
    return max(have, key=lambda s: s.ts[-1]) if have else None


def _config(series: Sequence[Series]) -> RecordedConfig | None:
    s = _newest([x for x in series if x.vs.size and x.vs[-1] > 0])
    if s is None:
        return None
    try:
        knobs = Knobs(int(s.label("window_size", "")), int(s.label("step_interval", "")),
                      int(s.label("num_redundant_experts", "")))
        ep = s.label("ep_size")
        ep_size = int(ep) if ep not in (None, "") else None
    except (ValueError, KnobsError):
        return None
    mode = (s.label(LABEL_USE_ASYNC) or "").lower()
    return RecordedConfig(knobs, ep_size, {"true": True, "false": False}.get(mode))


def telemetry_from_series(src: TelemetrySeries, grid: np.ndarray, bucket_steps: np.ndarray, *, num_layers: int,
                          model: str | None = None, pods_per_engine: int = 1,
                          start_times: Sequence[Series] = ()) -> TelemetryRead:
    """Build the telemetry of a trace with ``bucket_steps`` ``[T]`` on ``grid`` (see the module
    docstring). ``start_times``: ``moe_eplb_exporter_start_time_seconds`` samples (restarts)."""
    starts = {s.pod: s for s in _of_model(start_times, model)}
    kw: dict = {}
    skipped: dict[str, str] = {}
    steps = np.asarray(bucket_steps, np.float64)

    _step_seconds(src, grid, steps, model, starts, kw, skipped)
    _rank_load(src, grid, model, starts, num_layers, kw, skipped)
    _rearrangements(src, grid, model, starts, pods_per_engine, kw, skipped)
    _config_and_kv_bytes(src, model, kw, skipped)
    _kv_pressure(src, grid, steps, model, kw, skipped)
    _prefix_cache(src, grid, steps, model, kw, skipped)
    if "config" in kw and "rank_load" in kw and kw["config"].ep_size not in (None, kw["rank_load"].shape[2]):
        skipped["config"] = (f"config_info says ep_size {kw['config'].ep_size}, the rank series "
                             f"{kw['rank_load'].shape[2]} ranks")
        del kw["config"]
    return TelemetryRead(Telemetry(**kw) if kw else None, skipped)


def _step_seconds(src: TelemetrySeries, grid: np.ndarray, steps: np.ndarray, model: str | None, starts: dict,
                  kw: dict, skipped: dict) -> None:
    """``step_seconds``: the mean engine step time per bucket (``kw``; or why not, in ``skipped``)."""
    T = grid.shape[0] - 1
    ssum, scount = _of_model(src.step_sum, model), _of_model(src.step_count, model)
    if not ssum or not scount:
        skipped["step_seconds"] = f"no {metric_names.STEP_SECONDS} series"
    else:
        total, count = counter_sum(ssum, grid, starts), counter_sum(scount, grid, starts)
        missing = (steps > 0) & (count <= 0)
        if missing.any():
            skipped["step_seconds"] = (f"bucket {int(np.argmax(missing))} ran engine steps but has no "
                                       f"{metric_names.STEP_SECONDS} observation")
        else:
            kw["step_seconds"] = np.where(steps > 0, np.divide(total, count, out=np.zeros(T), where=count > 0), np.nan)


def _rank_load(src: TelemetrySeries, grid: np.ndarray, model: str | None, starts: dict, num_layers: int,
               kw: dict, skipped: dict) -> None:
    """``rank_load``: the tokens each EP rank served per layer and bucket."""
    T = grid.shape[0] - 1
    ranks = _of_model(src.rank_tokens, model)
    rank_sums = _of_model(src.rank_edge_sums, model)
    if not ranks and not rank_sums:
        skipped["rank_load"] = f"no {metric_names.RANK_TOKENS} series"
    else:
        try:
            keys = [(s.int_label(metric_names.LABEL_LAYER, "rank tokens"),
                     s.int_label(metric_names.LABEL_RANK, "rank tokens")) for s in ranks + rank_sums]
        except LoadReadError as exc:
            keys, skipped["rank_load"] = [], exc.message
        if keys:
            ep = max(k[1] for k in keys) + 1
            layers = {k[0] for k in keys}
            if max(layers) >= num_layers or len(layers) != num_layers:
                skipped["rank_load"] = f"rank series for layers {sorted(layers)[:5]}... do not cover the {num_layers} layers"
            else:
                rl = np.zeros((T, num_layers, ep))
                for (layer, rank), s in zip(keys, ranks):
                    rl[:, layer, rank] += counter_sum([s], grid, starts)
                if rank_sums:  # increments between consecutive edges (checked complete and never dropping)
                    at = np.asarray(keys[len(ranks):], np.int64)
                    np.add.at(rl, (slice(None), at[:, 0], at[:, 1]), np.diff(edge_matrix(rank_sums, grid), axis=1).T)
                kw["rank_load"] = np.maximum(rl, 0.0)


def _rearrangements(src: TelemetrySeries, grid: np.ndarray, model: str | None, starts: dict,
                    pods_per_engine: int, kw: dict, skipped: dict) -> None:
    """``rearrangements``: one per engine and rearrangement, with its mean seconds."""
    rsum, rcount = _of_model(src.rearrangement_sum, model), _of_model(src.rearrangement_count, model)
    if not rsum or not rcount:
        skipped["rearrangements"] = f"no {metric_names.REARRANGEMENT_SECONDS} series"
    else:
        total, count = counter_sum(rsum, grid, starts), counter_sum(rcount, grid, starts)
        events = []
        for b in np.flatnonzero(count > 0):
            n = int(round(count[b] / max(1, pods_per_engine)))
            events += [Rearrangement(int(b), float(total[b] / count[b]))] * n
        kw["rearrangements"] = tuple(events)


def _config_and_kv_bytes(src: TelemetrySeries, model: str | None, kw: dict, skipped: dict) -> None:
    """``config`` (the engines' EPLB settings) and ``kv_cache_bytes_per_gpu``."""
    cfg = _config(_of_model(src.config_info, model))
    if cfg is None:
        skipped["config"] = f"no readable {metric_names.CONFIG_INFO} series"
    else:
        kw["config"] = cfg
    kvb = [s.vs[-1] for s in _of_model(src.kv_bytes, model) if s.vs.size and s.vs[-1] > 0]
    if kvb:
        kw["kv_cache_bytes_per_gpu"] = float(np.median(kvb))
    else:
        skipped["kv_cache_bytes_per_gpu"] = f"no {metric_names.KV_CACHE_BYTES} series"


def _kv_pressure(src: TelemetrySeries, grid: np.ndarray, steps: np.ndarray, model: str | None, kw: dict,
                 skipped: dict) -> None:
    """``kv_cache_usage``, ``preemptions`` and ``requests_waiting`` per bucket; a series with no sample
    in a bucket that ran engine steps is left out."""
    for key, series, combine, counter in (("kv_cache_usage", src.kv_usage, "mean", False),
                                          ("preemptions", src.preemptions, "sum", True),
                                          ("requests_waiting", src.waiting, "sum", False)):
        ss = _of_model(series, model)
        if not ss:
            skipped[key] = "no series"
            continue
        values = counter_sum(ss, grid) if counter else gauge_mean(ss, grid, combine)
        gap = ~np.isfinite(values) & (steps > 0)  # where no engine ran, no sample is the truth
        if gap.any():
            skipped[key] = f"no sample for bucket {int(np.argmax(gap))}, which ran engine steps"
            continue
        kw[key] = np.clip(values, 0.0, 1.0) if key == "kv_cache_usage" else np.maximum(values, 0.0)


def _prefix_cache(src: TelemetrySeries, grid: np.ndarray, steps: np.ndarray, model: str | None, kw: dict,
                  skipped: dict) -> None:
    """The prefix-cache keys into ``kw`` (or why not into ``skipped``): queries and hit rate from
    vLLM's counters (the new names, else the older ``gpu_`` ones), the cache's size from
    ``vllm:cache_config_info``."""
    queries, hits = _of_model(src.prefix_queries, model), _of_model(src.prefix_hits, model)
    if not queries or not hits:
        queries, hits = _of_model(src.prefix_queries_old, model), _of_model(src.prefix_hits_old, model)
    if not queries or not hits:
        why = f"no {vllm_facts.PREFIX_CACHE_QUERIES} / {vllm_facts.PREFIX_CACHE_HITS} series (nor the older gpu_ names)"
        skipped["prefix_cache_queries"] = skipped["prefix_cache_hit_rate"] = why
    else:
        q, h = counter_sum(queries, grid), counter_sum(hits, grid)
        q = np.maximum(q, 0.0)
        kw["prefix_cache_queries"] = q
        kw["prefix_cache_hit_rate"] = np.where(q > 0, np.clip(np.divide(h, q, out=np.zeros_like(q), where=q > 0),
                                                              0.0, 1.0), np.nan)
    info = _newest([s for s in _of_model(src.cache_config, model) if s.vs.size and s.vs[-1] > 0])
    got = {}
    if info is not None:
        for key, label in (("kv_cache_blocks", vllm_facts.CACHE_CONFIG_BLOCKS_LABEL),
                           ("kv_block_size", vllm_facts.CACHE_CONFIG_BLOCK_SIZE_LABEL)):
            try:
                value = int(float(info.label(label, "") or "nan"))
            except (ValueError, OverflowError):
                continue
            if value > 0:
                got[key] = value
    for key in ("kv_cache_blocks", "kv_block_size"):
        if key in got and len(got) == 2 and kw:  # (the gauge has no model label: only beside the model's own)
            kw[key] = got[key]
        else:
            skipped[key] = (f"no {vllm_facts.CACHE_CONFIG_INFO} series with labels "
                            f"{vllm_facts.CACHE_CONFIG_BLOCKS_LABEL} and {vllm_facts.CACHE_CONFIG_BLOCK_SIZE_LABEL} > 0")


def series_from_rounds(rounds: Sequence[Round]) -> tuple[TelemetrySeries, list[Series]]:
    """Direct scraping: the telemetry samples the rounds kept, as :class:`Series` (one per pod and
    label set, sampled at the rounds' times), and the exporter start times."""
    by_key: dict[tuple[str, tuple], tuple[list, list]] = {}
    starts: dict[tuple, tuple[list, list]] = {}
    for rnd in rounds:
        for pod, sample in rnd.pods.items():
            for name, labels, value in sample.telemetry:
                key = (name, tuple(sorted({**labels, "pod": pod}.items())))
                ts, vs = by_key.setdefault(key, ([], []))
                ts.append(sample_time(rnd, sample))
                vs.append(value)
            for model, t0 in sample.start_time.items():
                ts, vs = starts.setdefault((("model_name", model), ("pod", pod)), ([], []))
                ts.append(sample_time(rnd, sample))
                vs.append(t0)
    def series(labels: dict, ts: list, vs: list) -> Series:  # in time order (overlapping rounds)
        order = np.argsort(np.asarray(ts, float), kind="stable")
        return Series(labels, np.asarray(ts, float)[order], np.asarray(vs, float)[order])

    src = TelemetrySeries()
    names = {v: k for k, v in SAMPLE_NAMES.items()}
    for (name, labels), (ts, vs) in by_key.items():
        getattr(src, names[name]).append(series(dict(labels), ts, vs))
    start_series = [series(dict(k), ts, vs) for k, (ts, vs) in starts.items()]
    return src, start_series
