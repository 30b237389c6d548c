"""The chart's Grafana dashboards, built with Grafana's own typed SDK (PyPI ``grafana-foundation-sdk``,
whose builders follow Grafana's dashboard schema) instead of hand-written JSON dictionaries.

``scripts/gen_chart.py`` writes :data:`DASHBOARDS` to ``charts/moe-eplb-operator/dashboards/*.json``
at development time (the operator never imports this). Every metric name comes from
``moe_eplb.contracts.metric_names`` or ``scripts/vllm_metric_names.py``; label names from the same contract.

Conventions follow vLLM's own dashboards (examples/observability): a ``datasource`` variable,
rates over ``$__rate_interval``, the served model in ``model_name`` (the exporter's series and vLLM's
carry the same label, so one variable filters both) and the DP engine in ``engine``.

Layout of "MoE expert load" for a large model (DeepSeek-V3: 58 MoE layers x 256 experts): nothing
repeats per layer. The default view shows the overview, a layer x time heatmap of balancedness with
the top-k most imbalanced layers, step time per rank, rearrangements, and ONE layer's experts
(``$layer``, a single value that defaults to the most imbalanced layer over the time range). The
per-expert tables, the serving metrics and the tuner/calibration panels sit in collapsed rows.
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import bargauge as gbar
from grafana_foundation_sdk.builders import common as gcommon
from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.builders import heatmap as gheat
from grafana_foundation_sdk.builders import prometheus as gprom
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import table as gtable
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as gcm
from grafana_foundation_sdk.models import dashboard as gdm
from grafana_foundation_sdk.models import heatmap as ghm
from grafana_foundation_sdk.models import prometheus as gpm

from moe_eplb.contracts import metric_names as mn
from moe_eplb.controller import decisions
from moe_eplb.eplb.tuning import replicas as replica_tuning
from scripts import vllm_metric_names as vllm

DS = gdm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"
L_MODEL, L_LAYER, L_EXPERT, L_RANK = mn.LABEL_MODEL, mn.LABEL_LAYER, mn.LABEL_EXPERT, mn.LABEL_RANK
L_INF = mn.MOEINFERENCE_LABEL

# Label selectors. The exporter's series carry model_name/layer/expert/rank from the exporter plus
# namespace, pod and moeinference added at scrape time by the PodMonitor; vLLM's carry model_name
# and engine; the operator's tuner series carry namespace and name (the MoEInference) and need
# honorLabels: true on the ServiceMonitor.
SEL = f'namespace="$namespace", {L_INF}="$moeinference", {L_MODEL}=~"$model_name"'
SEL_LAYER = SEL + f', {L_LAYER}="$layer"'
SEL_VLLM = SEL + ', engine=~"$engine"'
SEL_TUNER = 'namespace="$namespace", name="$moeinference"'


def _vllm(name: str, suffix: str = "") -> str:
    """A vLLM series name, checked against scripts/vllm_metric_names.py (``suffix``: _total, _bucket...)."""
    if name not in vllm.VLLM_METRICS or name + suffix not in vllm.exposed_series(name, vllm.VLLM_METRICS[name]):
        raise KeyError(f"{name}{suffix} is not a vLLM series the project checks (scripts/vllm_metric_names.py)")
    return name + suffix


# --- small builders on top of the SDK ---------------------------------------------------------------


class _Ids:
    """Unique panel ids (Grafana links and repeats key on them)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def query(expr: str, legend: str = "__auto", *, instant: bool = False, table: bool = False) -> gprom.Dataquery:
    q = gprom.Dataquery().expr(expr).legend_format(legend).datasource(DS)
    q = q.instant() if instant else q.range()
    return q.format(gpm.PromQueryFormat.TABLE if table else gpm.PromQueryFormat.TIME_SERIES)


def _common(p: Any, ids: _Ids, title: str, description: str, queries: list[gprom.Dataquery], w: int, h: int,
            unit: str) -> Any:
    p = p.id(ids()).title(title).description(description).datasource(DS).span(w).height(h).unit(unit)
    for i, q in enumerate(queries):
        p = p.with_target(q.ref_id(chr(ord("A") + i)))
    return p


def timeseries(ids: _Ids, title: str, description: str, queries: list[gprom.Dataquery], *, w: int = 12,
               h: int = 8, unit: str = "short", decimals: int | None = None, min_max: tuple[float, float] | None = None,
               bars: bool = False) -> gts.Panel:
    p = _common(gts.Panel(), ids, title, description, queries, w, h, unit)
    p = p.legend(gcommon.VizLegendOptions().display_mode(gcm.LegendDisplayMode.TABLE)
                 .placement(gcm.LegendPlacement.RIGHT if w >= 12 else gcm.LegendPlacement.BOTTOM)
                 .show_legend(True).calcs(["mean", "max", "lastNotNull"]))
    p = p.tooltip(gcommon.VizTooltipOptions().mode(gcm.TooltipDisplayMode.MULTI).sort(gcm.SortOrder.DESCENDING))
    if decimals is not None:
        p = p.decimals(decimals)
    if min_max is not None:
        p = p.min(min_max[0]).max(min_max[1])
    if bars:
        p = p.draw_style(gcm.GraphDrawStyle.BARS).fill_opacity(80)
    return p


def stat(ids: _Ids, title: str, description: str, expr: str, *, unit: str, decimals: int | None = None,
         w: int = 4, h: int = 4, min_max: tuple[float, float] | None = None) -> gstat.Panel:
    p = _common(gstat.Panel(), ids, title, description, [query(expr)], w, h, unit)
    p = (p.reduce_options(gcommon.ReduceDataOptions().calcs(["lastNotNull"]).values(False).fields(""))
         .color_mode(gcm.BigValueColorMode.VALUE).graph_mode(gcm.BigValueGraphMode.AREA)
         .text_mode(gcm.BigValueTextMode.AUTO))
    if decimals is not None:
        p = p.decimals(decimals)
    if min_max is not None:
        p = p.min(min_max[0]).max(min_max[1])
    return p


def replicas_stat(ids: _Ids) -> gstat.Panel:
    """Overview: replica groups ready, desired and the autoscaler's maximum, side by side."""
    rep = f"{mn.REPLICAS}{{{SEL_TUNER}"
    queries = [query(f"max({rep}, state=\"ready\"}})", "ready"), query(f"max({rep}, state=\"desired\"}})", "desired"),
               query(f"max({mn.AUTOSCALER_MAX_REPLICAS}{{{SEL_TUNER}}})", "max")]
    p = _common(gstat.Panel(), ids, "Replicas (ready, desired, max)",
                "Replica groups ready and desired (spec.replicas: the autoscaler's choice with spec.autoscaling) "
                "and the autoscaler's maxReplicas (none without one). Details in the Serving row.", queries, 4, 4,
                "none")
    return (p.reduce_options(gcommon.ReduceDataOptions().calcs(["lastNotNull"]).values(False).fields(""))
            .color_mode(gcm.BigValueColorMode.VALUE).graph_mode(gcm.BigValueGraphMode.NONE)
            .text_mode(gcm.BigValueTextMode.VALUE_AND_NAME).decimals(0))


def heatmap_of_series(ids: _Ids, title: str, description: str, q: gprom.Dataquery, *, w: int, h: int,
                      unit: str, scheme: str, y_label: str, reverse: bool = False,
                      min_max: tuple[float, float] | None = None) -> gheat.Panel:
    """A heatmap whose rows are the query's series (one per legend value, e.g. one per expert).

    The query stays in time-series format with a numeric legend: Grafana orders such series
    numerically as rows. (Grafana's "heatmap" format would de-cumulate them as if they were histogram
    buckets.) No calculation: the values are the cells."""
    color = (gheat.HeatmapColorOptions().mode(ghm.HeatmapColorMode.SCHEME).scheme(scheme)
             .scale(ghm.HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64).reverse(reverse).fill("dark-orange"))
    if min_max is not None:
        color = color.min(min_max[0]).max(min_max[1])
    p = _common(gheat.Panel(), ids, title, description, [q], w, h, unit)
    return (p.calculate(False).color(color)
            .y_axis(gheat.YAxisConfig().unit("none").axis_placement(gcm.AxisPlacement.LEFT).axis_label(y_label)
                    .decimals(0))
            .rows_frame(gheat.RowsHeatmapOptions().layout(gcm.HeatmapCellLayout.AUTO))
            .cell_gap(0).show_legend().show_y_histogram()
            .filter_values(gheat.FilterValueRange().le(1e-9)))  # hide empty cells


def bargauge(ids: _Ids, title: str, description: str, q: gprom.Dataquery, *, w: int, h: int,
             unit: str) -> gbar.Panel:
    p = _common(gbar.Panel(), ids, title, description, [q], w, h, unit)
    return (p.display_mode(gcm.BarGaugeDisplayMode.GRADIENT).orientation(gcm.VizOrientation.HORIZONTAL)
            .show_unfilled(True)
            .reduce_options(gcommon.ReduceDataOptions().calcs(["lastNotNull"]).values(False).fields("")))


def table(ids: _Ids, title: str, description: str, queries: list[gprom.Dataquery], *, w: int, h: int,
          unit: str = "none", transformations: list[gdm.DataTransformerConfig] = ()) -> gtable.Panel:
    p = _common(gtable.Panel(), ids, title, description, queries, w, h, unit)
    for t in transformations:
        p = p.with_transformation(t)
    return p


def organize(exclude: list[str], rename: dict[str, str] | None = None) -> gdm.DataTransformerConfig:
    return gdm.DataTransformerConfig(id_val="organize", options={
        "excludeByName": {name: True for name in exclude}, "renameByName": rename or {}})


def datasource_variable() -> gdash.DatasourceVariable:
    return gdash.DatasourceVariable("datasource").label("Data source").type("prometheus")


def query_variable(name: str, label: str, q: str, *, multi: bool = False, include_all: bool = False,
                   sort: gdm.VariableSort = gdm.VariableSort.ALPHABETICAL_ASC, regex: str | None = None,
                   description: str | None = None) -> gdash.QueryVariable:
    v = (gdash.QueryVariable(name).label(label).query(q).datasource(DS)
         .refresh(gdm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(sort).multi(multi).include_all(include_all))
    if include_all:
        v = v.all_value(".*")
    if regex:
        v = v.regex(regex)
    if description:
        v = v.description(description)
    return v


def custom_variable(name: str, label: str, values: list[str], description: str) -> gdash.CustomVariable:
    first = gdm.VariableOption(selected=True, text=values[0], value=values[0])
    return (gdash.CustomVariable(name).label(label).description(description).values(",".join(values))
            .current(first).multi(False).include_all(False))


class PrometheusAnnotation(gdm.AnnotationQuery):
    """The SDK's AnnotationQuery plus the fields Grafana's Prometheus annotations read (``step``,
    ``titleFormat``, ``tagKeys``, ``textFormat``, ``useValueForTime``), which the SDK's model lacks."""

    def __init__(self, *, title_format: str, tag_keys: str, step: str = "60s", **kw: Any) -> None:
        super().__init__(**kw)
        self.title_format, self.tag_keys, self.step = title_format, tag_keys, step

    def to_json(self) -> dict[str, object]:
        payload = super().to_json()
        payload.update(titleFormat=self.title_format, tagKeys=self.tag_keys, step=self.step, textFormat="",
                       useValueForTime=False)
        return payload


class _AnnotationBuilder(cogbuilder.Builder[gdm.AnnotationQuery]):
    def __init__(self, annotation: gdm.AnnotationQuery) -> None:
        self._internal = annotation

    def build(self) -> gdm.AnnotationQuery:
        return self._internal


def annotation(name: str, expr: str, title: str, color: str, *, enable: bool = True,
               tags: str = "") -> _AnnotationBuilder:
    return _AnnotationBuilder(PrometheusAnnotation(name=name, datasource=DS, enable=enable, hide=False,
                                                   icon_color=color, expr=expr, title_format=title, tag_keys=tags))


def builtin_annotation() -> gdash.AnnotationQuery:
    return (gdash.AnnotationQuery().name("Annotations & Alerts").built_in(1).enable(True).hide(True)
            .type("dashboard").icon_color("rgba(0, 211, 255, 1)")
            .datasource(gdm.DataSourceRef(type_val="grafana", uid="-- Grafana --")))


def dashboard(uid: str, title: str, description: str, tags: list[str]) -> gdash.Dashboard:
    return (gdash.Dashboard(title).uid(uid).description(description).tags(tags).timezone("browser")
            .editable().tooltip(gdm.DashboardCursorSync.CROSSHAIR).refresh("30s").time("now-3h", "now")
            .version(1).annotation(builtin_annotation()))


# --- the expressions both dashboards and the docs talk about -----------------------------------------

EXPERT_RATE = f"rate({mn.EXPERT_TOKENS}{{{SEL}}}{RATE})"
RANK_RATE = f"rate({mn.RANK_TOKENS}{{{SEL}}}{RATE})"
RANK_BY = f"sum by ({L_LAYER}, {L_RANK}) ({RANK_RATE})"
#: per-layer balancedness: the exporter's gauge where a pod holds every rank of its engine, else
#: computed from the per-rank counters (engines that span pods)
BALANCEDNESS_BY_LAYER = (f"(min by ({L_LAYER}) ({mn.BALANCEDNESS}{{{SEL}}}) or "
                         f"avg by ({L_LAYER}) ({RANK_BY}) / max by ({L_LAYER}) ({RANK_BY}))")
#: per-layer imbalance: busiest rank's load over the mean (1 = balanced; an MoE layer's step time
#: follows its busiest rank)
IMBALANCE_BY_LAYER = f"max by ({L_LAYER}) ({RANK_BY}) / avg by ({L_LAYER}) ({RANK_BY})"
#: the layer variable: layers ordered by imbalance over the dashboard's range, the worst first
LAYER_VARIABLE_QUERY = (
    f"query_result(sort_desc(max by ({L_LAYER}) (sum by ({L_LAYER}, {L_RANK}) "
    f"(rate({mn.RANK_TOKENS}{{{SEL}}}[$__range]))) / avg by ({L_LAYER}) (sum by ({L_LAYER}, {L_RANK}) "
    f"(rate({mn.RANK_TOKENS}{{{SEL}}}[$__range])))))")
LAYER_VARIABLE_REGEX = f'/{L_LAYER}="(\\d+)"/'


def _step_quantile(q: float, by: str, metric: str = mn.STEP_SECONDS) -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{{{SEL}}}{RATE})))"


def _per_arm(expr: str) -> str:
    """``expr`` (by label ``arm``) with the pods that have no arm label named ``control``."""
    return f'label_replace({expr}, "{mn.ARM_LABEL}", "control", "{mn.ARM_LABEL}", "")'


def arm_panels(ids: _Ids) -> list:
    """An experiment's arms (trial, control: one series each), in the collapsed autotune row: what
    the arms are compared on while an experiment runs (docs/autotune.md#experiments). A series per
    arm, not a row per arm: the default view of a DeepSeek-V3 stays within 20 panels."""
    step = (f"sum by ({mn.ARM_LABEL}) (rate({mn.STEP_SECONDS}_sum{{{SEL}}}{RATE})) / "
            f"sum by ({mn.ARM_LABEL}) (rate({mn.STEP_SECONDS}_count{{{SEL}}}{RATE}))")
    batch = (f"sum by ({mn.ARM_LABEL}) (rate({mn.STEP_TOKENS}_sum{{{SEL}}}{RATE})) / "
             f"sum by ({mn.ARM_LABEL}) (rate({mn.STEP_TOKENS}_count{{{SEL}}}{RATE}))")
    ttft_s = _vllm("vllm:time_to_first_token_seconds", "_sum")
    ttft_n = _vllm("vllm:time_to_first_token_seconds", "_count")
    ttft = (f"sum by ({mn.ARM_LABEL}) (rate({ttft_s}{{{SEL_VLLM}}}{RATE})) / "
            f"sum by ({mn.ARM_LABEL}) (rate({ttft_n}{{{SEL_VLLM}}}{RATE}))")
    return [
        timeseries(ids, "Step time per arm", "Mean engine step (inter-token) time of each arm's pods: the "
                   "objective where the engines are not saturated.", [query(_per_arm(step), "{{arm}}")],
                   w=8, unit="s"),
        timeseries(ids, "Tokens per step per arm", "Mean tokens per engine step (batch size) of each arm: step "
                   "times are compared at comparable batches.", [query(_per_arm(batch), "{{arm}}")],
                   w=8, unit="short"),
        timeseries(ids, "TTFT per arm", "Mean time to first token of each arm's pods: the experiment's guard.",
                   [query(_per_arm(ttft), "{{arm}}")], w=8, unit="s"),
    ]


def expert_load() -> gdash.Dashboard:
    """"MoE expert load": one MoEInference, its layers, experts, ranks, steps, EPLB, serving, tuner."""
    ids = _Ids()
    replicas = f"max by ({L_LAYER}, {L_EXPERT}) ({mn.EXPERT_REPLICAS}{{{SEL}}})"
    # an absent replica gauge means 1 replica (the exporter's "reduced" mode exports only > 1)
    replicas_or_one = (f"({replicas} or on ({L_LAYER}, {L_EXPERT}) "
                       f"(sum by ({L_LAYER}, {L_EXPERT}) ({EXPERT_RATE}) * 0 + 1))")
    rs = f"{mn.REARRANGEMENT_SECONDS}_bucket{{{SEL}}}"
    d = dashboard("moe-eplb-expert-load", "MoE expert load",
                  "Per-layer balance, per-expert and per-rank load of a MoEInference running vLLM with EPLB, "
                  "step time, rearrangements, vLLM's serving metrics and the tuner's calibration and decisions. "
                  "Built for large models: the default view shows the most imbalanced layers and one layer's "
                  "experts ($layer, the worst layer first), never one panel per layer.",
                  ["moe-eplb", "vllm", "eplb"])

    d = d.with_row(gdash.Row("Overview").id(ids()))
    for p in (
        stat(ids, "Balancedness (mean of layers)", "Mean over the MoE layers of the per-layer balancedness "
             "(mean / max of the tokens each EP rank processes; 1 = perfectly balanced).",
             f"avg({BALANCEDNESS_BY_LAYER})", unit="percentunit", decimals=1, min_max=(0, 1)),
        stat(ids, "Worst layer balancedness", "Lowest per-layer balancedness.",
             f"min({BALANCEDNESS_BY_LAYER})", unit="percentunit", decimals=1, min_max=(0, 1), w=3),
        stat(ids, "Routed tokens/s", "Expert activations per second: each token counts once per top-k "
             "expert it is routed to (tokens x top-k), summed over the layers.", f"sum({EXPERT_RATE})",
             unit="short", w=3),
        stat(ids, "Rearrangements in range", "EPLB rearrangements (expert weight moves) in the dashboard's "
             "time range, over all pods.", f"sum(increase({mn.REARRANGEMENTS}{{{SEL}}}[$__range]))",
             unit="none", decimals=0, w=3),
        stat(ids, "Step time p99 (slowest rank)", "99th percentile of the engine step's wall time on the "
             "slowest EP rank: every rank waits for the busiest one.",
             f"max({_step_quantile(0.99, f'{L_RANK}, le')})", unit="s", w=3),
        replicas_stat(ids),
        stat(ids, "Generation tokens/s", "Output tokens per second from vLLM (all pods).",
             f"sum(rate({_vllm('vllm:generation_tokens', '_total')}{{{SEL_VLLM}}}{RATE}))", unit="short"),
    ):
        d = d.with_panel(p)

    d = d.with_row(gdash.Row("Balance across layers").id(ids()))
    d = d.with_panel(heatmap_of_series(
        ids, "Balancedness per layer (layer x time)",
        "One row per MoE layer, its balancedness over time (mean / max tokens per EP rank; red = unbalanced). "
        "The exporter's gauge where a pod holds every rank of its engine, else computed from the per-rank "
        "counters.", query(BALANCEDNESS_BY_LAYER, "{{layer}}"), w=12, h=10, unit="percentunit",
        scheme="RdYlGn", y_label="layer", min_max=(0, 1)))
    d = d.with_panel(timeseries(
        ids, "Top $topk imbalanced layers: max / mean rank load",
        "The $topk layers whose busiest EP rank carries the most over the mean, at each point in time "
        "(1 = balanced). Pick one in the layer variable for its experts.",
        [query(f"topk($topk, {IMBALANCE_BY_LAYER})", "layer {{layer}}")], w=12, h=10, unit="none",
        decimals=2))
    d = d.with_panel(timeseries(
        ids, "Step duration per EP rank (p50, p99)",
        "Quantiles of one engine step's wall time per EP rank, from the exporter's step histogram: the "
        "slowest rank sets the pace; a sync rearrangement's stall lands in the step it happens in.",
        [query(_step_quantile(0.99, f"{L_RANK}, le"), "rank {{rank}} p99"),
         query(_step_quantile(0.5, f"{L_RANK}, le"), "rank {{rank}} p50")], w=12, h=8, unit="s"))
    d = d.with_panel(timeseries(
        ids, "Rearrangements and their duration",
        "EPLB rearrangements per interval per pod (bars), the p99 of their duration (right axis), and "
        "failures of vLLM's async EPLB worker per pod (vLLM >= 0.34; bars, none is good).",
        [query(f"sum by (pod) (increase({mn.REARRANGEMENTS}{{{SEL}}}{RATE}))", "{{pod}}"),
         query(f"histogram_quantile(0.99, sum by (le) (rate({rs}{RATE})))", "duration p99"),
         query(f"sum by (pod) (increase({mn.REBALANCE_FAILURES}{{{SEL}}}{RATE}))", "{{pod}} async worker failures")],
        w=12, h=8, unit="none", bars=True)
        .override_by_query("B", [gdm.DynamicConfigValue(id_val="unit", value="s"),
                                 gdm.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
                                 gdm.DynamicConfigValue(id_val="custom.drawStyle", value="line")]))

    d = d.with_row(gdash.Row("Layer $layer: experts and ranks").id(ids()))
    d = d.with_panel(heatmap_of_series(
        ids, "Layer $layer: tokens/s per expert",
        "Tokens per second routed to each logical expert of the selected layer over time (one row per "
        "expert). Hot rows are the experts EPLB replicates.",
        query(f"sum by ({L_EXPERT}) (rate({mn.EXPERT_TOKENS}{{{SEL_LAYER}}}{RATE}))", "{{expert}}"),
        w=12, h=10, unit="short", scheme="Oranges", y_label="expert"))
    d = d.with_panel(timeseries(
        ids, "Layer $layer: tokens/s per EP rank",
        "Tokens per second each EP rank processes in the selected layer (after EPLB's placement), and "
        "their mean: the gap between the top line and the mean is the imbalance.",
        [query(f"sum by ({L_RANK}) (rate({mn.RANK_TOKENS}{{{SEL_LAYER}}}{RATE}))", "rank {{rank}}"),
         query(f"avg(sum by ({L_RANK}) (rate({mn.RANK_TOKENS}{{{SEL_LAYER}}}{RATE})))", "mean")],
        w=12, h=10, unit="short"))

    row = gdash.Row("Hot experts and replicas (all layers)").id(ids()).collapsed(True)
    for p in (
        bargauge(ids, "Top $topk hot experts", "The experts with the most tokens/s over all layers right now.",
                 query(f"topk($topk, sum by ({L_LAYER}, {L_EXPERT}) ({EXPERT_RATE}))",
                       "layer {{layer}} expert {{expert}}", instant=True), w=8, h=10, unit="short"),
        bargauge(ids, "Top $topk load per replica", "Tokens/s per physical replica for the hottest experts "
                 "(expert load / replica count): what EPLB evens out across ranks.",
                 query(f"topk($topk, sum by ({L_LAYER}, {L_EXPERT}) ({EXPERT_RATE}) / on ({L_LAYER}, {L_EXPERT}) "
                       f"{replicas_or_one})", "layer {{layer}} expert {{expert}}", instant=True),
                 w=8, h=10, unit="short"),
        table(ids, "Replicated experts", "Experts that EPLB currently holds more than one physical copy "
              "of, with their replica count.", [query(f"{replicas} > 1", instant=True, table=True)],
              w=8, h=10, transformations=[organize(["Time"], {"Value": "replicas"})]),
        timeseries(ids, "Redundant replicas per layer", "Physical expert slots beyond one per logical "
                   "expert, per layer (the running num_redundant_experts, as placed by EPLB).",
                   [query(f"sum by ({L_LAYER}) ({replicas}) - count by ({L_LAYER}) ({replicas})",
                          "layer {{layer}}")], w=24, h=7, unit="none", decimals=0),
    ):
        row = row.with_panel(p)
    d = d.with_row(row)

    row = gdash.Row("Steps, rearrangements and exporters").id(ids()).collapsed(True)
    for p in (
        timeseries(ids, "Mean step duration per EP rank", "Mean wall time of one engine step per rank "
                   "(_sum / _count of the step histogram).",
                   [query(f"sum by ({L_RANK}) (rate({mn.STEP_SECONDS}_sum{{{SEL}}}{RATE})) / "
                          f"sum by ({L_RANK}) (rate({mn.STEP_SECONDS}_count{{{SEL}}}{RATE}))", "rank {{rank}}")],
                   w=8, unit="s"),
        timeseries(ids, "Tokens per engine step", "Tokens one engine step routes (p50, p99 and mean over "
                   "ranks): the batch the step time is paid for.",
                   [query(_step_quantile(0.5, "le", mn.STEP_TOKENS), "p50"),
                    query(_step_quantile(0.99, "le", mn.STEP_TOKENS), "p99"),
                    query(f"sum(rate({mn.STEP_TOKENS}_sum{{{SEL}}}{RATE})) / "
                          f"sum(rate({mn.STEP_TOKENS}_count{{{SEL}}}{RATE}))", "mean")], w=8, unit="short"),
        timeseries(ids, "Engine steps/s", "Engine steps per second per pod: window size and step interval "
                   "are counted in steps, so this converts them to seconds.",
                   [query(f"sum by (pod) (rate({mn.ENGINE_STEPS}{{{SEL}}}{RATE}))", "{{pod}}")], w=8, unit="short"),
        timeseries(ids, "Rearrangement duration", "How long a rearrangement takes (weight moves; a sync "
                   "rearrangement stalls the engine for this long); for async EPLB on vLLM >= 0.34 also "
                   "vLLM's own timing of each async cycle.",
                   [query(f"histogram_quantile(0.5, sum by (le) (rate({rs}{RATE})))", "p50"),
                    query(f"histogram_quantile(0.99, sum by (le) (rate({rs}{RATE})))", "p99"),
                    query(f"sum(rate({mn.REARRANGEMENT_SECONDS}_sum{{{SEL}}}{RATE})) / "
                          f"sum(rate({mn.REARRANGEMENT_SECONDS}_count{{{SEL}}}{RATE}))", "mean"),
                    query(f"histogram_quantile(0.99, sum by (le) (rate({mn.ASYNC_REARRANGEMENT_SECONDS}_bucket"
                          f"{{{SEL}}}{RATE})))", "async p99 (vLLM's own timing, >= 0.34)")], w=8, unit="s"),
        stat(ids, "EP ranks reporting", "EP ranks whose load the exporters serve, over all pods; it should "
             "equal the EP size (tensor x data) times the replicas.",
             f"sum(max by (pod) ({mn.EXPORTER_RANKS}{{{SEL}}}))", unit="none", decimals=0, w=8, h=8),
        stat(ids, "Exporter restarts in range", "Times an exporter restarted (its counters start again at "
             "0) in the dashboard's time range: an engine restart, e.g. after an applied change.",
             f"sum(changes({mn.EXPORTER_START_TIME}{{{SEL}}}[$__range]))", unit="none", decimals=0, w=8, h=8),
        table(ids, "EPLB settings running", "The EPLB settings each pod runs with, from the exporter's info "
              "metric (window size and step interval in engine steps).",
              [query(f"max by (pod, {L_MODEL}, {', '.join(mn.CONFIG_INFO_LABELS)}) ({mn.CONFIG_INFO}{{{SEL}}})",
                     instant=True, table=True)], w=24, h=5, transformations=[organize(["Time", "Value"])]),
        timeseries(ids, "Window and interval in force (live apply)",
                   "EPLB's load window and rearrangement interval each pod's EP ranks run now (engine steps; "
                   "the lowest and highest window over a pod's ranks differ only while a live change is under "
                   "way), and the engine step they took effect on: a live change moves these lines without a "
                   "restart. Shown where the exporter can apply settings live.",
                   [query(f"min by (pod) ({mn.SETTINGS_WINDOW_SIZE}{{{SEL}}})", "{{pod}} window"),
                    query(f"max by (pod) ({mn.SETTINGS_WINDOW_SIZE}{{{SEL}}})", "{{pod}} window (max)"),
                    query(f"max by (pod) ({mn.SETTINGS_STEP_INTERVAL}{{{SEL}}})", "{{pod}} interval"),
                    query(f"max by (pod) ({mn.SETTINGS_SINCE_STEP}{{{SEL}}})", "{{pod}} since step")],
                   w=24, unit="none"),
    ):
        row = row.with_panel(p)
    d = d.with_row(row)

    row = gdash.Row("Serving (vLLM)").id(ids()).collapsed(True)
    for metric, title in (("vllm:time_to_first_token_seconds", "Time to first token"),
                          ("vllm:inter_token_latency_seconds", "Inter-token latency")):
        b = f"{_vllm(metric, '_bucket')}{{{SEL_VLLM}}}"
        row = row.with_panel(timeseries(
            ids, title, f"{title} quantiles from vLLM's histogram over $__rate_interval, all pods.",
            [query(f"histogram_quantile({q}, sum by (le) (rate({b}{RATE})))", f"p{int(q * 100)}")
             for q in (0.5, 0.9, 0.99)]
            + [query(f"sum(rate({_vllm(metric, '_sum')}{{{SEL_VLLM}}}{RATE})) / "
                     f"sum(rate({_vllm(metric, '_count')}{{{SEL_VLLM}}}{RATE}))", "mean")], w=12, unit="s"))
    for p in (
        timeseries(ids, "Token throughput", "Prompt (prefill) and generation tokens per second.",
                   [query(f"sum(rate({_vllm('vllm:prompt_tokens', '_total')}{{{SEL_VLLM}}}{RATE}))", "prompt"),
                    query(f"sum(rate({_vllm('vllm:generation_tokens', '_total')}{{{SEL_VLLM}}}{RATE}))",
                          "generation")], w=6, unit="short"),
        timeseries(ids, "Requests running / waiting", "Requests in the running batch and in the queue.",
                   [query(f"sum({_vllm('vllm:num_requests_running')}{{{SEL_VLLM}}})", "running"),
                    query(f"sum({_vllm('vllm:num_requests_waiting')}{{{SEL_VLLM}}})", "waiting")], w=6, unit="none"),
        timeseries(ids, "KV-cache usage", "KV-cache usage per pod and DP engine (1 = full).",
                   [query(f"max by (pod, engine) ({_vllm('vllm:kv_cache_usage_perc')}{{{SEL_VLLM}}})",
                          "{{pod}} engine {{engine}}")], w=6, unit="percentunit", min_max=(0, 1)),
        timeseries(ids, "KV-cache bytes per GPU", "KV-cache memory of one GPU per EP rank (the exporter's "
                   "gauge): what redundant experts' weights take away from the KV cache.",
                   [query(f"max by ({L_RANK}) ({mn.KV_CACHE_BYTES}{{{SEL}}})", "rank {{rank}}")],
                   w=6, unit="bytes"),
        timeseries(ids, "Requests finished and aborted", "vLLM's own request counter per second: finished "
                   "requests, and those aborted -- a faulted engine (spec.faultTolerance) aborts everything it "
                   "runs; clients' aborts count here too. The operator's recovery phases are on the MoE EPLB "
                   "operator dashboard (Fault recovery per MoEInference).",
                   [query(f'sum(rate({_vllm("vllm:request_success", "_total")}{{{SEL_VLLM}, '
                          f'finished_reason!="abort"}}{RATE}))', "finished"),
                    query(f'sum(rate({_vllm("vllm:request_success", "_total")}{{{SEL_VLLM}, '
                          f'finished_reason="abort"}}{RATE}))', "aborted")], w=24, unit="reqps"),
    ):
        row = row.with_panel(p)
    rep = f"{mn.REPLICAS}{{{SEL_TUNER}"
    ready = f"scalar(clamp_min(max({rep}, state=\"ready\"}}), 1))"
    for p in (
        timeseries(ids, "Replicas (desired, ready, autoscaler's range)",
                   "Replica groups of the MoEInference: desired (spec.replicas, the autoscaler's choice when "
                   "spec.autoscaling is on), ready, and the autoscaler's minReplicas and maxReplicas (the "
                   "operator's gauges; no range without an autoscaler). Desired at max with requests waiting "
                   "is the MoEEPLBAutoscalerAtMax alert.",
                   [query(f"max({rep}, state=\"desired\"}})", "desired"),
                    query(f"max({rep}, state=\"ready\"}})", "ready"),
                    query(f"max({mn.AUTOSCALER_MAX_REPLICAS}{{{SEL_TUNER}}})", "max"),
                    query(f"max({mn.AUTOSCALER_MIN_REPLICAS}{{{SEL_TUNER}}})", "min")], w=12, unit="none",
                   decimals=0),
        timeseries(ids, "Autoscaler's metric and target",
                   "The metrics spec.autoscaling can scale on, as the autoscaler computes them: vLLM's waiting "
                   "requests per ready replica, mean KV-cache usage (0..1) and p90 time to first token (s), with "
                   "the target of the one chosen (moe_eplb_autoscaler_target, labelled by metric).",
                   [query(f"sum({_vllm('vllm:num_requests_waiting')}{{{SEL_VLLM}}}) / {ready}",
                          "waiting per replica"),
                    query(f"avg({_vllm('vllm:kv_cache_usage_perc')}{{{SEL_VLLM}}})", "KV-cache usage"),
                    query(f"histogram_quantile(0.9, sum by (le) (rate("
                          f"{_vllm('vllm:time_to_first_token_seconds', '_bucket')}{{{SEL_VLLM}}}{RATE})))", "TTFT p90"),
                    query(f"max by (metric) ({mn.AUTOSCALER_TARGET}{{{SEL_TUNER}}})", "target ({{metric}})")],
                   w=12, unit="short"),
    ):
        row = row.with_panel(p)

    d = d.with_row(row)

    row = gdash.Row("Autotune and calibration").id(ids()).collapsed(True)
    for p in arm_panels(ids):
        row = row.with_panel(p)
    cal = f"{mn.CALIBRATION_VALUE}{{{SEL_TUNER}}}"
    unc = f"{mn.CALIBRATION_UNCERTAINTY}{{{SEL_TUNER}}}"
    cal_p = f'{mn.CALIBRATION_VALUE}{{{SEL_TUNER}, parameter="$parameter"}}'
    unc_p = f'{mn.CALIBRATION_UNCERTAINTY}{{{SEL_TUNER}, parameter="$parameter"}}'
    for p in (
        timeseries(ids, "Tuner evaluations", "Evaluations of the autotune loop for this MoEInference, by result.",
                   [query(f"sum by (result) (increase({mn.TUNER_EVALUATIONS}{{{SEL_TUNER}}}{RATE}))", "{{result}}")],
                   w=8, unit="none"),
        timeseries(ids, "Tuner decisions", "What each evaluation decided: " + ", ".join(decisions.DECISIONS) + ".",
                   [query(f"sum by (decision) (increase({mn.TUNER_DECISIONS}{{{SEL_TUNER}}}{RATE}))",
                          "{{decision}}")], w=8, unit="none"),
        timeseries(ids, "Predicted gain and rollbacks", "Predicted relative throughput gain of the last "
                   "recommendation, and rollbacks of applied settings by reason.",
                   [query(f"max({mn.TUNER_PREDICTED_GAIN}{{{SEL_TUNER}}})", "predicted gain"),
                    query(f"sum by (reason) (increase({mn.ROLLBACKS}{{{SEL_TUNER}}}{RATE}))", "rollback: {{reason}}")],
                   w=8, unit="none"),
        timeseries(ids, "Replica load divergence", "Jensen-Shannon divergence (bits) between the replicas' "
                   "expert loads at each evaluation (two or more replicas): 0 when every replica sees the same "
                   f"load; above {replica_tuning.DIVERGENCE_THRESHOLD} bits the loop tunes each replica "
                   "on its own load and records the per-replica picks in status.autotune.lastEvaluation.replicas.",
                   [query(f"max({mn.REPLICA_LOAD_DIVERGENCE}{{{SEL_TUNER}}})", "divergence (bits)")],
                   w=24, h=6, unit="short"),
        table(ids, "Calibration of the cost model", "The cost-model parameters the last evaluation tuned "
              "with: measured from this deployment's telemetry, or the default kept (source), and one "
              "standard error of a measured one (empty for a default).",
              [query(f"max by (parameter, source) ({cal})", instant=True, table=True),
               query(f"max by (parameter) ({unc})", instant=True, table=True)],
              w=24, h=7, transformations=[
                  gdm.DataTransformerConfig(id_val="merge", options={}),
                  organize(["Time"], {"Value #A": "value", "Value #B": "uncertainty (1 s.e.)"})]),
        timeseries(ids, "Calibration: $parameter", "The calibrated value of $parameter over time, by source, "
                   "with a band of one standard error around it (measured values only).",
                   [query(f"max by (source) ({cal_p})", "{{source}}"),
                    query(f"max({cal_p}) + max({unc_p})", "+1 s.e."),
                    query(f"max({cal_p}) - max({unc_p})", "-1 s.e.")], w=8, unit="short")
        .repeat("parameter").repeat_direction("h").max_per_row(3),
    ):
        row = row.with_panel(p)
    d = d.with_row(row)

    d = (d.with_variable(datasource_variable())
         .with_variable(query_variable("namespace", "Namespace", f"label_values({mn.CONFIG_INFO}, namespace)"))
         .with_variable(query_variable("moeinference", "MoEInference",
                                       f'label_values({mn.CONFIG_INFO}{{namespace="$namespace"}}, {L_INF})'))
         .with_variable(query_variable(
             "model_name", "Model", f'label_values({mn.CONFIG_INFO}{{namespace="$namespace", '
             f'{L_INF}="$moeinference"}}, {L_MODEL})', include_all=True,
             description="The served model name: the same label on the exporter's and vLLM's series."))
         .with_variable(query_variable(
             "engine", "DP engine", f'label_values({_vllm("vllm:num_requests_running")}{{namespace="$namespace", '
             f'{L_INF}="$moeinference"}}, engine)', multi=True, include_all=True,
             sort=gdm.VariableSort.NUMERICAL_ASC))
         .with_variable(query_variable(
             "layer", "Layer (worst first)", LAYER_VARIABLE_QUERY, sort=gdm.VariableSort.DISABLED,
             regex=LAYER_VARIABLE_REGEX,
             description="One MoE layer for the per-expert panels; the list is ordered by imbalance over "
                         "the time range, so the default (the first) is the most imbalanced layer."))
         .with_variable(custom_variable("topk", "Top k", ["5", "10", "20", "50"],
                                        "How many layers / experts the top-k panels show."))

         .with_variable(query_variable(
             "parameter", "Calibration parameter",
             f'label_values({mn.CALIBRATION_VALUE}{{{SEL_TUNER}}}, parameter)', multi=True, include_all=True,
             description="Cost-model parameters shown in the collapsed calibration row (one panel each)."))
         )
    for a in (
        annotation("Tuner recommended", f'sum by (decision) (increase({mn.TUNER_DECISIONS}{{{SEL_TUNER}, '
                   f'decision="{decisions.RECOMMEND}"}}[2m])) > 0', "Tuner recommended new EPLB settings",
                   "yellow", tags="decision"),
        annotation("Tuner applied", f'sum by (decision) (increase({mn.TUNER_DECISIONS}{{{SEL_TUNER}, '
                   f'decision="{decisions.APPLY}"}}[2m])) > 0', "Tuner applied new EPLB settings (pods roll)",
                   "green", tags="decision"),
        annotation("Rollbacks", f"sum by (reason) (increase({mn.ROLLBACKS}{{{SEL_TUNER}}}[2m])) > 0",
                   "Tuner rolled back: {{reason}}", "red", tags="reason"),
        annotation("Rearrangements", f"sum(increase({mn.REARRANGEMENTS}{{{SEL}}}[2m])) > 0",
                   "EPLB rearrangement", "blue", enable=False),
    ):
        d = d.annotation(a)
    return d


def fault_recovery_row(ids: _Ids, sel: str) -> gdash.Row:
    """The "Fault recovery per MoEInference" row of the operator dashboard (spec.faultTolerance): the
    recovery phase, lost ranks, rounds and their durations, and the time left before the engines of a
    group with a round in flight give up. (Requests a fault aborted are vLLM's own counter, on the
    MoE expert load dashboard's Serving row.)"""
    row = gdash.Row("Fault recovery per MoEInference").id(ids())
    for p in (
        timeseries(ids, "Recovery phase", "The fault-recovery phase of each MoEInference with "
                   "spec.faultTolerance (its worst replica group's): Healthy, Recovering (a round prepared, "
                   "sent or polled), Degraded (a group serves on fewer ranks after scale_down), Restoring (its "
                   "planned restart), Failed (the engines give up; the group restarts).",
                   [query(f"max by (namespace, name, phase) ({mn.RECOVERY_PHASE}{{{sel}}}) > 0",
                          "{{namespace}}/{{name}} {{phase}}")], w=8, unit="none", decimals=0),
        timeseries(ids, "Lost ranks and time left", "Data-parallel ranks the replica groups run without (after "
                   "scale_down), and the seconds left before the engines of a group with a round in flight give "
                   "up (vLLM's engine_recovery_timeout_sec; MoEEPLBRecoveryStuck fires 30 s after it runs out).",
                   [query(f"max by (namespace, name) ({mn.RECOVERY_LOST_RANKS}{{{sel}}})",
                          "{{namespace}}/{{name}} lost ranks"),
                    query(f"max by (namespace, name, group) ({mn.RECOVERY_DEADLINE}{{{sel}}}) - time()",
                          "{{namespace}}/{{name}} group {{group}}: seconds left")], w=8, unit="short"),
        timeseries(ids, "Recovery rounds", "Rounds the operator finished, by instruction (retry, scale_down) "
                   "and result (Succeeded, Failed, TimedOut, Superseded).",
                   [query(f"sum by (namespace, name, instruction, result) (increase({mn.RECOVERY_ROUNDS}{{{sel}}}"
                          f"{RATE}))", "{{namespace}}/{{name}} {{instruction}} {{result}}")], w=8, unit="none"),
        timeseries(ids, "Fault to round end", "Seconds from a fault to the end of its round, by instruction "
                   "(every MoEInference of the operator: the histogram has no resource label).",
                   [query(f"histogram_quantile({q}, sum by (le, instruction) (rate("
                          f"{mn.RECOVERY_ROUND_SECONDS}_bucket{RATE})))", f"p{int(q * 100)} {{{{instruction}}}}")
                    for q in (0.5, 0.99)], w=24, unit="s"),
    ):
        row = row.with_panel(p)
    return row


def elastic_row(ids: _Ids, sel: str) -> gdash.Row:
    """"Elastic groups": each elastic MoEInference's size, its resizes and their phases (the operator's
    moe_eplb_elastic_* series; empty where no resource has spec.parallelism.elastic)."""
    row = gdash.Row("Elastic groups (resizes)").id(ids()).collapsed(True)
    by = "namespace, name"
    for p in (
        timeseries(ids, "Data-parallel ranks: now and target",
                   "status.elastic.dataParallel (the committed topology) and targetDataParallel (what the "
                   "operator drives it to: spec.replicas pods, set by the autoscaler or by hand), per group.",
                   [query(f"max by ({by}) ({mn.ELASTIC_DATA_PARALLEL}{{{sel}}})", "{{namespace}}/{{name}} now"),
                    query(f"max by ({by}) ({mn.ELASTIC_TARGET_DATA_PARALLEL}{{{sel}}})",
                          "{{namespace}}/{{name}} target")], w=8, unit="none", decimals=0),
        timeseries(ids, "Resize phase", "The phase of each group's status.elastic (1 while in it): Starting or "
                   "Draining, Preparing and Committing (vLLM's), Retiring, RollingBack, RestartingGroup, Failed, "
                   "Stable.",
                   [query(f"max by ({by}, phase) ({mn.ELASTIC_PHASE}{{{sel}}}) > 0", "{{namespace}}/{{name}} {{phase}}")],
                   w=8, unit="none", decimals=0),
        timeseries(ids, "Resize in progress vs its deadline",
                   "How long each group's resize in progress has run, and the deadline after which the operator "
                   "restarts the group to a known state (MoEEPLBResizeStuck fires past it).",
                   [query(f"max by ({by}) ({mn.ELASTIC_RESIZE_SECONDS}{{{sel}}})", "{{namespace}}/{{name}} running"),
                    query(f"max by ({by}) ({mn.ELASTIC_RESIZE_DEADLINE}{{{sel}}})", "{{namespace}}/{{name}} deadline")],
                   w=8, unit="s"),
        timeseries(ids, "Resizes by result", "Finished resizes by group, direction and result (completed, "
                   "rolled_back, group_restarted); anything but completed is MoEEPLBResizeFailed.",
                   [query(f"sum by ({by}, direction, result) (increase({mn.ELASTIC_RESIZES}{{{sel}}}{RATE}))",
                          "{{namespace}}/{{name}} {{direction}} {{result}}")], w=12, unit="none"),
        timeseries(ids, "Resize duration", "How long finished resizes took, by direction and result (p90).",
                   [query(f"histogram_quantile(0.9, sum by (le, direction, result) "
                          f"(rate({mn.ELASTIC_RESIZE_DURATION}_bucket{{{sel}}}{RATE})))", "p90 {{direction}} {{result}}")],
                   w=12, unit="s"),
    ):
        row = row.with_panel(p)
    return row


def operator_overview() -> gdash.Dashboard:
    """"MoE EPLB operator": the operator's reconciles and the tuner across MoEInferences."""
    ids = _Ids()
    sel = 'namespace=~"$namespace"'
    job = 'job=~"$job"'
    d = dashboard("moe-eplb-operator", "MoE EPLB operator",
                  "The moe-eplb operator: reconciles, the autotune loop and its calibration across MoEInferences.",
                  ["moe-eplb"])
    d = d.with_row(gdash.Row("Operator").id(ids()))
    for p in (
        stat(ids, "Operator replicas up", "Operator pods Prometheus scrapes successfully (one leads via kopf "
             "peering, the others stand by).", f"sum(up{{{job}}})", unit="none", decimals=0, w=6),
        stat(ids, "Reconcile errors (1h)", "Reconciles that failed in the last hour (result=error; "
             "result=invalid counts specs the validation rejected).",
             f'sum(increase({mn.RECONCILES}{{{job}, result="error"}}[1h]))', unit="none", decimals=0, w=6),
        stat(ids, "Tuner evaluations (1h)", "Autotune evaluations in the last hour.",
             f"sum(increase({mn.TUNER_EVALUATIONS}{{{sel}}}[1h]))", unit="none", decimals=0, w=6),
        stat(ids, "Rollbacks (24h)", "Rollbacks of applied EPLB settings in the last day.",
             f"sum(increase({mn.ROLLBACKS}{{{sel}}}[24h]))", unit="none", decimals=0, w=6),
        timeseries(ids, "Reconciles", "Reconciles per second by result.",
                   [query(f"sum by (result) (rate({mn.RECONCILES}{{{job}}}{RATE}))", "{{result}}")], unit="ops"),
        timeseries(ids, "Tuner evaluation duration", "Time one tuner evaluation takes (reading load, "
                   "simulating candidate settings).",
                   [query(f"histogram_quantile({q}, sum by (le) (rate({mn.TUNER_DURATION_SECONDS}_bucket"
                          f"{{{job}}}{RATE})))", f"p{int(q * 100)}") for q in (0.5, 0.99)], unit="s"),
    ):
        d = d.with_panel(p)
    d = d.with_row(gdash.Row("Autotune per MoEInference").id(ids()))
    for p in (
        timeseries(ids, "Evaluations by result", "Tuner evaluations per MoEInference and result.",
                   [query(f"sum by (namespace, name, result) (increase({mn.TUNER_EVALUATIONS}{{{sel}}}{RATE}))",
                          "{{namespace}}/{{name}} {{result}}")], unit="none"),
        timeseries(ids, "Decisions", "Tuner decisions per MoEInference.",
                   [query(f"sum by (namespace, name, decision) (increase({mn.TUNER_DECISIONS}{{{sel}}}{RATE}))",
                          "{{namespace}}/{{name}} {{decision}}")], unit="none"),
        timeseries(ids, "Predicted gain", "Predicted relative throughput gain of each MoEInference's last "
                   "recommendation.",
                   [query(f"max by (namespace, name) ({mn.TUNER_PREDICTED_GAIN}{{{sel}}})",
                          "{{namespace}}/{{name}}")], unit="percentunit"),
        timeseries(ids, "Time since last successful evaluation", "Age of the last successful tuner "
                   "evaluation per MoEInference; it should stay near the evaluation interval.",
                   [query(f"time() - max by (namespace, name) ({mn.TUNER_LAST_SUCCESS}{{{sel}}})",
                          "{{namespace}}/{{name}}")], unit="s"),
        timeseries(ids, "Calibrated parameters by source", "Cost-model parameters per MoEInference that the "
                   "last evaluation measured from the deployment's telemetry, or kept at their default "
                   "(too little or too noisy data).",
                   [query(f"count by (namespace, name, source) ({mn.CALIBRATION_VALUE}{{{sel}}})",
                          "{{namespace}}/{{name}} {{source}}")], w=24, unit="none", decimals=0),
        timeseries(ids, "Replica load divergence", "Jensen-Shannon divergence (bits) between each MoEInference's "
                   f"replicas' expert loads; above {replica_tuning.DIVERGENCE_THRESHOLD} bits the loop tunes each replica "
                   "on its own load (a cache-affine router sends each replica different traffic).",
                   [query(f"max by (namespace, name) ({mn.REPLICA_LOAD_DIVERGENCE}{{{sel}}})",
                          "{{namespace}}/{{name}}")], w=24, unit="short"),
    ):
        d = d.with_panel(p)
    d = d.with_row(fault_recovery_row(ids, sel))
    d = d.with_row(elastic_row(ids, sel))
    d = (d.with_variable(datasource_variable())
         .with_variable(query_variable("job", "Operator job", f"label_values({mn.RECONCILES}, job)", multi=True,
                                       include_all=True))
         .with_variable(query_variable("namespace", "Namespace", f"label_values({mn.TUNER_EVALUATIONS}, namespace)",
                                       multi=True, include_all=True)))
    d = d.annotation(annotation(
        "Rollbacks", f"sum by (namespace, name, reason) (increase({mn.ROLLBACKS}{{{sel}}}[2m])) > 0",
        "Rollback {{namespace}}/{{name}}: {{reason}}", "red", tags="reason"))
    return d


#: file name -> builder of each dashboard the chart ships
DASHBOARDS = {
    "moe-expert-load.json": expert_load,
    "moe-eplb-operator.json": operator_overview,
}


def to_json(d: gdash.Dashboard) -> str:
    """The dashboard as Grafana's JSON model (sorted keys, 2-space indent, trailing newline)."""
    return json.dumps(json.loads(json.dumps(d.build(), cls=JSONEncoder)), indent=2, sort_keys=True) + "\n"
