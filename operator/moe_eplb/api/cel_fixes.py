"""The fixes of the CRD's CEL refusals (pure): the edit each rule's message suggests, as a
:attr:`moe_eplb.api.problem.Problem.fix`, for the rules where one edit follows from the message.

The rules live in the CRD (the apiserver runs them); their message names the fix in words. Here each
rule that has a single sensible edit is matched by the field it names and words of its message, and
given that edit as a function of the (defaulted) resource. Refusals that ask for the user's intent (a
value out of range, which model, which version) carry no fix: their message says what to choose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from moe_eplb.api.elastic import ELASTIC_EXTERNAL_SINCE
from moe_eplb.api.imageref import parse_image
from moe_eplb.api.problem import REMOVE, Problem
from moe_eplb.api.versions import format_version

Fix = tuple[tuple[tuple[Any, ...], Any], ...]
OPERATOR_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
                   "app.kubernetes.io/component")
LWS_PREFIX = "leaderworkerset.sigs.k8s.io/"
LWS_EXCLUSIVE = LWS_PREFIX + "exclusive-topology"


def _get(res: dict[str, Any], *path: str) -> Any:
    node: Any = res
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _set(*path_and_value: Any) -> Fix:
    return ((tuple(path_and_value[:-1]), path_and_value[-1]),)


def _kept(items: dict[str, Any], drop: Callable[[str], bool]) -> Any:
    kept = {k: v for k, v in items.items() if not drop(k)}
    return kept if kept else REMOVE


def _workload_labels(res: dict[str, Any]) -> Fix:
    labels = _get(res, "spec", "workload", "metadata", "labels") or {}
    return _set("spec", "workload", "metadata", "labels", _kept(
        labels, lambda k: k in OPERATOR_LABELS or k.startswith(("eplb.ai/", LWS_PREFIX))))


def _workload_annotations(res: dict[str, Any]) -> Fix:
    notes = _get(res, "spec", "workload", "metadata", "annotations") or {}
    multi = (_get(res, "spec", "parallelism", "nodes") or 1) > 1
    return _set("spec", "workload", "metadata", "annotations", _kept(
        notes, lambda k: k.startswith("eplb.ai/") or (k.startswith(LWS_PREFIX) and not (multi and k == LWS_EXCLUSIVE))))


def _bounds(name: str, key: str) -> Callable[[dict[str, Any]], Fix]:
    def fix(res: dict[str, Any]) -> Fix:
        bound = dict(_get(res, "spec", "autotune", "bounds", name) or {})
        value = _get(res, "spec", "eplb", key)
        lo, hi = bound.get("min", value), bound.get("max", value)
        return _set("spec", "autotune", "bounds", name, {"min": min(lo, hi, value), "max": max(lo, hi, value)})
    return fix


def _ft_backend(res: dict[str, Any]) -> Fix:
    if str(_get(res, "spec", "engine", "gpuResourceName") or "").startswith("amd.com/"):
        return _set("spec", "faultTolerance", "enabled", False)  # both backends that mask a lost rank are NVIDIA's
    return _set("spec", "parallelism", "all2allBackend", "deepep_low_latency")


# --- elastic groups (spec.parallelism.elastic): keep the group elastic wherever one edit can ---------
#: vLLM's own images, whose tags are its release numbers (a newer release is the same tag scheme)
VLLM_IMAGES = ("vllm/vllm-openai", "vllm/vllm-openai-rocm")
ELASTIC_OFF: Fix = _set("spec", "parallelism", "elastic", "enabled", False)


def _group(res: dict[str, Any]) -> tuple[int, int, int, int | None]:
    """(launch data, ranks a pod, minData, maxData or None) as the CRD's rules read them."""
    par = _get(res, "spec", "parallelism") or {}
    data, nodes = int(par.get("data") or 1), int(par.get("nodes") or 1)
    el = par.get("elastic") or {}
    return data, max(1, data // nodes), int(el.get("minData") or data), el.get("maxData")


def _whole_pods(ranks: int, per_pod: int, up: bool) -> int:
    return (-(-ranks // per_pod) if up else ranks // per_pod) * per_pod


def _elastic_newer_vllm(res: dict[str, Any]) -> Fix:
    """vLLM's own image at the first release with external elastic EP (same repository, tag scheme
    kept, digest dropped); a custom image (or a version set by hand) is the user's to rebuild: elastic off."""
    ref = parse_image(str(_get(res, "spec", "engine", "image") or ""))
    if (_get(res, "spec", "engine", "version") or ref is None or ref.repository not in VLLM_IMAGES
            or ref.registry not in (None, "docker.io") or ref.version is None):
        return ELASTIC_OFF
    tag = ("v" if str(ref.tag).startswith("v") else "") + format_version(ELASTIC_EXTERNAL_SINCE)
    return _set("spec", "engine", "image", f"{ref.registry + '/' if ref.registry else ''}{ref.repository}:{tag}")


def _elastic_data(res: dict[str, Any]) -> Fix:
    """Launch with data parallel: 2 ranks a pod (``data`` = 2 x nodes) where maxData leaves the group
    room to grow past that; where it does not, the group could never be resized and the extra GPUs
    would buy nothing: elastic off (the launch size the user chose stays)."""
    nodes = int(_get(res, "spec", "parallelism", "nodes") or 1)
    data = 2 * nodes
    _, _, _, most = _group(res)
    return _set("spec", "parallelism", "data", data) if most is not None and most > data else ELASTIC_OFF


def _elastic_max(res: dict[str, Any]) -> Fix:
    """maxData from what the resource already asks for: the pods of ``spec.replicas``, the autoscaler's
    ``maxReplicas``, else the launch size (vLLM's own default for --elastic-ep-max-dp-size: no growth
    until the user raises it), in whole pods and at least minData."""
    _, per_pod, least, _ = _group(res)
    asked = [least, int(_get(res, "spec", "replicas") or 1) * per_pod]
    if _get(res, "spec", "autoscaling", "enabled"):
        asked.append(int(_get(res, "spec", "autoscaling", "maxReplicas") or 1) * per_pod)
    return _set("spec", "parallelism", "elastic", "maxData", _whole_pods(max(asked), per_pod, up=True))


def _elastic_max_whole_pods(res: dict[str, Any]) -> Fix:
    """maxData down to whole pods (up where that would fall below minData)."""
    _, per_pod, least, most = _group(res)
    down = _whole_pods(int(most), per_pod, up=False)
    return _set("spec", "parallelism", "elastic", "maxData",
                down if down >= least else _whole_pods(int(most), per_pod, up=True))


def _elastic_replicas(res: dict[str, Any]) -> Fix:
    """spec.replicas to the nearest pod count within [minData, maxData]."""
    _, per_pod, least, most = _group(res)
    lo, hi = -(-least // per_pod), int(most) // per_pod
    return _set("spec", "replicas", min(hi, max(lo, int(_get(res, "spec", "replicas") or 1))))


#: the elastic rules' fixes (field, words, fix)
ELASTIC_FIXERS: tuple[tuple[str, str, Callable[[dict[str, Any]], Fix]], ...] = (
    # "needs EPLB": its fix needs the whole check of the edited resource (validation._elastic_eplb_fix)
    ("spec.parallelism.elastic.enabled", "needs vLLM >= 0.33.0", _elastic_newer_vllm),
    ("spec.parallelism.elastic.enabled", "needs data parallel > 1", _elastic_data),
    ("spec.parallelism.elastic.maxData", "is required", _elastic_max),
    ("spec.parallelism.elastic.minData", "at least spec.parallelism.data",
     lambda r: _set("spec", "parallelism", "elastic", "minData", _group(r)[0])),
    ("spec.parallelism.elastic.maxData", "at least minData",
     lambda r: _set("spec", "parallelism", "elastic", "maxData", _group(r)[2])),
    ("spec.parallelism.elastic.minData", "a pod at a time",
     lambda r: _set("spec", "parallelism", "elastic", "minData", _whole_pods(_group(r)[2], _group(r)[1], up=True))),
    ("spec.parallelism.elastic.maxData", "a pod at a time", _elastic_max_whole_pods),
    ("spec.replicas", "pods of an elastic group", _elastic_replicas),
    ("spec.autoscaling.maxReplicas", "set maxReplicas to maxData / dataLocal",
     lambda r: _set("spec", "autoscaling", "maxReplicas", int(_group(r)[3]) // _group(r)[1])),
    ("spec.autoscaling.minReplicas", "set minReplicas to minData / dataLocal",
     lambda r: _set("spec", "autoscaling", "minReplicas", _group(r)[2] // _group(r)[1])),
    # NIXL in the image cannot be told from here; sync EPLB runs on every image
    ("spec.eplb.async", "needs NIXL", lambda r: _set("spec", "eplb", "async", False)),
)


#: (the field a rule names, words of its message, the fix)
FIXERS: tuple[tuple[str, str, Callable[[dict[str, Any]], Fix]], ...] = (
    ("spec.workload.metadata.labels", "", _workload_labels),
    ("spec.workload.metadata.annotations", "", _workload_annotations),
    ("spec.autotune.mode", "tunes EPLB", lambda r: _set("spec", "autotune", "mode", "Off")),
    ("spec.parallelism.expert", "needs expert parallelism", lambda r: _set("spec", "parallelism", "expert", True)),
    ("spec.parallelism.dataLocal", "must equal", lambda r: _set("spec", "parallelism", "dataLocal", REMOVE)),
    ("spec.autotune.bounds.windowSize", "must contain", _bounds("windowSize", "windowSize")),
    ("spec.autotune.bounds.stepInterval", "must contain", _bounds("stepInterval", "stepInterval")),
    ("spec.autotune.bounds.numRedundantExperts", "must contain", _bounds("numRedundantExperts", "numRedundantExperts")),
    ("spec.faultTolerance.enabled", "needs data parallel > 1", lambda r: _set("spec", "faultTolerance", REMOVE)),
    ("spec.faultTolerance.rankFailuresToSurvive", "needs vLLM >= 0.34",
     lambda r: _set("spec", "faultTolerance", "rankFailuresToSurvive", 0)),
    ("spec.parallelism.all2allBackend", "can mask lost ranks", _ft_backend),
    ("spec.parallelism.all2allBackend", "moonep", lambda r: _set("spec", "parallelism", "all2allBackend", REMOVE)),
    ("spec.eplb.communicator", "one NVLink domain", lambda r: _set("spec", "eplb", "communicator", REMOVE)),
    ("spec.rollout", "cannot both be 0", lambda r: _set("spec", "rollout", "maxUnavailable", 1)),
    ("spec.autoscaling.keda.activationQuery", "minReplicas 0",
     lambda r: _set("spec", "autoscaling", "minReplicas", 1)),
    ("spec.engine.resources.limits", "tensor x dataLocal",
     lambda r: _set("spec", "engine", "resources", "limits", _kept(
         _get(r, "spec", "engine", "resources", "limits") or {}, lambda k: k == _get(r, "spec", "engine", "gpuResourceName")))),
    ("spec.engine.resources.requests", "tensor x dataLocal",
     lambda r: _set("spec", "engine", "resources", "requests", _kept(
         _get(r, "spec", "engine", "resources", "requests") or {}, lambda k: k == _get(r, "spec", "engine", "gpuResourceName")))),
    *ELASTIC_FIXERS,
)


def with_fixes(problems: list[Problem], resource: dict[str, Any]) -> list[Problem]:
    """``problems`` with the fix of each CEL refusal that has one (:data:`FIXERS`) filled in."""
    out = []
    for p in problems:
        if p.rule is not None and p.fix is None:
            for fld, words, fixer in FIXERS:
                if p.field == fld and words in p.message:
                    p = dataclasses.replace(p, fix=fixer(resource))
                    break
        out.append(p)
    return out
