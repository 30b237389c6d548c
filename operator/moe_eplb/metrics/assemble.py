"""Raw counter samples -> one MoEInference's load trace (pure, no I/O).

The one route from Prometheus to a trace: :func:`trace_from_raw_counters` takes the raw samples
of the exporter's counters (Prometheus answers to instant queries of range vectors, with one
baseline sample per series at or before the window; see :mod:`moe_eplb.metrics.reader`), parses
them once (:mod:`moe_eplb.metrics.series`) and builds the :class:`~moe_eplb.eplb.workload.trace.LoadTrace`
directly, in named phases:

1. :func:`select_model` -- the model to read (a DeepSeek MTP drafter registers its own);
   :func:`check_pods` -- every pod reports both counters and every layer, and every pod of a
   multi-node replica group (LeaderWorkerSet group: the ``replica_group``, ``group_worker``,
   ``group_size`` labels the PodMonitor copies) reports: a group's load is the sum over its pods, so
   a missing pod is refused (``IncompleteGroup``) rather than read as a lighter load;
2. :func:`step_increments` -- per pod, the engine-step counter's exact increments per bucket, which
   also fix each pod's scrape-gap rule;
3. :func:`family_increments` -- the same for every series of a labelled counter family (expert
   tokens), grouped by pod and summed over pods;
4. :func:`check_gaps` -- the share of load that fell in scrape gaps (spread by time), refused above
   the threshold;
5. :func:`load_matrix` -- ``[T, L, E]`` with shape and completeness checks.

The direct-scrape source (the operator scraping the pods itself, no Prometheus) takes the same
route: :func:`counters_from_rounds` turns its ``/metrics`` rounds into the raw samples Prometheus
would hold (:func:`moe_eplb.metrics.reader.trace_from_scraped_rounds`). Buckets: ``grid`` [T+1]
edges (unix s); bucket k holds samples with ``grid[k] < t <= grid[k+1]``
(:mod:`moe_eplb.metrics.increments`).

Engine steps: a pod's step counter counts its engine's steps; an engine spanning
``pods_per_engine`` pods (``spec.parallelism.nodes``) is counted once, and independent engines
(``spec.replicas``) add up, so ``load / steps`` is the load of one engine step. The expert tokens
of an engine spanning pods are the sum over its pods (each pod counts what its own ranks routed), so
the tuner sees one EP group of ``tensor x data`` ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from moe_eplb.contracts import metric_names
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb.metrics.errors import (
    INCOMPLETE_GROUP,
    INCONSISTENT_SERIES,
    INSUFFICIENT_DATA,
    NO_DATA,
    SCRAPE_GAPS,
    LoadReadError,
)
from moe_eplb.metrics.grid import edge_matrix, max_gap_for, starts_at
from moe_eplb.metrics.increments import Increments, counter_increments
from moe_eplb.metrics.scrape import PodSample, Round, sample_time
from moe_eplb.metrics.series import Series, pod_name

#: Refuse a window with more than 10 % of its load in scrape gaps (spread by time, not measured).
DEFAULT_MAX_INTERPOLATED_FRACTION = 0.1


def round_steps(steps: np.ndarray) -> np.ndarray:
    """Whole engine steps per bucket ``[T]`` from fractional ones (spread gaps, ``pods_per_engine``)
    by rounding the running total: the total is kept (to the nearest step), each bucket is off by
    less than one step, and whole numbers come back unchanged."""
    return np.diff(np.round(np.cumsum(steps)), prepend=0.0)


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


# --------------------------------------------------------------------------------------------------
# phases
# --------------------------------------------------------------------------------------------------


@dataclass
class Counters:
    """The exporter's counter families of one read, parsed (phase 0) and filtered to one model."""

    expert_tokens: list[Series]
    engine_steps: list[Series]
    start_times: dict[tuple, Series] = field(default_factory=dict)  # pod -> exporter start time samples
    #: the regular pods' expert counters summed at the bucket edges, and their series counts per
    #: pod and layer (:class:`moe_eplb.metrics.edges.EdgeLoad`); empty when every pod is read raw
    edge_sums: list[Series] = field(default_factory=list)
    edge_counts: list[Series] = field(default_factory=list)
    #: pods of a replica group whose expert counts are in their group leader's counter
    #: (``moe_eplb_exporter_group_pods`` 0: they export no expert series; :mod:`moe_eplb.exporter.group`)
    forwarding: frozenset = frozenset()
    #: pod -> its newest ``moe_eplb_exporter_group_pods`` (a group's leader: the pods its counter holds)
    group_counts: dict = field(default_factory=dict)

    def starts_at(self, pod: tuple, ts: np.ndarray) -> np.ndarray | None:
        """The pod's exporter start time at each sample time (same scrape, same timestamp)."""
        s = self.start_times.get(pod)
        return None if s is None else starts_at(s, ts)


def _shapes_of(series: list[Series]) -> dict[str, tuple[int, int]]:
    shapes: dict[str, list[int]] = {}
    for s in series:
        try:
            l, e = int(s.label(metric_names.LABEL_LAYER, "-1")), int(s.label(metric_names.LABEL_EXPERT, "-1"))
        except ValueError:
            continue
        cur = shapes.setdefault(s.label(metric_names.LABEL_MODEL, "") or "", [0, 0])
        cur[0], cur[1] = max(cur[0], l + 1), max(cur[1], e + 1)
    return {k: (v[0], v[1]) for k, v in shapes.items()}


def select_model(c: Counters, model: str | None, num_layers: int | None, num_experts: int | None,
                 what: str) -> tuple[Counters, str | None]:
    """Phase 1: keep one model's series (given, the only one, or the one with the expected shape)."""
    tokens = c.expert_tokens + c.edge_sums
    if not tokens and not c.engine_steps:
        raise LoadReadError(NO_DATA, f"no {metric_names.PREFIX}* series{what}; check that the pods run the "
                            "exporter (VLLM_PLUGINS=moe_eplb_exporter, EPLB enabled) and that Prometheus "
                            "scrapes them (PodMonitor)")
    if not tokens and c.forwarding:
        _check_forwarding(c, {}, what)
    if not tokens or not c.engine_steps:
        missing = metric_names.EXPERT_TOKENS if not tokens else metric_names.ENGINE_STEPS
        raise LoadReadError(INCONSISTENT_SERIES, f"no {missing} series{what} while the other counter has some")
    if model is None and len({s.label(metric_names.LABEL_MODEL) for s in tokens}) > 1:
        shapes = _shapes_of(tokens)
        if len(shapes) > 1:
            model = pick_model(shapes, num_layers, num_experts, what)
    if model is not None:
        def keep(s: Series) -> bool:
            return s.label(metric_names.LABEL_MODEL, model) == model

        c = Counters([s for s in c.expert_tokens if keep(s)], [s for s in c.engine_steps if keep(s)],
                     {p: s for p, s in c.start_times.items() if keep(s)},
                     [s for s in c.edge_sums if keep(s)], [s for s in c.edge_counts if keep(s)], c.forwarding,
                     c.group_counts)
        if not (c.expert_tokens or c.edge_sums) or not c.engine_steps:
            raise LoadReadError(NO_DATA, f"no series for model {model!r}{what}")
    else:
        models = {s.label(metric_names.LABEL_MODEL) for s in tokens + c.engine_steps} - {None}
        model = models.pop() if len(models) == 1 else None
    return c, model


def _group_of(labels: Mapping[str, str]) -> tuple[tuple, int, int] | None:
    """``(group identity, worker index, group size)`` of a pod of a multi-node replica group."""
    group = labels.get(metric_names.GROUP_LABEL)
    if group is None:
        return None
    try:
        worker, size = int(labels.get(metric_names.GROUP_WORKER_LABEL, "")), int(labels.get(metric_names.GROUP_SIZE_LABEL, ""))
    except ValueError:
        raise LoadReadError(INCONSISTENT_SERIES, f"pod {labels.get('pod')}: replica group {group} without a whole "
                            f"{metric_names.GROUP_WORKER_LABEL} / {metric_names.GROUP_SIZE_LABEL} label") from None
    return (labels.get("namespace"), labels.get(metric_names.MOEINFERENCE_LABEL), group), worker, size


def _member_name(members: dict[int, str], worker: int) -> str:
    """The pod name of worker ``worker`` of a LeaderWorkerSet group from its members' names
    (leader ``<lws>-<g>``, workers ``<lws>-<g>-<w>``)."""
    if 0 in members:
        leader = members[0]
    else:
        w, name = next(iter(sorted(members.items())))
        leader = name[: -len(f"-{w}")] if name.endswith(f"-{w}") else f"{name}(leader)"
    return leader if worker == 0 else f"{leader}-{worker}"


def check_pods(c: Counters, what: str) -> None:
    """Phase 1b: the pods' series fit together (raises ``LoadReadError`` otherwise).

    * every pod with an engine-step series has expert-token series and the reverse (one without the
      other is a partial answer: its load would be counted without its steps, or not at all);
    * every pod reports every layer that any pod reports (a pod's missing layer is refused like a
      layer missing everywhere);
    * every pod of a multi-node replica group reports: reason ``IncompleteGroup`` naming the group and
      the missing pod (the group's load is the sum over its pods);
    * a group pod whose expert counts are in its leader's counter (``c.forwarding``) has step series
      only; its group must then have a pod with expert series (``IncompleteGroup`` otherwise).
    """
    step_pods = {s.pod for s in c.engine_steps}
    token_layers: dict[tuple, set] = {}
    for s in c.expert_tokens:
        token_layers.setdefault(s.pod, set()).add(s.labels.get(metric_names.LABEL_LAYER))
    for s in c.edge_counts:  # the regular pods: one series per pod and layer
        token_layers.setdefault(s.pod, set()).add(s.labels.get(metric_names.LABEL_LAYER))
    groups: dict[tuple, dict[int, str]] = {}
    sizes: dict[tuple, int] = {}
    for pod in step_pods | set(token_layers):
        g = _group_of(dict(pod))
        if g is not None:
            groups.setdefault(g[0], {})[g[1]] = pod_name(pod)
            sizes[g[0]] = max(sizes.get(g[0], 0), g[2])
    for key, members in sorted(groups.items(), key=lambda kv: str(kv[0])):
        missing = sorted(set(range(sizes[key])) - set(members))
        if missing:
            names = ", ".join(f"{_member_name(members, w)} (worker {w})" for w in missing)
            raise LoadReadError(INCOMPLETE_GROUP, f"replica group {key[2]} of {key[0]}/{key[1]}: no series from pod "
                                f"{names} of its {sizes[key]}{what}; the group's load is the sum over its pods, so "
                                "it cannot be read without them (check that Prometheus scrapes every pod of the group)")
    _check_forwarding(c, token_layers, what)
    for pod in sorted(set(token_layers) - step_pods) + sorted(step_pods - set(token_layers) - c.forwarding):
        has, lacks = ((metric_names.ENGINE_STEPS, metric_names.EXPERT_TOKENS) if pod in step_pods
                      else (metric_names.EXPERT_TOKENS, metric_names.ENGINE_STEPS))
        g = _group_of(dict(pod))
        raise LoadReadError(INCOMPLETE_GROUP if g else INCONSISTENT_SERIES,
                            f"pod {pod_name(pod)}{f' (replica group {g[0][2]})' if g else ''}: {has} series but no "
                            f"matching {lacks} series (same pod labels){what}; a partial answer, refused rather "
                            "than read as less load")
    if token_layers:
        every = set().union(*token_layers.values())
        for pod, layers in sorted(token_layers.items()):
            if layers != every:
                gone = sorted(every - layers, key=lambda x: int(x) if str(x).isdigit() else -1)
                raise LoadReadError(INCONSISTENT_SERIES, f"pod {pod_name(pod)}: no {metric_names.EXPERT_TOKENS} series "
                                    f"for layer(s) {gone[:10]} that other pods report{what}; the exporter reports "
                                    "every layer, so this answer is partial")


def _check_forwarding(c: Counters, token_layers: Mapping[tuple, set], what: str) -> None:
    """The groups of the forwarding pods have a pod exporting their expert counters (the leader),
    and that pod's counter holds every pod of the group (its ``moe_eplb_exporter_group_pods``)."""
    leaders: dict[tuple, tuple] = {}
    for p in token_layers:
        g = _group_of(dict(p))
        if g is not None:
            leaders[g[0]] = (p, g[2])
    for pod in sorted(c.forwarding & {s.pod for s in c.engine_steps}):
        g = _group_of(dict(pod))
        if g is None or g[0] not in leaders:
            raise LoadReadError(INCOMPLETE_GROUP if g else INCONSISTENT_SERIES,
                                f"pod {pod_name(pod)}: its expert counts are exported by its replica group's leader "
                                f"({metric_names.EXPORTER_GROUP_PODS} = 0), but no pod of "
                                f"{f'replica group {g[0][2]}' if g else 'its group'} has "
                                f"{metric_names.EXPERT_TOKENS} series{what}; check that Prometheus scrapes the leader")
        leader, size = leaders[g[0]]
        held = c.group_counts.get(leader)
        if held is None or held < size:
            raise LoadReadError(INCOMPLETE_GROUP, f"replica group {g[0][2]}{what}: its leader {pod_name(leader)} "
                                f"exports the group's expert counters for {0 if held is None else int(held)} of its "
                                f"{size} pods ({metric_names.EXPORTER_GROUP_PODS}); the leader's exporter cannot "
                                "reach a worker's exporter port (a NetworkPolicy, or MOE_EPLB_EXPORTER_GROUP_PEERS), "
                                "see its log")


def forwarding_pods(group_pods: Sequence[Series]) -> frozenset:
    """Pods whose ``moe_eplb_exporter_group_pods`` is 0 (at their newest sample): a replica group's
    workers, whose expert counts their leader exports."""
    return frozenset(p for p, v in group_counts(group_pods).items() if v == 0.0)


def group_counts(group_pods: Sequence[Series]) -> dict[tuple, float]:
    """Pod -> its newest ``moe_eplb_exporter_group_pods`` value."""
    out: dict[tuple, tuple[float, float]] = {}
    for s in group_pods:
        if s.vs.size and (s.pod not in out or s.ts[-1] >= out[s.pod][0]):
            out[s.pod] = (float(s.ts[-1]), float(s.vs[-1]))
    return {p: v for p, (_, v) in out.items()}


@dataclass
class StepIncrements:
    """Phase 2: engine steps per bucket summed over pods, and each pod's scrape-gap rule."""

    total: np.ndarray  # [T]
    max_gap: dict[tuple, float | None]  # pod -> seconds (None: no gap rule)
    spread: float  # steps spread over scrape gaps
    gaps: dict[tuple, set]  # pod -> {(t1, t2)}
    active: dict[tuple, np.ndarray] = field(default_factory=dict)  # pod -> [T] its step counter advanced


def step_increments(c: Counters, grid: np.ndarray, what: str, spread_gaps: bool = True) -> StepIncrements:
    """Phase 2: per pod, the step counter's increments; the window must hold at least one sample.
    ``spread_gaps=False``: no scrape-gap rule (every increment in its later sample's bucket)."""
    T = grid.shape[0] - 1
    bucket = float(grid[1] - grid[0])
    out = StepIncrements(np.zeros(T), {}, 0.0, {})
    most_inside = 0
    for s in c.engine_steps:
        max_gap = max_gap_for(s.ts, bucket) if spread_gaps else None
        inc = counter_increments(grid, s.ts, s.vs[None, :], c.starts_at(s.pod, s.ts), max_gap=max_gap)
        out.total += inc.values[0]
        out.active[s.pod] = out.active.get(s.pod, np.zeros(T, dtype=bool)) | (inc.values[0] > 0)
        out.spread += float(inc.interpolated.sum())
        out.max_gap[s.pod] = max_gap
        if inc.interpolated.any():
            out.gaps.setdefault(s.pod, set()).update(inc.gaps)
        most_inside = max(most_inside, int(np.sum(s.ts > grid[0])))
    if most_inside < 1:
        raise LoadReadError(INSUFFICIENT_DATA, f"no samples in the last {T * bucket:g}s{what}; wait for "
                            f"at least one full bucket ({bucket:g}s) of scrapes")
    return out


@dataclass
class FamilyIncrements:
    """Phase 3: per series key (e.g. ``(layer, expert)``), increments ``[T]`` summed over pods."""

    rows: dict[tuple[int, ...], np.ndarray]
    spread: dict[tuple, float]  # pod -> amount spread over its scrape gaps


def family_increments(series: list[Series], keys: tuple[str, ...], c: Counters, steps: StepIncrements,
                      grid: np.ndarray, what: str, edge_sums: Sequence[Series] = ()) -> FamilyIncrements:
    """Phase 3: increments of a labelled counter family (``keys``: the labels that tell its series
    apart within a pod), summed over pods. A pod's counters are scraped together, so series with the
    same pod and sample times are differenced as one matrix (DeepSeek-V3: 14 848 series per pod);
    the pod's step counter sets the gap rule, so its steps and these counters are spread alike.
    ``edge_sums``: the same family of the regular pods summed at the grid edges (checked complete
    and never dropping, :mod:`moe_eplb.metrics.edges`); their differences are added."""
    out = FamilyIncrements({}, {})
    groups: dict[tuple, list[Series]] = {}
    for s in series:
        if s.pod not in steps.max_gap:
            raise LoadReadError(INCONSISTENT_SERIES, f"{what}: series {dict(s.labels)} has no matching "
                                f"{metric_names.ENGINE_STEPS} series (same pod labels)")
        groups.setdefault((s.pod, s.ts.tobytes()), []).append(s)
    index: dict[tuple[int, ...], int] = {}  # series key -> row of the sum
    parsed: dict[tuple, tuple[int, ...]] = {}  # label values -> key (the same few hundred strings)

    def rows_of(members: Sequence[Series]) -> np.ndarray:
        rows = np.empty(len(members), np.int64)
        for j, s in enumerate(members):
            raw = tuple(s.labels.get(k) for k in keys)
            key = parsed.get(raw)
            if key is None:
                key = parsed[raw] = tuple(s.int_label(k, what) for k in keys)
            rows[j] = index.setdefault(key, len(index))
        return rows

    parts = []
    for (pod, _), members in groups.items():
        ts = members[0].ts
        inc: Increments = counter_increments(grid, ts, np.stack([s.vs for s in members]), c.starts_at(pod, ts),
                                             max_gap=steps.max_gap[pod])
        if inc.interpolated.any():
            out.spread[pod] = out.spread.get(pod, 0.0) + float(inc.interpolated.sum())
            steps.gaps.setdefault(pod, set()).update(inc.gaps)
        parts.append((rows_of(members), inc.values))
    if edge_sums:  # the regular pods, summed on the server: increments between consecutive edges
        parts.append((rows_of(edge_sums), np.diff(edge_matrix(edge_sums, grid), axis=1)))
    total = np.zeros((len(index), grid.shape[0] - 1))
    for rows, values in parts:
        if np.unique(rows).size == rows.size:
            total[rows] += values  # one series per key in a group (the usual case): plain indexing
        else:
            np.add.at(total, rows, values)
    out.rows = {key: total[i] for key, i in index.items()}
    return out


def check_gaps(tokens: FamilyIncrements, steps: StepIncrements, grid: np.ndarray, limit: float, what: str) -> float:
    """Phase 4: the share of the window's load spread over scrape gaps (the larger of the shares of
    tokens and of steps); above ``limit`` the window is refused (reason ``ScrapeGaps``)."""
    total_tokens = float(sum(row.sum() for row in tokens.rows.values()))
    token_share = sum(tokens.spread.values()) / total_tokens if total_tokens > 0 else 0.0
    step_share = steps.spread / float(steps.total.sum()) if steps.total.sum() > 0 else 0.0
    fraction = min(1.0, max(token_share, step_share))
    if fraction > limit:
        gaps = steps.gaps
        worst = max(gaps, key=lambda p: (tokens.spread.get(p, 0.0), len(gaps[p])))
        t1, t2 = max(gaps[worst], key=lambda g: g[1] - g[0])
        more = f" and {len(gaps[worst]) - 1} more gap(s)" if len(gaps[worst]) > 1 else ""
        span = (grid.shape[0] - 1) * float(grid[1] - grid[0])
        raise LoadReadError(SCRAPE_GAPS, f"{fraction:.0%} of the load in the last {span:g}s{what} fell in scrape "
                            f"gaps (allowed: {limit:.0%}) and could only be spread over the buckets by time; "
                            f"pod {pod_name(worst)}: no samples between t={t1:.3f} and t={t2:.3f} ({t2 - t1:.1f}s)"
                            f"{more}{f' ({len(gaps)} pods with gaps)' if len(gaps) > 1 else ''}; check that "
                            "Prometheus scrapes the pods (target up, scrape interval and timeout) or wait until "
                            "the gaps leave the window")
    return fraction


def load_matrix(rows: Mapping[tuple[int, ...], np.ndarray], T: int, num_layers: int | None,
                num_experts: int | None, what: str) -> np.ndarray:
    """Phase 5: ``[T, L, E]`` from ``{(layer, expert): [T]}``. An expert without a series counts 0
    (the exporter's counters appear once an expert has tokens); a label beyond the given shape, or a
    layer without any series (the exporter would report every layer), is an error."""
    max_layer = max(k[0] for k in rows)
    max_expert = max(k[1] for k in rows)
    if num_layers is not None and max_layer >= num_layers:
        raise LoadReadError(INCONSISTENT_SERIES, f"num_layers: is {num_layers} but the answer has a series for "
                            f"layer {max_layer}{what}")
    if num_experts is not None and max_expert >= num_experts:
        raise LoadReadError(INCONSISTENT_SERIES, f"num_experts: is {num_experts} but the answer has a series for "
                            f"expert {max_expert}{what}")
    L = num_layers if num_layers is not None else max_layer + 1
    E = num_experts if num_experts is not None else max_expert + 1
    load = np.zeros((T, L, E))
    seen = np.zeros(L, bool)
    for (layer, expert), row in rows.items():
        load[:, layer, expert] = row
        seen[layer] = True
    if not seen.all():
        missing = np.flatnonzero(~seen).tolist()
        raise LoadReadError(INCONSISTENT_SERIES, f"layer: no series at all for layer(s) {missing[:10]} of {L}{what}; "
                            "the exporter is not reporting them (or num_layers is wrong), so their load cannot be "
                            "filled with zeros")
    return load


# --------------------------------------------------------------------------------------------------
# the two sources
# --------------------------------------------------------------------------------------------------


def trace_from_raw_counters(
    expert_tokens: Sequence[Series],
    engine_steps: Sequence[Series],
    grid: np.ndarray,
    *,
    start_times: Sequence[Series] = (),
    edge_sums: Sequence[Series] = (),
    edge_counts: Sequence[Series] = (),
    pods_per_engine: int = 1,
    num_layers: int | None = None,
    num_experts: int | None = None,
    model: str | None = None,
    what: str = "",
    max_interpolated_fraction: float = DEFAULT_MAX_INTERPOLATED_FRACTION,
    spread_gaps: bool = True,
    group_pods: Sequence[Series] = (),
) -> LoadTrace:
    """Raw samples of the counters -> trace of T = len(grid) - 1 buckets.

    The series hold raw samples (:func:`~moe_eplb.metrics.series.parse_matrix` of the answers to
    e.g. ``moe_eplb_expert_tokens_total{...}[<window>s]`` at ``grid[-1]``) plus one baseline sample
    at or before ``grid[0]`` per series (:func:`moe_eplb.metrics.reader.with_baselines`).
    ``load[t]`` sums the increments over pods; ``bucket_steps[t]`` is the sum over pods of the step
    counter's increments divided by ``pods_per_engine``, in whole steps (running total rounded).
    ``start_times`` (the same for ``moe_eplb_exporter_start_time_seconds``) tells restarts and
    joins apart from scrape gaps. ``trace.meta["interpolated_fraction"]`` is the share of load spread over scrape
    gaps (:func:`check_gaps`); ``trace.meta["start_time"]`` is ``grid[0]``.

    ``edge_sums`` and ``edge_counts``: the expert counters of the *regular* pods summed at the grid
    edges and their series counts per pod and layer (:mod:`moe_eplb.metrics.edges`, checked by the
    caller); those pods' raw expert series are then not in ``expert_tokens``, while their step
    counters still are. ``trace.meta["pods_at_edges"]`` and ``["pods_raw"]`` count the two.

    ``spread_gaps=False`` (the operator's own scrapes, :func:`counters_from_rounds`): no scrape-gap
    rule -- a late round of a loaded operator just puts the load since the previous round in its
    bucket, nothing is estimated or refused (as the old one-bucket-per-two-rounds reading did).

    ``group_pods``: the samples of ``moe_eplb_exporter_group_pods``. A replica group's worker pods
    (value 0) export no expert series: their leader's counter holds the group's counts
    (:mod:`moe_eplb.exporter.group`), so they add only their steps. The trace is the one the
    per-pod layout gives for the same load.

    Raises:
        LoadReadError: reasons NoData, InsufficientData, InconsistentSeries or ScrapeGaps.
    """
    if not 0.0 <= max_interpolated_fraction <= 1.0:
        raise ValueError(f"max_interpolated_fraction: must be between 0 and 1 (a share of the load), "
                         f"got {max_interpolated_fraction}")
    counters = Counters(list(expert_tokens), list(engine_steps), {s.pod: s for s in start_times},
                        list(edge_sums), list(edge_counts), forwarding_pods(group_pods), group_counts(group_pods))
    counters, model = select_model(counters, model, num_layers, num_experts, what)
    check_pods(counters, what)
    steps = step_increments(counters, grid, what, spread_gaps)
    tokens = family_increments(counters.expert_tokens, (metric_names.LABEL_LAYER, metric_names.LABEL_EXPERT),
                               counters, steps, grid, metric_names.EXPERT_TOKENS, edge_sums=counters.edge_sums)
    fraction = check_gaps(tokens, steps, grid, max_interpolated_fraction, what)
    load = load_matrix(tokens.rows, grid.shape[0] - 1, num_layers, num_experts, what)
    return LoadTrace(load=load, bucket_steps=round_steps(steps.total / max(1, pods_per_engine)).astype(np.int64),
                     bucket_seconds=float(grid[1] - grid[0]), model=model,
                     meta={"start_time": float(grid[0]), "interpolated_fraction": fraction,
                           "engines": concurrent_engines(list(steps.active.values()), grid.shape[0] - 1,
                                                         pods_per_engine).tolist(),
                           "pods_at_edges": len({s.pod for s in counters.edge_counts}),
                           "pods_raw": len({s.pod for s in counters.expert_tokens})})


def group_pods_from_rounds(rounds: Sequence[Round]) -> list[Series]:
    """The ``moe_eplb_exporter_group_pods`` samples of direct-scrape rounds, labelled as
    :func:`counters_from_rounds` labels the counters (for ``trace_from_raw_counters(group_pods=)``)."""
    pts: dict[tuple[str, str], list[tuple[float, float]]] = {}
    labels: dict[str, tuple] = {}
    for rnd in rounds:
        for pod, sample in rnd.pods.items():
            labels[pod] = rnd.labels.get(pod, ())
            for model, v in sample.group_pods.items():
                pts.setdefault((pod, model), []).append((sample_time(rnd, sample), v))
    out = []
    for (pod, model), p in pts.items():
        p.sort(key=lambda x: x[0])
        out.append(Series({**dict(labels[pod]), "pod": pod, metric_names.LABEL_MODEL: model},
                          np.array([x[0] for x in p], np.float64), np.array([x[1] for x in p], np.float64)))
    return out


def counters_from_rounds(rounds: Sequence[Round]) -> tuple[list[Series], list[Series], list[Series]]:
    """Direct-scrape rounds as the raw samples Prometheus would hold of the same pods: the expert
    token, engine step and exporter start time series ``(expert_tokens, engine_steps, start_times)``,
    labelled ``pod``, ``model_name`` and the labels the PodMonitor copies from the pod
    (:func:`moe_eplb.metrics.scrape.pod_labels`: the LeaderWorkerSet group of a pod), for
    :func:`trace_from_raw_counters` -- so that a direct read has the Prometheus read's buckets,
    group joining and gap rules."""
    model_label, layer_label, expert_label = metric_names.LABEL_MODEL, metric_names.LABEL_LAYER, metric_names.LABEL_EXPERT
    seen: dict[tuple[str, str], list[tuple[float, PodSample]]] = {}
    labels: dict[str, tuple] = {}
    for rnd in rounds:
        for pod, sample in rnd.pods.items():
            labels[pod] = rnd.labels.get(pod, ())
            for model in sample.steps.keys() | sample.tokens.keys():
                seen.setdefault((pod, model), []).append((sample_time(rnd, sample), sample))
    tokens: list[Series] = []
    steps: list[Series] = []
    starts: list[Series] = []

    def series(base: dict, pts: list[tuple[float, float]]) -> Series:
        return Series(base, np.array([p[0] for p in pts], np.float64), np.array([p[1] for p in pts], np.float64))

    for (pod, model), samples in seen.items():
        samples.sort(key=lambda x: x[0])  # answers of overlapping rounds can come back out of order
        base = {**dict(labels[pod]), "pod": pod, model_label: model}
        if any(model in s.steps for _, s in samples):
            steps.append(series(base, [(t, s.steps[model]) for t, s in samples if model in s.steps]))
        if any(model in s.start_time for _, s in samples):
            starts.append(series(base, [(t, s.start_time[model]) for t, s in samples if model in s.start_time]))
        with_tokens = [(t, s.tokens[model]) for t, s in samples if s.tokens.get(model)]
        if not with_tokens:
            continue
        keys = tuple(with_tokens[0][1])
        if all(tuple(d) == keys for _, d in with_tokens):  # the usual case: the same series at every scrape
            ts = np.array([t for t, _ in with_tokens], np.float64)
            vs = np.stack([np.fromiter(d.values(), np.float64, len(keys)) for _, d in with_tokens], axis=1)
            tokens += [Series({**base, layer_label: str(k[0]), expert_label: str(k[1])}, ts, vs[i])
                       for i, k in enumerate(keys)]
            continue
        per_key: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for t, d in with_tokens:
            for k, v in d.items():
                per_key.setdefault(k, []).append((t, v))
        tokens += [series({**base, layer_label: str(k[0]), expert_label: str(k[1])}, pts) for k, pts in per_key.items()]
    return tokens, steps, starts


def concurrent_engines(active: list[np.ndarray], T: int, pods_per_engine: int = 1) -> np.ndarray:
    """``[T]``: about how many engines (replica groups of ``pods_per_engine`` pods) ran side by side
    in each bucket, from each pod's ``[T]`` "its step counter advanced" flags. A pod counts 1 in a
    bucket inside its run and 1/2 in the bucket where it starts or stops (it ran part of it); the
    count is floored at one engine where any pod ran, so a pod that replaces another within a bucket,
    or one engine starting mid-bucket, is one engine, while a replica joining N running ones makes
    N + 1/2."""
    if not active:
        return np.zeros(T)
    a = np.asarray(active, dtype=bool).reshape(len(active), T)
    prev = np.concatenate([a[:, :1], a[:, :-1]], axis=1)  # the window's edges count as inside a run
    nxt = np.concatenate([a[:, 1:], a[:, -1:]], axis=1)
    n = (np.where(prev & nxt, 1.0, 0.5) * a).sum(axis=0) / max(1, pods_per_engine)
    return np.where(a.any(axis=0), np.maximum(n, 1.0), 0.0)


def per_engine(trace: LoadTrace) -> LoadTrace:
    """The trace of ONE engine (replica group): load, steps, rank load, preemptions and waiting
    requests of every bucket divided by the engines that ran in it (``trace.meta["engines"]``, set by both sources).

    The sources sum over every pod, so with N replicas a bucket holds N engines' steps: replayed
    as one engine's, an EPLB window of W steps would cover 1/N of the time it covers in each engine,
    and the tuner's answer would change with the replica count. Per engine, it does not (the
    replicas serve the same workload). Tokens per step are unchanged. A trace without the count
    is returned as it is."""
    engines = trace.meta.get("engines")
    if engines is None or len(engines) != trace.num_buckets:
        return trace
    n = np.asarray(engines, dtype=np.float64)
    if not np.any(n > 1 + 1e-9):
        return trace
    div = np.where(n > 0, n, 1.0)
    steps = np.asarray(trace.bucket_steps, dtype=np.float64) / div
    steps = np.where(trace.bucket_steps > 0, np.maximum(np.round(steps), 1), 0).astype(np.int64)
    tel = trace.telemetry
    if tel is not None:
        changes = {}
        if tel.rank_load is not None:
            changes["rank_load"] = tel.rank_load / div[:, None, None]
        if tel.preemptions is not None:
            changes["preemptions"] = tel.preemptions / div
        if tel.requests_waiting is not None:  # summed over the engines, like the load
            changes["requests_waiting"] = tel.requests_waiting / div
        tel = replace(tel, **changes)
    meta = {**trace.meta, "engines": [1.0 if x > 0 else 0.0 for x in n], "engines_summed": list(engines)}
    return LoadTrace(load=trace.load / div[:, None, None], bucket_steps=steps, bucket_seconds=trace.bucket_seconds,
                     top_k=trace.top_k, model=trace.model, meta=meta, telemetry=tel)
