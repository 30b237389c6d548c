"""Merge ``spec.engine.podTemplate`` into a rendered engine pod template (pure).

The merge follows Kubernetes' strategic merge for the lists a pod template has, so that the
overlay reads like a ``kubectl patch``:

* objects merge key by key (``securityContext``, ``affinity``, ``nodeSelector``, ``resources``);
  scalars and lists without a merge key are set (replaced) by the overlay's value;
* lists with a merge key merge entry by entry: an overlay entry whose key matches a rendered one
  replaces it (containers and init containers *merge* into it, recursively), any other entry is
  appended in the overlay's order -- :data:`POD_LISTS` and :data:`CONTAINER_LISTS` name the keys;
* ``tolerations`` and ``envFrom`` (no key) are appended, an entry equal to a rendered one once;
* labels and annotations are added (the operator's selector labels and config-hash annotation
  cannot be in the overlay: :mod:`moe_eplb.api.podtemplate` refuses them).

So the container named ``vllm`` merges into the engine container (its env, envFrom, volumeMounts,
securityContext, resources such as ``rdma/ib``), other containers become sidecars.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from moe_eplb.api.podtemplate import PodTemplateOverlay

#: merge keys of the PodSpec's lists (strategic merge's ``patchMergeKey``s), and whether a matching
#: entry merges into the rendered one (True) or replaces it (False)
POD_LISTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "containers": (("name",), True),
    "initContainers": (("name",), True),
    "ephemeralContainers": (("name",), True),
    "volumes": (("name",), False),
    "imagePullSecrets": (("name",), False),
    "hostAliases": (("ip",), False),
    "resourceClaims": (("name",), False),
    "readinessGates": (("conditionType",), False),
    "schedulingGates": (("name",), False),
    "topologySpreadConstraints": (("topologyKey", "whenUnsatisfiable"), False),
}
#: the same for a container's lists
CONTAINER_LISTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "env": (("name",), False),
    "volumeMounts": (("mountPath",), False),
    "volumeDevices": (("devicePath",), False),
    "ports": (("containerPort", "protocol"), False),
    "resizePolicy": (("resourceName",), False),
}
#: lists without a merge key that the overlay appends to
APPENDED = ("tolerations", "envFrom")


def merge_pod_template(template: dict[str, Any], overlay: PodTemplateOverlay | None) -> dict[str, Any]:
    """``template`` (``{metadata, spec}``, not modified) with ``overlay`` merged in; the same object
    when there is no overlay."""
    if overlay is None:
        return template
    out = copy.deepcopy(template)
    meta = out.setdefault("metadata", {})
    for key, extra in (("labels", overlay.labels), ("annotations", overlay.annotations)):
        if extra:
            meta[key] = {**extra, **meta.get(key, {})}  # the operator's own keys are refused in the overlay
    out["spec"] = _merge_object(out.get("spec") or {}, overlay.spec, POD_LISTS)
    return out


def _merge_object(base: Mapping[str, Any], patch: Mapping[str, Any],
                  lists: Mapping[str, tuple[tuple[str, ...], bool]]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        old = out.get(key)
        if key in lists and isinstance(value, list) and isinstance(old, list):
            keys, merge_entries = lists[key]
            out[key] = _merge_list(old, value, keys, merge_entries)
        elif key in APPENDED and isinstance(value, list) and isinstance(old, list):
            out[key] = old + [copy.deepcopy(v) for v in value if v not in old]
        elif isinstance(value, Mapping) and isinstance(old, Mapping):
            out[key] = _merge_object(old, value, {})
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(base: list[Any], patch: list[Any], keys: tuple[str, ...], merge_entries: bool) -> list[Any]:
    def key_of(entry: Any) -> tuple[Any, ...] | None:
        return tuple(entry.get(k) for k in keys) if isinstance(entry, Mapping) else None

    out = list(base)
    where = {key_of(e): i for i, e in enumerate(out) if key_of(e) is not None}
    for entry in patch:
        k = key_of(entry)
        if k is not None and k in where:
            i = where[k]
            out[i] = _merge_object(out[i], entry, CONTAINER_LISTS) if merge_entries else copy.deepcopy(entry)
        else:
            out.append(copy.deepcopy(entry))
            if k is not None:
                where[k] = len(out) - 1
    return out
