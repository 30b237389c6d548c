"""The leader address of a multi-node group, on the REAL control plane with the REAL LeaderWorkerSet
controller (v0.8.0) and the operator applying what it renders.

The workers dial rank 0 at ``LWS_LEADER_ADDRESS`` = ``<leader pod>.<the pods' subdomain>.<ns>``; that
name resolves only where the subdomain is a headless Service selecting the group's pods. LWS's default
subdomain policy (``Shared``) names that Service after the LWS, ``<name>``: the operator's client
Service (ClusterIP), which the LWS controller skips because it exists. The operator renders
``networkConfig.subdomainPolicy: UniquePerReplica``, so each group gets a headless Service
``<name>-<group>`` of its own. Skipped unless both are built (``make kube``).
"""

from __future__ import annotations

from moe_eplb.contracts import k8s_names
from moe_eplb.eplb.workload import synth
from moe_eplb_harness.cluster.world import SimWorld
from moe_eplb_harness.real import lwscontroller
from moe_eplb_harness.real.controlplane import find_binaries
from tests.kube.conftest import tiny_resource
from tests.polling import eventually
from tests.require import missing


def _selects(selector: dict, pod: dict) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


async def test_each_groups_subdomain_is_a_headless_service_of_its_pods_not_the_client_service(
        real_control_plane) -> None:
    if find_binaries() is None or lwscontroller.find_lws_binary() is None:
        missing("the control plane and the LWS controller are not built (run `make kube`)")
    workload = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                              bucket_seconds=15, seed=5, shift_at=0.5)
    world = SimWorld(workload=workload, api="real", lws="real", scale=100.0, startup_seconds=5.0,
                     kubelet_poll=0.1, shared_plane=real_control_plane)
    async with world.run():
        assert world.lws == "real" and world.lws_controller is not None
        ns, cluster = world.namespace, world.cluster
        await world.start_operator()
        res = tiny_resource("tiny", replicas=2)
        res["spec"]["parallelism"] = {"tensor": 1, "data": 4, "nodes": 2}
        await world.apply(res)

        async def settled():
            pods = [p for p in await cluster.list(f"/api/v1/namespaces/{ns}/pods", "eplb.ai/name=tiny")
                    if not p["metadata"].get("deletionTimestamp")]
            services = {s["metadata"]["name"]: s for s in await cluster.list(f"/api/v1/namespaces/{ns}/services")}
            wanted = {p["spec"].get("subdomain") for p in pods}
            return (pods, services) if len(pods) == 4 and "tiny" in services and wanted <= set(services) else None

        pods, services = await eventually(settled, timeout=60.0, interval=0.1,
                                          what="4 pods and a Service of each pod's subdomain")
        client = services["tiny"]
        assert client["spec"]["type"] == "ClusterIP" and client["spec"]["clusterIP"] != "None"
        groups: dict[str, list[dict]] = {}
        for p in pods:
            groups.setdefault(p["metadata"]["labels"][k8s_names.LWS_GROUP_INDEX_LABEL], []).append(p)
        assert sorted(groups) == ["0", "1"]
        for g, members in groups.items():
            subdomains = {p["spec"].get("subdomain") for p in members}
            assert len(subdomains) == 1, subdomains  # one name for the whole group, leader and workers
            (sub,) = subdomains
            assert sub != "tiny", "the pods' subdomain is the client Service: LWS_LEADER_ADDRESS never resolves"
            svc = services[sub]
            assert svc["spec"].get("clusterIP") == "None", f"Service {sub} is not headless"
            assert svc["spec"].get("publishNotReadyAddresses") is True  # rank 0 resolves before it is ready
            selected = {p["metadata"]["name"] for p in pods if _selects(svc["spec"].get("selector") or {}, p)}
            assert selected == {p["metadata"]["name"] for p in members}, (sub, selected)
            leader = next(p for p in members if p["metadata"]["labels"][k8s_names.LWS_WORKER_INDEX_LABEL] == "0")
            assert leader["spec"]["hostname"] == leader["metadata"]["name"] == f"tiny-{g}"
            want = f"{leader['metadata']['name']}.{sub}.{ns}"
            assert want == k8s_names.lws_leader_address("tiny", int(g), ns)  # what render.elastic dials too
            for p in members:
                env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0].get("env") or []}
                assert env[k8s_names.LWS_LEADER_ADDRESS_ENV] == want, p["metadata"]["name"]
        world.lws_controller.check_alive()
