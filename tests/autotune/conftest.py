"""Fixtures for the operator-in-the-loop autotune tests.

Each test runs a whole simulated cluster (:class:`moe_eplb.sim.world.SimWorld`) in its event loop:
the emulated Kubernetes API, the fake kubelet running simulated engine pods (real HTTP metrics),
optionally a real Prometheus, and the real kopf operator with the autotune timer. Time is
accelerated 100x (a 300 s evaluation interval is 3 s of wall time).
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import pytest

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")

from moe_eplb.eplb import synth  # noqa: E402

NS = "default"
NAME = "tiny"
SCALE = 100.0
START = {"windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0}

#: A small MoE (4 MoE layers x 16 experts, top-2) on EP 4, so the loop's math is quick.
RESOURCE: dict[str, Any] = {
    "apiVersion": "eplb.ai/v1alpha1",
    "kind": "MoEInference",
    "metadata": {"name": NAME, "namespace": NS},
    "spec": {
        "model": {
            "name": "example/tiny-moe",
            "architecture": "Qwen3MoeForCausalLM",
            "moe": {"numExperts": 16, "numMoeLayers": 4, "topK": 2, "numExpertGroups": 1,
                    "bytesPerExpert": 1048576},
        },
        "engine": {"image": "vllm/vllm-openai:v0.12.0"},
        "parallelism": {"tensor": 1, "data": 4},
        "replicas": 2,
        "eplb": {"enabled": True, **START},
        "autotune": {
            "mode": "Apply",
            "memoryBudgetPerGpu": "1Gi",
            "evaluationIntervalSeconds": 300,
            "cooldownSeconds": 600,
            "maxRestartsPerDay": 4,
            "observeSeconds": 300,
            "minGain": 0.01,
        },
        "rollout": {"maxSurge": 0, "maxUnavailable": 1},
    },
}


@pytest.fixture(scope="session")
def workload():
    """4 simulated hours of a Qwen3-VL-like chat -> math workload mapped onto the small shape."""
    return synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=4,
                          bucket_seconds=15, seed=1, shift_at=0.5)


def resource(**autotune: Any) -> dict:
    r = copy.deepcopy(RESOURCE)
    r["spec"]["autotune"].update(autotune)
    return r


def cond(obj: dict, ctype: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == ctype), {})


def autotune_status(obj: dict) -> dict:
    return (obj.get("status") or {}).get("autotune") or {}


async def wait_for(world, check, timeout: float = 30.0, interval: float = 0.1):
    """Poll ``check(resource)`` until truthy; return its value (fails with the last status)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await world.get(NAME)
        value = check(last)
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"not reached within {timeout}s; status.autotune = {autotune_status(last or {})}")


async def events(world) -> list[dict]:
    return await world.cluster.list(f"/api/v1/namespaces/{NS}/events")


async def pods(world) -> list[dict]:
    return await world.cluster.list(f"/api/v1/namespaces/{NS}/pods", f"eplb.ai/name={NAME}")


async def deployment(world) -> dict:
    return await world.cluster.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}")


def template_hash(dep: dict) -> str:
    return dep["spec"]["template"]["metadata"]["annotations"]["eplb.ai/eplb-config-hash"]
