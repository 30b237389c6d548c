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

from moe_eplb.api.problem import REMOVE, Problem

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
