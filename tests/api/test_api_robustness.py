"""Malformed input of every kind gets Problems, never an exception (the operator then reports
SpecValid=False instead of crashing, and nothing is applied)."""

from __future__ import annotations

import copy

import pytest

from moe_eplb.api.spec import parse
from moe_eplb.api.validation import validate

WEIRD = [None, [], "x", 0, -1, 1.5, True, {}, {"a": 1}, [1, 2], "", 10**20]
PATHS = [
    "spec", "spec.model", "spec.model.name", "spec.eplb", "spec.eplb.windowSize", "spec.parallelism",
    "spec.parallelism.tensor", "spec.engine", "spec.engine.image", "spec.engine.resources",
    "spec.engine.resources.limits", "spec.autotune.bounds", "spec.autotune.bounds.windowSize", "metadata",
    "metadata.name", "spec.model.moe", "spec.engine.extraArgs", "spec.engine.env", "spec.engine.limitMmPerPrompt",
    "spec.model.storage", "spec.autotune.memoryBudgetPerGpu", "spec.engine.version", "status", "status.autotune",
    "status.autotune.override", "metadata.generation", "spec.replicas", "spec.rollout", "spec.monitoring.podMonitor",
    "apiVersion", "kind", "metadata.labels", "metadata.annotations", "metadata.namespace", "metadata.uid",
]


@pytest.mark.parametrize("path", PATHS)
def test_weird_values_never_raise(seed, path) -> None:
    for value in WEIRD:
        res = copy.deepcopy(seed)
        node = res
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        problems = validate(res)  # must not raise
        assert isinstance(problems, list) and all(p.field and p.message for p in problems)
        if path in ("spec", "spec.model", "metadata", "apiVersion", "kind") and value != {}:
            assert problems, (path, value)  # these can never be valid with a non-object / wrong value


def test_malformed_override_is_ignored(seed) -> None:
    res = copy.deepcopy(seed)
    res["metadata"]["generation"] = 1
    res["status"] = {"autotune": {"override": {"windowSize": "big", "specGeneration": 1}}}
    assert _effective(res).source == "spec"
    res["status"] = "weird"
    assert _effective(res).source == "spec" and validate(res) == []


def _effective(resource):
    """The EPLB settings that run for ``resource`` (parsed once)."""
    return parse(resource).effective
