"""Fixtures for the operator-in-the-loop autotune tests.

Each test runs a whole simulated cluster (:class:`moe_eplb_harness.cluster.world.SimWorld`) in its event loop:
the emulated Kubernetes API, the fake kubelet running simulated engine pods (real HTTP metrics),
optionally a real Prometheus, and the real kopf operator with the autotune timer. Time is
accelerated 100x (a 300 s evaluation interval is 3 s of wall time).

The scenarios run for both workload kinds (``kind`` fixture): ``Deployment`` (single-node replicas:
2 pods) and ``LeaderWorkerSet`` (the same EP 4 spread over 2 pods per replica group: 2 groups of a
leader and a worker, one engine per group).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")

from moe_eplb.eplb.workload import synth  # noqa: E402
from tests.polling import eventually
from tests.require import missing

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
            # these scenarios test the rollout of a change to every replica; the experiment that runs
            # a change on one replica first has its own (test_operator_experiments.py)
            "experiments": {"enabled": False},
        },
        "rollout": {"maxSurge": 0, "maxUnavailable": 1},
    },
}


@pytest.fixture(scope="session")
def workload():
    """4 simulated hours of a Qwen3-VL-like chat -> math workload mapped onto the small shape."""
    return synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=4,
                          bucket_seconds=15, seed=1, shift_at=0.5)


KINDS = ("Deployment", "LeaderWorkerSet")


def lws_path(ns: str) -> str:
    return f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets"


@pytest.fixture(params=["emulated", "real"])
def api(request) -> str:
    """The API a scenario runs on: the emulation, or the real control plane (real Deployment and
    ReplicaSet controllers and kube-scheduler, the real LeaderWorkerSet controller where
    ``tools/lws`` is built, simulated GPU nodes; ``make kube``). The real one is
    skipped without the built binaries, except in CI (``MOE_EPLB_REQUIRE_KUBE=1``)."""
    if request.param == "real":
        from moe_eplb_harness.real.controlplane import default_bin_dir, find_binaries

        if find_binaries() is None:
            missing(f"no control plane built in {default_bin_dir()} (run `make kube`)")
        request.node.add_marker(pytest.mark.kube)
    return request.param


@pytest.fixture()
def plane(api: str, request) -> Any:
    """On the real API, the session's control plane (``real_control_plane``) for ``SimWorld(shared_plane=...)``:
    each world then runs in a namespace and on Nodes of its own. ``None`` on the emulation."""
    return request.getfixturevalue("real_control_plane") if api == "real" else None


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    """The workload kind a scenario runs on (the resource's ``parallelism.nodes`` picks it)."""
    return request.param


def resource(kind: str = "Deployment", **autotune: Any) -> dict:
    r = copy.deepcopy(RESOURCE)
    r["spec"]["autotune"].update(autotune)
    if kind == "LeaderWorkerSet":
        r["spec"]["parallelism"] = {"tensor": 1, "data": 4, "nodes": 2}  # EP 4 over 2 pods per group
    return r


def pods_per_replica(kind: str) -> int:
    return 2 if kind == "LeaderWorkerSet" else 1


def cond(obj: dict, ctype: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == ctype), {})


def autotune_status(obj: dict) -> dict:
    return (obj.get("status") or {}).get("autotune") or {}


async def wait_for(world, check, timeout: float = 30.0, interval: float = 0.1):
    """Poll ``check(resource)`` until truthy; return its value (fails with the last status.autotune)."""
    seen: dict = {}

    async def probe():
        seen["resource"] = await world.get(NAME)
        return check(seen["resource"])

    return await eventually(probe, timeout=timeout, interval=interval,
                            what=lambda: f"status.autotune = {autotune_status(seen.get('resource') or {})}")


async def events(world) -> list[dict]:
    return await world.cluster.list(f"/api/v1/namespaces/{world.namespace}/events")


async def pods(world) -> list[dict]:
    return await world.cluster.list(f"/api/v1/namespaces/{world.namespace}/pods", f"eplb.ai/name={NAME}")


async def deployment(world) -> dict:
    return await world.cluster.get(f"/apis/apps/v1/namespaces/{world.namespace}/deployments/{NAME}")


async def workload_of(world, kind: str = "Deployment") -> dict:
    """The child workload: the Deployment, or the LeaderWorkerSet."""
    if kind == "LeaderWorkerSet":
        return await world.cluster.get(f"{lws_path(world.namespace)}/{NAME}")
    return await deployment(world)


async def workload_or_none(world, kind: str) -> dict | None:
    ns = world.namespace
    path = f"{lws_path(ns)}/{NAME}" if kind == "LeaderWorkerSet" else f"/apis/apps/v1/namespaces/{ns}/deployments/{NAME}"
    return await world.cluster.get_or_none(path)


def template_hash(obj: dict) -> str:
    """The config hash of the workload's pod template(s) (an LWS: its leader and worker templates agree)."""
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        hashes = {lwt[k]["metadata"]["annotations"]["eplb.ai/eplb-config-hash"]
                  for k in ("leaderTemplate", "workerTemplate")}
        assert len(hashes) == 1, hashes
        return hashes.pop()
    return obj["spec"]["template"]["metadata"]["annotations"]["eplb.ai/eplb-config-hash"]


def running_settings(world) -> set[tuple]:
    """(window, interval, redundant) of the engines the fake kubelet runs for ready pods."""
    out = set()
    for _, p in world.kubelet.running():
        if p.ready and p.settings is not None:
            out.add((p.settings.knobs.window_size, p.settings.knobs.step_interval, p.settings.num_redundant_experts))
    return out
