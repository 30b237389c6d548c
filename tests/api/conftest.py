"""Fixtures: the seed manifest and a builder of variations of it."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from api_helpers import EXAMPLES, load_moeinferences, set_path


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
