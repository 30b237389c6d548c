"""``moe-eplb run`` as a process against the emulated API server: liveness, metrics, a resource
reconciled, and a clean stop on SIGTERM."""

from __future__ import annotations

import pytest

pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
pytest.importorskip("kmock", reason="the test extra (kmock) is not installed")

import asyncio
import os
import signal
import socket
import subprocess
import sys

import aiohttp

from test_operator_loop import NS, example, observed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_get(url: str) -> tuple[int, str] | None:
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async with s.get(url) as resp:
                return resp.status, await resp.text()
    except aiohttp.ClientError:
        return None


async def test_run_command_serves_liveness_metrics_and_reconciles(kube, eventually, tmp_path):
    live, metrics = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_eplb", "run", "--kubeconfig", kube.kubeconfig, "--standalone",
         "--liveness", f"http://127.0.0.1:{live}/healthz", "--metrics-port", str(metrics)],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "operator.log", "w"), env={**os.environ})
    try:
        await eventually(lambda: http_get(f"http://127.0.0.1:{live}/healthz"), timeout=30)
        await kube.create(kube.moeinference_path(NS), example())
        await eventually(lambda: observed(kube, "qwen3-vl-30b", 1), timeout=20)
        status, text = await eventually(lambda: http_get(f"http://127.0.0.1:{metrics}/metrics"))
        assert status == 200
        assert 'moe_eplb_reconciles_total{result="ok"}' in text
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
        assert rc == 0, (tmp_path / "operator.log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
