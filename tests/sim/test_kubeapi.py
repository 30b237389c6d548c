"""The emulated API server (moe_eplb_harness.emulated.kubeapi) behaves like the apiserver where the operator
depends on it: server-set metadata, generation, conflicts, JSON patch tests, selectors, status
isolation, finalizers, cascade deletion and resumable watches."""

from __future__ import annotations

import pytest

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")

import json

import aiohttp
import pytest

from moe_eplb_harness.emulated.kubeapi import label_selector_matches, parse_label_selector

pytestmark = pytest.mark.integration  # an emulated API server

DEPLOYS = "/apis/apps/v1/namespaces/default/deployments"


def deployment(name: str, labels: dict | None = None, owner: str | None = None) -> dict:
    meta = {"name": name, "labels": labels or {}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "name": "o", "uid": owner}]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {"replicas": 1}}


async def status_of(exc_info) -> int:
    return exc_info.value.status


async def test_server_sets_metadata_and_generation(emulated_cluster):
    obj = await emulated_cluster.create(DEPLOYS, {"metadata": {"name": "d"}, "spec": {"replicas": 1}})
    meta = obj["metadata"]
    assert obj["apiVersion"] == "apps/v1" and obj["kind"] == "Deployment"
    assert meta["uid"] and meta["generation"] == 1 and meta["creationTimestamp"].endswith("Z")
    assert meta["namespace"] == "default"
    rv1 = int(meta["resourceVersion"])

    labelled = await emulated_cluster.patch(f"{DEPLOYS}/d", {"metadata": {"labels": {"a": "1"}}})
    assert labelled["metadata"]["generation"] == 1  # metadata only: no bump
    assert int(labelled["metadata"]["resourceVersion"]) > rv1
    scaled = await emulated_cluster.patch(f"{DEPLOYS}/d", {"spec": {"replicas": 2}})
    assert scaled["metadata"]["generation"] == 2
    same = await emulated_cluster.patch(f"{DEPLOYS}/d", {"spec": {"replicas": 2}})
    assert same["metadata"]["resourceVersion"] == scaled["metadata"]["resourceVersion"]  # no-op write


async def test_conflicts_and_failed_json_patch_tests(emulated_cluster):
    obj = await emulated_cluster.create(DEPLOYS, deployment("d"))
    with pytest.raises(aiohttp.ClientResponseError) as exc:
        await emulated_cluster.create(DEPLOYS, deployment("d"))
    assert exc.value.status == 409 and json.loads(exc.value.message)["reason"] == "AlreadyExists"
    await emulated_cluster.patch(f"{DEPLOYS}/d", {"spec": {"replicas": 3}})
    with pytest.raises(aiohttp.ClientResponseError) as exc:  # stale resourceVersion
        await emulated_cluster.patch(f"{DEPLOYS}/d", {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                                          "spec": {"replicas": 4}})
    assert exc.value.status == 409
    with pytest.raises(aiohttp.ClientResponseError) as exc:  # kopf's finalizer patch on a stale object
        await emulated_cluster.patch(f"{DEPLOYS}/d", [{"op": "test", "path": "/metadata/resourceVersion",
                                          "value": obj["metadata"]["resourceVersion"]},
                                         {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}],
                         json_patch=True)
    assert exc.value.status == 422
    live = await emulated_cluster.get(f"{DEPLOYS}/d")
    assert live["spec"]["replicas"] == 3 and "finalizers" not in live["metadata"]


async def test_label_selectors(emulated_cluster):
    await emulated_cluster.create(DEPLOYS, deployment("a", {"app": "x", "tier": "1"}))
    await emulated_cluster.create(DEPLOYS, deployment("b", {"app": "y"}))
    await emulated_cluster.create(DEPLOYS, deployment("c", {}))
    names = lambda items: sorted(i["metadata"]["name"] for i in items)  # noqa: E731
    assert names(await emulated_cluster.list(DEPLOYS, "app=x")) == ["a"]
    assert names(await emulated_cluster.list(DEPLOYS, "app!=x")) == ["b", "c"]
    assert names(await emulated_cluster.list(DEPLOYS, "app in (x,y)")) == ["a", "b"]
    assert names(await emulated_cluster.list(DEPLOYS, "app notin (x)")) == ["b", "c"]
    assert names(await emulated_cluster.list(DEPLOYS, "!app")) == ["c"]
    assert names(await emulated_cluster.list(DEPLOYS, "app,tier=1")) == ["a"]
    assert label_selector_matches(parse_label_selector("a=1, b in (2, 3)"), {"a": "1", "b": "3"})


async def test_status_subresource_is_isolated(emulated_cluster):
    path = emulated_cluster.moeinference_path("default")
    obj = await emulated_cluster.create(path, {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference",
                                   "metadata": {"name": "m"}, "spec": {"replicas": 1}, "status": {"phase": "X"}})
    assert "status" not in obj  # dropped on create
    st = await emulated_cluster.patch(f"{path}/m/status", {"status": {"phase": "Running"}, "spec": {"replicas": 5}})
    assert st["status"] == {"phase": "Running"} and st["spec"]["replicas"] == 1
    main = await emulated_cluster.patch(f"{path}/m", {"status": {"phase": "Hacked"}, "spec": {"replicas": 2}})
    assert main["status"] == {"phase": "Running"} and main["spec"]["replicas"] == 2
    assert main["metadata"]["generation"] == 2


async def test_finalizers_and_cascade_delete(emulated_cluster):
    path = emulated_cluster.moeinference_path("default")
    owner = await emulated_cluster.create(path, {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference",
                                     "metadata": {"name": "o", "finalizers": ["f"]}, "spec": {}})
    await emulated_cluster.create(DEPLOYS, deployment("child", owner=owner["metadata"]["uid"]))
    await emulated_cluster.create(DEPLOYS, deployment("other"))
    marked = await emulated_cluster.delete(f"{path}/o")
    assert marked["metadata"]["deletionTimestamp"]  # held by the finalizer
    assert await emulated_cluster.get_or_none(f"{DEPLOYS}/child") is not None
    await emulated_cluster.patch(f"{path}/o", {"metadata": {"finalizers": []}})
    assert await emulated_cluster.get_or_none(f"{path}/o") is None
    assert await emulated_cluster.get_or_none(f"{DEPLOYS}/child") is None  # garbage-collected
    assert await emulated_cluster.get_or_none(f"{DEPLOYS}/other") is not None


async def test_watch_resumes_after_a_resource_version(emulated_cluster):
    first = await emulated_cluster.create(DEPLOYS, deployment("a"))
    await emulated_cluster.create(DEPLOYS, deployment("b"))
    await emulated_cluster.patch(f"{DEPLOYS}/a", {"spec": {"replicas": 2}})
    params = {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"], "timeoutSeconds": "1"}
    events = []
    async with emulated_cluster.session.get(emulated_cluster.url + DEPLOYS, params=params) as resp:
        async for line in resp.content:
            if line.strip():
                events.append(json.loads(line))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b"), ("MODIFIED", "a")]


async def test_namespace_objects_list_get_watch_and_status(emulated_cluster):
    """The Namespace objects' own URLs (kmock 0.8 cannot parse them: the emulator serves them itself,
    query and all), as kopf lists and watches them in namespaced mode."""
    first = await emulated_cluster.create("/api/v1/namespaces", {"metadata": {"name": "team-a"}})
    assert first["kind"] == "Namespace" and first["metadata"]["uid"]
    listed = await emulated_cluster.request("GET", "/api/v1/namespaces")
    assert listed["kind"] == "NamespaceList" and [i["metadata"]["name"] for i in listed["items"]] == ["default", "team-a"]
    assert (await emulated_cluster.get("/api/v1/namespaces/team-a"))["metadata"]["name"] == "team-a"
    await emulated_cluster.create("/api/v1/namespaces", {"metadata": {"name": "team-b"}})
    status = await emulated_cluster.patch("/api/v1/namespaces/team-b/status", {"status": {"phase": "Active"}})
    assert status["status"] == {"phase": "Active"}
    params = {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"], "timeoutSeconds": "1"}
    events = []
    async with emulated_cluster.session.get(emulated_cluster.url + "/api/v1/namespaces", params=params) as resp:
        async for line in resp.content:
            if line.strip():
                events.append(json.loads(line))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "team-b"), ("MODIFIED", "team-b")]
    logged = [(r.resource.plural, r.name, r.subresource, r.url.path) for r in emulated_cluster.api
              if r.resource is not None and r.resource.group == "" and r.url.path.startswith("/api/v1/namespaces")]
    assert ("namespaces", "team-b", "status", "/api/v1/namespaces/team-b/status") in logged
    assert all(plural == "namespaces" for plural, *_ in logged), logged  # the log shows what was asked


async def test_generate_name_and_unsupported_apply(emulated_cluster):
    ev = await emulated_cluster.create("/api/v1/namespaces/default/events", {"metadata": {"generateName": "x."}})
    assert ev["metadata"]["name"].startswith("x.") and len(ev["metadata"]["name"]) > 2
    await emulated_cluster.create(DEPLOYS, deployment("a"))
    with pytest.raises(aiohttp.ClientResponseError) as exc:
        await emulated_cluster.request("PATCH", f"{DEPLOYS}/a", {"spec": {}}, content_type="application/apply-patch+yaml")
    assert exc.value.status == 415


async def test_workload_ready_delay_plays_the_controllers():
    from moe_eplb_harness.emulated.kubeapi import emulated_cluster as start

    async with start(workload_ready_delay=0.01) as cluster:
        await cluster.create(DEPLOYS, {"metadata": {"name": "d"}, "spec": {"replicas": 3}})
        import asyncio
        for _ in range(100):
            live = await cluster.get(f"{DEPLOYS}/d")
            if live.get("status", {}).get("readyReplicas") == 3:
                break
            await asyncio.sleep(0.01)
        assert live["status"]["observedGeneration"] == 1 and live["status"]["updatedReplicas"] == 3


async def test_dry_run_keeps_nothing(emulated_cluster):
    dry = await emulated_cluster.request("POST", DEPLOYS + "?dryRun=All", deployment("a"))
    assert dry["metadata"]["name"] == "a" and await emulated_cluster.get_or_none(f"{DEPLOYS}/a") is None
    real = await emulated_cluster.create(DEPLOYS, deployment("a"))
    patched = await emulated_cluster.request("PATCH", f"{DEPLOYS}/a?dryRun=All", {"spec": {"replicas": 5}},
                                 content_type="application/merge-patch+json")
    assert patched["spec"]["replicas"] == 5
    live = await emulated_cluster.get(f"{DEPLOYS}/a")
    assert live["spec"]["replicas"] == 1 and live["metadata"]["resourceVersion"] == real["metadata"]["resourceVersion"]
    assert [w[0] for w in emulated_cluster.api.writes if w[1] == "deployments"] == ["create"]
