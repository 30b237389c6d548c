"""Example manifests for the API and render tests: loaders, a dotted-path setter, and the fixtures
``seed`` and ``variant`` (re-exported by tests/api/conftest.py and tests/render/conftest.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
DELETE = object()


def load_moeinferences(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "MoEInference"]


def set_path(obj: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in ``obj`` (creating maps); value ``DELETE`` removes the key."""
    parts = dotted.split(".")
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    if value is DELETE:
        obj.pop(parts[-1], None)
    else:
        obj[parts[-1]] = value


def frozen(value: Any) -> Any:
    """A read-only mapping view of a manifest, like the ones kopf hands to handlers."""
    from types import MappingProxyType

    if isinstance(value, dict):
        return MappingProxyType({k: frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(frozen(v) for v in value)
    return value


@pytest.fixture()
def seed() -> dict[str, Any]:
    """The seed setup (Qwen3-VL-30B-A3B AWQ W4A16, TP4 + EP, EPLB R=8, W=3000, I=1000)."""
    return load_moeinferences(EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml")[0]


@pytest.fixture()
def variant(seed: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    """``variant({"spec.eplb.windowSize": 0, ...})`` -> a modified deep copy of the seed."""

    def make(changes: dict[str, Any] | None = None, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = copy.deepcopy(base if base is not None else seed)
        for dotted, value in (changes or {}).items():
            set_path(out, dotted, value)
        return out

    return make
