"""Validation of a MoEInference: ONE implementation for ``moe-eplb validate``, the operator and tests.

:func:`validate` runs, in order:

1. the apiserver's checks, using the CRD itself: unknown fields (strict field validation, with a
   'did you mean'), the structural OpenAPI schema after defaulting, and the CRD's CEL
   ``x-kubernetes-validations`` rules (evaluated with the ``cel`` package), so the CRD at apply
   time and this function cannot disagree;
2. checks that need the model catalog and the engine version, which the CRD cannot express:
   EPLB support of the architecture and quantization for the vLLM version, unknown model without a
   ``moe`` override, divisibility with the catalog's expert count (naming the nearest valid
   values), image reference, extra args that clash with generated flags, etc.

Every :class:`Problem` names the field and says how to fix it. An empty list means valid.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moe_eplb.api import catalog, elastic, fit, wide_ep
from moe_eplb.api.cel_fixes import ELASTIC_OFF, with_fixes
from moe_eplb.api.cel_rules import cel_problems
from moe_eplb.api.crd import openapi_schema
from moe_eplb.api.fit import all2all_backend, tokens_per_rank
from moe_eplb.api.fit import arg_value as _arg_value
from moe_eplb.api.imageref import parse_image
from moe_eplb.api.podtemplate import overlay_problems
from moe_eplb.api.problem import REMOVE, Problem, apply_fix
from moe_eplb.api.quantity import quantity_bytes
from moe_eplb.api.schema import (
    fill_schema_defaults,
    format_path,
    schema_problems,
    show,
    unknown_field_problems,
)
from moe_eplb.api.spec import MoEInference, OperatorDefaults, SpecError, parse, to_plain
from moe_eplb.api.versions import EPLB_CONFIG_JSON, EPLB_FIRST, Version, format_version
from moe_eplb.contracts import k8s_names, vllm_facts
from moe_eplb.contracts.k8s_names import API_GROUP, API_VERSION, KIND

__all__ = ["Problem", "Checked", "check", "validate", "apiserver_problems", "nearest_redundant_values"]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

#: Plausibility bounds of sizes the schema leaves open (the schema alone accepts 8Ei and 2**62):
#: /dev/shm is node memory, a memory budget is one GPU's, a context is far below 2**31 tokens.
MAX_SHM_BYTES = 2**50
MAX_GPU_BYTES = 2**40
MAX_MODEL_LEN = 2**31 - 1

# flags the operator generates from the spec: extraArgs must not repeat them
_GENERATED_FLAGS = {
    "--tensor-parallel-size": "spec.parallelism.tensor",
    "-tp": "spec.parallelism.tensor",
    "--data-parallel-size": "spec.parallelism.data",
    "-dp": "spec.parallelism.data",
    "--data-parallel-size-local": "spec.parallelism.dataLocal",
    "--data-parallel-address": "spec.parallelism.nodes (the operator wires multi-node data parallel)",
    "--data-parallel-start-rank": "spec.parallelism.nodes (the operator wires multi-node data parallel)",
    "--data-parallel-rpc-port": "spec.parallelism.nodes (the operator wires multi-node data parallel)",
    "--enable-expert-parallel": "spec.parallelism.expert",
    "--enable-eplb": "spec.eplb.enabled",
    "--eplb-config": "spec.eplb",
    "--num-redundant-experts": "spec.eplb.numRedundantExperts",
    "--eplb-window-size": "spec.eplb.windowSize",
    "--eplb-step-interval": "spec.eplb.stepInterval",
    "--eplb-log-balancedness": "spec.eplb.logBalancedness",
    "--dtype": "spec.engine.dtype",
    "--max-model-len": "spec.engine.maxModelLen",
    "--gpu-memory-utilization": "spec.engine.gpuMemoryUtilization",
    "--limit-mm-per-prompt": "spec.engine.limitMmPerPrompt",
    "--mm-encoder-tp-mode": "spec.engine.mmEncoderTpMode",
    "--chat-template": "spec.engine.chatTemplate",
    "--served-model-name": "spec.model.servedName",
    "--port": "nothing (the API port is fixed at 8000)",
    "--headless": "spec.parallelism.nodes",
    "--shutdown-timeout": "spec.engine.drainSeconds (the operator sets --shutdown-timeout with the drain)",
    "--enable-fault-tolerance": "spec.faultTolerance.enabled",
    "--fault-tolerance-config": "spec.faultTolerance.recoveryTimeoutSeconds (the operator's recovery rounds must "
                                "finish within it)",
    "--data-parallel-external-lb": "spec.faultTolerance.enabled (the operator wires the load balancing)",
    "--data-parallel-multi-port-external-lb": "spec.faultTolerance.enabled (the operator wires the load balancing)",
    "--data-parallel-rank": "spec.faultTolerance.enabled (the operator wires the load balancing)",
    "--enable-elastic-ep": "spec.parallelism.elastic.enabled",
    "--elastic-ep-max-dp-size": "spec.parallelism.elastic.maxData",
    "--data-parallel-supervisor-port": "spec.faultTolerance.enabled (the operator wires the API servers' ports)",
    "--data-parallel-hybrid-lb": "spec.parallelism (the operator wires the load balancing: every rank served)",
}


def _set(*path_and_value: Any) -> tuple[tuple[tuple[Any, ...], Any], ...]:
    """A one-edit fix: ``_set("spec", "eplb", "numRedundantExperts", 8)``."""
    return ((tuple(path_and_value[:-1]), path_and_value[-1]),)


def _drop_args(inf: MoEInference, first: int, count: int = 1) -> tuple[tuple[tuple[Any, ...], Any], ...]:
    """A fix that removes ``count`` entries of ``spec.engine.extraArgs`` from ``first`` on (a flag and
    its value); the whole list when nothing is left."""
    rest = list(inf.engine.extra_args[:first]) + list(inf.engine.extra_args[first + count:])
    return _set("spec", "engine", "extraArgs", rest if rest else REMOVE)


def _drop_moe_backend(inf: MoEInference) -> tuple[tuple[tuple[Any, ...], Any], ...] | None:
    found = _arg_value(inf.engine.extra_args, "--moe-backend")
    return _drop_args(inf, found[0], _flag_width(inf, found[0])) if found else None


def _flag_width(inf: MoEInference, i: int) -> int:
    """1 for ``--flag=value`` or a switch, 2 for ``--flag value``."""
    args = inf.engine.extra_args
    return 1 if "=" in args[i] or i + 1 >= len(args) or args[i + 1].startswith("--") else 2


def apiserver_problems(resource: dict[str, Any]) -> list[Problem]:
    """What the apiserver itself would reject at apply time, using only the CRD (schema + CEL).

    Strict unknown-field check, then defaults, structural schema and CEL rules. ``status`` is left
    out: it is written through the status subresource by the operator, not by the user, and a
    spec must not turn invalid because of what the operator recorded.
    """
    return _apiserver_check(to_plain(resource))[0]


def _apiserver_check(resource: dict[str, Any]) -> tuple[list[Problem], dict[str, Any] | None]:
    """(problems, the defaulted object when it passes the structural schema, else None)."""
    resource = {k: v for k, v in resource.items() if k != "status"}
    schema = openapi_schema()
    problems = unknown_field_problems(resource, schema)
    defaulted = fill_schema_defaults(resource, schema)
    structural = schema_problems(defaulted, schema)
    rules = cel_problems(defaulted, schema)
    if structural:  # a rule over a mistyped value only adds noise
        rules = [p for p in rules if "(rule error:" not in p.message]
    rules = _elastic_eplb_fix(with_fixes(rules, defaulted), defaulted)
    return problems + structural + rules, None if structural else defaulted


#: refusals of enabling EPLB that only the user can answer (which model, format or version)
_EPLB_ASKS = ("spec.eplb.enabled", "spec.model.moe", "spec.model.quantization", "spec.engine.version")


def _elastic_eplb_fix(rules: list[Problem], resource: dict[str, Any]) -> list[Problem]:
    """The fix of the CRD's "elastic needs EPLB": EPLB on (vLLM's elastic EP places the experts of each
    size with it), unless vLLM runs no EPLB for this model, checkpoint or version -- enabling it then
    leaves a refusal only the user can answer -- where the group runs without elastic instead."""
    out = []
    for p in rules:
        if p.rule is not None and p.fix is None and p.field == "spec.parallelism.elastic.enabled" \
                and "needs EPLB" in p.message:
            on = _set("spec", "eplb", "enabled", True)
            asks = [q for q in validate(apply_fix(resource, on)) if q.fix is None and q.field in _EPLB_ASKS]
            p = dataclasses.replace(p, fix=ELASTIC_OFF if asks else on)
        out.append(p)
    return out


@dataclass(frozen=True)
class Checked:
    """What :func:`check` found: the problems ([] = valid) and the resource parsed once (None when
    the schema already fails, so no typed view can be built)."""

    problems: list[Problem]
    inference: MoEInference | None


def validate(resource: Any) -> list[Problem]:
    """All problems with ``resource`` (a MoEInference as a dict or any mapping); [] when it is valid."""
    return check(resource).problems


def check(resource: Any) -> Checked:
    """Validate ``resource`` and parse it, with ONE pass of the CRD's defaulting: the operator's
    reconcile and ``moe-eplb validate|render`` start here."""
    if not isinstance(resource, Mapping):
        return Checked([Problem("<root>", "expected a MoEInference object (a mapping), got "
                                + type(resource).__name__)], None)
    resource = to_plain(resource)
    problems: list[Problem] = []
    expected_api = f"{API_GROUP}/{API_VERSION}"
    if resource.get("apiVersion") != expected_api:
        problems.append(Problem("apiVersion", f"must be {expected_api} (got {resource.get('apiVersion')!r})"))
    if resource.get("kind") != KIND:
        problems.append(Problem("kind", f"must be {KIND} (got {resource.get('kind')!r})"))
    if not isinstance(resource.get("metadata"), Mapping):
        problems.append(Problem("metadata", "must be an object with at least a name"))
        return Checked(problems, None)
    if resource.get("status") is not None and not isinstance(resource.get("status"), Mapping):
        resource = {k: v for k, v in resource.items() if k != "status"}  # not ours to judge; ignore it
    name = resource["metadata"].get("name")
    if not name:
        problems.append(Problem("metadata.name", "required; set a name (lower-case letters, digits and '-')"))
        return Checked(problems, None)
    if not _DNS_LABEL.match(str(name)):
        problems.append(
            Problem("metadata.name", f"{name!r} must be a DNS label: lower-case letters, digits and '-', "
                    "starting and ending with a letter or digit")
        )
    problems += metadata_problems(resource["metadata"]) + non_finite_problems(resource)
    base, defaulted = _apiserver_check(resource)
    if defaulted is None:  # the typed view cannot be built; these are the problems to fix first
        return Checked(problems + base, None)
    if "status" in resource:
        defaulted["status"] = resource["status"]
    try:
        inf = parse(defaulted, defaulted=True)
    except SpecError as exc:  # the schema passed but a value still has the wrong type
        field, _, message = str(exc).partition(":")
        said = any(p.field == field for p in problems + base)  # e.g. metadata.labels, by metadata_problems
        return Checked(problems + base + ([] if said else [Problem(field, message.strip())]), None)
    semantic = semantic_problems(inf)
    # a catalog rule of the CRD and the catalog check say the same thing; keep the richer message
    covered = {p.field for p in semantic}
    base = [p for p in base if not (p.field in covered and p.rule in _duplicated_rules())]
    return Checked(problems + base + semantic, inf)


@functools.lru_cache(maxsize=1)
def _duplicated_rules() -> frozenset[str]:
    """CRD rules that :func:`semantic_problems` repeats with more detail: the rules generated
    from the catalog, and the divisibility rule for ``model.moe.numExperts``."""
    from moe_eplb.api.cel_catalog import rules

    out = {r["rule"] for r in rules()}
    for rule in openapi_schema()["properties"]["spec"].get("x-kubernetes-validations") or ():
        if rule.get("fieldPath") == ".eplb.numRedundantExperts":
            out.add(rule["rule"])
    return frozenset(out)


def nearest_redundant_values(num_experts: int, redundant: int, ep_size: int) -> list[int]:
    """Valid numRedundantExperts next to ``redundant`` (one below if >= 0, one above if <= 1023).

    Valid means ``(num_experts + R) % ep_size == 0``; sorted ascending.
    """
    out = []
    below = redundant - (num_experts + redundant) % ep_size
    if below >= 0:
        out.append(below)
    above = below + ep_size
    if above <= vllm_facts.MAX_REDUNDANT_EXPERTS:
        out.append(above)
    return out


def _size_problems(inf: MoEInference) -> list[Problem]:
    """Quantities that are not quantities, and sizes no hardware has."""
    problems: list[Problem] = []
    engine = inf.engine
    for fld, value, most, what in (("spec.engine.shmSize", engine.shm_size, MAX_SHM_BYTES, "any node's memory (1Pi)"),
                                   ("spec.autotune.memoryBudgetPerGpu", inf.autotune.raw_memory_budget,
                                    MAX_GPU_BYTES, "any GPU's memory (1Ti)")):
        nbytes = None if value is None else quantity_bytes(value)
        if value is not None and nbytes is None:
            problems.append(Problem(fld, f"{value!r} is not a Kubernetes quantity; use e.g. 16Gi or 500M"))
        elif nbytes is not None and nbytes > most:
            problems.append(Problem(fld, f"{value!r} is {nbytes} bytes, more than {what}; "
                                         "use the real size, e.g. 16Gi"))
    if engine.max_model_len is not None and engine.max_model_len > MAX_MODEL_LEN:
        problems.append(Problem("spec.engine.maxModelLen", f"{engine.max_model_len} tokens is more than "
                                f"{MAX_MODEL_LEN} (2**31 - 1), far past any model's context; use the model's "
                                "context length"))
    return problems


def semantic_problems(inf: MoEInference) -> list[Problem]:
    """Checks needing the catalog or the engine version (resource already passes the schema)."""
    problems = _engine_problems(inf)
    version = inf.engine.version
    arch = catalog.lookup_architecture(inf.architecture) if inf.architecture else None
    if inf.eplb.enabled:
        problems += _eplb_problems(inf, arch, version)
    problems += _multimodal_problems(inf, arch)
    problems += label_problems(inf.monitoring.pod_monitor_labels, "spec.monitoring.podMonitor.labels")
    problems += label_problems(inf.spec.workload.labels, "spec.workload.metadata.labels")
    problems += autoscaling_problems(inf, version)
    problems += _extra_args_problems(inf)
    problems += _pod_template_problems(inf)
    problems += wide_ep_problems(inf, version)
    return problems


def _pod_template_problems(inf: MoEInference) -> list[Problem]:
    """``spec.engine.podTemplate``: label syntax, and what :func:`overlay_problems` checks."""
    overlay = inf.engine.pod_template
    if overlay is None:
        return []
    pvc = inf.model.pvc
    return (label_problems(overlay.labels, "spec.engine.podTemplate.metadata.labels")
            + overlay_problems(overlay, exporter_injected=inf.engine.exporter.inject,
                               model_mount_path=pvc.mount_path if pvc else None))


def _engine_problems(inf: MoEInference) -> list[Problem]:
    """The image reference, the sizes, the vLLM version (needed with EPLB) and the exporter."""
    engine = inf.engine
    problems: list[Problem] = []
    if parse_image(engine.image) is None:
        problems.append(
            Problem("spec.engine.image", f"{engine.image!r} is not a valid image reference; use "
                    "[registry/]repository[:tag][@sha256:digest] with a lower-case repository, "
                    "e.g. vllm/vllm-openai:v0.12.0")
        )
    problems += _size_problems(inf)
    version = engine.version
    if version is None and inf.eplb.enabled:
        source = f"spec.engine.version {engine.version_field!r}" if engine.version_field else f"the image tag of {engine.image!r}"
        problems.append(
            Problem("spec.engine.version", f"cannot tell the vLLM version from {source}; "
                    "set spec.engine.version to the vLLM version in the image (e.g. 0.12.0)")
        )
    problems += _exporter_problems(inf, version)
    return problems


def _eplb_problems(inf: MoEInference, arch: catalog.ArchitectureInfo | None, version: Version | None) -> list[Problem]:
    """With EPLB enabled: the vLLM version and the architecture support it, the quantization, the
    async option, the expert count against the EP size, and the memory."""
    eplb, arch_name = inf.eplb, inf.architecture
    problems: list[Problem] = []
    if version is not None and version < EPLB_FIRST:
        problems.append(_version_problem("spec.eplb.enabled", "EPLB", EPLB_FIRST, version))
    if arch is None and inf.model.moe.num_experts is None:
        what = f"architecture {arch_name!r} is not in the catalog" if arch_name else (
            f"model {inf.model.name!r} is not in the catalog")
        problems.append(
            Problem("spec.model.moe", f"{what}, so EPLB cannot be checked: set spec.model.architecture "
                    "(the vLLM class, e.g. Qwen3MoeForCausalLM) and spec.model.moe (numExperts, "
                    "numMoeLayers, topK), or set spec.eplb.enabled: false")
        )
    if arch is not None:
        if arch.eplb_since is None:
            problems.append(
                Problem("spec.eplb.enabled", f"vLLM has no EPLB for {arch.name}; set spec.eplb.enabled: false")
            )
        elif version is not None and EPLB_FIRST < arch.eplb_since and version < arch.eplb_since:
            problems.append(_version_problem("spec.eplb.enabled", f"EPLB for {arch.name}", arch.eplb_since, version))
    problems += _quantization_problems(inf, version)
    backend = inf.engine.moe_backend_arg
    refused_since = catalog.MOE_BACKEND_EPLB_REFUSALS.get((arch_name or "", backend or ""))
    if refused_since is not None and (version is None or version >= refused_since):
        problems.append(Problem("spec.engine.extraArgs", f"--moe-backend {backend}: vLLM refuses EPLB with this "
                                f"kernel for {arch_name} (MegaMoE); remove the argument or set spec.eplb.enabled: false",
                                fix=_drop_moe_backend(inf)))
    if version is not None and eplb.use_async is not None and version < EPLB_CONFIG_JSON:
        problems.append(
            Problem("spec.eplb.async", f"needs --eplb-config (vLLM >= {format_version(EPLB_CONFIG_JSON)}); "
                    f"the image has {format_version(version)}: remove spec.eplb.async or use a newer image")
        )
    problems += _redundancy_problems(inf)
    problems += _memory_problems(inf, inf.moe_shape)
    return problems


def _redundancy_problems(inf: MoEInference) -> list[Problem]:
    """Experts plus redundant experts must divide by the EP size: the spec's value (or, omitted, what
    the version runs), and some value within the autotune bounds."""
    shape, par, eplb = inf.moe_shape, inf.parallelism, inf.eplb
    problems: list[Problem] = []
    if not shape.num_experts:
        return problems
    total = shape.num_experts + eplb.num_redundant_experts
    version = inf.engine.version
    if inf.redundancy_omitted and version is not None and version < wide_ep.REDUNDANCY_AUTO_MIN_SINCE:
        smallest = wide_ep.smallest_valid_redundancy(shape.num_experts, par.ep_size)
        if smallest:
            problems.append(Problem(
                "spec.eplb.numRedundantExperts",
                f"omitted, and vLLM {format_version(version)} then runs 0 redundant experts (only vLLM >= "
                f"{format_version(wide_ep.REDUNDANCY_AUTO_MIN_SINCE)} picks the minimum valid value), but experts "
                f"({shape.num_experts}) is not divisible by the EP size {par.ep_size} (tensor {par.tensor} x data "
                f"{par.data}): set numRedundantExperts {smallest} (or {smallest + par.ep_size}, ...)",
                fix=_set("spec", "eplb", "numRedundantExperts", smallest)))
    elif total % par.ep_size:
        near = nearest_redundant_values(shape.num_experts, eplb.num_redundant_experts, par.ep_size)
        choices = " or ".join(map(str, near))
        problems.append(
            Problem("spec.eplb.numRedundantExperts",
                    f"experts ({shape.num_experts}) + numRedundantExperts ({eplb.num_redundant_experts}) "
                    f"= {total} is not divisible by the EP size {par.ep_size} (tensor {par.tensor} x "
                    f"data {par.data}); use numRedundantExperts {choices}",
                    fix=_set("spec", "eplb", "numRedundantExperts", near[-1] if near[-1] >= eplb.num_redundant_experts
                             or len(near) == 1 else near[0]))
        )
    lo, hi = inf.autotune.bounds.redundant
    if inf.redundancy_omitted and lo is not None and hi is not None and not lo <= eplb.num_redundant_experts <= hi:
        problems.append(Problem("spec.autotune.bounds.numRedundantExperts",
                                f"[{lo}, {hi}] must contain the redundancy in force, {eplb.num_redundant_experts} "
                                "(spec.eplb.numRedundantExperts omitted: the minimum valid value); widen the bounds "
                                "or set spec.eplb.numRedundantExperts",
                                fix=_set("spec", "autotune", "bounds", "numRedundantExperts",
                                         {"min": min(lo, eplb.num_redundant_experts),
                                          "max": max(hi, eplb.num_redundant_experts)})))
    if lo is not None and hi is not None and not any(
            (shape.num_experts + r) % par.ep_size == 0 for r in range(lo, hi + 1)):
        problems.append(
            Problem("spec.autotune.bounds.numRedundantExperts",
                    f"no value in [{lo}, {hi}] makes experts ({shape.num_experts}) + R divisible by "
                    f"the EP size {par.ep_size}; widen the bounds")
        )
    return problems


def _multimodal_problems(inf: MoEInference, arch: catalog.ArchitectureInfo | None) -> list[Problem]:
    """Multimodal engine options on a model the catalog knows is text-only."""
    engine = inf.engine
    if arch is None or arch.multimodal:
        return []
    return [Problem(f"spec.engine.{fld}", f"{arch.name} is not multimodal (vLLM rejects multimodal "
                    "options for it); remove the field", fix=_set("spec", "engine", fld, REMOVE))
            for fld, value in (("limitMmPerPrompt", engine.limit_mm_per_prompt),
                               ("mmEncoderTpMode", engine.mm_encoder_tp_mode))
            if value is not None]


def _extra_args_problems(inf: MoEInference) -> list[Problem]:
    """``spec.engine.extraArgs`` must not set what the operator generates."""
    problems: list[Problem] = []
    for i, arg in enumerate(inf.engine.extra_args):
        flag = arg.split("=", 1)[0]
        if flag in _GENERATED_FLAGS or flag.startswith("--eplb-config."):
            source = _GENERATED_FLAGS.get(flag, "spec.eplb")
            problems.append(
                Problem(f"spec.engine.extraArgs[{i}]", f"{flag} is generated by the operator from {source}; "
                        "set that field instead and remove the argument",
                        fix=_drop_args(inf, i, _flag_width(inf, i)))
            )
    count = _arg_value(inf.engine.extra_args, "--api-server-count")
    if count is not None and any(pod.headless for pod in inf.layout.pods):
        problems.append(Problem(f"spec.engine.extraArgs[{count[0]}]", "--api-server-count reaches the group's "
                                "--headless workers too (every pod gets the same arguments), and vLLM refuses it "
                                "there; remove it (the leader then runs vLLM's default, one API server per "
                                "data-parallel rank of the group)", fix=_drop_args(inf, count[0], _flag_width(inf, count[0]))))
    return problems


def autoscaling_problems(inf: MoEInference, version: Version | None) -> list[Problem]:
    """``spec.autoscaling`` checks the CRD cannot make: the metric exists in the engine's vLLM
    version (:func:`moe_eplb.contracts.vllm_facts.autoscaling_metric`), and backend External needs the
    ``moeinference`` series label the PodMonitor adds."""
    a = inf.autoscaling
    if a is None:
        return []
    if version is None:
        source = f"spec.engine.version {inf.engine.version_field!r}" if inf.engine.version_field else \
            f"the image tag of {inf.engine.image!r}"
        return [Problem("spec.autoscaling.metric.type", f"cannot tell the vLLM version from {source}, so not which "
                        "metric names the engine exports; set spec.engine.version (e.g. 0.12.0)")]
    if vllm_facts.autoscaling_metric(a.metric.type, version) is None:
        have = ", ".join(t for t in vllm_facts.AUTOSCALING_METRICS if vllm_facts.autoscaling_metric(t, version))
        return [Problem("spec.autoscaling.metric.type", f"vLLM {format_version(version)} has no {a.metric.type} "
                        f"metric; use one it has ({have}) or a newer image")]
    if a.backend == "HPA" and a.hpa is not None and a.hpa.metrics_api == "External" and not inf.monitoring.pod_monitor:
        return [Problem("spec.autoscaling.hpa.metricsApi", "External selects the series by the moeinference label, "
                        "which the operator's PodMonitor adds: set spec.monitoring.podMonitor.enabled: true (or "
                        "metricsApi: Pods for single-node replicas, or backend: KEDA)")]
    return []


def operator_default_problems(inf: MoEInference) -> list[Problem]:
    """Checks of a resource with the operator's defaults filled in (:func:`check_for_operator`):
    what only the operator's own options (``moe-eplb run --prometheus-url``, which ``validate`` and
    ``render`` take too) can make valid, so neither the CRD nor :func:`check` refuses it."""
    a = inf.autoscaling
    if a is not None and a.backend == "KEDA" and not inf.prometheus_url:
        return [Problem("spec.monitoring.prometheusUrl", "spec.autoscaling backend KEDA queries Prometheus, and "
                        "neither this field nor --prometheus-url (the operator's option; validate and render take "
                        "it too) names one: set spec.monitoring.prometheusUrl or --prometheus-url, or use "
                        "backend: HPA with prometheus-adapter")]
    return []


def check_for_operator(resource: Any, defaults: OperatorDefaults | None = None) -> Checked:
    """:func:`check`, then the operator's defaults filled in (:meth:`MoEInference.with_operator_defaults`,
    a private copy) and, when nothing else is wrong, :func:`operator_default_problems`: what the
    reconciler renders from, and what ``moe-eplb validate|render`` check (their ``--prometheus-url``,
    ``--exporter-image`` and ``--pod-monitor-labels`` are ``defaults``, as ``moe-eplb run``'s are)."""
    checked = check(resource)
    if checked.inference is None:
        return checked
    inf = checked.inference.with_operator_defaults(defaults or OperatorDefaults())
    return Checked(checked.problems or operator_default_problems(inf), inf)


def override_problems(inf: MoEInference) -> list[Problem]:
    """Notes on a tuner override that is recorded but does not run because it is invalid for the
    current spec (bounds, divisibility with the EP size): the effective settings fall back to
    ``spec.eplb`` then, so these are informational and never make the spec invalid (``validate``
    does not include them)."""
    override = inf.status.override
    if override is None or inf.effective.source == "autotune" or not inf.eplb.enabled:
        return []
    try:
        why = inf.knobs_problem(override.resolve(inf.spec_knobs))
    except ValueError as exc:
        why = str(exc)
    if why is None:
        return []
    return [Problem("status.autotune.override", f"not applied: {why}; spec.eplb runs instead "
                    "(the tuner will choose a valid value on its next evaluation)")]


MAX_ANNOTATIONS_BYTES = 256 * 1024  # the API server's limit on all annotations of an object together


def metadata_problems(meta: Mapping[str, Any]) -> list[Problem]:
    """What the API server checks in ObjectMeta itself: the namespace is a DNS label, label keys and
    values are Kubernetes labels, annotations take at most 256 KiB together."""
    problems = []
    ns = meta.get("namespace")
    if ns is not None and (not isinstance(ns, str) or len(ns) > 63 or not _DNS_LABEL.match(ns)):
        problems.append(Problem("metadata.namespace", f"{show(ns)} is not a namespace name: at most 63 lower-case "
                                "letters, digits and '-', starting and ending with a letter or digit"))
    labels = meta.get("labels")
    if labels is not None:
        if not isinstance(labels, Mapping):
            problems.append(Problem("metadata.labels", f"expected an object of labels, got {show(labels)}"))
        else:
            problems += label_problems(labels, "metadata.labels")
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping):
        size = sum(len(str(k).encode()) + len(str(v).encode()) for k, v in annotations.items())
        if size > MAX_ANNOTATIONS_BYTES:
            problems.append(Problem("metadata.annotations", f"{size} bytes in all; the API server allows at most "
                                    f"{MAX_ANNOTATIONS_BYTES} (256 KiB): move large data to a ConfigMap"))
    elif annotations is not None:
        problems.append(Problem("metadata.annotations", f"expected an object, got {show(annotations)}"))
    return problems


def non_finite_problems(obj: Any, path: tuple = ()) -> list[Problem]:
    """NaN and infinities anywhere (YAML has .nan and .inf; JSON, and so the API server, has neither)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return [Problem(format_path(path) or "<root>", f"{obj} is not a number the API server accepts "
                        "(JSON has no NaN or Infinity); give a finite number")]
    if isinstance(obj, Mapping):
        return [p for k, v in obj.items() for p in non_finite_problems(v, path + (k,))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in non_finite_problems(v, path + (i,))]
    return []


def _exporter_problems(inf: MoEInference, version: Version | None) -> list[Problem]:
    """The exporter plugin: injected into an image whose vLLM it supports, or installed in the image."""
    exporter, eplb = inf.engine.exporter, inf.eplb
    if not eplb.enabled or version is None:
        return []  # no EPLB state to export; an unknown version is reported elsewhere
    supported = vllm_facts.exporter_supports(version)
    plugin_image = inf.plugin_image
    if exporter.inject and not supported:
        return [Problem("spec.engine.exporter.inject",
                        f"the exporter plugin supports vLLM {vllm_facts.exporter_range()}, the image has "
                        f"{format_version(version)}: use an image in that range, or set "
                        "spec.engine.exporter.inject: false to run the stock engine without per-expert metrics (and "
                        "tuning: spec.autotune.mode Off); its probes and drain are then vLLM's own",
                        fix=_set("spec", "engine", "exporter", "inject", False) + (
                            _set("spec", "autotune", "mode", "Off") if inf.autotune.mode != "Off" else ()))]
    if not exporter.inject and supported and not plugin_image:
        return [Problem("spec.engine.exporter.inject",
                        f"false, but {inf.engine.image!r} is not the plugin image "
                        f"({k8s_names.PLUGIN_IMAGE_REPOSITORY}): the pods would export no per-expert load; "
                        f"set spec.engine.exporter.inject: true (the default) or use {k8s_names.PLUGIN_IMAGE_REPOSITORY}",
                        fix=_set("spec", "engine", "exporter", "inject", True))]
    if not exporter.inject and not supported and inf.autotune.mode != "Off":
        return [Problem("spec.autotune.mode",
                        f"{inf.autotune.mode} needs the per-expert load exporter, which supports vLLM "
                        f"{vllm_facts.exporter_range()} (the image has {format_version(version)}): use an image "
                        "in that range or set spec.autotune.mode: Off", fix=_set("spec", "autotune", "mode", "Off"))]
    return []


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def label_problems(labels: Mapping[str, Any], where: str) -> list[Problem]:
    """Kubernetes label keys (``[prefix/]name``, name <= 63 characters, prefix a DNS subdomain) and
    values (<= 63 characters, alphanumeric at both ends), as the API server checks them."""
    out = []
    for key, value in labels.items():
        key = str(key)
        prefix = key.split("/", 1)[0] if "/" in key else ""
        if not _LABEL_KEY.match(key) or len(prefix) > 253:
            out.append(Problem(f"{where}[{key[:80]!r}]", "is not a Kubernetes label key: [prefix/]name with name "
                               "at most 63 letters, digits, '-', '_' or '.' (starting and ending with a letter or "
                               "digit) and prefix a DNS subdomain"))
        elif not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            out.append(Problem(f"{where}[{key[:80]!r}]", f"{show(value)} is not a label value: at most 63 letters, "
                               "digits, '-', '_' or '.', starting and ending with a letter or digit"))
    return out


def _version_problem(field: str, what: str, need: Version, have: Version) -> Problem:
    return Problem(field, f"{what} needs vLLM >= {format_version(need)}, the image has {format_version(have)}: "
                   f"use an image with vLLM >= {format_version(need)} (spec.engine.image) or set spec.eplb.enabled: false")


def _quantization_problems(inf: MoEInference, version: Version | None) -> list[Problem]:
    quant = inf.quantization
    if quant is None:
        return [
            Problem("spec.model.quantization",
                    f"the name {inf.model.name!r} suggests a 4-bit checkpoint, whose formats differ in EPLB support: "
                    "set spec.model.quantization (compressed-tensors-wna16 for llm-compressor AWQ/GPTQ W4A16 "
                    "checkpoints, i.e. config.json quant_method 'compressed-tensors'; awq or gptq for AutoAWQ/AutoGPTQ)")
        ]
    info = catalog.QUANTIZATIONS[quant]
    if info.eplb_moe_backend and version is not None and version >= catalog.MOE_BACKEND_FLAG_SINCE:
        chosen = inf.engine.moe_backend_arg
        if chosen is not None and chosen != info.eplb_moe_backend:
            return [
                Problem("spec.engine.extraArgs", f"--moe-backend {chosen}: vLLM supports EPLB with {quant} MoE weights "
                        f"only on the {info.eplb_moe_backend} backend; remove the argument (the operator sets "
                        f"--moe-backend {info.eplb_moe_backend}) or set spec.eplb.enabled: false",
                        fix=_drop_moe_backend(inf))
            ]
    if info.eplb_since is None:
        hint = ""
        if quant in ("awq", "gptq"):
            hint = (" If the checkpoint was made with llm-compressor (config.json quant_method "
                    "'compressed-tensors'), set spec.model.quantization: compressed-tensors-wna16.")
        return [
            Problem("spec.model.quantization", f"vLLM's MoE method for {quant} ({info.vllm_method}) does not support "
                    f"EPLB in any release; use another checkpoint format or set spec.eplb.enabled: false.{hint}")
        ]
    if version is not None and EPLB_FIRST < info.eplb_since and version < info.eplb_since:
        return [
            Problem("spec.model.quantization", f"EPLB with {quant} MoE weights needs vLLM >= "
                    f"{format_version(info.eplb_since)}, the image has {format_version(version)}: use a newer image "
                    "(spec.engine.image) or set spec.eplb.enabled: false")
        ]
    return []


def _memory_problems(inf: MoEInference, shape: Any) -> list[Problem]:
    budget = inf.autotune.memory_budget_bytes
    if budget is None or inf.autotune.mode == "Off" or not shape.bytes_per_expert or not shape.num_moe_layers:
        return []
    r = inf.eplb.num_redundant_experts
    ep = inf.parallelism.ep_size
    cost = shape.num_moe_layers * shape.bytes_per_expert * r / ep
    if cost > budget:
        return [
            Problem("spec.eplb.numRedundantExperts",
                    f"{r} redundant experts cost {cost / 2**30:.2f} GiB per GPU ({shape.num_moe_layers} MoE layers x "
                    f"{shape.bytes_per_expert / 2**20:.1f} MiB per expert x R / EP {ep}), more than "
                    f"spec.autotune.memoryBudgetPerGpu ({budget / 2**30:.2f} GiB); lower R or raise the budget",
                    fix=_set("spec", "autotune", "memoryBudgetPerGpu", f"{math.ceil(cost / 2**30)}Gi"))
        ]
    return []


# --------------------------------------------------------------------------------------------------
# wide expert parallelism: all2all backend, EPLB communicator, fault tolerance (vLLM 0.34)
# --------------------------------------------------------------------------------------------------


def wide_ep_problems(inf: MoEInference, version: Version | None) -> list[Problem]:
    """The all2all backend and the EPLB communicator for the version and with EPLB, the DeepEP
    low-latency buffer of the redundancy, and fault tolerance's own constraints and redundancy floor
    (the CRD checks what it can: versions, data parallel, backends; these need the catalog, the
    version's defaults or extraArgs)."""
    problems = _all2all_problems(inf, version) + _communicator_problems(inf, version) + vendor_problems(inf)
    problems += fit.memory_problems(inf)
    if inf.fault_tolerance.enabled:
        problems += _fault_tolerance_problems(inf)
    if inf.elastic_enabled:
        problems += _elastic_problems(inf)
    return problems


def _elastic_problems(inf: MoEInference) -> list[Problem]:
    """What vLLM's elastic EP refuses that the CRD cannot see (extraArgs: pipeline parallelism, hybrid
    load balancing, several API servers, a MoE draft model), and every size of the group in pod steps
    (:func:`moe_eplb.api.elastic.sizes`): the redundancy vLLM runs there (``R' = (E + R) x DP' / DP -
    E``) must be one it accepts, and DeepEP low latency's buffer must hold its physical experts."""
    problems: list[Problem] = []
    args = inf.engine.extra_args
    pp = _arg_value(args, "--pipeline-parallel-size") or _arg_value(args, "-pp")
    if pp is not None and pp[1] != "1":
        problems.append(Problem(f"spec.engine.extraArgs[{pp[0]}]", "vLLM's elastic EP does not run with pipeline "
                                "parallelism; remove the argument or set spec.parallelism.elastic.enabled: false",
                                fix=_drop_args(inf, pp[0], _flag_width(inf, pp[0]))))
    for i, arg in enumerate(args):
        if arg.split("=", 1)[0] == "--data-parallel-hybrid-lb":
            problems.append(Problem(f"spec.engine.extraArgs[{i}]", "vLLM's elastic EP refuses hybrid load balancing; "
                                    "the operator runs one API server per rank (external load balancing): remove "
                                    "the argument", fix=_drop_args(inf, i, _flag_width(inf, i))))
    count = _arg_value(args, "--api-server-count")
    if count is not None and count[1] != "1" and not inf.fault_tolerance.enabled:  # fault tolerance says it already
        problems.append(Problem(f"spec.engine.extraArgs[{count[0]}]", "an elastic group runs one API server per "
                                "rank (vLLM caps elastic EP at one); remove the argument",
                                fix=_drop_args(inf, count[0], _flag_width(inf, count[0]))))
    draft = _speculative_moe_draft(inf)
    if draft is not None and not inf.fault_tolerance.enabled:
        problems.append(Problem(f"spec.engine.extraArgs[{draft}]", "vLLM's elastic EP does not support a MoE draft "
                                "model (MTP of a MoE model, or a MoE drafter); remove --speculative-config or set "
                                "spec.parallelism.elastic.enabled: false", fix=_drop_args(inf, draft, _flag_width(inf, draft))))
    par, experts = inf.parallelism, inf.moe_shape.num_experts
    if not experts or not inf.eplb.enabled or par.max_data < par.min_data:
        return problems  # the CRD refuses the bounds already; nothing is known of the experts
    r = inf.eplb.num_redundant_experts
    ok: list[int] = []  # the sizes vLLM runs, from the smallest up to the first it refuses
    for size in elastic.sizes(par.min_data, par.max_data, par.data_local):
        why = elastic.size_problem(experts, r, par.tensor, par.data, size)
        if why is None:
            at = elastic.redundancy_at(experts, r, par.data, size)
            why = vllm_facts.redundant_problem(experts, par.tensor * size, at)
            why = f"at {size} data-parallel ranks vLLM runs {at} redundant experts: {why}" if why else None
        if why is not None:
            grow = size > par.data  # too large: maxData down to the last size that runs; too small: launch size
            fld = "spec.parallelism.elastic.maxData" if grow else "spec.parallelism.elastic.minData"
            fix = _set("spec", "parallelism", "elastic", "maxData", ok[-1]) if grow and ok else (
                None if grow else _set("spec", "parallelism", "elastic", "minData", par.data))
            problems.append(Problem(fld, f"{why} (R' = (E + R) x DP' / DP - E with E {experts}, R {r}, DP "
                                         f"{par.data}); keep the group's sizes within what vLLM can run", fix=fix))
            break
        ok.append(size)
    return problems + _elastic_deepep_problems(inf)


def _elastic_deepep_problems(inf: MoEInference) -> list[Problem]:
    """DeepEP low latency's buffer at the group's largest size (its physical experts grow with it);
    the fix lowers maxData to the largest size whose buffer fits."""
    backend, entry, par = all2all_backend(inf), inf.catalog_model, inf.parallelism
    experts, r = inf.moe_shape.num_experts or 0, inf.eplb.num_redundant_experts
    if backend is None or backend[0] != wide_ep.DEEPEP_LOW_LATENCY or entry is None:
        return []
    tokens = tokens_per_rank(inf)

    def need(size: int) -> int:
        return wide_ep.deepep_ll_buffer_bytes(tokens, entry.hidden_size, experts + elastic.redundancy_at(
            experts, r, par.data, size))

    at = elastic.redundancy_at(experts, r, par.data, par.max_data)
    if need(par.max_data) <= wide_ep.DEEPEP_LL_BUFFER_LIMIT:
        return []
    fits = [s for s in elastic.sizes(par.min_data, par.max_data, par.data_local) if need(s) <= wide_ep.DEEPEP_LL_BUFFER_LIMIT]
    return [Problem("spec.parallelism.elastic.maxData",
                    f"at {par.max_data} ranks vLLM runs {at} redundant experts, and DeepEP low latency's buffer for "
                    f"{experts + at} physical experts is {need(par.max_data) / 2**30:.1f} GiB per GPU, more than the "
                    f"32 GiB it can register: lower maxData{f' (to {fits[-1]})' if fits else ''}, numRedundantExperts "
                    "or --max-num-batched-tokens",
                    fix=_set("spec", "parallelism", "elastic", "maxData", fits[-1]) if fits else None)]


def _all2all_problems(inf: MoEInference, version: Version | None) -> list[Problem]:
    found = all2all_backend(inf)
    problems: list[Problem] = []
    where = "spec.parallelism.all2allBackend"
    if inf.parallelism.all2all_backend and _arg_value(inf.engine.extra_args, "--all2all-backend"):
        i = _arg_value(inf.engine.extra_args, "--all2all-backend")[0]  # type: ignore[index]
        problems.append(Problem(f"spec.engine.extraArgs[{i}]", f"--all2all-backend is generated by the operator from "
                                f"{where}; remove the argument"))
    if found is None:
        return problems
    backend, fld = found
    if fld != where and backend not in wide_ep.ALL2ALL_SINCE:
        return problems + [Problem(fld, f"--all2all-backend {backend!r} is not one of vLLM's backends "
                                        f"({', '.join(wide_ep.ALL2ALL_BACKENDS)}); set {where} instead")]
    if backend not in wide_ep.ALL2ALL_SINCE:
        return problems
    need, have = wide_ep.backend_vendor(backend), wide_ep.gpu_vendor(inf.engine.gpu_resource_name)
    if need is not None and have is not None and need != have:
        theirs = ", ".join(wide_ep.AMD_ONLY if have == "amd" else ("deepep_low_latency", "nixl_ep"))
        problems.append(Problem(fld, f"{backend} runs on {need.upper() if need == 'amd' else 'NVIDIA'} GPUs only, and "
                                f"spec.engine.gpuResourceName asks for {inf.engine.gpu_resource_name}: use "
                                f"allgather_reducescatter (any vendor) or one of that vendor's backends ({theirs}), "
                                "or change spec.engine.gpuResourceName",
                                fix=_set("spec", "parallelism", "all2allBackend", REMOVE) if fld == where
                                else _drop_args(inf, int(fld.split("[")[1].rstrip("]")), 2)))
    if inf.eplb.enabled and backend == wide_ep.MOONEP and fld != where:
        problems.append(Problem(fld, "moonep does not support EPLB (vLLM refuses it); use another backend or set "
                                     "spec.eplb.enabled: false", fix=_drop_args(inf, int(fld.split("[")[1].rstrip("]")), 2)))
    if backend == wide_ep.MOONEP and (inf.quantization or "none") != "none":
        problems.append(Problem(fld, f"moonep runs unquantized bfloat16 models only, and the checkpoint is "
                                     f"{inf.quantization} (vLLM refuses it): use another backend",
                                fix=_set("spec", "parallelism", "all2allBackend", REMOVE) if fld == where else None))
    if backend == wide_ep.DEEPEP_LOW_LATENCY and inf.eplb.enabled:
        problems += _deepep_buffer_problems(inf, fld)
    return problems


def _deepep_buffer_problems(inf: MoEInference, fld: str) -> list[Problem]:
    """DeepEP low latency's RDMA buffer grows with the physical experts (logical + redundant); above
    32 GiB it cannot be registered. Refused with the largest redundancy that fits."""
    entry, shape, par = inf.catalog_model, inf.moe_shape, inf.parallelism
    if entry is None or not shape.num_experts or par.data <= 1:
        return []  # the hidden size is unknown, or vLLM runs no all2all exchange
    r, tokens = inf.eplb.num_redundant_experts, tokens_per_rank(inf)
    need = wide_ep.deepep_ll_buffer_bytes(tokens, entry.hidden_size, shape.num_experts + r)
    if need <= wide_ep.DEEPEP_LL_BUFFER_LIMIT:
        return []
    best = wide_ep.largest_deepep_ll_redundancy(shape.num_experts, par.ep_size, tokens, entry.hidden_size)
    fix = (f"use numRedundantExperts {best} or less" if best is not None else
           "no redundancy fits: lower --max-num-batched-tokens")
    return [Problem("spec.eplb.numRedundantExperts",
                    f"{r} redundant experts make DeepEP low latency's buffer {need / 2**30:.1f} GiB per GPU ({tokens} "
                    f"tokens per rank x hidden {entry.hidden_size} x {shape.num_experts + r} physical experts), more "
                    f"than the 32 GiB it can register ({fld} deepep_low_latency); {fix}, or lower "
                    "--max-num-batched-tokens in spec.engine.extraArgs",
                    fix=_set("spec", "eplb", "numRedundantExperts", best) if best is not None else None)]


#: vLLM's official images per vendor: the CUDA one, and the ROCm one (``rocm`` in its name, as in
#: ``vllm/vllm-openai-rocm`` and AMD's ``rocm/vllm``)
CUDA_IMAGES = ("vllm/vllm-openai",)


def vendor_problems(inf: MoEInference) -> list[Problem]:
    """The image against the GPU vendor where the image says which it is built for: a ROCm image
    (``rocm`` in its repository) on NVIDIA GPUs, vLLM's CUDA image on AMD ones."""
    ref = parse_image(inf.engine.image)
    vendor = wide_ep.gpu_vendor(inf.engine.gpu_resource_name)
    if ref is None or vendor is None:
        return []
    repo = ref.repository.lower()
    if vendor == "nvidia" and "rocm" in repo:
        return [Problem("spec.engine.gpuResourceName", f"{inf.engine.image!r} is a ROCm (AMD) image and the pods ask "
                        f"for {inf.engine.gpu_resource_name}: set spec.engine.gpuResourceName: amd.com/gpu, or use a "
                        "CUDA image (vllm/vllm-openai)", fix=_set("spec", "engine", "gpuResourceName", "amd.com/gpu"))]
    if vendor == "amd" and repo in CUDA_IMAGES and ref.registry in (None, "docker.io"):
        return [Problem("spec.engine.image", f"{inf.engine.image!r} is vLLM's CUDA image and the pods ask for "
                        f"{inf.engine.gpu_resource_name}: use vLLM's ROCm image (vllm/vllm-openai-rocm, same tag) or "
                        "set spec.engine.gpuResourceName: nvidia.com/gpu",
                        fix=_set("spec", "engine", "image",
                                 inf.engine.image.replace("vllm/vllm-openai", "vllm/vllm-openai-rocm", 1)))]
    return []


def _communicator_problems(inf: MoEInference, version: Version | None) -> list[Problem]:
    comm = inf.spec.eplb.communicator if inf.spec.eplb is not None else None
    if comm is None or version is None:
        return []
    async_on = inf.eplb.use_async if inf.eplb.use_async is not None else version >= wide_ep.ASYNC_DEFAULT_SINCE
    if comm in wide_ep.ASYNC_REFUSED_COMMUNICATORS and async_on:
        return [Problem("spec.eplb.communicator", f"{comm} cannot run with async EPLB (vLLM refuses it: NCCL "
                        "multi-stream conflicts), and async is on: use torch_gloo or nixl, or set spec.eplb.async: false",
                        fix=_set("spec", "eplb", "communicator", "torch_gloo"))]
    return []


def _speculative_moe_draft(inf: MoEInference) -> int | None:
    """Index in extraArgs of a ``--speculative-config`` whose draft is a MoE model (an MTP drafter of
    a MoE model, or a catalog model), else None."""
    found = _arg_value(inf.engine.extra_args, "--speculative-config")
    if found is None:
        return None
    text = found[1].lower()
    if "mtp" in text or any(m.matches_name(word) for m in catalog.MODELS for word in re.findall(r"[\w./-]+", text)):
        return found[0]
    return None


def _fault_tolerance_problems(inf: MoEInference) -> list[Problem]:
    """What vLLM's fault tolerance refuses that the CRD cannot see (extraArgs, the catalog's expert
    count), and the redundancy floor (:func:`moe_eplb.api.wide_ep.fault_tolerance_floor`)."""
    problems: list[Problem] = []
    count = _arg_value(inf.engine.extra_args, "--api-server-count")
    if count is not None and count[1] != "1":
        problems.append(Problem(f"spec.engine.extraArgs[{count[0]}]", "fault tolerance needs one API server per "
                                "engine (vLLM refuses --api-server-count > 1 with it); remove the argument",
                                fix=_drop_args(inf, count[0], _flag_width(inf, count[0]))))
    draft = _speculative_moe_draft(inf)
    if draft is not None:
        problems.append(Problem(f"spec.engine.extraArgs[{draft}]", "vLLM fault tolerance does not support a MoE draft "
                                "model (MTP of a MoE model, or a MoE drafter) yet; remove --speculative-config or set "
                                "spec.faultTolerance.enabled: false", fix=_drop_args(inf, draft, _flag_width(inf, draft))))
    k, experts, par = inf.ranks_to_survive, inf.moe_shape.num_experts, inf.parallelism
    if k and par.data_local > 1 and k % par.data_local:
        layouts = fit.fault_tolerant_layouts(inf) if inf.eplb.enabled else []
        best = fit.best_layout(layouts)
        whole = -(-k // par.data_local) * par.data_local
        if layouts:
            advice = fit.layouts_text(inf, layouts)
            fix = fit.layout_fix(inf, best) if best is not None else None
        else:
            advice = (f"use {whole}" if whole < par.data else "with every rank in one pod only retry is possible: set "
                      "it to 0, or spread the ranks over pods (spec.parallelism.nodes)")
            fix = ((("spec", "faultTolerance", "rankFailuresToSurvive"), whole if whole < par.data else 0),)
        problems.append(Problem("spec.faultTolerance.rankFailuresToSurvive",
                                f"{k} is not a multiple of the ranks per pod ({par.data_local}): vLLM's multi-port "
                                f"supervisor loses a pod's ranks together; {advice}", fix=fix))
    if not k or not experts or k >= par.data or not inf.eplb.enabled:
        return problems  # nothing to survive, or the CRD refuses it already
    floor = wide_ep.fault_tolerance_floor(experts, par.tensor, par.data, k)
    r = inf.eplb.num_redundant_experts
    if floor is None:
        problems.append(Problem("spec.faultTolerance.rankFailuresToSurvive",
                                f"no redundancy up to vLLM's limit ({vllm_facts.MAX_REDUNDANT_EXPERTS}) survives {k} lost "
                                f"data-parallel rank(s) of {par.data}; lower it or raise spec.parallelism.data"))
    elif r < floor:
        problems.append(Problem("spec.eplb.numRedundantExperts",
                                f"{r} is below the fault-tolerance floor {floor} for surviving {k} lost data-parallel "
                                f"rank(s): each rank holds tensor x (experts + R) / EP = {(experts + r) // par.data} "
                                f"slots per layer, and re-hosting them needs R >= k x (experts + R) / data (experts "
                                f"{experts}, data {par.data}); set numRedundantExperts to at least {floor}, or lower "
                                "spec.faultTolerance.rankFailuresToSurvive",
                                fix=_set("spec", "eplb", "numRedundantExperts", floor)))
    lo, hi = inf.autotune.bounds.redundant
    if floor is not None and hi is not None and hi < floor:
        problems.append(Problem("spec.autotune.bounds.numRedundantExperts",
                                f"max {hi} is below the fault-tolerance floor {floor}, which the tuner never goes "
                                f"below; raise it to at least {floor}",
                                fix=_set("spec", "autotune", "bounds", "numRedundantExperts", {"min": lo or 0, "max": floor})))
    return problems
