"""The REAL LeaderWorkerSet controller (``sigs.k8s.io/lws``, ``tools/build-go-tool.sh tools/lws``) on the real
control plane, its webhooks served and registered (:mod:`moe_eplb_harness.real.lwscontroller`), with the
simulated GPU nodes running each group as one engine (:mod:`moe_eplb_harness.real.nodeagent`).

What the operator relies on, checked against the real thing: the pods of a group (labels,
annotation and env from its pod webhook), groups ready, ``updatedReplicas`` / ``readyReplicas`` and
the conditions' ``observedGeneration`` through a rolling update within ``maxUnavailable``, and what
happens to the pods when a template is rolled back. Skipped unless both are built (``make kube``).
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import yaml

from moe_eplb.api.spec import parse
from moe_eplb.contracts import k8s_names
from moe_eplb.controller.status import workload_observed_generation
from moe_eplb.eplb.workload import synth
from moe_eplb.render.objects import render_children
from moe_eplb_harness.cluster.world import SimWorld
from moe_eplb_harness.real import lwscontroller
from moe_eplb_harness.real.controlplane import find_binaries
from tests.autotune.conftest import RESOURCE
from tests.polling import eventually
from tests.require import missing

PUBLISHED = """
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: mutating-webhook-configuration}
webhooks:
- admissionReviewVersions: [v1]
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}}
  failurePolicy: Fail
  name: mpod.kb.io
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}]
  sideEffects: None
"""


def test_webhook_configurations_point_at_the_loopback_server() -> None:
    (doc,) = lwscontroller.webhook_configurations(PUBLISHED, "https://127.0.0.1:9443/", b"PEM")
    hook = doc["webhooks"][0]
    assert hook["clientConfig"] == {"url": "https://127.0.0.1:9443/mutate--v1-pod", "caBundle": "UEVN"}
    assert hook["rules"] == yaml.safe_load(PUBLISHED)["webhooks"][0]["rules"] and hook["failurePolicy"] == "Fail"
    with pytest.raises(Exception, match="no clientConfig.service.path"):
        lwscontroller.webhook_configurations(PUBLISHED.replace("path: /mutate--v1-pod", "port: 443"), "https://x", b"")


def test_the_built_manifests_name_every_served_path() -> None:
    binary = lwscontroller.find_lws_binary()
    if binary is None:
        pytest.skip(f"no LWS controller built in {lwscontroller.default_lws_bin_dir()} (run `make kube`)")
    docs = lwscontroller.webhook_configurations((binary.parent / lwscontroller.MANIFESTS).read_text(),
                                                "https://127.0.0.1:1", b"x")
    urls = sorted(h["clientConfig"]["url"] for d in docs for h in d["webhooks"])
    assert urls == sorted(f"https://127.0.0.1:1{p}" for p in lwscontroller.WEBHOOK_PATHS)


def _lws(replicas: int = 2, window: int = 1000, ns: str = "default") -> dict:
    res = copy.deepcopy(RESOURCE)
    res["spec"]["parallelism"] = {"tensor": 1, "data": 4, "nodes": 2}
    res["spec"]["replicas"] = replicas
    res["spec"]["eplb"]["windowSize"] = window
    lws = next(c for c in render_children(parse(res)) if c["kind"] == "LeaderWorkerSet")
    lws["metadata"]["namespace"] = ns
    return lws


def _cond(obj: dict, ctype: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


async def _degraded(world, op, ns: str, reason: str) -> tuple[dict, dict]:
    """(the resource's status, its ``Degraded`` condition) once that is True with ``reason``."""

    async def check():
        # the operator's resync timer (60 s in a cluster) refreshes the status: asked for here
        op["controller"].reconciler.request_refresh(ns, "tiny")
        st = (await world.get("tiny")).get("status") or {}
        c = _cond({"status": st}, "Degraded")
        return (st, c) if c.get("status") == "True" and c.get("reason") == reason else None

    return await eventually(check, timeout=60, what=f"Degraded={reason}", interval=0.1)


@pytest.fixture()
def built() -> None:
    """Skip without the built control plane and LWS controller (fail in CI: MOE_EPLB_REQUIRE_KUBE=1)."""
    if find_binaries() is None or lwscontroller.find_lws_binary() is None:
        missing("the control plane and the LWS controller are not built (run `make kube`)")


async def test_real_controller_runs_rolls_and_rolls_back_groups(built, real_control_plane) -> None:
    workload = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                              bucket_seconds=15, seed=4, shift_at=0.5)
    world = SimWorld(workload=workload, api="real", lws="real", scale=100.0, startup_seconds=30.0,
                     kubelet_poll=0.1, shared_plane=real_control_plane)
    async with world.run():
        assert world.lws == "real" and world.lws_controller is not None
        ns = world.namespace
        lws_path = f"/apis/{k8s_names.LWS_API_VERSION}/namespaces/{ns}/leaderworkersets"
        cluster = world.cluster
        await cluster.create(lws_path, _lws(2, window=1000, ns=ns))

        async def pods() -> list[dict]:
            return await cluster.list(f"/api/v1/namespaces/{ns}/pods", "eplb.ai/name=tiny")

        async def settled(revision_differs_from: str | None = None):
            obj = await cluster.get(f"{lws_path}/tiny")
            st = obj.get("status") or {}
            ps = [p for p in await pods() if not p["metadata"].get("deletionTimestamp")]
            revs = {p["metadata"]["labels"].get(k8s_names.LWS_TEMPLATE_REVISION_LABEL) for p in ps}
            ok = (st.get("readyReplicas") == 2 and st.get("updatedReplicas") == 2 and len(ps) == 4
                  and _cond(obj, "Available").get("status") == "True" and len(revs) == 1
                  and revs != {revision_differs_from})
            return (obj, ps) if ok else None

        obj, first = await eventually(settled, timeout=60.0, interval=0.1, what="2 groups ready")
        gen = obj["metadata"]["generation"]
        # the pod webhook's labels, annotation and env on every pod of a group
        by_name = {p["metadata"]["name"]: p for p in first}
        assert sorted(by_name) == ["tiny-0", "tiny-0-1", "tiny-1", "tiny-1-1"]
        for name, p in by_name.items():
            labels, ann = p["metadata"]["labels"], p["metadata"]["annotations"]
            worker = 0 if name.count("-") == 1 else 1
            assert labels[k8s_names.LWS_NAME_LABEL] == "tiny"
            assert labels[k8s_names.LWS_GROUP_INDEX_LABEL] == name.split("-")[1]
            assert labels[k8s_names.LWS_WORKER_INDEX_LABEL] == str(worker)
            assert ann[k8s_names.LWS_SIZE_ANNOTATION] == "2"
            env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0].get("env") or []}
            assert env[k8s_names.LWS_GROUP_SIZE_ENV] == "2" and env[k8s_names.LWS_WORKER_INDEX_ENV] == str(worker)
            group = int(labels[k8s_names.LWS_GROUP_INDEX_LABEL])
            assert env[k8s_names.LWS_LEADER_ADDRESS_ENV] == k8s_names.lws_leader_address("tiny", group, ns)
        # one engine per group spanning its two pods, each pod on its own IP
        engines = world.kubelet.engines("tiny")
        assert len(engines) == 2 and all(e.pods == 2 for e in engines)
        assert {e.hosts for e in engines} == {(by_name[f"tiny-{g}"]["status"]["podIP"],
                                               by_name[f"tiny-{g}-1"]["status"]["podIP"]) for g in (0, 1)}
        # v0.8.0 reports no generation at all: not in status (pruned: not in its CRD), not in the
        # conditions (the operator then trusts the counts and checks the pods: workload_observed_generation)
        assert "observedGeneration" not in obj["status"]
        assert obj["status"]["conditions"] and all("observedGeneration" not in c for c in obj["status"]["conditions"])
        assert workload_observed_generation(obj) == gen
        first_rev = first[0]["metadata"]["labels"][k8s_names.LWS_TEMPLATE_REVISION_LABEL]

        # a template change rolls the groups within maxUnavailable = 1; record the status seen
        samples: list[dict] = []

        async def watch():
            while True:
                o = await cluster.get(f"{lws_path}/tiny")
                st = o.get("status") or {}
                samples.append({"gen": o["metadata"]["generation"], "ready": st.get("readyReplicas"),
                                "updated": st.get("updatedReplicas"), "replicas": st.get("replicas"),
                                "observedGeneration": st.get("observedGeneration"),
                                "conds": {c["type"]: (c["status"], c.get("observedGeneration"))
                                          for c in st.get("conditions") or []}})
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            new = _lws(2, window=500, ns=ns)
            cur = await cluster.get(f"{lws_path}/tiny")
            cur["spec"]["leaderWorkerTemplate"] = new["spec"]["leaderWorkerTemplate"]
            await cluster.request("PUT", f"{lws_path}/tiny", cur)
            obj, second = await eventually(lambda: settled(first_rev), timeout=60.0, interval=0.1, what="the rollout")
        finally:
            watcher.cancel()
        rolled = samples
        second_rev = second[0]["metadata"]["labels"][k8s_names.LWS_TEMPLATE_REVISION_LABEL]
        assert {e.settings.knobs.window_size for e in world.kubelet.engines("tiny")} == {500}
        assert {p["metadata"]["uid"] for p in second}.isdisjoint(p["metadata"]["uid"] for p in first)
        # never more than maxUnavailable = 1 group down; the update is reported in progress on the way
        assert min(s["ready"] or 0 for s in rolled) >= 1
        assert any(s["conds"].get("UpdateInProgress", ("",))[0] == "True" for s in rolled)
        assert all(s["observedGeneration"] is None for s in rolled)

        # roll back to the first template
        samples = []
        watcher = asyncio.create_task(watch())
        try:
            cur = await cluster.get(f"{lws_path}/tiny")
            cur["spec"]["leaderWorkerTemplate"] = _lws(2, window=1000, ns=ns)["spec"]["leaderWorkerTemplate"]
            await cluster.request("PUT", f"{lws_path}/tiny", cur)
            obj, third = await eventually(lambda: settled(second_rev), timeout=60.0, interval=0.1, what="the rollback")
        finally:
            watcher.cancel()
        # the rolled-back template is the first revision again (a content hash), run by new pods
        third_rev = third[0]["metadata"]["labels"][k8s_names.LWS_TEMPLATE_REVISION_LABEL]
        assert third_rev == first_rev != second_rev
        assert {p["metadata"]["uid"] for p in third}.isdisjoint(p["metadata"]["uid"] for p in first + second)
        assert min(s["ready"] or 0 for s in samples) >= 1
        assert {e.settings.knobs.window_size for e in world.kubelet.engines("tiny")} == {1000}
        # the real controller's objects: a leader StatefulSet, one worker StatefulSet per group
        sts = await cluster.list(f"/apis/apps/v1/namespaces/{ns}/statefulsets")
        assert sorted(s["metadata"]["name"] for s in sts) == ["tiny", "tiny-0", "tiny-1"]
        world.lws_controller.check_alive()


async def test_a_stuck_worker_gets_its_group_recreated(built, real_control_plane) -> None:
    """A worker that hangs in a forward pass (alive, no API of its own) fails its rendered liveness
    probe (the exporter's ``/livez``), which the node agent runs as a kubelet would; the container
    restart makes the REAL LeaderWorkerSet controller recreate the whole group
    (``RecreateGroupOnPodRestart``); the other group is left alone and the new group runs again. The
    operator's ``Degraded`` reading (:func:`moe_eplb.controller.status.restarting`) names the group."""
    from moe_eplb.controller.status import restarting
    from moe_eplb.controller.workload import event_span

    workload = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                              bucket_seconds=15, seed=5, shift_at=0.5)
    world = SimWorld(workload=workload, api="real", lws="real", scale=100.0, startup_seconds=30.0,
                     kubelet_poll=0.1, shared_plane=real_control_plane)
    async with world.run():
        ns, cluster = world.namespace, world.cluster
        lws = _lws(2, ns=ns)
        worker_c = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        live = worker_c["livenessProbe"]
        assert live["httpGet"] == {"path": k8s_names.EXPORTER_LIVE_PATH, "port": k8s_names.EXPORTER_PORT_NAME}
        lws_path = f"/apis/{k8s_names.LWS_API_VERSION}/namespaces/{ns}/leaderworkersets"
        await cluster.create(lws_path, lws)

        async def pods() -> dict[str, dict]:
            return {p["metadata"]["name"]: p for p in await cluster.list(f"/api/v1/namespaces/{ns}/pods",
                                                                         "eplb.ai/name=tiny")
                    if not p["metadata"].get("deletionTimestamp")}

        async def all_ready():
            ps = await pods()
            ok = len(ps) == 4 and all(any(c["type"] == "Ready" and c["status"] == "True"
                                          for c in (p.get("status") or {}).get("conditions") or [])
                                      for p in ps.values())
            return ps if ok else None

        first = await eventually(all_ready, what="2 groups ready", timeout=60, interval=0.1)
        world.kubelet.agent.stick(ns, "tiny-0-1")
        seen: list[dict] = []

        async def recreated():
            ps = await pods()
            for p in ps.values():
                for cs in (p.get("status") or {}).get("containerStatuses") or []:
                    if int(cs.get("restartCount") or 0) > 0:
                        seen.append({"pod": p["metadata"]["name"], **cs})
            new = {n: p["metadata"]["uid"] for n, p in ps.items()}
            ok = (len(new) == 4 and new["tiny-0"] != first["tiny-0"]["metadata"]["uid"]
                  and new["tiny-0-1"] != first["tiny-0-1"]["metadata"]["uid"])
            return ps if ok else None

        await eventually(recreated, timeout=90, what="group 0 recreated", interval=0.1)
        second = await eventually(all_ready, timeout=90, what="group 0 ready again", interval=0.1)
        # the other group kept its pods; the stuck pod's restart carried the probe's reason
        assert {second[n]["metadata"]["uid"] for n in ("tiny-1", "tiny-1-1")} == \
            {first[n]["metadata"]["uid"] for n in ("tiny-1", "tiny-1-1")}
        assert {second[n]["metadata"]["uid"] for n in ("tiny-0", "tiny-0-1")}.isdisjoint(
            {first[n]["metadata"]["uid"] for n in ("tiny-0", "tiny-0-1")})
        restarted = [s for s in seen if s["pod"] == "tiny-0-1"]
        if restarted:  # LWS may delete the pod before a poll here sees its status
            term = restarted[0]["lastState"]["terminated"]
            assert term["exitCode"] == 137 and "Liveness probe failed" in term["message"] and "503" in term["message"]
        assert not [s for s in seen if s["pod"].startswith("tiny-1")]
        # the real controller's Event, as the operator reads it for Degraded
        events = await cluster.list(f"/api/v1/namespaces/{ns}/events")
        recreate = [e for e in events if e.get("reason") == k8s_names.LWS_RECREATE_GROUP_REASON]
        assert recreate and "tiny-0-1" in recreate[0]["message"] and event_span(recreate[0])[0] is not None
        assert restarting([], ["tiny-0-1 (group 0 recreated 3x)"])[0] == "GroupRestarting"
        world.lws_controller.check_alive()


async def test_a_group_that_keeps_restarting_turns_degraded_naming_the_pod(built, real_control_plane) -> None:
    """The operator on the real plane with the real LWS controller: a worker that fails at every start
    makes LWS recreate its group again and again (fresh pods, restart counts 0); the operator counts
    the controller's ``RecreateGroupOnPodRestart`` Events and sets ``Degraded`` (``GroupRestarting``)
    with the pod, and phase ``Degraded``."""
    workload = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                              bucket_seconds=15, seed=6, shift_at=0.5)
    world = SimWorld(workload=workload, api="real", lws="real", scale=100.0, startup_seconds=30.0,
                     kubelet_poll=0.1, shared_plane=real_control_plane, crash_pod_if=lambda s, worker: worker == 1)
    async with world.run():
        ns, cluster = world.namespace, world.cluster
        op = await world.start_operator()
        res = copy.deepcopy(RESOURCE)
        res["spec"]["parallelism"] = {"tensor": 1, "data": 4, "nodes": 2}
        res["spec"]["replicas"] = 1
        res["spec"]["autotune"]["mode"] = "Off"
        await world.apply(res)

        async def recreations():
            events = await cluster.list(f"/api/v1/namespaces/{ns}/events")
            n = sum(max(int(e.get("count") or 1), int((e.get("series") or {}).get("count") or 0))
                    for e in events if e.get("reason") == k8s_names.LWS_RECREATE_GROUP_REASON)
            return n if n >= 3 else None

        await eventually(recreations, timeout=120, what="3 group recreations", interval=0.1)

        st, cond = await _degraded(world, op, ns, "GroupRestarting")
        assert "tiny-0-1 (group 0 recreated" in cond["message"], cond
        assert st["phase"] == "Degraded" and st["message"] == cond["message"]
        world.lws_controller.check_alive()


async def test_a_stuck_single_node_pod_restarts_in_place_and_degrades(built, real_control_plane) -> None:
    """A Deployment pod (no group to recreate) whose engine hangs fails its liveness probe; the
    container restarts in place (``restartCount`` + 1, ``lastState`` exit code 137 with the probe's
    message) and serves again; after three such restarts the operator sets ``Degraded``
    (``PodRestarting``) naming the pod and the failed probe."""
    workload = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                              bucket_seconds=15, seed=7, shift_at=0.5)
    world = SimWorld(workload=workload, api="real", lws="real", scale=100.0, startup_seconds=30.0,
                     kubelet_poll=0.1, shared_plane=real_control_plane)
    async with world.run():
        ns, cluster = world.namespace, world.cluster
        op = await world.start_operator()
        res = copy.deepcopy(RESOURCE)
        res["spec"]["replicas"] = 1
        res["spec"]["autotune"]["mode"] = "Off"
        await world.apply(res)

        async def pod(restarts: int):
            ps = [p for p in await cluster.list(f"/api/v1/namespaces/{ns}/pods", "eplb.ai/name=tiny")
                  if not p["metadata"].get("deletionTimestamp")]
            if len(ps) != 1:
                return None
            (cs,) = (ps[0].get("status") or {}).get("containerStatuses") or [{}]
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in ps[0]["status"].get("conditions") or [])
            return ps[0] if ready and int(cs.get("restartCount") or 0) == restarts else None

        first = await eventually(lambda: pod(0), what="the pod ready", timeout=60, interval=0.1)
        name = first["metadata"]["name"]
        for n in (1, 2, 3):
            world.kubelet.agent.stick(ns, name)
            again = await eventually(lambda n=n: pod(n), timeout=60, what=f"restart {n} and ready again", interval=0.1)
        assert again["metadata"]["uid"] == first["metadata"]["uid"]  # restarted in place, not replaced
        term = again["status"]["containerStatuses"][0]["lastState"]["terminated"]
        assert term["exitCode"] == 137 and term["message"].startswith("Liveness probe failed: HTTP probe failed with statuscode: 503")

        _, cond = await _degraded(world, op, ns, "PodRestarting")
        assert f"pod {name} restarted 3x (last: Error, exit code 137, Liveness probe failed" in cond["message"], cond
