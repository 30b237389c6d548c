"""``moe-eplb run`` as a process against the emulated API server, configured only through the
environment the Helm chart sets: liveness, metrics, JSON logs, a resource reconciled, and a clean
stop on SIGTERM."""

from __future__ import annotations

import pytest

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp

from moe_eplb_harness.floor.procs import free_port
from tests.controller.test_operator_loop import NS, example, observed

pytestmark = pytest.mark.integration  # `moe-eplb run` processes


async def http_get(url: str) -> tuple[int, str] | None:
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async with s.get(url) as resp:
                return resp.status, await resp.text()
    except aiohttp.ClientError:
        return None


def chart_env(emulated_cluster, health: int, metrics: int, pod: str, **extra: str) -> dict[str, str]:
    """What the chart's Deployment sets (peering on, no priority), pointed at the emulator."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_EPLB_") and k != "POD_ID"}
    return {**env, "MOE_EPLB_KUBECONFIG": emulated_cluster.kubeconfig, "MOE_EPLB_NAMESPACES": "", "MOE_EPLB_PEERING": "",
            "MOE_EPLB_PROMETHEUS_URL": "", "MOE_EPLB_HEALTH_PORT": str(health), "MOE_EPLB_METRICS_PORT": str(metrics),
            "MOE_EPLB_LOG_LEVEL": "INFO", "MOE_EPLB_LOG_FORMAT": "json", "POD_NAME": pod,
            "POD_NAMESPACE": "moe-system", **extra}


def json_logs(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reconciles(metrics_text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith("moe_eplb_reconciles_total{"))


async def test_run_command_serves_liveness_metrics_and_reconciles(emulated_cluster, eventually, tmp_path):
    health, metrics = free_port(), free_port()
    env = chart_env(emulated_cluster, health, metrics, "moe-eplb-0", MOE_EPLB_PEERING="")  # '' = standalone
    log_path = tmp_path / "operator.log"
    proc = subprocess.Popen([sys.executable, "-m", "moe_eplb", "run"], stdout=subprocess.DEVNULL,
                            stderr=open(log_path, "w"), env=env)
    try:
        await eventually(lambda: http_get(f"http://127.0.0.1:{health}/healthz"), timeout=30)
        await emulated_cluster.create(emulated_cluster.moeinference_path(NS), example())
        await eventually(lambda: observed(emulated_cluster, "qwen3-vl-30b", 1), timeout=20)
        status, text = await eventually(lambda: http_get(f"http://127.0.0.1:{metrics}/metrics"))
        assert status == 200
        assert 'moe_eplb_reconciles_total{result="ok"}' in text
        assert "moe_eplb_reconciles_created" not in text and "_created{" not in text  # no *_created series
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
        assert rc == 0, log_path.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = json_logs(log_path)
    assert lines and all({"message", "severity", "timestamp"} <= rec.keys() for rec in lines)
    start = next(rec["message"] for rec in lines if rec["message"].startswith("moe-eplb operator:"))
    assert "all namespaces" in start and "off (standalone)" in start and "pods read directly" in start
    assert not any("peering" in rec["message"].lower() and rec["severity"] in ("warn", "error") for rec in lines)


async def test_two_replicas_with_the_charts_env_elect_one(emulated_cluster, eventually, tmp_path):
    """Two ``moe-eplb run`` processes with the chart's environment (peering on, no priority given):
    each draws its own priority (by seniority), the peering is required, so the newer never resumes,
    and exactly one reconciles. (With a shared
    priority kopf 1.45 would pause both.)"""
    await emulated_cluster.create("/apis/kopf.dev/v1/clusterkopfpeerings", {"metadata": {"name": "moe-eplb"}})
    procs, ports, logs = {}, {}, {}
    try:
        for pod in ("moe-eplb-a", "moe-eplb-b"):
            health, metrics = free_port(), free_port()
            ports[pod], logs[pod] = (health, metrics), tmp_path / f"{pod}.log"
            procs[pod] = subprocess.Popen(
                [sys.executable, "-m", "moe_eplb", "run"], stdout=subprocess.DEVNULL, stderr=open(logs[pod], "w"),
                env=chart_env(emulated_cluster, health, metrics, pod, MOE_EPLB_PEERING="moe-eplb"))
        for health, _ in ports.values():
            await eventually(lambda h=health: http_get(f"http://127.0.0.1:{h}/healthz"), timeout=30)

        async def both_registered():
            peers = (await emulated_cluster.get("/apis/kopf.dev/v1/clusterkopfpeerings/moe-eplb")).get("status") or {}
            return peers if set(peers) == set(procs) else None

        peers = await eventually(both_registered, timeout=20)
        priorities = {pod: peers[pod]["priority"] for pod in procs}
        assert len(set(priorities.values())) == 2, priorities
        leader = max(priorities, key=priorities.get)
        standby = min(priorities, key=priorities.get)
        # required peering (the chart names it): both start paused; only the leader ever resumes
        await eventually(lambda: any("Resuming operations" in r["message"] for r in json_logs(logs[leader])),
                         timeout=20)

        await emulated_cluster.create(emulated_cluster.moeinference_path(NS), example())
        await eventually(lambda: observed(emulated_cluster, "qwen3-vl-30b", 1), timeout=20)
        await asyncio.sleep(1.0)  # room for a (wrong) second actor to reconcile too
        counts = {}
        for pod, (_, metrics) in ports.items():
            status, text = await eventually(lambda m=metrics: http_get(f"http://127.0.0.1:{m}/metrics"))
            counts[pod] = reconciles(text)
        assert counts[leader] >= 1 and counts[standby] == 0, (priorities, counts)
        assert not any("Pausing" in r["message"] for r in json_logs(logs[leader]))
        assert not any("Resuming operations" in r["message"] for r in json_logs(logs[standby]))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
