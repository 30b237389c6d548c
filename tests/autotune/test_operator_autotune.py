"""Operator-in-the-loop scenarios of the tuning loop: the real kopf operator, the emulated Kubernetes
API, simulated engine pods replaying a generated workload through EPLB (real HTTP metrics, the real
load reader), accelerated time. Each scenario runs on a Deployment (single-node replicas) and on a
LeaderWorkerSet (replica groups of a leader and a worker pod, one engine per group) and asserts what
lands in the API and in the pods."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from moe_eplb_harness.cluster.world import SimWorld
from moe_eplb_harness.floor.prometheus import prometheus_binary

from .conftest import (
    NAME,
    SCALE,
    START,
    autotune_status,
    cond,
    events,
    pods,
    pods_per_replica,
    resource,
    running_settings,
    template_hash,
    wait_for,
    workload_of,
    workload_or_none,
)

pytestmark = pytest.mark.integration  # the real operator, an emulated API server and simulated engine pods

START_KNOBS = (START["windowSize"], START["stepInterval"], START["numRedundantExperts"])


def _world(workload_trace, **kw) -> SimWorld:
    kw.setdefault("scale", SCALE)
    kw.setdefault("startup_seconds", 60.0)
    kw.setdefault("tick_seconds", 0.2)
    return SimWorld(workload=workload_trace, **kw)


def _metric(world, name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"namespace": world.namespace, "name": NAME, **labels}) or 0.0


def _last_decision(res: dict) -> str | None:
    return (autotune_status(res).get("lastEvaluation") or {}).get("decision")


def _knobs(s) -> tuple:
    return (s.knobs.window_size, s.knobs.step_interval, s.num_redundant_experts)


async def _running(world, kind):
    return await wait_for(world, lambda r: r.get("status", {}).get("phase") == "Running" or None, timeout=15)


async def test_recommend_only_changes_nothing(workload, kind):
    world = _world(workload, prometheus=prometheus_binary() is not None, scrape_interval=0.5)
    async with world.run():
        res = resource(kind, mode="Recommend")
        before = _metric(world, "moe_eplb_tuner_decisions_total", decision="Recommend")
        op = await world.start_operator()
        if world.prometheus_url:
            # the operator's default (--prometheus-url / MOE_EPLB_PROMETHEUS_URL), the spec leaves it empty
            from moe_eplb.controller.settings import OperatorSettings

            op["controller"].settings = OperatorSettings(prometheus_url=world.prometheus_url)
        await world.apply(res)
        await _running(world, kind)
        first_hash = template_hash(await workload_of(world, kind))
        names_before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await pods(world)}
        assert len(names_before) == 2 * pods_per_replica(kind)
        got = await wait_for(world, lambda r: _last_decision(r) == "Recommend" and r, timeout=30)
        at = autotune_status(got)
        rec = at["recommendation"]
        assert {k: rec[k] for k in START} != START
        assert rec["predictedGain"] > 0.01
        assert "override" not in at and "rollout" not in at
        assert at["lastEvaluation"]["dataWindow"]["source"] == ("prometheus" if world.prometheus_url else "pods")
        assert "prometheusUrl" not in (got["spec"].get("monitoring") or {})  # the default is never written
        assert at["lastEvaluation"]["dataWindow"]["steps"] >= 2000
        assert cond(got, "Tuned")["reason"] == "Recommended"
        assert cond(got, "MetricsAvailable")["status"] == "True"
        # nothing restarted: same template, same pods, engines still on the spec's settings
        assert template_hash(await workload_of(world, kind)) == first_hash
        assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in await pods(world)} == names_before
        assert running_settings(world) == {START_KNOBS}
        assert got["status"]["eplb"]["windowSize"] == 1000
        assert _metric(world, "moe_eplb_tuner_decisions_total", decision="Recommend") > before
        assert any(e["reason"] == "Recommended" for e in await events(world))


async def test_apply_rolls_out_and_keeps(workload, kind, api, plane):
    # the LWS path reads and judges through a real Prometheus when installed (group labels via its
    # scrape config, as the PodMonitor sets them); the Deployment path scrapes the pods
    use_prom = kind == "LeaderWorkerSet" and prometheus_binary() is not None
    world = _world(workload, api=api, shared_plane=plane, prometheus=use_prom, scrape_interval=0.5)
    min_ready = []

    async with world.run():
        await world.start_operator()
        res = resource(kind)
        if use_prom:  # judged on 10 simulated minutes (6 s of wall time: Prometheus scrapes in wall time)
            res["spec"]["monitoring"] = {"prometheusUrl": world.prometheus_url}
            res["spec"]["autotune"]["observeSeconds"] = 600
        await world.apply(res)

        async def watch_capacity():
            # once Running, ready replicas (groups) must never drop below replicas - maxUnavailable = 1
            while True:
                w = await workload_or_none(world, kind) or {}
                if w.get("status", {}).get("readyReplicas") == 2 or min_ready:
                    min_ready.append(int(w.get("status", {}).get("readyReplicas") or 0))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_capacity())
        try:
            applied = await wait_for(world, lambda r: autotune_status(r).get("rollout") and r, timeout=40)
            target = applied["status"]["autotune"]["rollout"]["to"]
            assert applied["status"]["autotune"]["override"] == {
                **target, "specGeneration": applied["metadata"]["generation"], "specEplb": START}
            assert applied["status"]["autotune"]["rollout"]["baseline"]["balancedness"] > 0
            done = await wait_for(world, lambda r: (autotune_status(r).get("history") or [None])[-1] and r
                                  if not autotune_status(r).get("rollout") else None, timeout=50)
        finally:
            watcher.cancel()
        at = autotune_status(done)
        last = at["history"][-1]
        assert last["action"] == "Kept", last
        assert last["measured"]["balancedness"] > 0
        assert last["measured"]["pods"] == 2 * pods_per_replica(kind)  # judged on every pod of the new groups
        assert last["measured"]["source"] == ("prometheus" if use_prom else "pods")
        assert done["status"]["eplb"] == {"enabled": True, **target}
        # every ready engine now runs the tuned settings; the rollout never dropped below 1 ready replica
        want = (target["windowSize"], target["stepInterval"], target["numRedundantExperts"])
        assert running_settings(world) == {want}
        assert min(min_ready) >= 1, min_ready
        assert len(at["restarts"]) == 1
        reasons = [e["reason"] for e in await events(world)]
        assert "ApplyingTunedSettings" in reasons and "TunedSettingsKept" in reasons
        assert cond(done, "Tuned")["reason"] == "Kept"
        assert _metric(world, "moe_eplb_tuner_last_success_timestamp_seconds") > 0

        # Scaling (a /scale by an HPA bumps the generation) keeps the tuned settings: no pod restarts;
        # for a LeaderWorkerSet only its spec.replicas changes (one more group).
        tuned_hash = template_hash(await workload_of(world, kind))
        pods_before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await pods(world)}
        await world.cluster.patch(world.cluster.moeinference_path(world.namespace, NAME) + "/scale", {"spec": {"replicas": 3}})
        scaled = await wait_for(world, lambda r: (r.get("status") or {}).get("readyReplicas") == 3 and r, timeout=20)
        assert scaled["metadata"]["generation"] > done["metadata"]["generation"]
        child = await workload_of(world, kind)
        assert template_hash(child) == tuned_hash and child["spec"]["replicas"] == 3
        pods_after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await pods(world)}
        assert {k: v for k, v in pods_after.items() if k in pods_before} == pods_before  # none replaced
        assert len(pods_after) == 3 * pods_per_replica(kind)
        assert scaled["status"]["eplb"] == {"enabled": True, **target}
        assert autotune_status(scaled)["override"]["specEplb"] == START

        # An edit of spec.eplb wins: the override is dropped and the spec's settings roll out.
        edited = {**START, "windowSize": 2000}
        await world.cluster.patch(world.cluster.moeinference_path(world.namespace, NAME), {"spec": {"eplb": edited}})
        got = await wait_for(world, lambda r: "override" not in autotune_status(r)
                             and (r.get("status") or {}).get("eplb", {}).get("windowSize") == 2000 and r, timeout=20)
        assert got["status"]["eplb"] == {"enabled": True, **edited}
        assert template_hash(await workload_of(world, kind)) != tuned_hash


async def test_cooldown_and_restart_budget_defer(workload, kind):
    world = _world(workload)
    async with world.run():
        # a change was made moments ago (simulated clock): the cooldown blocks the next one
        res = resource(kind, cooldownSeconds=100000)
        await world.start_operator()
        created = await world.apply(res)
        now = world.clock.now()
        from moe_eplb.controller.decisions import iso

        await world.cluster.patch(world.cluster.moeinference_path(world.namespace, NAME) + "/status",
                                  {"status": {"autotune": {"lastChangeTime": iso(now), "restarts": [iso(now)]}}})
        await _running(world, kind)
        hash0 = template_hash(await workload_of(world, kind))
        got = await wait_for(world, lambda r: _last_decision(r) == "Defer" and r, timeout=30)
        assert "cooldown" in got["status"]["autotune"]["lastEvaluation"]["reason"]
        assert "override" not in got["status"]["autotune"]
        assert template_hash(await workload_of(world, kind)) == hash0

        # budget: cooldown over, but maxRestartsPerDay = 1 is spent by the recorded restart
        await world.cluster.patch(world.cluster.moeinference_path(world.namespace, NAME),
                                  {"spec": {"autotune": {"cooldownSeconds": 0, "maxRestartsPerDay": 1}}})
        got = await wait_for(world, lambda r: _last_decision(r) == "Defer"
                             and "restart budget" in autotune_status(r)["lastEvaluation"]["reason"] and r, timeout=30)
        assert "override" not in got["status"]["autotune"] and "rollout" not in got["status"]["autotune"]
        assert running_settings(world) == {START_KNOBS}
        assert created["metadata"]["generation"] < got["metadata"]["generation"]


async def test_regression_rolls_back(workload, kind, api, plane):
    from moe_eplb_harness.engines.engine import EngineFaults

    # Pods with the tuned settings pack the hottest experts together (a broken expert map):
    # measured balancedness falls below the baseline, so the change must be rolled back.
    world = _world(workload, api=api, shared_plane=plane,
                   faults_for=lambda s: EngineFaults(clustered_placement=_knobs(s) != START_KNOBS))
    async with world.run():
        before = _metric(world, "moe_eplb_rollbacks_total", reason="regression")
        await world.start_operator()
        await world.apply(resource(kind))
        got = await wait_for(world, lambda r: any(h.get("action") == "RolledBack"
                                                  for h in autotune_status(r).get("history") or []) and r, timeout=90)
        at = autotune_status(got)
        assert not any(h.get("action") == "Kept" for h in at["history"]), at["history"]
        entry = [h for h in at["history"] if h["action"] == "RolledBack"][-1]
        assert "rollbackTolerance" in entry["reason"]
        assert entry["measured"]["balancedness"] < entry["baseline"]["balancedness"] * 0.98
        assert "override" not in at  # the spec's settings run again
        assert got["status"]["eplb"]["windowSize"] == 1000
        assert cond(got, "Tuned")["reason"] == "RolledBack"
        await wait_for(world, lambda r: running_settings(world) == {START_KNOBS}, timeout=20)
        assert _metric(world, "moe_eplb_rollbacks_total", reason="regression") == before + 1
        assert any(e["reason"] == "RollingBack" and e["type"] == "Warning" for e in await events(world))


async def test_crash_loop_rolls_back_and_degrades(workload, kind, api, plane):
    if kind == "LeaderWorkerSet":
        # a WORKER pod of every group with the new settings crashes; LWS recreates the group each time
        # (on the real API: the real LWS controller, its RecreateGroupOnPodRestart Events stamped with
        # wall-clock times, which the operator maps onto its accelerated clock)
        world = _world(workload, api=api, shared_plane=plane,
                       crash_pod_if=lambda s, worker: worker == 1 and _knobs(s) != START_KNOBS)
    else:
        world = _world(workload, api=api, shared_plane=plane, crash_if=lambda s: _knobs(s) != START_KNOBS)
    degraded_seen = []
    async with world.run():
        await world.start_operator()
        await world.apply(resource(kind))

        def check(r):
            if cond(r, "Degraded").get("status") == "True":
                degraded_seen.append(cond(r, "Degraded")["reason"])
            return any(h.get("action") == "RolledBack" for h in autotune_status(r).get("history") or []) and r

        got = await wait_for(world, check, timeout=60, interval=0.05)
        at = autotune_status(got)
        assert at["degraded"]["reason"] == "RolledBackAfterCrashLoop"
        reason = at["history"][-1]["reason"]
        assert "crash-looping" in reason
        if kind == "LeaderWorkerSet":
            assert "tiny-1-1 (group 1 recreated" in reason  # the worker pod is named, and its group
            recreations = [e for e in await events(world) if e["reason"] == "RecreateGroupOnPodRestart"]
            assert recreations and all(e["involvedObject"]["kind"] == "LeaderWorkerSet" for e in recreations)
        assert "override" not in at
        assert degraded_seen, "the Degraded condition was never True"
        await wait_for(world, lambda r: running_settings(world) == {START_KNOBS} and
                       (r.get("status") or {}).get("readyReplicas") == 2, timeout=20)
        assert _metric(world, "moe_eplb_rollbacks_total", reason="crashloop") >= 1
        # the reconciler recomputes Degraded from readiness (all ready now): status.autotune.degraded
        # keeps it true. Scaling makes the reconciler write the status again.
        await world.cluster.patch(world.cluster.moeinference_path(world.namespace, NAME), {"spec": {"replicas": 3}})
        got = await wait_for(world, lambda r: (r.get("status") or {}).get("readyReplicas") == 3
                             and r["status"].get("observedGeneration") == r["metadata"]["generation"] and r, timeout=20)
        assert cond(got, "Degraded")["status"] == "True", cond(got, "Degraded")
        assert cond(got, "Degraded")["reason"] == "RolledBackAfterCrashLoop"
        assert got["status"]["phase"] == "Degraded" and cond(got, "Ready")["status"] == "True"


async def test_prometheus_down_changes_nothing(workload, kind):
    world = _world(workload)
    async with world.run():
        res = resource(kind)
        res["spec"]["monitoring"] = {"prometheusUrl": "http://127.0.0.1:9"}  # nothing listens there
        await world.start_operator()
        await world.apply(res)
        await _running(world, kind)
        hash0 = template_hash(await workload_of(world, kind))
        got = await wait_for(world, lambda r: _last_decision(r) == "NoData"
                             and cond(r, "MetricsAvailable").get("status") == "False"
                             and (r.get("status") or {}).get("readyReplicas") == 2 and r, timeout=30)
        assert cond(got, "MetricsAvailable")["reason"] == "PrometheusUnavailable"
        assert cond(got, "Tuned")["status"] == "False"
        at = autotune_status(got)
        assert "override" not in at and "rollout" not in at and "recommendation" not in at
        await asyncio.sleep(3.5)  # another evaluation interval: still nothing changes
        got = await world.get(NAME)
        assert _last_decision(got) == "NoData"
        assert template_hash(await workload_of(world, kind)) == hash0
        assert _metric(world, "moe_eplb_tuner_evaluations_total", result="nodata") >= 2


async def test_operator_killed_mid_rollout_resumes(workload, kind, api, plane):
    world = _world(workload, api=api, shared_plane=plane)
    async with world.run():
        op = await world.start_operator()
        await world.apply(resource(kind))
        await wait_for(world, lambda r: (autotune_status(r).get("rollout") or {}).get("phase") == "Rolling", timeout=30)
        created_at_kill = world.kubelet.pods_created
        await world.stop_operator(op)  # killed: no graceful shutdown
        await asyncio.sleep(1.0)  # the rollout continues without an operator (groups roll on)
        await world.start_operator()
        got = await wait_for(world, lambda r: autotune_status(r).get("history") and not autotune_status(r).get("rollout")
                             and r, timeout=40)
        at = autotune_status(got)
        assert [h["action"] for h in at["history"]] == ["Kept"], at["history"]
        assert len(at["restarts"]) == 1  # one change, not restarted twice
        # the initial pods + the pods of the single rollout; a duplicate restart would create more
        assert world.kubelet.pods_created == 2 * 2 * pods_per_replica(kind), (created_at_kill,
                                                                             world.kubelet.pods_created)


async def test_two_operators_only_one_acts(workload, kind, api, plane):
    world = _world(workload, api=api, shared_plane=plane)
    async with world.run():
        peering = f"moe-eplb-{world.namespace}"  # cluster-scoped: one of this test's own on a shared plane
        await world.cluster.create("/apis/kopf.dev/v1/clusterkopfpeerings",
                                   {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                    "metadata": {"name": peering}})
        await world.start_operator(standalone=False, priority=100, peering_name=peering)
        await world.start_operator(standalone=False, priority=50, peering_name=peering)
        await world.apply(resource(kind, mode="Recommend"))
        actors = set()

        def check(r):
            ev = autotune_status(r).get("lastEvaluation") or {}
            if ev.get("evaluatedBy"):
                actors.add((ev["evaluatedBy"], ev["time"]))
            return len(actors) >= 3

        await wait_for(world, check, timeout=30, interval=0.05)
        assert len({a for a, _ in actors}) == 1, actors


async def test_user_edit_during_rollout_wins(workload, kind):
    world = _world(workload)
    async with world.run():
        await world.start_operator()
        await world.apply(resource(kind))
        await wait_for(world, lambda r: (autotune_status(r).get("rollout") or {}).get("phase") in ("Rolling", "Observing"),
                       timeout=30)
        user = {"windowSize": 2000, "stepInterval": 4000, "numRedundantExperts": 4}
        await world.cluster.patch(world.cluster.moeinference_path(world.namespace, NAME),
                                  {"spec": {"eplb": user, "autotune": {"cooldownSeconds": 100000}}})
        got = await wait_for(world, lambda r: any(h.get("action") == "Superseded"
                                                  for h in autotune_status(r).get("history") or []) and r, timeout=30)
        assert "override" not in autotune_status(got)
        assert cond(got, "Tuned")["reason"] == "Superseded"
        got = await wait_for(world, lambda r: (r.get("status") or {}).get("eplb", {}).get("windowSize") == 2000 and r,
                             timeout=20)
        await wait_for(world, lambda r: running_settings(world) == {(2000, 4000, 4)}, timeout=30)
        child = await workload_of(world, kind)
        spec = child["spec"]["template"]["spec"] if kind == "Deployment" else \
            child["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
        container = spec["containers"][0]
        assert '"window_size":2000' in " ".join(container.get("args") or container["command"])


async def test_kept_without_a_measurement_sets_tuned(workload, kind):
    """The tuned pods' exporters answer nothing (a broken plugin): the change cannot be judged, is
    kept on the prediction after 2 x observeSeconds + 60 s, and that exit path sets the Tuned
    condition too (it used to keep saying Applying)."""
    from moe_eplb_harness.engines.engine import EngineFaults

    world = _world(workload, faults_for=lambda s: EngineFaults(silent=_knobs(s) != START_KNOBS))
    async with world.run():
        await world.start_operator()
        await world.apply(resource(kind))
        applying = await wait_for(world, lambda r: autotune_status(r).get("rollout") and r, timeout=40)
        assert cond(applying, "Tuned")["reason"] == "Applying"
        got = await wait_for(world, lambda r: autotune_status(r).get("history") and r, timeout=60)
        entry = autotune_status(got)["history"][-1]
        assert entry["action"] == "Kept" and "without a measurement" in entry["reason"]
        assert "measured" not in entry
        tuned = cond(got, "Tuned")
        assert (tuned["status"], tuned["reason"]) == ("True", "KeptUnmeasured"), tuned
        assert "rollout" not in autotune_status(got)
