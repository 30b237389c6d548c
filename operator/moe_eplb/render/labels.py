"""Labels and selectors put on every child of a MoEInference (names from :mod:`moe_eplb.contracts.k8s_names`)."""

from __future__ import annotations

from moe_eplb.contracts.k8s_names import (
    COMPONENT,
    COMPONENT_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NAME_LABEL,
)


def labels(name: str) -> dict[str, str]:
    """Labels on every child object and pod of MoEInference ``name``."""
    return {
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/instance": name,
        MANAGED_BY_LABEL: MANAGED_BY,
        COMPONENT_LABEL: COMPONENT,
        NAME_LABEL: name,
    }


def selector_labels(name: str) -> dict[str, str]:
    """The (immutable) pod selector of the workload, Service, PDB and PodMonitor."""
    return {COMPONENT_LABEL: COMPONENT, NAME_LABEL: name}


def selector_string(name: str) -> str:
    """``selector_labels`` as a label-selector string (for ``status.selector`` / the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))
