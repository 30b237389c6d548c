"""Read one MoEInference's load trace: from Prometheus, or by scraping its pods (the I/O side).

* **Prometheus** (``prometheus_url`` set): instant queries of range vectors return the *raw
  samples* of ``moe_eplb_expert_tokens_total``, ``moe_eplb_engine_steps_total`` and
  ``moe_eplb_exporter_start_time_seconds`` selected by ``namespace`` and ``moeinference`` (the
  label the PodMonitor copies from ``eplb.ai/name``), over the window, plus each series' last
  sample before the window (its baseline: instant queries of ``x`` and ``timestamp(x)``). Buckets
  are aligned to multiples of ``bucket_seconds``. :func:`moe_eplb.metrics.assemble.trace_from_raw_counters`
  turns them into the trace (restarts, pods joining and leaving, scrape gaps spread by time and
  bounded).
* **Direct scraping** (no URL): a :class:`~moe_eplb.metrics.scrape.PodScraper` the caller keeps
  across calls scrapes every pod once per call (the operator also scrapes twice per bucket between
  reads); its rounds are read as the raw samples Prometheus would hold
  (:func:`~moe_eplb.metrics.assemble.counters_from_rounds`) by the same assembly, on the same grid.

Both sources also read the telemetry the calibration fits on (step durations, rank tokens,
rearrangement durations, the running config, KV-cache series;
:mod:`moe_eplb.metrics.telemetry_keys`); a missing source leaves its trace key absent.

Every problem is a :class:`~moe_eplb.metrics.errors.LoadReadError` with a status reason; nothing
here returns a partial matrix.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace

import numpy as np

from moe_eplb.contracts import metric_names
from moe_eplb.contracts.trace_format import TELEMETRY_KEYS
from moe_eplb.eplb.workload.trace import LoadTrace, TraceError
from moe_eplb.metrics import edges
from moe_eplb.metrics.assemble import (
    DEFAULT_MAX_INTERPOLATED_FRACTION,
    counters_from_rounds,
    forwarding_pods,
    group_pods_from_rounds,
    trace_from_raw_counters,
)
from moe_eplb.metrics.errors import (
    INCOMPLETE_GROUP,
    INCONSISTENT_SERIES,
    INSUFFICIENT_DATA,
    PROMETHEUS_QUERY_FAILED,
    LoadReadError,
)
from moe_eplb.metrics.grid import grid_for
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.scrape import PodScraper, Round, targets_from_pods
from moe_eplb.metrics.series import Series, merge, parse_matrix, parse_vector
from moe_eplb.metrics.telemetry_keys import (
    NO_MODEL_LABEL,
    SAMPLE_NAMES,
    TelemetrySeries,
    series_from_rounds,
    telemetry_from_series,
)


def _q(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def selector(namespace: str, name: str, model: str | None = None) -> str:
    """PromQL label matchers for one MoEInference (and optionally one model)."""
    parts = [f'namespace="{_q(namespace)}"', f'{metric_names.MOEINFERENCE_LABEL}="{_q(name)}"']
    if model:
        parts.append(f'{metric_names.LABEL_MODEL}="{_q(model)}"')
    return "{" + ", ".join(parts) + "}"


#: Raw samples one answer may hold (series x samples per series). A decoded sample costs ~150 bytes
#: of Python objects, and a whole answer is decoded at once: a DeepSeek-V3 replica group over 4
#: pods (59 392 expert-token series) scraped every 15 s has 7.2 million samples in 30 min, ~1.1 GB
#: decoded in one answer -- more than the chart's 512 Mi operator limit. Reading the family in
#: groups of layers keeps one answer to ~75 MB (:func:`layer_groups`).
MAX_SAMPLES_PER_ANSWER = 500_000


def layer_groups(client: PrometheusClient, selector_expr: str, start: float, end: float,
                 max_samples: int = MAX_SAMPLES_PER_ANSWER) -> list[str] | None:
    """Label matchers that split the series of ``selector_expr`` into answers of at most about
    ``max_samples`` raw samples in ``(start, end]``, by ``layer`` (whole layers, in order; series
    without a layer label in a group of their own), or None when one answer holds them all.

    One small aggregate query sizes it (the raw samples per layer in the window, :func:`pack_layers`
    groups them). Groups are disjoint, so their answers are simply concatenated."""
    width = max(float(end) - float(start), 1e-3)
    label = metric_names.LABEL_LAYER
    expr = f"sum by ({label}) (count_over_time({selector_expr}[{int(math.ceil(width * 1000))}ms]))"
    per_layer = {s.labels.get(label, ""): float(s.vs[0]) if s.vs.size else 0.0
                 for s in parse_vector(client.query(expr, time=end), selector_expr)}
    return _layer_matchers(per_layer, max_samples)


def _layer_matchers(per_layer: Mapping[str, float], max_samples: int) -> list[str] | None:
    groups = pack_layers(per_layer, max_samples)
    if groups is None:
        return None
    label = metric_names.LABEL_LAYER
    matchers = [f'{label}=~"{"|".join(_re_escape(x) for x in g)}"' for g in groups]
    if "" in per_layer:
        matchers.append(f'{label}=""')
    return matchers


def pack_layers(samples: Mapping[str, float], max_samples: int = MAX_SAMPLES_PER_ANSWER) -> list[list[str]] | None:
    """Layers (label values; ``""`` = no layer label, left out) packed in order into groups of at
    most ``max_samples`` raw samples each (a layer larger than that is a group alone), from the
    samples each layer holds; None when all of them fit in one answer."""
    if sum(samples.values()) <= max_samples:
        return None
    out: list[list[str]] = []
    group: list[str] = []
    size = 0.0
    for layer in sorted((k for k in samples if k), key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k)):
        if group and size + samples[layer] > max_samples:
            out.append(group)
            group, size = [], 0.0
        group.append(layer)
        size += samples[layer]
    if group:
        out.append(group)
    return out


def _re_escape(value: str) -> str:
    return _q(re.escape(value))


def pod_matcher(pods: Iterable[str], negate: bool = False) -> str:
    """``pod=~"a|b"`` (``pod!~"a|b"`` with ``negate``) for exactly these pod names."""
    return f'{edges.POD}{"!~" if negate else "=~"}"{"|".join(_re_escape(p) for p in sorted(pods))}"'


#: Points per series one range query may return (Prometheus refuses more than 11 000).
MAX_POINTS_PER_SERIES = 10_000


def ranged(client: PrometheusClient, expr: str, grid: np.ndarray, max_points: int = MAX_POINTS_PER_SERIES) -> list[Series]:
    """``expr`` evaluated at every edge of ``grid`` (a range query with ``step`` = the bucket), in
    time chunks of at most ``max_points`` edges per series, joined series by series."""
    step = float(grid[1] - grid[0])
    parts = []
    for a in range(0, grid.shape[0], max_points):
        b = min(a + max_points, grid.shape[0]) - 1
        parts.append(parse_matrix(client.query_range(expr, float(grid[a]), float(grid[b]), step), expr))
    return parts[0] if len(parts) == 1 else merge(s for part in parts for s in part)


def read_expert_tokens(client: PrometheusClient, selector_expr: str, grid: np.ndarray, engine_steps: list[Series],
                       start_times: list[Series], max_samples: int = MAX_SAMPLES_PER_ANSWER,
                       at_edges: bool = True, max_points: int = MAX_POINTS_PER_SERIES,
                       forwarding: frozenset = frozenset(),
                       ) -> tuple[list[Series], edges.EdgeLoad | None, str]:
    """The expert-token family of ``selector_expr`` (``{...}`` matchers) over ``grid``: the
    regular pods' counters summed at the bucket edges by Prometheus, the other pods' raw samples
    with baselines (:mod:`moe_eplb.metrics.edges`). Returns the raw series, the edge load (None:
    every pod read raw) and how it was read (``"edges"``, or ``"raw: <why>"``).

    ``engine_steps`` and ``start_times`` are the raw step counters and exporter start times of the
    same window (they tell regular pods apart and check the range queries). ``forwarding``: pod keys
    of a replica group's workers, which export no expert series (their leader's counter holds them;
    :func:`~moe_eplb.metrics.assemble.forwarding_pods`): left out of the edge sums."""
    metric = f"{metric_names.EXPERT_TOKENS}{selector_expr}"
    g0, g1 = float(grid[0]), float(grid[-1])

    def everything(why: str) -> tuple[list[Series], None, str]:
        return with_baselines(client, metric, g0, g1, max_samples=max_samples), None, f"raw: {why}"

    if not at_edges:
        return everything("edge sums off")
    verdict = edges.irregular([s for s in engine_steps if s.pod not in forwarding], start_times, grid)
    pods = frozenset(name for name, why in verdict.items() if why is None)
    if not pods:
        name, why = next(iter(sorted(verdict.items())), ("", "no step counter"))
        return everything(f"no pod is regular over the window (pod {name}: {why})")
    reach = edges.edge_reach(engine_steps, pods, grid)
    try:
        steps = with_matcher(f'{metric_names.ENGINE_STEPS}{selector_expr}', pod_matcher(pods))
        step_sums = ranged(client, f"sum({last_within(steps, reach)})", grid, max_points)
        why = edges.check_steps(pods, engine_steps, start_times, step_sums, grid)
        got = why or edge_family(client, metric, metric_names.LABEL_EXPERT, pods, grid, max_samples, max_points,
                                 reach=reach)
    except LoadReadError as exc:
        if exc.reason != PROMETHEUS_QUERY_FAILED:  # unreachable: the raw read would fail alike
            raise
        got = f"a range query was refused ({exc.message})"
    if isinstance(got, str):
        return everything(got)
    rest = with_baselines(client, with_matcher(metric, pod_matcher(pods, negate=True)), g0, g1, max_samples=max_samples)
    return rest, edges.EdgeLoad(*got, pods, reach), "edges"


def read_rank_tokens(client: PrometheusClient, selector_expr: str, grid: np.ndarray, pods: frozenset[str],
                     max_samples: int = MAX_SAMPLES_PER_ANSWER, reach: float = edges.LOOKBACK_SECONDS,
                     ) -> tuple[list[Series], list[Series], str]:
    """``moe_eplb_rank_tokens_total`` of ``selector_expr`` over ``grid``: the regular ``pods``
    (already checked on the expert family) summed at the edges (``reach``: the expert family's
    :attr:`~moe_eplb.metrics.edges.EdgeLoad.reach`), the others raw; or all raw when the sums cannot
    stand for them. Returns the raw series, the sums and how it was read."""
    metric = f"{metric_names.RANK_TOKENS}{selector_expr}"
    try:
        got = edge_family(client, metric, metric_names.LABEL_RANK, pods, grid, max_samples, reach=reach)
    except LoadReadError as exc:
        got = f"a range query failed ({exc.message})"
    if isinstance(got, str):
        return with_baselines(client, metric, grid[0], grid[-1], max_samples=max_samples), [], f"raw: {got}"
    rest = with_baselines(client, with_matcher(metric, pod_matcher(pods, negate=True)), grid[0], grid[-1],
                          max_samples=max_samples)
    return rest, got[0], "edges"


def edge_family(client: PrometheusClient, metric: str, per_series: str, pods: frozenset[str], grid: np.ndarray,
                max_samples: int = MAX_SAMPLES_PER_ANSWER, max_points: int = MAX_POINTS_PER_SERIES,
                reach: float = edges.LOOKBACK_SECONDS) -> tuple[list[Series], list[Series]] | str:
    """A counter family (``metric{...}``) of the regular ``pods`` (whose step counters passed
    :func:`~moe_eplb.metrics.edges.check_steps`) summed at the bucket edges by
    ``(model_name, layer, <per_series>)``, each series' last sample within ``reach`` of the edge
    (:func:`~moe_eplb.metrics.edges.edge_reach`), and its series counts per pod and layer; or why not
    (:func:`~moe_eplb.metrics.edges.check_counts`, :func:`~moe_eplb.metrics.edges.check_sums`)."""
    regular = with_matcher(metric, pod_matcher(pods))
    counts = ranged(client, f"count without ({per_series}) ({last_within(regular, reach)})", grid, max_points)
    why = edges.check_counts(pods, counts, grid, family=per_series)
    if why:
        return why
    by = ", ".join((metric_names.LABEL_MODEL, metric_names.LABEL_LAYER, per_series))
    groups = _layer_matchers(edges.points_per_layer(counts, grid.shape[0]), max_samples) or [None]
    sums = [s for g in groups for s in ranged(
        client, f"sum by ({by}) ({last_within(with_matcher(regular, g) if g else regular, reach)})", grid, max_points)]
    return edges.check_sums(sums, grid) or (sums, counts)


def last_within(selector_expr: str, reach: float) -> str:
    """``last_over_time(<selector_expr>[<reach>ms])``: at each evaluation time, every series' last
    real sample within ``reach`` seconds (a range selector skips the staleness markers a failed
    scrape writes, which hide the series from an instant vector)."""
    return f"last_over_time({selector_expr}[{max(1, int(math.ceil(reach * 1000)))}ms])"


def with_matcher(selector_expr: str, matcher: str) -> str:
    """``metric{a="b"}`` + ``c=~"d"`` -> ``metric{a="b", c=~"d"}`` (``metric`` -> ``metric{c=~"d"}``)."""
    if selector_expr.endswith("}"):
        head = selector_expr[:-1].rstrip()
        return f"{head}{'' if head.endswith('{') else ', '}{matcher}}}"
    return f"{selector_expr}{{{matcher}}}"


def raw_samples(client: PrometheusClient, selector_expr: str, start: float, end: float,
                chunk_seconds: float = 3600.0) -> list[Series]:
    """Every raw sample of ``selector_expr`` in ``(start, end]``, one :class:`Series` per series.

    Instant queries of range vectors (``x[<chunk>s]`` at the chunk's end) return raw samples with
    their scrape timestamps; long windows are split into chunks (left-open, right-closed, so no
    sample is returned twice) to stay within Prometheus' per-query sample limit."""
    parts: list[Series] = []
    t = float(end)
    while t > start + 1e-9:
        width = min(chunk_seconds, t - start)
        body = client.query(f"{selector_expr}[{int(math.ceil(width * 1000))}ms]", time=t)
        parts.append(parse_matrix(body, selector_expr))
        t -= width
    if len(parts) == 1:  # one chunk: every series once
        return [_without_name(s) for s in parts[0]]
    return merge(_without_name(s) for chunk in parts for s in chunk)


def _without_name(s: Series) -> Series:
    if "__name__" not in s.labels:
        return s
    labels = dict(s.labels)
    del labels["__name__"]
    return Series(labels, s.ts, s.vs)


def with_baselines(client: PrometheusClient, selector_expr: str, start: float, end: float,
                   chunk_seconds: float = 3600.0, max_samples: int | None = MAX_SAMPLES_PER_ANSWER) -> list[Series]:
    """:func:`raw_samples` in ``(start, end]`` plus, per series, its last raw sample at or before
    ``start`` (the baseline the first increment is taken from).

    The baseline comes from two instant queries at ``start`` (``x`` and ``timestamp(x)``: the value
    and the scrape time of the newest sample within Prometheus' lookback, 5 min by default) instead
    of 5 minutes of raw samples, which would be most of the data on short windows. A family with
    more than ~``max_samples`` samples in the window is read in groups of layers
    (:func:`layer_groups`; None: in one answer)."""
    groups = layer_groups(client, selector_expr, start, end, max_samples) if max_samples else None
    if groups:
        return [s for g in groups for s in with_baselines(client, with_matcher(selector_expr, g), start, end,
                                                          chunk_seconds, max_samples=None)]
    raw = raw_samples(client, selector_expr, start, end, chunk_seconds)
    values = {pod_key_all(s): s for s in parse_vector(client.query(selector_expr, time=start), selector_expr)}
    stamps = {pod_key_all(s): s for s in parse_vector(client.query(f"timestamp({selector_expr})", time=start),
                                                       f"timestamp({selector_expr})")}
    if set(values) != set(stamps):  # the same instant, the same series: answers that disagree are partial
        odd = dict(sorted(set(values) ^ set(stamps))[0])
        group = odd.get(metric_names.GROUP_LABEL)
        where = f"replica group {group}: pod {odd.get('pod')}" if group is not None else f"pod {odd.get('pod')}"
        raise LoadReadError(INCOMPLETE_GROUP if group is not None else INCONSISTENT_SERIES,
                            f"{selector_expr}: {where} is missing from one of the baseline answers at t={start:.3f} "
                            f"({len(set(values) ^ set(stamps))} series differ, e.g. {odd}); a partial answer, refused")
    out = []
    for s in raw:  # the baseline first: it lies at or before the window, the raw samples inside it
        key = pod_key_all(s)
        v = values.pop(key, None)
        if v is not None and v.vs.size and stamps[key].vs.size and (not s.ts.size or stamps[key].vs[0] < s.ts[0]):
            s = Series(s.labels, np.concatenate([stamps[key].vs[:1], s.ts]), np.concatenate([v.vs[:1], s.vs]))
        out.append(s)
    for key, v in values.items():  # a series with a baseline but no sample in the window (it left)
        if v.vs.size and stamps[key].vs.size:
            out.append(Series(_without_name(v).labels, stamps[key].vs[:1], v.vs[:1]))
    return out


def pod_key_all(s: Series) -> tuple:
    """Every label but ``__name__`` (the identity of one series across queries)."""
    labels = dict(s.labels)
    labels.pop("__name__", None)
    return tuple(sorted(labels.items()))


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
    budget: float | None = 30.0,
    client: PrometheusClient | None = None,
    max_interpolated_fraction: float = DEFAULT_MAX_INTERPOLATED_FRACTION,
    max_samples_per_answer: int = MAX_SAMPLES_PER_ANSWER,
    at_edges: bool = True,
    only_pods: frozenset[str] | None = None,
    telemetry: bool = True,
) -> LoadTrace:
    """The load of MoEInference ``namespace/name`` over the last ``window_seconds``.

    ``only_pods``: the load of these pods alone (one replica, or one LeaderWorkerSet group: the
    per-replica reads of :meth:`moe_eplb.controller.observe.LoadObserver.read_replica_traces`); from the
    pods directly, the rounds already scraped are read (no new scrape). ``telemetry=False``: the load
    and steps only (no telemetry series read; the trace's ``telemetry`` is None) -- for a caller that
    tunes with a cost model calibrated already, as the per-replica reads do.

    T = ``window_seconds // bucket_seconds`` buckets ending at the last multiple of
    ``bucket_seconds`` before ``now``, from Prometheus with ``prometheus_url`` (or ``client``).
    Without: scrape ``pods`` (pod dicts as listed from the API, filtered by label
    ``eplb.ai/name=<name>``) once more with ``scraper`` and read its rounds (``now``: this round) as
    the raw samples Prometheus would hold (:func:`~moe_eplb.metrics.assemble.counters_from_rounds`):
    the same buckets and LeaderWorkerSet groups joined; the caller scrapes more often than once per
    bucket (the operator: twice) so that a bucket holds a round. The rounds are the operator's own:
    one that came late (a loaded operator) puts the load since the previous one in its bucket, with
    no scrape-gap rule (``spread_gaps=False``), as a late round did before.
    Blocking (HTTP); call it with ``asyncio.to_thread`` from async code.

    From Prometheus, load between missed scrapes is spread over the buckets by time;
    ``trace.meta["interpolated_fraction"]`` (0..1) is its share of the window's load, and a window
    where it exceeds ``max_interpolated_fraction`` is refused (:func:`trace_from_raw_counters`).
    Transient Prometheus errors are retried within ``budget`` seconds (:class:`PrometheusClient`).
    A family with more than ~``max_samples_per_answer`` raw samples in the window is read in groups
    of layers (:func:`layer_groups`), which bounds the memory one answer needs. The expert counters
    of pods that are regular over the window are summed at the bucket edges by Prometheus instead
    (``at_edges``; :func:`read_expert_tokens`, :mod:`moe_eplb.metrics.edges`): the same trace from
    ~15x fewer numbers; ``trace.meta["read"]`` says which way it went and why.

    Raises:
        LoadReadError: reason PrometheusUnavailable, PrometheusQueryFailed, ScrapeFailed,
            NoTargets, NoData, InsufficientData, ScrapeGaps or InconsistentSeries.
    """
    what = f" for {namespace}/{name}"
    if prometheus_url or client is not None:
        client = client or PrometheusClient(prometheus_url, timeout=timeout, budget=budget)
        now = time.time() if now is None else now
        grid = grid_for(now, window_seconds, bucket_seconds)
        sel = selector(namespace, name, model)
        any_model = selector(namespace, name)
        if only_pods is not None:
            sel, any_model = with_matcher(sel, pod_matcher(only_pods)), with_matcher(any_model, pod_matcher(only_pods))

        def read(metric: str, sel: str = sel) -> list[Series]:
            return with_baselines(client, f"{metric}{sel}", grid[0], grid[-1], max_samples=max_samples_per_answer)

        def read_any_model(metric: str) -> list[Series]:  # series without a model_name label
            return read(metric, any_model)

        starts = read(metric_names.EXPORTER_START_TIME)
        steps = read(metric_names.ENGINE_STEPS)
        group_pods = read(metric_names.EXPORTER_GROUP_PODS)
        tokens, edge, how = read_expert_tokens(client, sel, grid, steps, starts, max_samples_per_answer, at_edges,
                                               forwarding=forwarding_pods(group_pods))
        trace = trace_from_raw_counters(tokens, steps, grid, start_times=starts, group_pods=group_pods,
                                        edge_sums=edge.sums if edge else (), edge_counts=edge.counts if edge else (),
                                        pods_per_engine=pods_per_engine, num_layers=num_layers,
                                        num_experts=num_experts, model=model, what=what,
                                        max_interpolated_fraction=max_interpolated_fraction)
        trace.meta["read"] = how
        if not telemetry:
            return trace
        src = read_telemetry_series(read, skip=("rank_tokens",) if edge else (), read_any_model=read_any_model)
        if edge:  # the rank tokens of the same regular pods, summed at the edges too
            try:
                src.rank_tokens, src.rank_edge_sums, trace.meta["read_rank_tokens"] = read_rank_tokens(
                    client, sel, grid, edge.pods, max_samples_per_answer, reach=edge.reach)
            except LoadReadError:
                pass  # as for any telemetry source: its key is left out
        return with_telemetry(trace, src, grid, pods_per_engine, starts)
    if scraper is None:
        raise LoadReadError(INSUFFICIENT_DATA, "no spec.monitoring.prometheusUrl and no pod scraper; "
                            "set a Prometheus URL or keep a PodScraper per MoEInference")
    if only_pods is None:
        scraper.scrape(targets_from_pods(pods or [], name))
    if not scraper.rounds:
        raise LoadReadError(INSUFFICIENT_DATA, f"no scrape of the pods yet{what}")
    grid = grid_for(scraper.rounds[-1].time, window_seconds, bucket_seconds)
    rounds = scraper.since(grid[0])
    if only_pods is not None:
        rounds = [Round(r.time, {p: v for p, v in r.pods.items() if p in only_pods},
                        {p: v for p, v in r.labels.items() if p in only_pods}) for r in rounds]
    return trace_from_scraped_rounds(rounds, grid, pods_per_engine=pods_per_engine,
                                     num_layers=num_layers, num_experts=num_experts, model=model, what=what,
                                     max_interpolated_fraction=max_interpolated_fraction, telemetry=telemetry)


def trace_from_scraped_rounds(rounds: list[Round], grid: np.ndarray, *, pods_per_engine: int = 1,
                              num_layers: int | None = None, num_experts: int | None = None,
                              model: str | None = None, what: str = "",
                              max_interpolated_fraction: float = DEFAULT_MAX_INTERPOLATED_FRACTION,
                              telemetry: bool = True) -> LoadTrace:
    """The direct read's pure part (what :func:`read_load_trace` does with its scraper's rounds):
    ``rounds`` (time order; the last one at or before ``grid[0]`` is the baseline) read as the raw
    samples Prometheus would hold (:func:`~moe_eplb.metrics.assemble.counters_from_rounds`) on the
    bucket grid ``grid``, with the Prometheus read's rules for restarts, pods joining and leaving,
    LeaderWorkerSet groups and telemetry, and no scrape-gap rule (a late round of the operator's own
    puts the load since the previous one in its bucket)."""
    tokens, steps, starts = counters_from_rounds(rounds)
    trace = trace_from_raw_counters(tokens, steps, grid, start_times=starts, group_pods=group_pods_from_rounds(rounds),
                                    pods_per_engine=pods_per_engine,
                                    num_layers=num_layers, num_experts=num_experts, model=model, what=what,
                                    max_interpolated_fraction=max_interpolated_fraction, spread_gaps=False)
    spacing = np.diff([r.time for r in rounds])
    trace.meta["read"] = (f"scraped the pods directly: {len(rounds)} round(s)"
                          + (f", at most {spacing.max():.1f}s apart" if spacing.size else ""))
    if not telemetry:
        return trace
    src, tel_starts = series_from_rounds(rounds)
    return with_telemetry(trace, src, grid, pods_per_engine, tel_starts)


def read_telemetry_series(read, skip: tuple[str, ...] = (), read_any_model=None) -> TelemetrySeries:
    """Every telemetry source (but ``skip``) through ``read(metric) -> [Series]`` (raw samples with
    baselines); a source whose query fails is left empty (its trace key absent). Sources vLLM
    exports without a ``model_name`` label (:data:`NO_MODEL_LABEL`) go through ``read_any_model``
    when given."""
    src = TelemetrySeries()
    for attr, metric in SAMPLE_NAMES.items():
        if attr in skip:
            continue
        try:
            setattr(src, attr, (read_any_model or read)(metric) if attr in NO_MODEL_LABEL else read(metric))
        except LoadReadError:
            pass
    return src


def with_telemetry(trace: LoadTrace, src: TelemetrySeries, grid, pods_per_engine: int,
                   starts: list[Series]) -> LoadTrace:
    """``trace`` with the telemetry its sources give (:func:`moe_eplb.metrics.telemetry_keys.telemetry_from_series`);
    ``trace.meta["telemetry_skipped"]`` says why each missing key is missing."""
    got = telemetry_from_series(src, grid, trace.bucket_steps, num_layers=trace.num_layers, model=trace.model,
                                pods_per_engine=pods_per_engine, start_times=starts)
    skipped = dict(got.skipped)
    tel = got.telemetry
    while True:
        try:
            return LoadTrace(load=trace.load, bucket_steps=trace.bucket_steps, bucket_seconds=trace.bucket_seconds,
                             top_k=trace.top_k, model=trace.model, meta={**trace.meta, "telemetry_skipped": skipped},
                             telemetry=tel)
        except TraceError as exc:  # an inconsistent key is left out; it never spoils the load or the others
            key = str(exc).split(":", 1)[0].split(".", 1)[0].split("[", 1)[0]
            skipped[key] = str(exc)
            tel = replace(tel, **{key: None}) if key in TELEMETRY_KEYS and tel is not None else None
