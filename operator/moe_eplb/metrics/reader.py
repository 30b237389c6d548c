"""Build one MoEInference's load trace (T x L x E, steps per bucket) from the exporter's counters.

Two sources:

* **Prometheus** (``prometheus_url`` set): instant queries of range vectors, which return
  the *raw samples* of ``moe_eplb_expert_tokens_total``, ``moe_eplb_engine_steps_total`` and
  ``moe_eplb_exporter_start_time_seconds`` selected by ``namespace`` and ``moeinference`` (the
  label the PodMonitor copies from ``eplb.ai/name``), over the window, plus each series' last
  sample before the window (its baseline: instant queries of ``x`` and ``timestamp(x)``).
  Buckets are aligned to multiples of ``bucket_seconds``. Each series (one pod's counter) is
  differenced sample by sample (:mod:`moe_eplb.metrics.increments`: restarts, pods joining and
  leaving, scrape gaps), summed over pods, and assembled by
  :func:`moe_eplb.eplb.tracefile.trace_from_prometheus` (shape and completeness checks).
  Missed scrapes: the load between two samples further apart than ``max(bucket, 3 x the scrape
  interval)`` is spread over the buckets in between by time (uniform rate); the spread share of the
  window's load is ``trace.meta["interpolated_fraction"]``, and above ``max_interpolated_fraction``
  the window is refused (reason ``ScrapeGaps``).
* **Direct scraping** (no URL): a :class:`~moe_eplb.metrics.scrape.PodScraper` the caller keeps
  across calls scrapes every pod once per call; successive rounds are differenced the same way
  (bucket = time between two rounds).

Engine steps: a pod's step counter counts its engine's steps; an engine spanning
``pods_per_engine`` pods (``spec.parallelism.nodes``) is counted once, and independent engines
(``spec.replicas``) add up, so ``load / steps`` is the load of one engine step.

Every problem is a :class:`~moe_eplb.metrics.errors.LoadReadError` with a status reason; nothing
here returns a partial matrix, and estimated (gap-spread) load is bounded and reported.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

import numpy as np

from moe_eplb.eplb.trace import LoadTrace, TraceError
from moe_eplb.eplb.tracefile import series_points, trace_from_prometheus
from moe_eplb.exporter import names
from moe_eplb.metrics.errors import (
    INCONSISTENT_SERIES,
    INSUFFICIENT_DATA,
    NO_DATA,
    SCRAPE_GAPS,
    LoadReadError,
)
from moe_eplb.metrics.increments import Increments, counter_increments
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.scrape import PodScraper, Round, Target

POD_LABELS_EXCLUDED = ("__name__", names.LABEL_LAYER, names.LABEL_EXPERT)


def _q(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def selector(namespace: str, name: str, model: str | None = None) -> str:
    """PromQL label matchers for one MoEInference (and optionally one model)."""
    parts = [f'namespace="{_q(namespace)}"', f'{names.MOEINFERENCE_LABEL}="{_q(name)}"']
    if model:
        parts.append(f'{names.LABEL_MODEL}="{_q(model)}"')
    return "{" + ", ".join(parts) + "}"


def grid_for(now: float, window_seconds: float, bucket_seconds: float) -> np.ndarray:
    """``T + 1`` grid times (unix s), multiples of ``bucket_seconds``, the last one <= ``now``."""
    if not bucket_seconds > 0:
        raise LoadReadError(INSUFFICIENT_DATA, f"bucket_seconds must be > 0, got {bucket_seconds}")
    buckets = int(window_seconds // bucket_seconds)
    if buckets < 1:
        raise LoadReadError(INSUFFICIENT_DATA, f"window {window_seconds}s is shorter than one bucket "
                            f"({bucket_seconds}s)")
    end = math.floor(now / bucket_seconds) * bucket_seconds
    return end - bucket_seconds * np.arange(buckets, -1, -1, dtype=np.float64)


def _series_points(series: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    try:
        return series_points(series, "series")
    except TraceError as exc:
        raise LoadReadError(INCONSISTENT_SERIES, str(exc)) from None


def pick_model(shapes: dict[str, tuple[int, int]], num_layers: int | None, num_experts: int | None,
               what: str = "") -> str:
    """The model to read among those the pods report (``{name: (layers, experts)}``): the only one,
    or the only one with the expected shape (a DeepSeek MTP drafter registers its own EPLB model
    with 1 MoE layer next to the main model's 58)."""
    if len(shapes) == 1:
        return next(iter(shapes))
    fits = [m for m, (l, e) in shapes.items()
            if (num_layers is None or l == num_layers) and (num_experts is None or e == num_experts)]
    if len(fits) == 1:
        return fits[0]
    listing = ", ".join(f"{m} ({l}x{e})" for m, (l, e) in sorted(shapes.items()))
    raise LoadReadError(INCONSISTENT_SERIES, f"series of {len(shapes)} models{what}: {listing}; "
                        "pass the model to read (or the expected number of layers and experts)")


def _shapes_of(series: list) -> dict[str, tuple[int, int]]:
    shapes: dict[str, list[int]] = {}
    for s in series:
        m = s.get("metric", {})
        try:
            l, e = int(m.get(names.LABEL_LAYER, -1)), int(m.get(names.LABEL_EXPERT, -1))
        except ValueError:
            continue
        cur = shapes.setdefault(m.get(names.LABEL_MODEL, ""), [0, 0])
        cur[0], cur[1] = max(cur[0], l + 1), max(cur[1], e + 1)
    return {k: (v[0], v[1]) for k, v in shapes.items()}


def _pod_key(metric: Mapping[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in metric.items() if k not in POD_LABELS_EXCLUDED))


def _result(body: Mapping[str, Any], what: str) -> list:
    data = body.get("data") or {}
    if data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
        raise LoadReadError(INCONSISTENT_SERIES, f"{what}: expected a range-query matrix")
    return data["result"]




def _start_lookup(start_body: Mapping[str, Any] | None) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    out = {}
    if start_body is None:
        return out
    for s in _result(start_body, names.EXPORTER_START_TIME):
        ts, vs = _series_points(s)
        out[_pod_key(s.get("metric", {}))] = (ts, vs)
    return out


def _starts_at(lookup, key, ts: np.ndarray) -> np.ndarray | None:
    """The pod's exporter start time at each sample time (same scrape, same timestamp)."""
    if key not in lookup:
        return None
    sts, svs = lookup[key]
    out = np.full(ts.shape, np.nan)
    if sts.size:
        idx = np.clip(np.searchsorted(sts, ts), 0, sts.size - 1)
        hit = np.abs(sts[idx] - ts) < 1e-3
        out[hit] = svs[idx[hit]]
    return out


DEFAULT_MAX_INTERPOLATED_FRACTION = 0.1  # refuse a window with more than 10 % of its load in scrape gaps


def max_gap_for(ts: np.ndarray, bucket_seconds: float) -> float:
    """Seconds between two samples of a series beyond which scrapes were missed: the larger of one
    bucket and three times the series' usual (median) scrape interval. ``ts`` [n] sorted."""
    spacing = float(np.median(np.diff(ts))) if ts.size > 2 else 0.0
    return max(bucket_seconds, 3 * spacing)


def _increments(grid, series, lookup) -> tuple[tuple, Increments, int, float]:
    """(pod key, increments [1, T], samples inside the grid, max_gap) of one engine-steps series."""
    metric = series.get("metric", {})
    ts, vs = _series_points(series)
    order = np.argsort(ts, kind="stable")
    ts, vs = ts[order], vs[order]
    key = _pod_key(metric)
    max_gap = max_gap_for(ts, float(grid[1] - grid[0]))
    inc = counter_increments(grid, ts, vs[None, :], _starts_at(lookup, key, ts), max_gap=max_gap)
    inside = int(np.sum(ts > grid[0]))
    return key, inc, inside, max_gap


def _pod_name(pod: tuple) -> str:
    labels = dict(pod)
    return labels.get("pod") or ", ".join(f"{k}={v}" for k, v in pod)


def _gaps_text(gaps: set) -> str:
    t1, t2 = max(gaps, key=lambda g: g[1] - g[0])
    more = f" and {len(gaps) - 1} more gap(s)" if len(gaps) > 1 else ""
    return f"no samples between t={t1:.3f} and t={t2:.3f} ({t2 - t1:.1f}s){more}"


def round_steps(steps: np.ndarray) -> np.ndarray:
    """Whole engine steps per bucket ``[T]`` from fractional ones (spread gaps, ``pods_per_engine``)
    by rounding the running total: the total is kept (to the nearest step), each bucket is off by
    less than one step, and whole numbers come back unchanged."""
    return np.diff(np.round(np.cumsum(steps)), prepend=0.0)


def trace_from_raw_counters(
    expert_body: Mapping[str, Any],
    steps_body: Mapping[str, Any],
    grid: np.ndarray,
    *,
    pods_per_engine: int = 1,
    num_layers: int | None = None,
    num_experts: int | None = None,
    model: str | None = None,
    what: str = "",
    start_body: Mapping[str, Any] | None = None,
    max_interpolated_fraction: float = DEFAULT_MAX_INTERPOLATED_FRACTION,
) -> LoadTrace:
    """Pure: raw samples of the counters -> trace of T = len(grid) - 1 buckets.

    The bodies are Prometheus answers (matrix) holding raw samples, e.g. of the instant query
    ``moe_eplb_expert_tokens_total{...}[<window>s]`` at ``grid[-1]`` plus one baseline sample at or
    before ``grid[0]`` per series (:func:`with_baselines`). Per series the exact
    increments are bucketed by :func:`~moe_eplb.metrics.increments.counter_increments`;
    ``load[t]`` sums them over pods, ``bucket_steps[t]`` is the sum over pods of the step counter's
    increments divided by ``pods_per_engine``. ``start_body`` (the same for
    ``moe_eplb_exporter_start_time_seconds``) tells restarts and joins apart from scrape gaps.

    Scrape gaps (two samples of a pod further apart than :func:`max_gap_for` of its step counter)
    are spread over the buckets they span by time (:mod:`moe_eplb.metrics.increments`), the same
    way for the pod's step counter and its token counters. ``trace.meta["interpolated_fraction"]``
    is the spread share of the window's load (the larger of the shares of expert tokens and of
    engine steps, 0.0 when the data is complete); above ``max_interpolated_fraction`` the window is
    refused with reason ``ScrapeGaps``. ``bucket_steps`` are whole steps (running total rounded).
    """
    if not 0.0 <= max_interpolated_fraction <= 1.0:
        raise ValueError(f"max_interpolated_fraction: must be between 0 and 1 (a share of the load), "
                         f"got {max_interpolated_fraction}")
    expert_series = _result(expert_body, names.EXPERT_TOKENS)
    step_series = _result(steps_body, names.ENGINE_STEPS)
    if not expert_series and not step_series:
        raise LoadReadError(NO_DATA, f"no {names.PREFIX}* series{what}; check that the pods run the exporter "
                            "(VLLM_PLUGINS=moe_eplb_exporter, EPLB enabled) and that Prometheus scrapes them "
                            "(PodMonitor)")
    if not expert_series or not step_series:
        missing = names.EXPERT_TOKENS if not expert_series else names.ENGINE_STEPS
        raise LoadReadError(INCONSISTENT_SERIES, f"no {missing} series{what} while the other counter has some")
    T = grid.shape[0] - 1
    bucket_seconds = float(grid[1] - grid[0])
    if model is None:
        shapes = _shapes_of(expert_series)
        if len(shapes) > 1:
            model = pick_model(shapes, num_layers, num_experts, what)
    if model is not None:
        def keep(s):
            return s.get("metric", {}).get(names.LABEL_MODEL, model) == model

        expert_series = [s for s in expert_series if keep(s)]
        step_series = [s for s in step_series if keep(s)]
        if start_body is not None:
            start_body = {"data": {"resultType": "matrix",
                                   "result": [s for s in _result(start_body, names.EXPORTER_START_TIME) if keep(s)]}}
        if not expert_series or not step_series:
            raise LoadReadError(NO_DATA, f"no series for model {model!r}{what}")
    models = {s.get("metric", {}).get(names.LABEL_MODEL) for s in expert_series + step_series} - {None}
    lookup = _start_lookup(start_body)
    total_steps = np.zeros(T)
    step_pods: dict[tuple, float] = {}  # pod -> max_gap from its step counter
    spread_tokens: dict[tuple, float] = {}  # pod -> tokens spread over its gaps
    spread_steps = 0.0
    gaps: dict[tuple, set] = {}  # pod -> gaps (t1, t2)
    most_inside = 0
    for s in step_series:
        key, inc, inside, max_gap = _increments(grid, s, lookup)
        total_steps += inc.values[0]
        spread_steps += float(inc.interpolated.sum())
        step_pods[key] = max_gap
        if inc.interpolated.any():
            gaps.setdefault(key, set()).update(inc.gaps)
        most_inside = max(most_inside, inside)
    if most_inside < 1:
        raise LoadReadError(INSUFFICIENT_DATA, f"no samples in the last {T * bucket_seconds:g}s{what}; wait for "
                            f"at least one full bucket ({bucket_seconds:g}s) of scrapes")
    summed: dict[tuple[str, str], np.ndarray] = {}
    # a pod's counters are scraped together: group series with identical sample times and
    # difference each group as one matrix (DeepSeek-V3: 14 848 series per pod)
    groups: dict[tuple, list] = {}
    for s in expert_series:
        metric = s.get("metric", {})
        pod = _pod_key(metric)
        if pod not in step_pods:
            raise LoadReadError(INCONSISTENT_SERIES, f"{names.EXPERT_TOKENS} series {metric} has no matching "
                                f"{names.ENGINE_STEPS} series (same pod labels)")
        ts, vs = _series_points(s)
        order = np.argsort(ts, kind="stable")
        ts, vs = ts[order], vs[order]
        key = (metric.get(names.LABEL_LAYER, "?"), metric.get(names.LABEL_EXPERT, "?"))
        groups.setdefault((pod, ts.tobytes()), []).append((key, ts, vs, metric))
    for (pod, _), members in groups.items():
        ts = members[0][1]
        # the pod's step counter sets the gap rule, so its steps and tokens are spread alike
        inc = counter_increments(grid, ts, np.stack([m[2] for m in members]), _starts_at(lookup, pod, ts),
                                 max_gap=step_pods[pod])
        if inc.interpolated.any():
            spread_tokens[pod] = spread_tokens.get(pod, 0.0) + float(inc.interpolated.sum())
            gaps.setdefault(pod, set()).update(inc.gaps)
        for (key, *_), row in zip(members, inc.values):
            if key in summed:
                summed[key] += row
            else:
                summed[key] = row
    total_tokens = float(sum(row.sum() for row in summed.values()))
    token_share = sum(spread_tokens.values()) / total_tokens if total_tokens > 0 else 0.0
    step_share = spread_steps / float(total_steps.sum()) if total_steps.sum() > 0 else 0.0
    fraction = min(1.0, max(token_share, step_share))
    if fraction > max_interpolated_fraction:
        worst = max(gaps, key=lambda p: (spread_tokens.get(p, 0.0), len(gaps[p])))
        raise LoadReadError(SCRAPE_GAPS, f"{fraction:.0%} of the load in the last {T * bucket_seconds:g}s{what} "
                            f"fell in scrape gaps (allowed: {max_interpolated_fraction:.0%}) and could only be "
                            f"spread over the buckets by time; pod {_pod_name(worst)}: {_gaps_text(gaps[worst])}"
                            f"{f' ({len(gaps)} pods with gaps)' if len(gaps) > 1 else ''}; check that Prometheus "
                            "scrapes the pods (target up, scrape interval and timeout) or wait until the gaps "
                            "leave the window")
    steps = round_steps(total_steps / max(1, pods_per_engine))
    stamps = grid[1:].tolist()
    e_body = {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {names.LABEL_LAYER: l, names.LABEL_EXPERT: e}, "values": list(zip(stamps, inc.tolist()))}
        for (l, e), inc in summed.items()]}}
    s_body = {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {}, "values": list(zip(stamps, steps.tolist()))}]}}

    try:
        trace = trace_from_prometheus(e_body, s_body, num_layers=num_layers, num_experts=num_experts,
                                      bucket_seconds=bucket_seconds, model=model or (models.pop() if models else None))
    except TraceError as exc:
        raise LoadReadError(INCONSISTENT_SERIES, f"{exc}{what}") from None
    trace.meta["interpolated_fraction"] = fraction
    return trace


def trace_from_rounds(rounds: list[Round], *, model: str | None = None, pods_per_engine: int = 1,
                      num_layers: int | None = None, num_experts: int | None = None) -> LoadTrace:
    """Pure: successive direct-scrape rounds -> trace with one bucket between each two rounds.

    A pod seen for the first time counts from 0 if its exporter started after the previous round
    (it joined), otherwise from its first value (history we did not see); a pod whose start time
    changed or whose counters dropped restarted (counts from 0).
    """
    if len(rounds) < 2:
        raise LoadReadError(INSUFFICIENT_DATA, f"{len(rounds)} scrape round(s) so far; need 2 to form a bucket")
    all_models = {m for r in rounds for p in r.pods.values() for m in p.tokens}
    if model is None:
        if not all_models:
            raise LoadReadError(NO_DATA, f"no {names.EXPERT_TOKENS} series on any pod; is EPLB enabled and "
                                "the exporter plugin loaded (VLLM_PLUGINS=moe_eplb_exporter)?")
        shapes: dict[str, tuple[int, int]] = {}
        for r in rounds:
            for p in r.pods.values():
                for m, toks in p.tokens.items():
                    if toks:
                        l0, e0 = shapes.get(m, (0, 0))
                        shapes[m] = (max(l0, max(k[0] for k in toks) + 1), max(e0, max(k[1] for k in toks) + 1))
        model = pick_model(shapes, num_layers, num_experts)
    keys = {k for r in rounds for p in r.pods.values() for k in p.tokens.get(model, {})}
    if not keys:
        raise LoadReadError(NO_DATA, f"no {names.EXPERT_TOKENS} series for model {model!r}")
    L = num_layers or max(k[0] for k in keys) + 1
    E = num_experts or max(k[1] for k in keys) + 1
    if max(k[0] for k in keys) >= L or max(k[1] for k in keys) >= E:
        raise LoadReadError(INCONSISTENT_SERIES, f"series for layer/expert beyond the model's {L} x {E}")
    T = len(rounds) - 1
    load = np.zeros((T, L, E))
    steps = np.zeros(T)
    prev: dict[str, tuple[float, np.ndarray, float]] = {}
    for t, rnd in enumerate(rounds):
        cur = {}
        for pod, s in rnd.pods.items():
            if model not in s.tokens:
                continue
            if model not in s.steps:
                raise LoadReadError(INCONSISTENT_SERIES, f"pod {pod}: {names.EXPERT_TOKENS} without {names.ENGINE_STEPS}")
            m = np.full((L, E), np.nan)
            for (l, e), v in s.tokens[model].items():
                m[l, e] = v
            if np.isnan(m).any():
                missing = np.argwhere(np.isnan(m))[0]
                raise LoadReadError(INCONSISTENT_SERIES, f"pod {pod}: no counter for layer {missing[0]} expert "
                                    f"{missing[1]} (the exporter exports every (layer, expert) of a model)")
            cur[pod] = (s.start_time.get(model, 0.0), m, s.steps[model])
        if t > 0:
            prev_time = rounds[t - 1].time
            for pod, (start, m, st) in cur.items():
                old = prev.get(pod)
                if old is None:
                    if start and start > prev_time:
                        load[t - 1] += m
                        steps[t - 1] += st
                    continue
                restarted = (start and old[0] and start != old[0]) or np.any(m < old[1]) or st < old[2]
                if restarted:
                    load[t - 1] += m
                    steps[t - 1] += st
                else:
                    load[t - 1] += m - old[1]
                    steps[t - 1] += st - old[2]
        prev = cur
    times = np.array([r.time for r in rounds])
    return LoadTrace(load=load, bucket_steps=np.round(steps / max(1, pods_per_engine)).astype(np.int64),
                     bucket_seconds=float(np.median(np.diff(times))), model=model,
                     meta={"start_time": float(times[0]), "interpolated_fraction": 0.0})


def raw_samples(client: PrometheusClient, selector_expr: str, start: float, end: float,
                chunk_seconds: float = 3600.0) -> dict:
    """Every raw sample of ``selector_expr`` in ``(start, end]``, as one matrix body.

    Instant queries of range vectors (``x[<chunk>s]`` at the chunk's end) return raw samples with
    their scrape timestamps; long windows are split into chunks (left-open, right-closed, so no
    sample is returned twice) to stay within Prometheus' per-query sample limit."""
    series: dict[tuple, dict] = {}
    t = float(end)
    while t > start + 1e-9:
        width = min(chunk_seconds, t - start)
        body = client.query(f"{selector_expr}[{int(math.ceil(width * 1000))}ms]", time=t)
        for s in _result(body, selector_expr):
            key = tuple(sorted((s.get("metric") or {}).items()))
            entry = series.setdefault(key, {"metric": s.get("metric") or {}, "values": []})
            earlier = s.get("values") or []
            if entry["values"]:  # never the same sample twice at a chunk edge
                first = float(entry["values"][0][0])
                earlier = [v for v in earlier if float(v[0]) < first]
            entry["values"][:0] = earlier  # the earlier chunk goes first
        t -= width
    return {"status": "success", "data": {"resultType": "matrix", "result": list(series.values())}}


def _vector(body: Mapping[str, Any], what: str) -> list:
    data = body.get("data") or {}
    if data.get("result") == []:
        return []
    if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise LoadReadError(INCONSISTENT_SERIES, f"{what}: expected an instant-query vector")
    return data["result"]


def _labels(metric: Mapping[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))


def with_baselines(client: PrometheusClient, selector_expr: str, start: float, end: float,
                   chunk_seconds: float = 3600.0) -> dict:
    """:func:`raw_samples` in ``(start, end]`` plus, per series, its last raw sample at or before
    ``start`` (the baseline the first increment is taken from), as one matrix body.

    The baseline comes from two instant queries at ``start`` (``x`` and ``timestamp(x)``: the value
    and the scrape time of the newest sample within Prometheus' lookback, 5 min by default) instead
    of 5 minutes of raw samples, which would be most of the data on short windows."""
    body = raw_samples(client, selector_expr, start, end, chunk_seconds)
    values = {_labels(r.get("metric") or {}): r for r in _vector(client.query(selector_expr, time=start), selector_expr)}
    stamps = {_labels(r.get("metric") or {}): r for r in
              _vector(client.query(f"timestamp({selector_expr})", time=start), f"timestamp({selector_expr})")}
    series = {_labels(s.get("metric") or {}): s for s in body["data"]["result"]}
    for key, r in values.items():
        if key not in stamps:
            continue
        try:
            point = [float(stamps[key]["value"][1]), r["value"][1]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise LoadReadError(INCONSISTENT_SERIES, f"malformed baseline sample of {r.get('metric')}") from None
        entry = series.get(key)
        if entry is None:
            series[key] = {"metric": r.get("metric") or {}, "values": [point]}
        elif not entry["values"] or float(entry["values"][0][0]) > point[0] + 1e-6:
            entry["values"].insert(0, point)
    return {"status": "success", "data": {"resultType": "matrix", "result": list(series.values())}}


def read_load_trace(
    *,
    namespace: str,
    name: str,
    window_seconds: float,
    bucket_seconds: float,
    prometheus_url: str | None = None,
    pods: list[dict] | None = None,
    scraper: PodScraper | None = None,
    model: str | None = None,
    num_layers: int | None = None,
    num_experts: int | None = None,
    pods_per_engine: int = 1,
    now: float | None = None,
    timeout: float = 10.0,
    client: PrometheusClient | None = None,
    max_interpolated_fraction: float = DEFAULT_MAX_INTERPOLATED_FRACTION,
) -> LoadTrace:
    """The load of MoEInference ``namespace/name`` over the last ``window_seconds``.

    With ``prometheus_url`` (or ``client``): T = ``window_seconds // bucket_seconds`` buckets ending
    at the last multiple of ``bucket_seconds`` before ``now``. Without: scrape ``pods`` (pod dicts
    as listed from the API, filtered by label ``eplb.ai/name=<name>``) once with ``scraper`` and
    return the buckets between its rounds within ``window_seconds``.
    Blocking (HTTP); call it with ``asyncio.to_thread`` from async code.

    From Prometheus, load between missed scrapes is spread over the buckets by time;
    ``trace.meta["interpolated_fraction"]`` (0..1) is its share of the window's load, and a window
    where it exceeds ``max_interpolated_fraction`` is refused (:func:`trace_from_raw_counters`).

    Raises:
        LoadReadError: reason PrometheusUnavailable, PrometheusQueryFailed, ScrapeFailed,
            NoTargets, NoData, InsufficientData, ScrapeGaps or InconsistentSeries.
    """
    what = f" for {namespace}/{name}"
    if prometheus_url or client is not None:
        client = client or PrometheusClient(prometheus_url, timeout=timeout)
        now = time.time() if now is None else now
        grid = grid_for(now, window_seconds, bucket_seconds)
        sel = selector(namespace, name, model)
        expert_body = with_baselines(client, f"{names.EXPERT_TOKENS}{sel}", grid[0], grid[-1])
        steps_body = with_baselines(client, f"{names.ENGINE_STEPS}{sel}", grid[0], grid[-1])
        start_body = with_baselines(client, f"{names.EXPORTER_START_TIME}{sel}", grid[0], grid[-1])
        return trace_from_raw_counters(expert_body, steps_body, grid, pods_per_engine=pods_per_engine,
                                       num_layers=num_layers, num_experts=num_experts, model=model, what=what,
                                       start_body=start_body, max_interpolated_fraction=max_interpolated_fraction)
    if scraper is None:
        raise LoadReadError(INSUFFICIENT_DATA, "no spec.monitoring.prometheusUrl and no pod scraper; "
                            "set a Prometheus URL or keep a PodScraper per MoEInference")
    from moe_eplb.metrics.scrape import targets_from_pods

    targets: list[Target] = targets_from_pods(pods or [], name)
    scraper.scrape(targets)
    horizon = scraper.rounds[-1].time - window_seconds
    rounds = [r for r in scraper.rounds if r.time >= horizon - 1e-9]
    return trace_from_rounds(rounds, model=model, pods_per_engine=pods_per_engine,
                             num_layers=num_layers, num_experts=num_experts)
