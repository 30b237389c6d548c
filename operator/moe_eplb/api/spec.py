"""The typed model of a MoEInference: parse the resource once, use typed values everywhere after.

:func:`parse` takes the resource as a dict (as kopf or ``yaml.safe_load`` give it), applies the
CRD's defaults once, and returns a frozen :class:`MoEInference`: the spec, the tuner's record
(``status.autotune``, :mod:`moe_eplb.api.autotune_status`), and the **effective** EPLB settings --
the tuner's override resolved against ``spec.eplb`` with the pinned precedence (see
:func:`resolve_effective`). Handlers, timer ticks and CLI commands call it once; rendering, the
tuner, the decision and the rollout take the typed values. camelCase keys are read here and in
:mod:`moe_eplb.api.convert` only.

It assumes a resource that passes the CRD's schema (:mod:`moe_eplb.api.validation`); on one that
does not, it raises :class:`SpecError` naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_eplb.api import catalog, wide_ep
from moe_eplb.api import elastic as elastic_api
from moe_eplb.api.autotune_status import AutotuneStatus, LiveSettings, Override, parse_autotune_status
from moe_eplb.api.convert import ConvertError, from_crd, to_crd
from moe_eplb.api.crd import openapi_schema
from moe_eplb.api.elastic import ElasticStatus, parse_status
from moe_eplb.api.imageref import parse_image
from moe_eplb.api.knobs import Bounds, Knobs, KnobsError
from moe_eplb.api.layout import Layout, layout
from moe_eplb.api.podtemplate import PodTemplateOverlay
from moe_eplb.api.quantity import quantity_bytes
from moe_eplb.api.recovery_status import RecoveryStatus, parse_recovery_status
from moe_eplb.api.schema import fill_schema_defaults
from moe_eplb.api.versions import Version, parse_version
from moe_eplb.contracts import k8s_names, vllm_facts

MODES = ("Off", "Recommend", "Apply")


class SpecError(ValueError):
    """The resource cannot be read into the typed model; the message starts with the field."""


def to_plain(value: Any) -> Any:
    """A deep copy made of plain dicts and lists (kopf bodies and other mappings are views)."""
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def apply_defaults(resource: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``resource`` with the CRD's schema defaults filled in, as the apiserver stores it."""
    return fill_schema_defaults(to_plain(resource), openapi_schema())


# --------------------------------------------------------------------------------------------------
# spec
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeShape:
    """MoE shape used for validation and memory math (catalog, overridden by spec.model.moe)."""

    num_experts: int | None
    num_moe_layers: int | None
    top_k: int | None
    num_expert_groups: int
    bytes_per_expert: int | None


@dataclass(frozen=True)
class MoeOverride:
    """``spec.model.moe``: the shape of a model the catalog does not know (or corrections)."""

    num_experts: int | None = None
    num_moe_layers: int | None = None
    top_k: int | None = None
    num_expert_groups: int | None = None
    bytes_per_expert: int | None = None


@dataclass(frozen=True)
class PvcStorage:
    claim_name: str
    mount_path: str = "/models"
    sub_path: str | None = None
    read_only: bool = False


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str = "token"


@dataclass(frozen=True)
class ConfigMapKeyRef:
    name: str
    key: str = "chat_template.jinja"


@dataclass(frozen=True)
class Model:
    name: str
    served_name: str | None = None
    architecture: str | None = None  # as given in the spec
    quantization: str | None = None  # as given in the spec
    moe: MoeOverride = field(default_factory=MoeOverride)
    pvc: PvcStorage | None = field(default=None, metadata={"key": "storage.pvc"})
    hf_token_secret: SecretKeyRef | None = field(default=None, metadata={"key": "storage.hfTokenSecret"})


def _pull_secret_names(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, Mapping) and isinstance(x.get("name"), str) for x in value):
        raise ConvertError(f"{path}: expected a list of {{name: <secret>}}")
    return tuple(x["name"] for x in value)


@dataclass(frozen=True)
class ExporterSpec:
    """``spec.engine.exporter``: inject the plugin into the engine pods (default), and from which image."""

    inject: bool = True
    image: str | None = None


@dataclass(frozen=True)
class Engine:
    image: str
    version_field: str | None = field(default=None, metadata={"key": "version"})
    dtype: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_encoder_tp_mode: str | None = None
    chat_template: ConfigMapKeyRef | None = field(default=None, metadata={"key": "chatTemplate.configMapRef"})
    extra_args: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = field(default=(), metadata={"raw": True})
    resources: dict[str, Any] = field(default_factory=dict, metadata={"raw": True})
    shm_size: Any = None  # a Kubernetes quantity, string or number
    startup_timeout_seconds: int = 3600
    drain_seconds: int = 600
    gpu_resource_name: str = "nvidia.com/gpu"
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = field(default=(), metadata={"raw": True})
    image_pull_secrets: tuple[str, ...] = field(default=(), metadata={"read": _pull_secret_names})
    exporter: ExporterSpec = field(default_factory=ExporterSpec)
    gpu_memory: Any = None  # one GPU's memory (a Kubernetes quantity); else from the node selector
    pod_template: PodTemplateOverlay | None = None

    @property
    def moe_backend_arg(self) -> str | None:
        """The value of ``--moe-backend`` given in ``extraArgs``, if any."""
        args = self.extra_args
        for i, arg in enumerate(args):
            if arg.startswith("--moe-backend="):
                return arg.split("=", 1)[1]
            if arg == "--moe-backend" and i + 1 < len(args):
                return args[i + 1]
        return None

    @property
    def gpu_memory_bytes(self) -> int | None:
        return quantity_bytes(self.gpu_memory) if self.gpu_memory is not None else None

    @property
    def version(self) -> Version | None:
        """vLLM version: ``spec.engine.version``, else parsed from the image tag, else None."""
        if self.version_field:
            return parse_version(self.version_field)
        ref = parse_image(self.image)
        return ref.version if ref else None


@dataclass(frozen=True)
class Elastic:
    """``spec.parallelism.elastic``: the group's data-parallel size changes while it serves (vLLM's
    external elastic EP), a pod of ``dataLocal`` ranks at a time, between ``minData`` (default
    ``spec.parallelism.data``, the launch size) and ``maxData`` (``--elastic-ep-max-dp-size``)."""

    enabled: bool = False
    min_data_field: int | None = field(default=None, metadata={"key": "minData"})
    max_data_field: int | None = field(default=None, metadata={"key": "maxData"})


@dataclass(frozen=True)
class Parallelism:
    tensor: int = 1
    data: int = 1
    nodes: int = 1
    data_local_field: int | None = field(default=None, metadata={"key": "dataLocal"})
    expert: bool = True
    all2all_backend: str | None = field(default=None, metadata={"key": "all2allBackend"})  # vLLM --all2all-backend
    elastic: Elastic = field(default_factory=Elastic)

    @property
    def min_data(self) -> int:
        """The fewest data-parallel ranks an elastic group runs (``elastic.minData``, default ``data``)."""
        return self.elastic.min_data_field or self.data

    @property
    def max_data(self) -> int:
        """The most data-parallel ranks an elastic group grows to (``elastic.maxData``; ``data``
        without elastic)."""
        return (self.elastic.max_data_field or self.data) if self.elastic.enabled else self.data

    @property
    def data_local(self) -> int:
        """Data-parallel ranks per pod."""
        return self.data_local_field or max(1, self.data // self.nodes)

    @property
    def ep_size(self) -> int:
        """Expert-parallel size = tensor x data (GPUs per replica group)."""
        return self.tensor * self.data

    @property
    def gpus_per_pod(self) -> int:
        return self.tensor * self.data_local


@dataclass(frozen=True)
class SpecEplb:
    """``spec.eplb`` as written. ``num_redundant_experts`` None: omitted (the operator renders the
    minimum valid value for the version, :attr:`MoEInference.redundancy_in_force`)."""

    enabled: bool
    window_size: int
    step_interval: int
    num_redundant_experts: int | None = None
    use_async: bool | None = field(default=None, metadata={"key": "async"})
    log_balancedness: bool = False
    communicator: str | None = None  # eplb-config communicator (None: vLLM's automatic choice)

    def knobs_with(self, redundant: int) -> Knobs:
        """The knobs with ``redundant`` in force (the written value, or the resolved one when omitted)."""
        return Knobs(self.window_size, self.step_interval, redundant)


@dataclass(frozen=True)
class FaultTolerance:
    """``spec.faultTolerance``: vLLM's ``--enable-fault-tolerance``, and how many lost data-parallel
    ranks ``scale_down`` must be able to re-host (the redundancy floor, :mod:`moe_eplb.api.wide_ep`)."""

    enabled: bool = False
    rank_failures_to_survive: int = 0
    #: ``engine_recovery_timeout_sec`` (``--fault-tolerance-config``); None: vLLM's default (120 s)
    recovery_timeout_s: int | None = field(default=None, metadata={"key": "recoveryTimeoutSeconds"})


@dataclass(frozen=True)
class EplbSettings:
    """The EPLB settings of a pod template. ``source``: ``spec`` or ``autotune`` (the override)."""

    enabled: bool
    knobs: Knobs
    use_async: bool | None = None
    log_balancedness: bool = False
    source: str = "spec"
    communicator: str | None = None

    @property
    def window_size(self) -> int:
        return self.knobs.window_size

    @property
    def step_interval(self) -> int:
        return self.knobs.step_interval

    @property
    def num_redundant_experts(self) -> int:
        return self.knobs.num_redundant_experts

    def config_hash(self) -> str:
        """Short stable hash of the settings that need an engine restart (16 hex chars)."""
        payload = {"enabled": self.enabled, "window_size": self.window_size, "step_interval": self.step_interval,
                   "num_redundant_experts": self.num_redundant_experts, "use_async": self.use_async,
                   "log_balancedness": self.log_balancedness}
        if self.communicator is not None:  # absent from the hash when unset: existing pods keep their hash
            payload["communicator"] = self.communicator
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _read_bounds(value: Any, path: str) -> Bounds:
    if not isinstance(value, Mapping):
        raise ConvertError(f"{path}: expected an object")
    ranges = {}
    for key, name in (("windowSize", "window"), ("stepInterval", "interval"), ("numRedundantExperts", "redundant")):
        b = value.get(key)
        if b is None:
            continue
        if not isinstance(b, Mapping) or not all(isinstance(b.get(k), int) and not isinstance(b.get(k), bool)
                                                 for k in ("min", "max")):
            raise ConvertError(f"{path}.{key}: expected {{min: <int>, max: <int>}}")
        ranges[name] = (b["min"], b["max"])
    try:
        return Bounds(**ranges)
    except KnobsError as exc:
        raise ConvertError(f"{path}: {exc}") from None


def _read_mode(value: Any, path: str) -> str:
    if value not in MODES:
        raise ConvertError(f"{path}: {value!r} is not one of {', '.join(MODES)}")
    return value


@dataclass(frozen=True)
class ExperimentsSpec:
    """``spec.autotune.experiments``: a change first runs on one replica (group) -- the trial arm --
    while the others keep the running settings (the control arm), on the same traffic; the arms'
    objective decides (:mod:`moe_eplb.eplb.tuning.judge`). Durations in seconds; ``confidence`` is the
    two-sided level of the interval that promotes or discards the trial (each side spends half of
    ``1 - confidence`` over the looks). ``min_s``/``max_s`` count the time that is judged: after the
    restarted trial's warm-up (``warmup_s``), or from the first block of an interleaved experiment;
    ``baseline_s``: the pre-period of a cross-pod experiment (the pods' own differences on the
    running settings, measured before the trial restarts; 0: none)."""

    enabled: bool = True
    min_s: float = field(default=900.0, metadata={"key": "minSeconds"})
    max_s: float = field(default=3600.0, metadata={"key": "maxSeconds"})
    confidence: float = 0.9
    baseline_s: float = field(default=1800.0, metadata={"key": "baselineSeconds"})
    warmup_s: float = field(default=300.0, metadata={"key": "warmupSeconds"})


@dataclass(frozen=True)
class AutotuneSpec:
    """``spec.autotune`` with the CRD's defaults. Durations in seconds; the memory budget in bytes
    per GPU (None: no budget, or not a quantity -- validation names that)."""

    mode: str = field(default="Off", metadata={"read": _read_mode})
    bounds: Bounds = field(default_factory=Bounds, metadata={"read": _read_bounds})
    raw_memory_budget: Any = field(default=None, metadata={"key": "memoryBudgetPerGpu"})
    evaluation_interval_s: float = field(default=300.0, metadata={"key": "evaluationIntervalSeconds"})
    cooldown_s: float = field(default=3600.0, metadata={"key": "cooldownSeconds"})
    max_restarts_per_day: int = 4
    min_gain: float = 0.02
    rollback_tolerance: float = 0.02
    observe_s: float = field(default=600.0, metadata={"key": "observeSeconds"})
    experiments: ExperimentsSpec = field(default_factory=ExperimentsSpec)
    #: Apply mode may turn EPLB off where the tuner predicts it does not pay (else a recommendation)
    allow_disable: bool = field(default=False, metadata={"key": "allowDisable"})

    @property
    def memory_budget_bytes(self) -> int | None:
        return quantity_bytes(self.raw_memory_budget)

    @property
    def rollout_timeout_s(self) -> float:
        """How long new pods may take to become ready before the change is rolled back."""
        return max(1800.0, 3.0 * self.observe_s)


@dataclass(frozen=True)
class WorkloadSpec:
    """``spec.workload``: labels and annotations of the workload object itself (the Deployment or the
    LeaderWorkerSet), e.g. Kueue's queue label for a group's gang admission."""

    labels: dict[str, str] = field(default_factory=dict, metadata={"key": "metadata.labels"})
    annotations: dict[str, str] = field(default_factory=dict, metadata={"key": "metadata.annotations"})


@dataclass(frozen=True)
class RolloutSpec:
    max_surge: int = 1
    max_unavailable: int = 0


#: ``spec.autoscaling.metric.target`` when left out, per metric type: waiting requests per replica
#: group, KV-cache usage (fraction), TTFT quantile (seconds).
DEFAULT_AUTOSCALING_TARGETS = {"RequestsWaiting": 8.0, "KVCacheUsage": 0.8, "TTFT": 2.0}


@dataclass(frozen=True)
class AutoscalingMetric:
    """``spec.autoscaling.metric``: what the autoscaler holds at its target."""

    type: str = "RequestsWaiting"
    target_field: float | None = field(default=None, metadata={"key": "target"})
    quantile: float = 0.9
    window_seconds: int = 120

    @property
    def target(self) -> float:
        """The target, or the metric type's default (:data:`DEFAULT_AUTOSCALING_TARGETS`)."""
        return float(self.target_field) if self.target_field is not None else DEFAULT_AUTOSCALING_TARGETS[self.type]


@dataclass(frozen=True)
class ScalingRule:
    """``spec.autoscaling.scaleUp`` / ``scaleDown``: HPA behavior of one direction (at most
    ``replicas`` per ``period_seconds``, after ``stabilization_window_seconds``)."""

    stabilization_window_seconds: int
    replicas: int = 1
    period_seconds: int = 300


@dataclass(frozen=True)
class HpaSource:
    """``spec.autoscaling.hpa``: the metrics API prometheus-adapter serves the metric in."""

    metrics_api: str
    metric_name: str | None = None


@dataclass(frozen=True)
class KedaOptions:
    polling_interval_seconds: int = 30
    activation_query: str | None = None  # wakes the resource from zero (a gateway's queue)


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling`` with the CRD's defaults (replica groups; see docs/resource.md)."""

    max_replicas: int
    enabled: bool = True
    min_replicas: int = 1
    backend: str = "KEDA"
    metric: AutoscalingMetric = field(default_factory=AutoscalingMetric)
    scale_up: ScalingRule = field(default_factory=lambda: ScalingRule(0, 1, 300))
    scale_down: ScalingRule = field(default_factory=lambda: ScalingRule(1800, 1, 600))
    hpa: HpaSource | None = None
    keda: KedaOptions = field(default_factory=KedaOptions)


@dataclass(frozen=True)
class Monitoring:
    prometheus_url: str | None = None
    pod_monitor: bool = field(default=False, metadata={"key": "podMonitor.enabled"})
    pod_monitor_labels: dict[str, str] = field(default_factory=dict, metadata={"key": "podMonitor.labels"})


@dataclass(frozen=True)
class OperatorDefaults:
    """Operator-wide defaults (``moe-eplb run`` options, set by the Helm chart) for what a resource
    leaves unset; applied by :meth:`MoEInference.with_operator_defaults`, never written back."""

    prometheus_url: str | None = None
    pod_monitor_labels: Mapping[str, str] = field(default_factory=dict)
    exporter_image: str | None = None


@dataclass(frozen=True)
class Spec:
    model: Model
    engine: Engine
    parallelism: Parallelism = field(default_factory=Parallelism)
    replicas: int = 1
    eplb: SpecEplb | None = None
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    autotune: AutotuneSpec = field(default_factory=AutotuneSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    monitoring: Monitoring = field(default_factory=Monitoring)
    autoscaling_field: AutoscalingSpec | None = field(default=None, metadata={"key": "autoscaling"})

    @property
    def autoscaling(self) -> AutoscalingSpec | None:
        """``spec.autoscaling`` when an autoscaler runs (present and enabled), else None."""
        a = self.autoscaling_field
        return a if a is not None and a.enabled else None


# --------------------------------------------------------------------------------------------------
# the resource
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEInference:
    """A parsed MoEInference: metadata, spec (after defaults), the tuner's status record and the
    effective EPLB settings (what the pods run)."""

    name: str
    namespace: str | None
    uid: str | None
    generation: int
    resource_version: str | None
    labels: dict[str, str]
    spec: Spec
    status: AutotuneStatus
    effective: EplbSettings
    override_problem: str | None = None  # why a recorded override does not run (None: it runs, or none)
    conditions: tuple[dict[str, Any], ...] = ()  # status.conditions as stored (Kubernetes conditions)
    #: status.faultTolerance: the fault-recovery loop's record (controller/recovery_loop.py)
    fault_recovery: RecoveryStatus = field(default_factory=RecoveryStatus)
    elastic_record: ElasticStatus | None = None  # status.elastic as stored (None: none yet, or unreadable)

    # shortcuts into the spec
    @property
    def model(self) -> Model:
        return self.spec.model

    @property
    def engine(self) -> Engine:
        return self.spec.engine

    @property
    def parallelism(self) -> Parallelism:
        return self.spec.parallelism

    @property
    def replicas(self) -> int:
        return self.spec.replicas

    @property
    def autotune(self) -> AutotuneSpec:
        return self.spec.autotune

    @property
    def rollout(self) -> RolloutSpec:
        return self.spec.rollout

    @property
    def monitoring(self) -> Monitoring:
        return self.spec.monitoring

    @property
    def autoscaling(self) -> AutoscalingSpec | None:
        """``spec.autoscaling`` when an autoscaler runs, else None (spec.replicas is the user's)."""
        return self.spec.autoscaling

    @property
    def object_ref(self) -> dict[str, Any]:
        """The resource as an object an Event is about (``involvedObject``: apiVersion, kind, name,
        namespace, uid)."""
        return {"apiVersion": k8s_names.API, "kind": k8s_names.KIND,
                "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid}}

    @property
    def served_model_name(self) -> str:
        """The name clients (and vLLM's ``model_name`` label) use: ``servedName``, else ``name``."""
        return self.model.served_name or self.model.name

    @property
    def layout(self) -> Layout:
        """How a replica group is launched: the pods' ranks, API servers and load balancing
        (:func:`moe_eplb.api.layout.layout`; fault tolerance and elastic groups: every rank serves its
        own API)."""
        p, args = self.parallelism, self.engine.extra_args
        count = next((a.split("=", 1)[1] for a in args if a.startswith("--api-server-count=")), None) or next(
            (args[i + 1] for i, a in enumerate(args[:-1]) if a == "--api-server-count"), None)
        return layout(p.data, p.data_local, p.nodes, external=self.fault_tolerance.enabled or self.elastic_enabled,
                      api_server_count=int(count) if count and count.isdigit() and int(count) > 0 else None)

    # --- elastic groups (spec.parallelism.elastic, status.elastic) ----------------------------------

    @property
    def elastic_enabled(self) -> bool:
        return self.parallelism.elastic.enabled

    @property
    def uses_lws(self) -> bool:
        """The workload is a LeaderWorkerSet: multi-node replica groups, and every elastic group (its
        founding pods, also one: LWS gives rank 0 the address the joining pods handshake with)."""
        return self.parallelism.nodes > 1 or self.elastic_enabled

    @property
    def replica_groups(self) -> int:
        """Replica groups (independent engines): ``spec.replicas``, but one for an elastic group (whose
        ``spec.replicas`` counts its pods)."""
        return 1 if self.elastic_enabled else self.spec.replicas

    @property
    def elastic_desired(self) -> int:
        """The data-parallel size an elastic group should run: ``spec.replicas`` pods (what ``/scale``
        and the autoscaler set) of ``dataLocal`` ranks, within ``[minData, maxData]``."""
        p = self.parallelism
        return min(p.max_data, max(p.min_data, self.spec.replicas * p.data_local))

    @property
    def elastic_status(self) -> ElasticStatus:
        """``status.elastic``, or what a group that has just launched runs (``spec.parallelism.data``
        ranks, driven to :attr:`elastic_desired`)."""
        if self.elastic_record is not None:
            return self.elastic_record
        return ElasticStatus(self.parallelism.data, self.elastic_desired, elastic_api.LAUNCHING)

    @property
    def data_parallel_now(self) -> int:
        """Data-parallel ranks of the group's committed topology: ``status.elastic.dataParallel`` for
        an elastic group, else ``spec.parallelism.data``."""
        return self.elastic_status.data_parallel if self.elastic_enabled else self.parallelism.data

    def redundancy_at(self, data: int, redundant: int | None = None) -> int:
        """The redundant experts vLLM runs at ``data`` ranks when ``redundant`` (default: the settings
        that run, :attr:`effective`) are rendered for the launch size (``spec.parallelism.data``): an
        elastic group re-expresses them at every resize (:func:`moe_eplb.api.elastic.redundancy_at`),
        never restarting for it. Without the expert count, or at the launch size: ``redundant``."""
        r = self.effective.num_redundant_experts if redundant is None else redundant
        experts = self.moe_shape.num_experts
        if not experts or data == self.parallelism.data or not self.eplb_enabled:
            return r
        return elastic_api.redundancy_at(experts, r, self.parallelism.data, data)

    @property
    def plugin_image(self) -> bool:
        """``spec.engine.image`` is the project's image with the exporter plugin installed."""
        ref = parse_image(self.engine.image)
        return ref is not None and f"{ref.registry}/{ref.repository}" == k8s_names.PLUGIN_IMAGE_REPOSITORY

    @property
    def exporter_in_pod(self) -> bool:
        """The engine pods run the exporter (its probes, drain and metrics): injected
        (``spec.engine.exporter.inject``), or installed in the image. False: a stock engine, whose
        probes and drain are vLLM's own (``/health``, ``--shutdown-timeout``)."""
        return self.engine.exporter.inject or self.plugin_image

    @property
    def eplb(self) -> EplbSettings:
        """``spec.eplb`` as written, an omitted ``numRedundantExperts`` resolved
        (:attr:`redundancy_in_force`; see :attr:`effective` for what runs)."""
        return _spec_settings(self.spec.eplb, self.redundancy_in_force)

    @property
    def fault_tolerance(self) -> FaultTolerance:
        return self.spec.fault_tolerance

    @property
    def ranks_to_survive(self) -> int:
        """Lost data-parallel ranks ``scale_down`` must be able to re-host (0: fault tolerance off,
        or ``retry`` only)."""
        ft = self.spec.fault_tolerance
        return ft.rank_failures_to_survive if ft.enabled else 0

    @property
    def redundancy_floor(self) -> int:
        """The fewest redundant experts this spec may run (a hard lower bound of the tuner too):
        the fault-tolerance floor (:func:`moe_eplb.api.wide_ep.fault_tolerance_floor`) when ranks
        must be survived and the expert count is known, else 0."""
        experts, k = self.moe_shape.num_experts, self.ranks_to_survive
        if not k or not experts or not self.eplb_enabled:
            return 0
        floor = wide_ep.fault_tolerance_floor(experts, self.parallelism.tensor, self.parallelism.data, k)
        return floor if floor is not None else 0

    @property
    def tuner_bounds(self) -> Bounds:
        """``spec.autotune.bounds`` with the redundancy floor (:attr:`redundancy_floor`) as a hard lower
        end: what the tuner searches."""
        return self.autotune.bounds.with_redundancy_floor(self.redundancy_floor)

    @property
    def eplb_enabled(self) -> bool:
        return bool(self.spec.eplb is not None and self.spec.eplb.enabled)

    @property
    def redundancy_omitted(self) -> bool:
        """``spec.eplb.numRedundantExperts`` is not in the spec."""
        return self.spec.eplb is not None and self.spec.eplb.num_redundant_experts is None

    @property
    def redundancy_in_force(self) -> int:
        """``spec.eplb.numRedundantExperts``, or where the spec omits it the minimum valid value: the
        smallest R with (experts + R) divisible by the EP size (what vLLM 0.34 picks itself;
        validation refuses it on older versions where that is not 0, as they would), raised to the
        fault-tolerance floor. 0 with EPLB off (vLLM forces it) or when the expert count is unknown
        (what vLLM before 0.34 runs)."""
        eplb = self.spec.eplb
        if eplb is not None and eplb.num_redundant_experts is not None:
            return eplb.num_redundant_experts
        experts = self.moe_shape.num_experts
        if not self.eplb_enabled or not experts:
            return 0
        return max(wide_ep.smallest_valid_redundancy(experts, self.parallelism.ep_size), self.redundancy_floor)

    @property
    def catalog_model(self) -> catalog.ModelInfo | None:
        return catalog.lookup(self.model.name)

    @property
    def architecture(self) -> str | None:
        """spec.model.architecture, else the catalog's."""
        if self.model.architecture:
            return self.model.architecture
        entry = self.catalog_model
        return entry.architecture if entry else None

    @property
    def quantization(self) -> str | None:
        """spec.model.quantization, else guessed from name + catalog (None = cannot tell)."""
        if self.model.quantization:
            return self.model.quantization
        return catalog.guess_quantization(self.model.name, self.catalog_model)

    @property
    def moe_shape(self) -> MoeShape:
        """Catalog shape with spec.model.moe fields overriding it."""
        entry = self.catalog_model
        moe = self.model.moe

        def pick(own: int | None, default: int | None) -> int | None:
            return own if own is not None else default

        return MoeShape(
            num_experts=pick(moe.num_experts, entry.num_experts if entry else None),
            num_moe_layers=pick(moe.num_moe_layers, entry.num_moe_layers if entry else None),
            top_k=pick(moe.top_k, entry.top_k if entry else None),
            num_expert_groups=pick(moe.num_expert_groups, entry.num_expert_groups if entry else 1) or 1,
            bytes_per_expert=pick(moe.bytes_per_expert, entry.bytes_per_expert(self.quantization) if entry else None),
        )

    @property
    def live(self) -> LiveSettings | None:
        """``status.autotune.live`` while it applies: EPLB on and the pod template is the one the
        values were applied on (its config hash); else None (a new template runs its own values)."""
        rec = self.status.live
        if rec is None or not self.effective.enabled or rec.config_hash != self.effective.config_hash():
            return None
        return rec

    @property
    def running_knobs(self) -> Knobs:
        """What the engines run: the template's settings (:attr:`effective`) with the window and
        interval applied live over them (:attr:`live`)."""
        live = self.live
        return live.over(self.effective.knobs) if live is not None else self.effective.knobs

    @property
    def spec_knobs(self) -> Knobs:
        """``spec.eplb``'s knobs (what an override records as ``specEplb``)."""
        return self.eplb.knobs

    @property
    def prometheus_url(self) -> str | None:
        return self.monitoring.prometheus_url or None

    def with_operator_defaults(self, defaults: OperatorDefaults) -> MoEInference:
        """This resource with what the operator process fills in where the spec leaves it unset (a
        private copy: never written back): ``spec.monitoring.prometheusUrl`` (``--prometheus-url``),
        the PodMonitor's labels (``--pod-monitor-labels``; the resource's own labels win) and the
        exporter-injection image (``--exporter-image``, the operator's own image in the chart)."""
        monitoring, engine = self.monitoring, self.engine
        if defaults.prometheus_url and not monitoring.prometheus_url:
            monitoring = dataclasses.replace(monitoring, prometheus_url=defaults.prometheus_url)
        if defaults.pod_monitor_labels:
            labels = {**defaults.pod_monitor_labels, **monitoring.pod_monitor_labels}
            monitoring = dataclasses.replace(monitoring, pod_monitor_labels=labels)
        if defaults.exporter_image and engine.exporter.inject and not engine.exporter.image:
            engine = dataclasses.replace(engine, exporter=dataclasses.replace(engine.exporter,
                                                                              image=defaults.exporter_image))
        if monitoring is self.monitoring and engine is self.engine:
            return self
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, monitoring=monitoring, engine=engine))

    def knobs_problem(self, knobs: Knobs) -> str | None:
        """Why ``knobs`` cannot run with this spec (vLLM's limit, divisibility of experts +
        redundant by the EP size, the fault-tolerance floor), or None when they can."""
        problem = vllm_facts.redundant_problem(self.moe_shape.num_experts, self.parallelism.ep_size,
                                               knobs.num_redundant_experts)
        if problem is None and knobs.num_redundant_experts < self.redundancy_floor:
            problem = (f"{knobs.num_redundant_experts} redundant experts is below the fault-tolerance floor "
                       f"{self.redundancy_floor} (spec.faultTolerance.rankFailuresToSurvive "
                       f"{self.ranks_to_survive})")
        return problem


def status_eplb(settings: EplbSettings) -> dict[str, Any]:
    """The ``status.eplb`` object: ``{enabled, windowSize, stepInterval, numRedundantExperts}``."""
    return {"enabled": settings.enabled, **to_crd(settings.knobs)}


def _spec_settings(eplb: SpecEplb | None, redundant: int) -> EplbSettings:
    if eplb is None:
        raise SpecError("spec.eplb: required (the CRD defaults it; was the resource defaulted?)")
    return EplbSettings(enabled=eplb.enabled, knobs=eplb.knobs_with(redundant), use_async=eplb.use_async,
                        log_balancedness=eplb.log_balancedness, source="spec", communicator=eplb.communicator)


def resolve_effective(spec_eplb: EplbSettings, override: Override | None, generation: int,
                      problem_of: Any, *, allow_disable: bool = False) -> tuple[EplbSettings, str | None]:
    """The EPLB settings that run, and why a recorded override does not (pinned precedence).

    ``status.autotune.override`` wins while it applies: EPLB is enabled, ``spec.eplb`` still equals
    the ``specEplb`` it was written for (so scaling with ``replicas``/``/scale`` or editing
    ``autotune`` keeps it, and any edit of ``spec.eplb`` wins), and its values are valid for the
    current spec (``problem_of(knobs)`` is None). An override without ``specEplb`` (written by an
    older operator) runs while ``specGeneration == metadata.generation``. Fields missing from the
    override keep the spec's value; ``enabled``, ``async`` and ``logBalancedness`` always come from
    the spec. An override that turned EPLB off (``enabled: false``) runs only while
    ``spec.autotune.allowDisable`` (``allow_disable``) stays true: setting it false turns EPLB back on.
    """
    if override is None or not spec_eplb.enabled:
        return spec_eplb, None
    if override.spec_eplb is not None:
        if override.spec_eplb != spec_eplb.knobs:
            return spec_eplb, "spec.eplb changed since the tuner applied it"
    elif override.spec_generation is None or override.spec_generation != generation:
        return spec_eplb, "the spec changed since the tuner applied it (generation)"
    if override.enabled is False:
        if not allow_disable:
            return spec_eplb, "spec.autotune.allowDisable is false: the tuner's EPLB off no longer applies"
        return EplbSettings(enabled=False, knobs=spec_eplb.knobs, use_async=spec_eplb.use_async,
                            log_balancedness=spec_eplb.log_balancedness, source="autotune",
                            communicator=spec_eplb.communicator), None
    try:
        knobs = override.resolve(spec_eplb.knobs)
    except KnobsError as exc:
        return spec_eplb, str(exc)
    problem = problem_of(knobs)
    if problem is not None:
        return spec_eplb, problem
    return EplbSettings(enabled=True, knobs=knobs, use_async=spec_eplb.use_async,
                        log_balancedness=spec_eplb.log_balancedness, source="autotune",
                        communicator=spec_eplb.communicator), None


def parse(resource: Mapping[str, Any], *, defaulted: bool = False) -> MoEInference:
    """Parse a MoEInference (dict or mapping) into :class:`MoEInference`, applying the CRD's
    defaults first (skipped when ``defaulted``: the caller applied them already).

    Raises:
        SpecError: a field that does not have the CRD's type (the resource would not pass the
            schema), named with its path.
    """
    res = to_plain(resource) if defaulted else apply_defaults(resource)
    meta = res.get("metadata")
    if not isinstance(meta, Mapping):
        raise SpecError("metadata: required (an object with at least a name)")
    if not isinstance(res.get("spec"), Mapping):
        raise SpecError("spec: required")
    try:
        spec = from_crd(Spec, res["spec"], "spec")
    except (ConvertError, KnobsError) as exc:
        raise SpecError(str(exc)) from None
    status = res.get("status") if isinstance(res.get("status"), Mapping) else {}
    autotune = parse_autotune_status(status.get("autotune"))
    raw_generation = meta.get("generation") or 1
    if isinstance(raw_generation, bool) or not isinstance(raw_generation, int):
        raise SpecError(f"metadata.generation: expected a whole number, got {raw_generation!r}")
    generation = raw_generation
    labels = meta.get("labels") or {}
    if not isinstance(labels, Mapping):
        raise SpecError(f"metadata.labels: expected an object of labels, got {type(labels).__name__}")
    partial = MoEInference(name=str(meta.get("name") or ""), namespace=meta.get("namespace"), uid=meta.get("uid"),
                           generation=generation, resource_version=meta.get("resourceVersion"),
                           labels=dict(labels), spec=spec, status=autotune,
                           effective=_spec_settings(spec.eplb, 0),
                           conditions=tuple(dict(c) for c in status.get("conditions") or () if isinstance(c, Mapping)),
                           fault_recovery=parse_recovery_status(status.get("faultTolerance")),
                           elastic_record=parse_status(status.get("elastic")))
    effective, why = resolve_effective(partial.eplb, autotune.override, generation, partial.knobs_problem,
                                       allow_disable=spec.autotune.allow_disable)
    if why is None and autotune.override is None and any(n.startswith("status.autotune.override") for n in autotune.notes):
        why = next(n for n in autotune.notes if n.startswith("status.autotune.override"))
    return MoEInference(**{**partial.__dict__, "effective": effective, "override_problem": why})
