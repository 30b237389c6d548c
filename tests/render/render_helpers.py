"""Helpers for the render tests: example manifests and a builder of variations (fixtures in conftest)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


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


DELETE = object()
