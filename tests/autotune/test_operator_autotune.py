"""Operator-in-the-loop scenarios of the tuning loop: the real kopf operator, the emulated Kubernetes
API, simulated engine pods replaying a generated workload through EPLB (real HTTP metrics, the real
load reader), accelerated time. Each scenario asserts what lands in the API and in the pods."""

from __future__ import annotations

import asyncio

import pytest
from moe_eplb.sim.world import SimWorld, prometheus_binary
from prometheus_client import REGISTRY

from .conftest import (
    NAME,
    NS,
    SCALE,
    START,
    autotune_status,
    cond,
    deployment,
    events,
    pods,
    resource,
    template_hash,
    wait_for,
)

pytestmark = pytest.mark.integration  # the real operator, an emulated API server and simulated engine pods


def _world(workload, **kw) -> SimWorld:
    kw.setdefault("scale", SCALE)
    kw.setdefault("startup_seconds", 60.0)
    kw.setdefault("tick_seconds", 0.2)
    return SimWorld(workload=workload, **kw)


def _metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"namespace": NS, "name": NAME, **labels}) or 0.0


def _last_decision(res: dict) -> str | None:
    return (autotune_status(res).get("lastEvaluation") or {}).get("decision")


def _running_settings(world) -> set[tuple]:
    """(window, interval, redundant) of the engines the fake kubelet runs for ready pods."""
    out = set()
    for d in world.kubelet.deployments.values():
        for p in d.pods.values():
            if p.ready and p.settings is not None:
                out.add((p.settings.knobs.window_size, p.settings.knobs.step_interval, p.settings.num_redundant_experts))
    return out


async def test_recommend_only_changes_nothing(workload):
    world = _world(workload, prometheus=prometheus_binary() is not None, scrape_interval=0.5)
    async with world.run():
        res = resource(mode="Recommend")
        before = _metric("moe_eplb_tuner_decisions_total", decision="Recommend")
        op = await world.start_operator()
        if world.prometheus_url:
            # the operator's default (--prometheus-url / MOE_EPLB_PROMETHEUS_URL), the spec leaves it empty
            from moe_eplb.controller.settings import OperatorSettings

            op["controller"].settings = OperatorSettings(prometheus_url=world.prometheus_url)
        await world.apply(res)
        first_hash = template_hash(await wait_for(world, lambda r: r.get("status", {}).get("phase") == "Running" or None,
                                                  timeout=15) and await deployment(world))
        names_before = {p["metadata"]["name"] for p in await pods(world)}
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
        assert template_hash(await deployment(world)) == first_hash
        assert {p["metadata"]["name"] for p in await pods(world)} == names_before
        assert _running_settings(world) == {(1000, 3000, 0)}
        assert got["status"]["eplb"]["windowSize"] == 1000
        assert _metric("moe_eplb_tuner_decisions_total", decision="Recommend") > before
        assert any(e["reason"] == "Recommended" for e in await events(world))


async def test_apply_rolls_out_and_keeps(workload):
    world = _world(workload)
    min_ready = []

    async with world.run():
        await world.start_operator()
        await world.apply(resource())

        async def watch_capacity():
            # once Running, ready pods must never drop below replicas - maxUnavailable = 1
            while True:
                d = await world.cluster.get_or_none(f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}") or {}
                if d.get("status", {}).get("readyReplicas") == 2 or min_ready:
                    min_ready.append(int(d.get("status", {}).get("readyReplicas") or 0))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_capacity())
        try:
            applied = await wait_for(world, lambda r: autotune_status(r).get("rollout") and r, timeout=30)
            target = applied["status"]["autotune"]["rollout"]["to"]
            assert applied["status"]["autotune"]["override"] == {
                **target, "specGeneration": applied["metadata"]["generation"], "specEplb": START}
            assert applied["status"]["autotune"]["rollout"]["baseline"]["balancedness"] > 0
            done = await wait_for(world, lambda r: (autotune_status(r).get("history") or [None])[-1] and r
                                  if not autotune_status(r).get("rollout") else None, timeout=40)
        finally:
            watcher.cancel()
        at = autotune_status(done)
        last = at["history"][-1]
        assert last["action"] == "Kept", last
        assert last["measured"]["balancedness"] > 0
        assert done["status"]["eplb"] == {"enabled": True, **target}
        # every ready engine now runs the tuned settings; the rollout never dropped below 1 ready pod
        assert _running_settings(world) == {(target["windowSize"], target["stepInterval"], target["numRedundantExperts"])}
        assert min(min_ready) >= 1
        assert len(at["restarts"]) == 1
        reasons = [e["reason"] for e in await events(world)]
        assert "ApplyingTunedSettings" in reasons and "TunedSettingsKept" in reasons
        assert _metric("moe_eplb_tuner_last_success_timestamp_seconds") > 0

        # Scaling (a /scale by an HPA bumps the generation) keeps the tuned settings: no pod restarts.
        tuned_hash = template_hash(await deployment(world))
        pods_before = {p["metadata"]["name"] for p in await pods(world)}
        await world.cluster.patch(world.cluster.moeinference_path(NS, NAME), {"spec": {"replicas": 3}})
        scaled = await wait_for(world, lambda r: (r.get("status") or {}).get("readyReplicas") == 3 and r, timeout=20)
        assert scaled["metadata"]["generation"] > done["metadata"]["generation"]
        assert template_hash(await deployment(world)) == tuned_hash
        assert pods_before <= {p["metadata"]["name"] for p in await pods(world)}  # none replaced
        assert scaled["status"]["eplb"] == {"enabled": True, **target}
        assert autotune_status(scaled)["override"]["specEplb"] == START

        # An edit of spec.eplb wins: the override is dropped and the spec's settings roll out.
        edited = {**START, "windowSize": 2000}
        await world.cluster.patch(world.cluster.moeinference_path(NS, NAME), {"spec": {"eplb": edited}})
        got = await wait_for(world, lambda r: "override" not in autotune_status(r)
                             and (r.get("status") or {}).get("eplb", {}).get("windowSize") == 2000 and r, timeout=20)
        assert got["status"]["eplb"] == {"enabled": True, **edited}
        assert template_hash(await deployment(world)) != tuned_hash


async def test_cooldown_and_restart_budget_defer(workload):
    world = _world(workload)
    async with world.run():
        # a change was made moments ago (simulated clock): the cooldown blocks the next one
        res = resource(cooldownSeconds=100000)
        await world.start_operator()
        created = await world.apply(res)
        now = world.clock.now()
        from moe_eplb.controller.decisions import iso

        await world.cluster.patch(world.cluster.moeinference_path(NS, NAME) + "/status",
                                  {"status": {"autotune": {"lastChangeTime": iso(now), "restarts": [iso(now)]}}})
        hash0 = template_hash(await wait_for(world, lambda r: r.get("status", {}).get("phase") == "Running" or None,
                                             timeout=15) and await deployment(world))
        got = await wait_for(world, lambda r: _last_decision(r) == "Defer" and r, timeout=30)
        assert "cooldown" in got["status"]["autotune"]["lastEvaluation"]["reason"]
        assert "override" not in got["status"]["autotune"]
        assert template_hash(await deployment(world)) == hash0

        # budget: cooldown over, but maxRestartsPerDay = 1 is spent by the recorded restart
        await world.cluster.patch(world.cluster.moeinference_path(NS, NAME),
                                  {"spec": {"autotune": {"cooldownSeconds": 0, "maxRestartsPerDay": 1}}})
        got = await wait_for(world, lambda r: _last_decision(r) == "Defer"
                             and "restart budget" in autotune_status(r)["lastEvaluation"]["reason"] and r, timeout=30)
        assert "override" not in got["status"]["autotune"] and "rollout" not in got["status"]["autotune"]
        assert _running_settings(world) == {(1000, 3000, 0)}
        assert created["metadata"]["generation"] < got["metadata"]["generation"]


async def test_regression_rolls_back(workload):
    from moe_eplb.sim.engine import EngineFaults

    # Pods with the tuned settings place experts from an inverted view of the load (a broken expert map):
    # measured balancedness falls below the baseline, so the change must be rolled back.
    world = _world(workload, faults_for=lambda s: EngineFaults(inverted_placement=(
        s.knobs.window_size, s.knobs.step_interval, s.num_redundant_experts) != (1000, 3000, 0)))
    async with world.run():
        before = _metric("moe_eplb_rollbacks_total", reason="regression")
        await world.start_operator()
        await world.apply(resource())
        got = await wait_for(world, lambda r: any(h.get("action") == "RolledBack"
                                                  for h in autotune_status(r).get("history") or []) and r, timeout=60)
        at = autotune_status(got)
        entry = [h for h in at["history"] if h["action"] == "RolledBack"][-1]
        assert "rollbackTolerance" in entry["reason"]
        assert entry["measured"]["balancedness"] < entry["baseline"]["balancedness"] * 0.98
        assert "override" not in at  # the spec's settings run again
        assert got["status"]["eplb"]["windowSize"] == 1000
        await wait_for(world, lambda r: _running_settings(world) == {(1000, 3000, 0)}, timeout=20)
        assert _metric("moe_eplb_rollbacks_total", reason="regression") == before + 1
        assert any(e["reason"] == "RollingBack" and e["type"] == "Warning" for e in await events(world))


async def test_crash_loop_rolls_back_and_degrades(workload):
    world = _world(workload, crash_if=lambda s: (s.knobs.window_size, s.knobs.step_interval, s.num_redundant_experts)
                   != (1000, 3000, 0))
    degraded_seen = []
    async with world.run():
        await world.start_operator()
        await world.apply(resource())

        def check(r):
            if cond(r, "Degraded").get("status") == "True":
                degraded_seen.append(cond(r, "Degraded")["reason"])
            return any(h.get("action") == "RolledBack" for h in autotune_status(r).get("history") or []) and r

        got = await wait_for(world, check, timeout=60, interval=0.05)
        at = autotune_status(got)
        assert at["degraded"]["reason"] == "RolledBackAfterCrashLoop"
        assert "crash-looping" in at["history"][-1]["reason"]
        assert "override" not in at
        assert degraded_seen, "the Degraded condition was never True"
        await wait_for(world, lambda r: _running_settings(world) == {(1000, 3000, 0)} and
                       (r.get("status") or {}).get("readyReplicas") == 2, timeout=20)
        assert _metric("moe_eplb_rollbacks_total", reason="crashloop") >= 1
        # the reconciler recomputes Degraded from readiness (all ready now): status.autotune.degraded
        # keeps it true. Scaling makes the reconciler write the status again.
        await world.cluster.patch(world.cluster.moeinference_path(NS, NAME), {"spec": {"replicas": 3}})
        got = await wait_for(world, lambda r: (r.get("status") or {}).get("readyReplicas") == 3
                             and r["status"].get("observedGeneration") == r["metadata"]["generation"] and r, timeout=20)
        assert cond(got, "Degraded")["status"] == "True", cond(got, "Degraded")
        assert cond(got, "Degraded")["reason"] == "RolledBackAfterCrashLoop"
        assert got["status"]["phase"] == "Degraded" and cond(got, "Ready")["status"] == "True"


async def test_prometheus_down_changes_nothing(workload):
    world = _world(workload)
    async with world.run():
        res = resource()
        res["spec"]["monitoring"] = {"prometheusUrl": "http://127.0.0.1:9"}  # nothing listens there
        await world.start_operator()
        await world.apply(res)
        hash0 = template_hash(await wait_for(world, lambda r: r.get("status", {}).get("phase") == "Running" or None,
                                             timeout=15) and await deployment(world))
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
        assert template_hash(await deployment(world)) == hash0
        assert _metric("moe_eplb_tuner_evaluations_total", result="nodata") >= 2


async def test_operator_killed_mid_rollout_resumes(workload):
    world = _world(workload)
    async with world.run():
        op = await world.start_operator()
        await world.apply(resource())
        await wait_for(world, lambda r: (autotune_status(r).get("rollout") or {}).get("phase") == "Rolling", timeout=30)
        created_at_kill = world.kubelet.pods_created
        await world.stop_operator(op)  # killed: no graceful shutdown
        await asyncio.sleep(1.0)  # the rollout continues without an operator
        await world.start_operator()
        got = await wait_for(world, lambda r: autotune_status(r).get("history") and not autotune_status(r).get("rollout")
                             and r, timeout=40)
        at = autotune_status(got)
        assert [h["action"] for h in at["history"]] == ["Kept"]
        assert len(at["restarts"]) == 1  # one change, not restarted twice
        # 2 initial pods + 2 pods of the single rollout; a duplicate restart would create more
        assert world.kubelet.pods_created == 4, (created_at_kill, world.kubelet.pods_created)


async def test_two_operators_only_one_acts(workload):
    world = _world(workload)
    async with world.run():
        await world.cluster.create("/apis/kopf.dev/v1/clusterkopfpeerings",
                                   {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                    "metadata": {"name": "moe-eplb"}})
        await world.start_operator(standalone=False, priority=100)
        await world.start_operator(standalone=False, priority=50)
        await world.apply(resource(mode="Recommend"))
        actors = set()

        def check(r):
            ev = autotune_status(r).get("lastEvaluation") or {}
            if ev.get("evaluatedBy"):
                actors.add((ev["evaluatedBy"], ev["time"]))
            return len(actors) >= 3

        await wait_for(world, check, timeout=30, interval=0.05)
        assert len({a for a, _ in actors}) == 1, actors


async def test_user_edit_during_rollout_wins(workload):
    world = _world(workload)
    async with world.run():
        await world.start_operator()
        await world.apply(resource())
        await wait_for(world, lambda r: (autotune_status(r).get("rollout") or {}).get("phase") in ("Rolling", "Observing"),
                       timeout=30)
        user = {"windowSize": 2000, "stepInterval": 4000, "numRedundantExperts": 4}
        await world.cluster.patch(world.cluster.moeinference_path(NS, NAME),
                                  {"spec": {"eplb": user, "autotune": {"cooldownSeconds": 100000}}})
        got = await wait_for(world, lambda r: any(h.get("action") == "Superseded"
                                                  for h in autotune_status(r).get("history") or []) and r, timeout=30)
        assert "override" not in autotune_status(got)
        got = await wait_for(world, lambda r: (r.get("status") or {}).get("eplb", {}).get("windowSize") == 2000 and r,
                             timeout=20)
        await wait_for(world, lambda r: _running_settings(world) == {(2000, 4000, 4)}, timeout=30)
        dep = await deployment(world)
        assert '"window_size":2000' in " ".join(dep["spec"]["template"]["spec"]["containers"][0]["args"])
