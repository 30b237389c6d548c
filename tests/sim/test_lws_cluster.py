"""The fake kubelet runs LeaderWorkerSets like the LWS controller would, over the emulated API's real
HTTP: groups of pods with LWS's labels, one engine per group stepping in lockstep with each pod
exporting its own ranks' counters, a rolling update by group within maxUnavailable, /scale changing
groups only, RecreateGroup on a pod restart -- and every LWS object and status stored passes the
published CRD (the emulated API enforces it on every write)."""

from __future__ import annotations

import asyncio
import copy
import time

import aiohttp
import numpy as np
import pytest

from moe_eplb.api.autotune_status import parse_iso
from moe_eplb.api.spec import parse
from moe_eplb.contracts import k8s_names
from moe_eplb.eplb.workload import synth
from moe_eplb.metrics.scrape import parse_exposition
from moe_eplb.render.objects import render_children
from moe_eplb_harness.emulated.kubeapi import emulated_cluster
from moe_eplb_harness.emulated.kubelet import FakeKubelet
from moe_eplb_harness.engines.engine import SimClock
from moe_eplb_harness.floor.pods import KubeletSettings
from tests.autotune.conftest import RESOURCE
from tests.polling import eventually
from tests.sim.test_lws import _problems

pytestmark = pytest.mark.integration  # an emulated API server, the fake kubelet, simulated engines

NS = "default"
LWS_PATH = f"/apis/{k8s_names.LWS_API_VERSION}/namespaces/{NS}/leaderworkersets"


def _lws(replicas: int = 3, window: int = 1000) -> dict:
    res = copy.deepcopy(RESOURCE)
    res["spec"]["parallelism"] = {"tensor": 1, "data": 4, "nodes": 2}
    res["spec"]["replicas"] = replicas
    res["spec"]["eplb"]["windowSize"] = window
    lws = next(c for c in render_children(parse(res)) if c["kind"] == "LeaderWorkerSet")
    lws["metadata"]["namespace"] = NS
    return lws


async def _metrics(port: int) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
        return await r.text()


@pytest.fixture(scope="module")
def workload():
    return synth.generate("qwen3-vl-30b-a3b-chat-to-math", model_shape=(4, 16, 1, 2), hours=1, bucket_seconds=15,
                          seed=4, shift_at=0.5)


async def test_groups_roll_one_at_a_time_and_scale_without_restarts(workload):
    clock = SimClock.started_now(scale=200.0)
    async with emulated_cluster() as kube:
        kubelet = FakeKubelet(kube.url, KubeletSettings(workload, clock, startup_seconds=30.0, poll=0.05, engine_tick=0.05))
        async with kubelet:
            await kube.create(LWS_PATH, _lws(3))

            async def ready(n):
                obj = await kube.get(f"{LWS_PATH}/tiny")
                st = obj.get("status") or {}
                return obj if st.get("readyReplicas") == n and st.get("updatedReplicas") == n \
                    and st.get("replicas") == n and st.get("observedGeneration") == obj["metadata"]["generation"] \
                    else None

            obj = await eventually(lambda: ready(3), timeout=20.0)
            assert _problems(obj) == []
            pods = await kube.list(f"/api/v1/namespaces/{NS}/pods", "eplb.ai/name=tiny")
            assert sorted(p["metadata"]["name"] for p in pods) == ["tiny-0", "tiny-0-1", "tiny-1", "tiny-1-1",
                                                                   "tiny-2", "tiny-2-1"]
            first_uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}

            # one engine per group, its ranks in lockstep, each pod exporting its own ranks' counters
            await asyncio.sleep(0.5)
            lw = kubelet.leaderworkersets[(NS, "tiny")]
            group = lw.groups[0]
            engine = group.engine
            assert engine is not None and engine.pods == 2 and group.pods[0].engine is group.pods[1].engine
            for w in (0, 1):  # each pod serves its own endpoint
                assert parse_exposition(await _metrics(group.pods[w].port)).steps["example/tiny-moe"] > 0
            # both pods' expositions rendered at one instant (no engine tick between them)
            samples = [parse_exposition(engine.exposition(w).decode()) for w in (0, 1)]
            steps = [s.steps["example/tiny-moe"] for s in samples]
            assert steps[0] == steps[1] == engine.replay.steps > 0  # lockstep: both count the engine's steps
            tokens = [np.array([v for _, v in sorted(s.tokens["example/tiny-moe"].items())]) for s in samples]
            assert not np.allclose(tokens[0], tokens[1])  # the pods' routers saw different requests
            total = tokens[0] + tokens[1]
            assert total == pytest.approx(engine.expert_tokens.ravel())  # the engine's load is their sum
            assert total.sum() > 0
            text = await _metrics(group.pods[1].port)
            assert "moe_eplb_balancedness{" not in text  # no pod holds every rank
            assert 'moe_eplb_exporter_ranks{model_name="example/tiny-moe"} 2.0' in text

            # a template change rolls the groups from the highest index, never more than one down
            min_ready, max_groups, order = [], [], []

            async def watch():
                while True:
                    st = (await kube.get(f"{LWS_PATH}/tiny")).get("status") or {}
                    min_ready.append(int(st.get("readyReplicas") or 0))
                    max_groups.append(int(st.get("replicas") or 0))
                    for p in await kube.list(f"/api/v1/namespaces/{NS}/pods", "eplb.ai/name=tiny"):
                        g = p["metadata"]["labels"][k8s_names.LWS_GROUP_INDEX_LABEL]
                        if p["metadata"]["uid"] not in first_uids.values() and g not in order:
                            order.append(g)
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch())
            try:
                await kube.patch(f"{LWS_PATH}/tiny", {"spec": {"leaderWorkerTemplate": {
                    "leaderTemplate": {"metadata": {"annotations": {"test/rev": "2"}}},
                    "workerTemplate": {"metadata": {"annotations": {"test/rev": "2"}}}}}})
                obj = await eventually(lambda: ready(3), timeout=30)
                await asyncio.sleep(0.1)
            finally:
                watcher.cancel()
            assert min(min_ready) == 2 and max(max_groups) == 3
            assert order == ["2", "1", "0"]
            assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"] == 2
            assert _problems(obj) == []
            pods = await kube.list(f"/api/v1/namespaces/{NS}/pods", "eplb.ai/name=tiny")
            assert {p["metadata"]["annotations"].get("test/rev") for p in pods} == {"2"}
            assert len({p["metadata"]["labels"][k8s_names.LWS_TEMPLATE_REVISION_LABEL] for p in pods}) == 1

            # /scale (an HPA): one more group, no pod replaced; the selector picks the leaders
            scale = await kube.get(f"{LWS_PATH}/tiny/scale")
            assert scale["status"]["selector"] == (f"{k8s_names.LWS_NAME_LABEL}=tiny,"
                                                   f"{k8s_names.LWS_WORKER_INDEX_LABEL}=0")
            before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
            await kube.patch(f"{LWS_PATH}/tiny/scale", {"spec": {"replicas": 4}})
            await eventually(lambda: ready(4), timeout=20.0)
            after = {p["metadata"]["name"]: p["metadata"]["uid"]
                     for p in await kube.list(f"/api/v1/namespaces/{NS}/pods", "eplb.ai/name=tiny")}
            assert {k: v for k, v in after.items() if k in before} == before
            assert set(after) - set(before) == {"tiny-3", "tiny-3-1"}


async def test_a_crashing_worker_recreates_its_group_and_records_it(workload):
    clock = SimClock.started_now(scale=200.0)
    async with emulated_cluster() as kube:
        kubelet = FakeKubelet(kube.url, KubeletSettings(
            workload, clock, startup_seconds=30.0, poll=0.05, engine_tick=0.05,
            crash_pod_if=lambda s, worker: worker == 1 and s.knobs.window_size == 2000))
        async with kubelet:
            await kube.create(LWS_PATH, _lws(2))
            await eventually(lambda: _status(kube, "readyReplicas", 2), timeout=20.0)
            lwt = _lws(2, window=2000)["spec"]["leaderWorkerTemplate"]  # what a tuner change renders
            await kube.patch(f"{LWS_PATH}/tiny", {"spec": {"leaderWorkerTemplate": lwt}})

            async def recreated():
                events = await kube.request("GET", f"/api/v1/namespaces/{NS}/events", params={
                    "fieldSelector": "involvedObject.kind=LeaderWorkerSet,involvedObject.name=tiny,reason=RecreateGroupOnPodRestart"})
                return events["items"] if len(events["items"]) >= 3 else None

            events = await eventually(recreated, timeout=30, interval=0.05)
            # one Event per recreation: each is related to a new leader pod (its uid), never merged
            assert len({e["related"]["uid"] for e in events}) == len(events) >= 3
            assert {e["message"] for e in events} == {
                "Worker pod tiny-1-1 failed, deleted leader pod tiny-1 to recreate group 1"}
            assert all(e["related"]["name"] == "tiny-1" and e["type"] == "Normal" for e in events)
            # stamped with the wall-clock time as the real controller does, not the accelerated clock's
            assert all(abs(parse_iso(e["eventTime"]) - time.time()) < 30 for e in events), \
                [(e["eventTime"], clock.now()) for e in events]
            st = (await kube.get(f"{LWS_PATH}/tiny"))["status"]
            # group 1 never becomes ready, so the update never reaches group 0 (still serving)
            assert st["readyReplicas"] == 1 and st["updatedReplicas"] == 1
            conds = {c["type"]: c["status"] for c in st["conditions"]}
            assert conds["UpdateInProgress"] == "True" and conds["Available"] == "False"
            leader0 = next(p for p in await kube.list(f"/api/v1/namespaces/{NS}/pods", "eplb.ai/name=tiny")
                           if p["metadata"]["name"] == "tiny-0")
            assert '"window_size":1000' in " ".join(leader0["spec"]["containers"][0]["args"])


async def _status(kube, key, value):
    st = (await kube.get(f"{LWS_PATH}/tiny")).get("status") or {}
    return st.get(key) == value
