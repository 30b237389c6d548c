"""Operator-in-the-loop: a change of window and interval applied LIVE (the real kopf operator, the
emulated Kubernetes API, simulated engine pods that take live commands over HTTP with the control
token: moe_eplb_harness.engines.live_route). No rollout, no pod replaced, no template change; every
engine runs the new values from the step recorded; a pod that is replaced comes back with them."""

from __future__ import annotations

import json

import pytest

from moe_eplb.contracts import k8s_names
from moe_eplb.contracts import live_protocol as lp
from moe_eplb_harness.cluster.world import SimWorld
from tests.polling import eventually

from .conftest import NAME, SCALE, autotune_status, cond, events, pods, resource, template_hash, wait_for, workload_of

pytestmark = pytest.mark.integration


def _live_resource(kind: str) -> dict:
    res = resource(kind, minGain=0.001, bounds={"numRedundantExperts": {"min": 0, "max": 0}})
    res["spec"]["engine"] = {"image": "vllm/vllm-openai:v0.32.0"}  # a vLLM live apply is checked on
    return res


def _engine_knobs(world) -> set[tuple[int, int, int]]:
    return {(e.settings.knobs.window_size, e.settings.knobs.step_interval, e.settings.num_redundant_experts)
            for e in world.kubelet.engines(NAME) if e.ready}


async def test_live_apply_changes_the_running_engines_without_a_restart(workload, kind):
    world = SimWorld(workload=workload, scale=SCALE, startup_seconds=60.0, tick_seconds=0.2)
    async with world.run():
        await world.start_operator()
        await world.apply(_live_resource(kind))
        await wait_for(world, lambda r: r.get("status", {}).get("phase") == "Running" or None, timeout=20)
        first_hash = template_hash(await workload_of(world, kind))
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await pods(world)}
        done = await wait_for(world, lambda r: autotune_status(r).get("liveChanges") and r, timeout=60)
        at = autotune_status(done)
        change, live = at["liveChanges"][-1], at["live"]
        target = (change["to"]["windowSize"], change["to"]["stepInterval"], 0)
        assert (live["windowSize"], live["stepInterval"]) == target[:2] and live["configHash"] == first_hash
        assert change["from"] == {"windowSize": 1000, "stepInterval": 3000, "numRedundantExperts": 0}
        assert "rollout" not in at and "override" not in at and not at.get("restarts")
        assert at["lastEvaluation"]["applyMode"] == "live" and cond(done, "Tuned")["reason"] == "AppliedLive"
        # the reconciler (asked at once) shows what runs in status.eplb and writes the ConfigMap
        shown = await wait_for(world, lambda r: (r.get("status") or {}).get("eplb", {}).get("windowSize") == target[0]
                               and r, timeout=20)
        assert shown["status"]["eplb"] == {"enabled": True, "windowSize": target[0], "stepInterval": target[1],
                                           "numRedundantExperts": 0}
        # nothing restarted: the same pods and template; every engine runs the values, from the step recorded
        assert template_hash(await workload_of(world, kind)) == first_hash
        assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in await pods(world)} == before
        assert _engine_knobs(world) == {target}
        engines = world.kubelet.engines(NAME)
        assert sorted(e.replay.since_step for e in engines) == sorted(live["steps"].values())
        assert any(e["reason"] == "AppliedLive" for e in await events(world))
        # the pods' ConfigMap holds them for a pod that restarts
        cm = await world.cluster.get(f"/api/v1/namespaces/{world.namespace}/configmaps/"
                                     f"{k8s_names.live_configmap_name(NAME)}")
        saved = json.loads(cm["data"][k8s_names.LIVE_FILE_KEY])
        assert (saved[lp.FILE_WINDOW], saved[lp.FILE_INTERVAL], saved[lp.FILE_HASH]) == (*target[:2], first_hash)
        if kind == "Deployment":  # a replaced pod starts with the live values, not the template's
            victim = next(iter(before))
            assert await world.kubelet.evict(world.namespace, victim)

            async def replaced():
                names = {p["metadata"]["name"] for p in await pods(world)}
                return victim not in names and len(names) == 2 and all(e.ready for e in world.kubelet.engines(NAME))

            await eventually(replaced, timeout=30, interval=0.2)
            assert _engine_knobs(world) == {target}
