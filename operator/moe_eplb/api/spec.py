"""Typed view of a MoEInference resource, and the EPLB settings that actually run.

:func:`parse` takes the resource as a dict (as kopf or ``yaml.safe_load`` give it), applies the
CRD's defaults, and returns frozen dataclasses. It assumes the resource is valid (see
:mod:`moe_eplb.api.validation`); on an invalid one it may raise ``KeyError``/``TypeError``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from moe_eplb.api import catalog
from moe_eplb.api.crd import openapi_schema
from moe_eplb.api.imageref import parse_image
from moe_eplb.api.schema import apply_defaults as _apply_schema_defaults
from moe_eplb.api.versions import Version, parse_version


def to_plain(value: Any) -> Any:
    """A deep copy made of plain dicts and lists (kopf bodies and other mappings are views)."""
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def apply_defaults(resource: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``resource`` with the CRD's schema defaults filled in, as the apiserver stores it."""
    return _apply_schema_defaults(to_plain(resource), openapi_schema())


@dataclass(frozen=True)
class MoeShape:
    """MoE shape used for validation and memory math (catalog, overridden by spec.model.moe)."""

    num_experts: int | None
    num_moe_layers: int | None
    top_k: int | None
    num_expert_groups: int
    bytes_per_expert: int | None


@dataclass(frozen=True)
class PvcStorage:
    claim_name: str
    mount_path: str = "/models"
    sub_path: str | None = None
    read_only: bool = False


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class Model:
    name: str
    served_name: str | None
    architecture: str | None  # as given in the spec
    quantization: str | None  # as given in the spec
    moe: dict[str, int]  # spec.model.moe as given (camelCase keys)
    pvc: PvcStorage | None
    hf_token_secret: SecretKeyRef | None


@dataclass(frozen=True)
class Engine:
    image: str
    version_field: str | None
    dtype: str | None
    max_model_len: int | None
    gpu_memory_utilization: float | None
    limit_mm_per_prompt: dict[str, int] | None
    mm_encoder_tp_mode: str | None
    chat_template: SecretKeyRef | None  # ConfigMap name + key
    extra_args: tuple[str, ...]
    env: tuple[dict[str, Any], ...]
    resources: dict[str, Any]
    shm_size: str | int | None
    startup_timeout_seconds: int
    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]
    image_pull_secrets: tuple[str, ...] = ()

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
    def version(self) -> Version | None:
        """vLLM version: ``spec.engine.version``, else parsed from the image tag, else None."""
        if self.version_field:
            return parse_version(self.version_field)
        ref = parse_image(self.image)
        return ref.version if ref else None


@dataclass(frozen=True)
class Parallelism:
    tensor: int
    data: int
    nodes: int
    data_local_field: int | None
    expert: bool

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
class EplbSettings:
    """EPLB settings. ``source`` is ``spec`` or ``autotune`` (from status.autotune.override)."""

    enabled: bool
    window_size: int
    step_interval: int
    num_redundant_experts: int
    use_async: bool | None = None
    log_balancedness: bool = False
    source: str = "spec"

    def to_status(self) -> dict[str, Any]:
        """The ``status.eplb`` object."""
        return {
            "enabled": self.enabled,
            "windowSize": self.window_size,
            "stepInterval": self.step_interval,
            "numRedundantExperts": self.num_redundant_experts,
        }

    def config_hash(self) -> str:
        """Short stable hash of the settings that need an engine restart (16 hex chars)."""
        payload = {k: v for k, v in asdict(self).items() if k != "source"}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Bound:
    min: int
    max: int


@dataclass(frozen=True)
class Autotune:
    mode: str
    window_size: Bound | None
    step_interval: Bound | None
    num_redundant_experts: Bound | None
    memory_budget_per_gpu: int | None  # bytes
    raw_memory_budget: str | int | None  # as written
    evaluation_interval_seconds: int
    cooldown_seconds: int
    max_restarts_per_day: int
    min_gain: float
    rollback_tolerance: float
    observe_seconds: int


@dataclass(frozen=True)
class Rollout:
    max_surge: int
    max_unavailable: int


@dataclass(frozen=True)
class Monitoring:
    prometheus_url: str | None
    pod_monitor: bool


@dataclass(frozen=True)
class MoEInference:
    """A parsed MoEInference (spec after defaults)."""

    name: str
    namespace: str | None
    uid: str | None
    generation: int | None
    model: Model
    engine: Engine
    parallelism: Parallelism
    replicas: int
    eplb: EplbSettings  # spec.eplb as written (see effective_eplb for what runs)
    autotune: Autotune
    rollout: Rollout
    monitoring: Monitoring
    labels: dict[str, str] = field(default_factory=dict)

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
        quant = self.quantization
        return MoeShape(
            num_experts=moe.get("numExperts", entry.num_experts if entry else None),
            num_moe_layers=moe.get("numMoeLayers", entry.num_moe_layers if entry else None),
            top_k=moe.get("topK", entry.top_k if entry else None),
            num_expert_groups=moe.get("numExpertGroups", entry.num_expert_groups if entry else 1),
            bytes_per_expert=moe.get("bytesPerExpert", entry.bytes_per_expert(quant) if entry else None),
        )


def _bound(d: dict[str, Any] | None) -> Bound | None:
    return Bound(int(d["min"]), int(d["max"])) if d else None


def quantity_bytes(value: Any) -> int | None:
    """A Kubernetes quantity (``8Gi``, ``500M``, 1024) as an int; None when absent or malformed."""
    if value is None:
        return None
    from kubernetes.utils.quantity import (
        parse_quantity,  # maintained parser of k8s quantities
    )

    try:
        return int(parse_quantity(value))
    except (ValueError, TypeError, ArithmeticError):
        return None


def parse(resource: dict[str, Any]) -> MoEInference:
    """Parse a (valid) MoEInference dict into :class:`MoEInference`, applying CRD defaults first."""
    res = apply_defaults(resource)
    meta = res.get("metadata") or {}
    spec = res["spec"]
    m, e, p, eplb, at = spec["model"], spec["engine"], spec["parallelism"], spec["eplb"], spec["autotune"]
    storage = m.get("storage") or {}
    pvc = storage.get("pvc")
    tok = storage.get("hfTokenSecret")
    tmpl = (e.get("chatTemplate") or {}).get("configMapRef")
    bounds = at.get("bounds") or {}
    return MoEInference(
        name=meta.get("name", ""),
        namespace=meta.get("namespace"),
        uid=meta.get("uid"),
        generation=meta.get("generation"),
        labels=dict(meta.get("labels") or {}),
        model=Model(
            name=m["name"],
            served_name=m.get("servedName"),
            architecture=m.get("architecture"),
            quantization=m.get("quantization"),
            moe=dict(m.get("moe") or {}),
            pvc=PvcStorage(pvc["claimName"], pvc.get("mountPath", "/models"), pvc.get("subPath"), pvc.get("readOnly", False))
            if pvc
            else None,
            hf_token_secret=SecretKeyRef(tok["name"], tok.get("key", "token")) if tok else None,
        ),
        engine=Engine(
            image=e["image"],
            version_field=e.get("version"),
            dtype=e.get("dtype"),
            max_model_len=e.get("maxModelLen"),
            gpu_memory_utilization=e.get("gpuMemoryUtilization"),
            limit_mm_per_prompt=e.get("limitMmPerPrompt"),
            mm_encoder_tp_mode=e.get("mmEncoderTpMode"),
            chat_template=SecretKeyRef(tmpl["name"], tmpl.get("key", "chat_template.jinja")) if tmpl else None,
            extra_args=tuple(e.get("extraArgs") or ()),
            env=tuple(e.get("env") or ()),
            resources=dict(e.get("resources") or {}),
            shm_size=e.get("shmSize"),
            startup_timeout_seconds=int(e.get("startupTimeoutSeconds", 3600)),
            node_selector=dict(e.get("nodeSelector") or {}),
            tolerations=tuple(e.get("tolerations") or ()),
            image_pull_secrets=tuple(x["name"] for x in e.get("imagePullSecrets") or ()),
        ),
        parallelism=Parallelism(
            tensor=p["tensor"], data=p["data"], nodes=p["nodes"], data_local_field=p.get("dataLocal"), expert=p["expert"]
        ),
        replicas=spec["replicas"],
        eplb=_spec_eplb(eplb),
        autotune=Autotune(
            mode=at["mode"],
            window_size=_bound(bounds.get("windowSize")),
            step_interval=_bound(bounds.get("stepInterval")),
            num_redundant_experts=_bound(bounds.get("numRedundantExperts")),
            memory_budget_per_gpu=quantity_bytes(at.get("memoryBudgetPerGpu")),
            raw_memory_budget=at.get("memoryBudgetPerGpu"),
            evaluation_interval_seconds=at["evaluationIntervalSeconds"],
            cooldown_seconds=at["cooldownSeconds"],
            max_restarts_per_day=at["maxRestartsPerDay"],
            min_gain=float(at["minGain"]),
            rollback_tolerance=float(at["rollbackTolerance"]),
            observe_seconds=at["observeSeconds"],
        ),
        rollout=Rollout(spec["rollout"]["maxSurge"], spec["rollout"]["maxUnavailable"]),
        monitoring=Monitoring(
            prometheus_url=spec["monitoring"].get("prometheusUrl"),
            pod_monitor=bool(spec["monitoring"]["podMonitor"]["enabled"]),
        ),
    )


def _spec_eplb(eplb: dict[str, Any]) -> EplbSettings:
    return EplbSettings(
        enabled=bool(eplb["enabled"]),
        window_size=int(eplb["windowSize"]),
        step_interval=int(eplb["stepInterval"]),
        num_redundant_experts=int(eplb["numRedundantExperts"]),
        use_async=eplb.get("async"),
        log_balancedness=bool(eplb.get("logBalancedness", False)),
        source="spec",
    )


_OVERRIDE_KEYS = ("windowSize", "stepInterval", "numRedundantExperts")

#: vLLM's EPLBConfig limit on redundant experts (same as ``validation.MAX_REDUNDANT``).
_MAX_REDUNDANT = 1023


def spec_eplb_record(resource: Mapping[str, Any]) -> dict[str, int]:
    """``spec.eplb`` (after defaults) as the tuner's override records it (``override.specEplb``):
    ``{windowSize, stepInterval, numRedundantExperts}`` -- every field an override replaces."""
    eplb = apply_defaults(resource)["spec"]["eplb"]
    return {k: int(eplb[k]) for k in _OVERRIDE_KEYS}


def override_invalid_reason(resource: Mapping[str, Any], values: Mapping[str, int]) -> str | None:
    """Why override ``values`` cannot run with the current spec (bounds, divisibility of
    experts + redundant by the EP size), or None when it can. A spec that cannot be parsed: None."""
    try:
        inf = parse(dict(resource))
    except (KeyError, TypeError, ValueError):
        return None
    window = int(values.get("windowSize", inf.eplb.window_size))
    step = int(values.get("stepInterval", inf.eplb.step_interval))
    r = int(values.get("numRedundantExperts", inf.eplb.num_redundant_experts))
    if window < 1 or step < 1:
        return "windowSize and stepInterval must be >= 1"
    if not 0 <= r <= _MAX_REDUNDANT:
        return f"numRedundantExperts {r} is outside 0..{_MAX_REDUNDANT}"
    experts = inf.moe_shape.num_experts
    ep = inf.parallelism.ep_size
    if experts and ep and (experts + r) % ep:
        return f"experts ({experts}) + numRedundantExperts {r} is not divisible by the EP size {ep}"
    return None


def current_override(resource: Mapping[str, Any]) -> dict[str, int] | None:
    """``status.autotune.override`` (its knob values) when it runs, else None.

    It runs while the user has not changed the EPLB settings since the tuner wrote it:
    ``override.specEplb`` (see :func:`spec_eplb_record`) equals ``spec.eplb`` now -- so edits of
    ``replicas`` (``/scale``), ``autotune`` or anything else keep it -- and it is valid for the
    current spec (:func:`override_invalid_reason`). An override without ``specEplb`` (written by
    an older operator) runs while ``override.specGeneration == metadata.generation``.
    A malformed override (not a mapping, non-integer values) never applies.
    """
    status = resource.get("status")
    autotune = status.get("autotune") if isinstance(status, Mapping) else None
    override = autotune.get("override") if isinstance(autotune, Mapping) else None
    if not isinstance(override, Mapping):
        return None
    values = {k: override[k] for k in _OVERRIDE_KEYS if k in override}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
        return None
    recorded = override.get("specEplb")
    if recorded is not None:
        try:
            if not isinstance(recorded, Mapping) or dict(recorded) != spec_eplb_record(resource):
                return None
        except (KeyError, TypeError, ValueError):
            return None
    else:
        meta = resource.get("metadata")
        generation = meta.get("generation") if isinstance(meta, Mapping) else None
        if generation is None or override.get("specGeneration") != generation:
            return None
    if override_invalid_reason(resource, values) is not None:
        return None
    return values


def effective_eplb(resource: Mapping[str, Any]) -> EplbSettings:
    """The EPLB settings that run (pinned precedence).

    ``status.autotune.override`` = {windowSize, stepInterval, numRedundantExperts, specEplb,
    specGeneration} wins while it applies (:func:`current_override`: ``spec.eplb`` unchanged since
    the tuner wrote it, EPLB enabled, valid for the current spec); otherwise ``spec.eplb`` (a
    user's edit of ``spec.eplb`` always wins; a ``replicas`` change does not touch the override).
    Fields missing from the override keep the spec's value. ``enabled``, ``async`` and
    ``logBalancedness`` always come from the spec.
    """
    res = apply_defaults(resource)
    base = _spec_eplb(res["spec"]["eplb"])
    if not base.enabled:
        return base
    override = current_override(res)
    if override is None:
        return base
    return EplbSettings(
        enabled=base.enabled,
        window_size=int(override.get("windowSize", base.window_size)),
        step_interval=int(override.get("stepInterval", base.step_interval)),
        num_redundant_experts=int(override.get("numRedundantExperts", base.num_redundant_experts)),
        use_async=base.use_async,
        log_balancedness=base.log_balancedness,
        source="autotune",
    )
