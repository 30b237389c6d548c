"""``spec.engine.gpuResourceName`` against the REAL kube-scheduler: on simulated ROCm nodes (their
device plugin advertises ``amd.com/gpu``), an engine pod requesting ``amd.com/gpu`` is scheduled and
serves, while one requesting the default ``nvidia.com/gpu`` stays Pending, unschedulable for want of
that resource."""

from __future__ import annotations

import copy

from moe_eplb.eplb.workload import synth
from moe_eplb_harness.cluster.world import SimWorld
from tests.autotune.conftest import RESOURCE
from tests.polling import eventually


def _cond(pod: dict, ctype: str) -> dict:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


async def test_pods_request_the_named_gpu_resource_and_the_scheduler_honours_it(real_control_plane) -> None:
    workload = synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1,
                              bucket_seconds=15, seed=8, shift_at=0.5)
    world = SimWorld(workload=workload, api="real", lws="auto", scale=100.0, startup_seconds=30.0,
                     kubelet_poll=0.1, shared_plane=real_control_plane, gpu_resource="amd.com/gpu")
    async with world.run():
        ns, cluster = world.namespace, world.cluster
        await world.start_operator()
        for name, gpu in (("rocm", "amd.com/gpu"), ("cuda", None)):
            res = copy.deepcopy(RESOURCE)
            res["metadata"]["name"] = name
            res["spec"]["replicas"] = 1
            res["spec"]["autotune"]["mode"] = "Off"
            if gpu:  # ROCm nodes run vLLM's ROCm image (the CUDA one is refused with amd.com/gpu)
                res["spec"]["engine"]["gpuResourceName"] = gpu
                image = res["spec"]["engine"].get("image", "vllm/vllm-openai:v0.32.0")
                res["spec"]["engine"]["image"] = image.replace("vllm/vllm-openai:", "vllm/vllm-openai-rocm:")
            await world.apply(res)

        async def pod(name: str, check) -> dict | None:
            ps = await cluster.list(f"/api/v1/namespaces/{ns}/pods", f"eplb.ai/name={name}")
            return ps[0] if len(ps) == 1 and check(ps[0]) else None

        rocm = await eventually(lambda: pod("rocm", lambda p: _cond(p, "Ready").get("status") == "True"),
                            what="the amd.com/gpu pod ready", timeout=60, interval=0.1)
        assert rocm["spec"]["containers"][0]["resources"]["limits"] == {"amd.com/gpu": "4"}  # the apiserver stores quantities as strings
        assert rocm["spec"]["nodeName"].startswith(world.backend.node_prefix)
        cuda = await eventually(lambda: pod("cuda", lambda p: _cond(p, "PodScheduled").get("reason") == "Unschedulable"),
                            what="the nvidia.com/gpu pod refused by the scheduler", timeout=60, interval=0.1)
        assert cuda["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4"}
        assert "Insufficient nvidia.com/gpu" in _cond(cuda, "PodScheduled")["message"]
        assert not cuda["spec"].get("nodeName")
