"""The MoEInference CRD, loaded from the packaged ``crd.yaml`` (the single source of truth).

``crds/moeinferences.eplb.ai.yaml`` in the repository is a byte-identical copy of that file, and
``moe-eplb crd`` prints it.
"""

from __future__ import annotations

import copy
import functools
from importlib import resources
from typing import Any

import yaml

from moe_eplb.contracts.k8s_names import API_VERSION

CRD_FILE = "crd.yaml"


@functools.lru_cache(maxsize=1)
def crd_text() -> str:
    """The CRD YAML exactly as shipped (str)."""
    return resources.files("moe_eplb.api").joinpath(CRD_FILE).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _crd() -> dict[str, Any]:
    # libyaml's loader when PyYAML has it: the CRD carries a generated PodSpec schema (~0.3 MB), which
    # the pure-Python loader takes about half a second to read
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(crd_text(), Loader=loader)  # noqa: S506 (a safe loader)


def crd() -> dict[str, Any]:
    """The CRD as a dict (a fresh deep copy each call; callers may mutate it)."""
    return copy.deepcopy(_crd())


def version_entry(version: str = API_VERSION) -> dict[str, Any]:
    """The CRD's ``spec.versions[]`` entry for ``version`` (shared, do not mutate)."""
    for entry in _crd()["spec"]["versions"]:
        if entry["name"] == version:
            return entry
    raise KeyError(f"CRD has no version {version!r}")


def openapi_schema(version: str = API_VERSION) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``version`` (shared, do not mutate)."""
    return version_entry(version)["schema"]["openAPIV3Schema"]


def default_engine_image() -> str:
    """Default vLLM image (the CRD's default for ``spec.engine.image``)."""
    engine = openapi_schema()["properties"]["spec"]["properties"]["engine"]
    return engine["properties"]["image"]["default"]
