"""Advice that deploys, on a REAL vLLM engine (vLLM 0.32 on CPU with the test bridge): an image whose
vLLM the exporter does not support is refused with the advice ``spec.engine.exporter.inject: false``;
the advice applied, the rendered pod is a stock engine's -- its startup, readiness and liveness probes
on vLLM's own ``/health`` of the API port, no preStop hook, and vLLM's graceful shutdown
(``--shutdown-timeout drainSeconds``) as the whole drain -- and that pod spec runs: the engine
started from the rendered args answers every probe as rendered, and a request in flight when
SIGTERM comes (as the kubelet sends it, with no hook before) completes within the rendered
``terminationGracePeriodSeconds``.

The manifest asks for vLLM 0.35 (``vllm/vllm-openai:v0.35.0``: past the exporter's range); the engine
that runs the rendered args is the 0.32 CPU wheel (the only one that runs here): the arguments the
operator renders are the same for both (tests/launch_logic checks them against 0.32-0.34's code).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from moe_eplb.api.problem import apply_fix
from moe_eplb.api.validation import validate
from moe_eplb_harness.vllm_engine import harness

from .conftest import record_time

pytestmark = [pytest.mark.vllm_engine, pytest.mark.integration]

LONG = 200  # tokens of the request in flight at SIGTERM


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_the_stock_engines_pod_runs_on_a_real_engine(cpu_wheel, tiny_model, bridge_dir, engine_root):
    resource = harness.manifest("full")
    resource["metadata"]["name"] = "tiny-stock"
    resource["spec"]["engine"]["image"] = "vllm/vllm-openai:v0.35.0"
    resource["spec"]["engine"]["drainSeconds"] = 120
    (refusal,) = validate(resource)
    assert refusal.field == "spec.engine.exporter.inject" and refusal.fix is not None, refusal
    fixed = apply_fix(resource, refusal.fix)
    assert fixed["spec"]["engine"]["exporter"]["inject"] is False and validate(fixed) == []

    work = os.path.join(engine_root, "stock")
    os.makedirs(work, exist_ok=True)
    rendered = harness.render(fixed, work)
    c = rendered.container
    probes = [c[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    assert probes == [{"path": "/health", "port": "http"}] * 3  # vLLM's own, on the API port
    assert "lifecycle" not in c and [p["name"] for p in c["ports"]] == ["http"]
    assert "VLLM_PLUGINS" not in rendered.env  # no exporter plugin named: vLLM's own plugin choice
    args = c["args"]
    assert args[args.index("--shutdown-timeout") + 1] == "120"
    grace = int(rendered.yaml_text.split("terminationGracePeriodSeconds: ")[1].split()[0])
    assert grace == 120 + 30

    engine = harness.Engine(rendered, tiny_model, bridge_dir, work, exporter=False)
    try:
        engine.start()
        record_time("stock engine: start until /health (s)", engine.ready_seconds)
        health = f"http://127.0.0.1:{engine.api_port}{probes[1]['path']}"  # the probes' port `http` -> the API port
        assert _status(health) == 200
        assert engine.complete("warm up", 4)["usage"]["completion_tokens"] == 4

        result: dict = {}
        flight = threading.Thread(target=lambda: result.update(engine.complete("a long story", LONG, timeout=300)))
        flight.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "vllm:num_requests_running" not in _running(engine):
            time.sleep(0.05)
        proc = engine.proc
        assert proc is not None
        term_at = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # no preStop: the kubelet's SIGTERM right away
        code = proc.wait(timeout=grace)
        record_time("stock engine: SIGTERM until exit (s)", time.monotonic() - term_at)
        flight.join(60)
        assert result.get("usage", {}).get("completion_tokens") == LONG, (result, engine.tail())
        assert code == 0, engine.tail()
    finally:
        engine.stop()


def _running(engine: harness.Engine) -> str:
    """vLLM's ``/metrics`` lines of requests running, where one is (else "")."""
    try:
        text = engine.vllm_metrics_text()
    except OSError:
        return ""
    return "\n".join(ln for ln in text.splitlines()
                     if ln.startswith("vllm:num_requests_running") and not ln.rstrip().endswith(" 0.0"))
