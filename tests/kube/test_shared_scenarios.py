"""API scenarios run on BOTH the emulation (``moe_eplb_harness.emulated.kubeapi``, the fast tier and the demo's
fallback) and the real kube-apiserver, through the same async client calls: where the emulation's
answer differs from the real one, the real one wins and the emulation is fixed, or the difference is
listed in ``moe_eplb_harness/emulated/kubeapi.py``'s docstring ("Differences from a real apiserver") and asserted here as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.example_manifests import EXAMPLES, load_moeinferences

SEED = load_moeinferences(EXAMPLES / "qwen3-vl-30b-a3b-awq-eplb.yaml")[0]


@pytest.fixture(params=["emulated", "real"])
def either(request, control_plane) -> Any:
    """``async with either() as (cluster, ns)``: a client and a fresh namespace on the emulation or
    on the real control plane (the ``real`` one is only reachable with the control plane built)."""
    kind = request.param

    @contextlib.asynccontextmanager
    async def open_cluster() -> AsyncIterator[tuple[Any, str]]:
        ns = f"s-{secrets.token_hex(3)}"
        if kind == "emulated":
            from moe_eplb_harness.emulated.kubeapi import emulated_cluster

            async with emulated_cluster(namespaces=("default", ns)) as cluster:
                yield cluster, ns
        else:
            from moe_eplb_harness.real.realapi import real_cluster

            async with real_cluster(control_plane) as cluster:
                await cluster.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
                yield cluster, ns

    open_cluster.kind = kind  # type: ignore[attr-defined]
    return open_cluster


def seed_in(ns: str, **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(SEED)
    doc["metadata"]["namespace"] = ns
    doc["spec"].update(spec)
    return doc


async def status_of(exc_info: Any) -> tuple[int, dict[str, Any]]:
    exc = exc_info.value
    return exc.status, json.loads(exc.message or "{}")


async def test_server_set_metadata_and_generation(either) -> None:
    async with either() as (kube, ns):
        obj = await kube.create(kube.moeinference_path(ns), seed_in(ns))
        meta = obj["metadata"]
        assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"] and meta["generation"] == 1
        assert obj["apiVersion"] == "eplb.ai/v1alpha1" and obj["kind"] == "MoEInference"
        path = kube.moeinference_path(ns, "qwen3-vl-30b")
        labelled = await kube.patch(path, {"metadata": {"labels": {"team": "a"}}})
        assert labelled["metadata"]["generation"] == 1  # metadata only: no new generation
        changed = await kube.patch(path, {"spec": {"eplb": {"windowSize": 2000}}})
        assert changed["metadata"]["generation"] == 2
        assert int(changed["metadata"]["resourceVersion"]) > int(labelled["metadata"]["resourceVersion"])


async def test_status_subresource_is_isolated(either) -> None:
    async with either() as (kube, ns):
        await kube.create(kube.moeinference_path(ns), seed_in(ns))
        path = kube.moeinference_path(ns, "qwen3-vl-30b")
        after = await kube.patch(path + "/status", {"status": {"phase": "Running"}, "spec": {"replicas": 5}})
        assert after["status"]["phase"] == "Running" and after["spec"]["replicas"] == 1
        assert after["metadata"]["generation"] == 1
        main = await kube.patch(path, {"status": {"phase": "Degraded"}, "spec": {"replicas": 2}})
        assert main["status"]["phase"] == "Running" and main["spec"]["replicas"] == 2


async def test_scale_subresource(either) -> None:
    async with either() as (kube, ns):
        await kube.create(kube.moeinference_path(ns), seed_in(ns))
        path = kube.moeinference_path(ns, "qwen3-vl-30b")
        await kube.patch(path + "/status", {"status": {"replicas": 1, "selector": "eplb.ai/inference=qwen3-vl-30b"}})
        scale = await kube.get(path + "/scale")
        assert scale["kind"] == "Scale" and scale["apiVersion"] == "autoscaling/v1"
        assert scale["spec"]["replicas"] == 1 and scale["status"] == {"replicas": 1,
                                                                        "selector": "eplb.ai/inference=qwen3-vl-30b"}
        await kube.patch(path + "/scale", {"spec": {"replicas": 3}})
        assert (await kube.get(path))["spec"]["replicas"] == 3


async def test_stale_resource_version_conflicts(either) -> None:
    async with either() as (kube, ns):
        obj = await kube.create(kube.moeinference_path(ns), seed_in(ns))
        path = kube.moeinference_path(ns, "qwen3-vl-30b")
        await kube.patch(path, {"spec": {"replicas": 2}})
        with pytest.raises(aiohttp.ClientResponseError) as info:
            await kube.patch(path, {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                                    "spec": {"replicas": 3}})
        code, status = await status_of(info)
        assert code == 409 and status["reason"] == "Conflict"


async def test_failed_json_patch_test_is_422(either) -> None:
    async with either() as (kube, ns):
        await kube.create(kube.moeinference_path(ns), seed_in(ns))
        path = kube.moeinference_path(ns, "qwen3-vl-30b")
        with pytest.raises(aiohttp.ClientResponseError) as info:
            await kube.patch(path, [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
                                    {"op": "replace", "path": "/spec/replicas", "value": 4}], json_patch=True)
        code, _ = await status_of(info)
        assert code == 422


async def test_dry_run_create_keeps_nothing(either) -> None:
    async with either() as (kube, ns):
        answer = await kube.request("POST", kube.moeinference_path(ns), seed_in(ns), params={"dryRun": "All"})
        assert answer["metadata"]["name"] == "qwen3-vl-30b"
        assert await kube.get_or_none(kube.moeinference_path(ns, "qwen3-vl-30b")) is None


async def test_label_selector_lists(either) -> None:
    async with either() as (kube, ns):
        for name, team in (("a", "x"), ("b", "y")):
            cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": {"team": team}}}
            await kube.create(f"/api/v1/namespaces/{ns}/configmaps", cm)
        got = await kube.list(f"/api/v1/namespaces/{ns}/configmaps", label_selector="team in (x),team!=z")
        assert [o["metadata"]["name"] for o in got] == ["a"]


async def test_dependents_are_garbage_collected(either) -> None:
    async with either() as (kube, ns):
        owner = await kube.create(kube.moeinference_path(ns), seed_in(ns))
        ref = {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "name": "qwen3-vl-30b",
               "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
        await kube.create(f"/api/v1/namespaces/{ns}/configmaps", {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "child", "ownerReferences": [ref]}})
        await kube.delete(kube.moeinference_path(ns, "qwen3-vl-30b"))
        # the real garbage collector learns a CRD's kind at its next discovery resync (every 30 s), so
        # right after the CRD was installed the dependents can wait that long
        for _ in range(700):
            if await kube.get_or_none(f"/api/v1/namespaces/{ns}/configmaps/child") is None:
                break
            await asyncio.sleep(0.1)
        assert await kube.get_or_none(f"/api/v1/namespaces/{ns}/configmaps/child") is None


async def test_invalid_resource_admission(either) -> None:
    """The real apiserver runs the CRD's schema and CEL on every write; the emulation serves the
    MoEInference without admission (a documented difference: the operator's own validation
    refuses such a resource with SpecValid=False, see tests/controller)."""
    async with either() as (kube, ns):
        bad = seed_in(ns)
        bad["spec"]["eplb"]["numRedundantExperts"] = 7
        if either.kind == "real":
            with pytest.raises(aiohttp.ClientResponseError) as info:
                await kube.create(kube.moeinference_path(ns), bad)
            code, status = await status_of(info)
            assert code == 422 and "spec.eplb.numRedundantExperts" in status["message"]
        else:
            stored = await kube.create(kube.moeinference_path(ns), bad)
            assert stored["spec"]["eplb"]["numRedundantExperts"] == 7
