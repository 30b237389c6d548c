"""Labels, selectors and annotations put on every child of a MoEInference (pinned names)."""

from __future__ import annotations

from moe_eplb.exporter.names import POD_NAME_LABEL

CONFIG_HASH_ANNOTATION = "eplb.ai/eplb-config-hash"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def labels(name: str) -> dict[str, str]:
    """Labels on every child object and pod of MoEInference ``name``."""
    return {
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "moe-eplb",
        "app.kubernetes.io/component": "engine",
        POD_NAME_LABEL: name,
    }


def selector_labels(name: str) -> dict[str, str]:
    """The (immutable) pod selector of the workload, Service, PDB and PodMonitor."""
    return {"app.kubernetes.io/component": "engine", POD_NAME_LABEL: name}


def selector_string(name: str) -> str:
    """``selector_labels`` as a label-selector string (for ``status.selector`` / the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))
