"""A planned stop of a REAL vLLM engine loses no request: the rendered ``preStop`` drain, then SIGTERM
as the kubelet sends it, with the rendered ``--shutdown-timeout`` (vLLM on CPU with the test bridge).

The engine runs the args and env ``moe-eplb render`` gives the "full" MoEInference of
:func:`moe_eplb_harness.vllm_engine.harness.manifest` (its adaptations listed there); the pod's hooks are
played as the kubelet plays them: the ``preStop`` is the rendered ``exec`` (``python3 -m
moe_eplb.exporter.drain``, run with the container's env and interpreter, as the kubelet runs it inside
the container: it posts the drain to the exporter on loopback), started while long generations run
(traffic until the pod turns unready); SIGTERM goes
to the engine's main process once the hook returned;
the process gets ``terminationGracePeriodSeconds`` (minus what the hook took) to exit. Also checked:
the pod turns unready while it drains (``readinessProbe``), stays live (``livenessProbe``), and a
request that still arrives after the drain (a straggler) is finished by vLLM's own graceful shutdown.
Before that, the liveness probe's stuck check on the same engine: a worker frozen mid-generation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from moe_eplb.contracts import k8s_names
from moe_eplb.exporter.health import pid_alive, read_beats
from moe_eplb_harness.vllm_engine import harness

from .conftest import record_time

pytestmark = [pytest.mark.vllm_engine, pytest.mark.integration]

LONG = 440  # tokens of the long generation (max_model_len 512)


def _get(url: str, timeout: float = 600.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _run_hook(engine: harness.Engine, hook: dict) -> tuple[int, str]:
    """The rendered ``exec`` preStop, run with the engine container's env (what the kubelet does):
    (exit status, its output)."""
    out = subprocess.run(engine.hook_command(hook["exec"]["command"]), env=engine.env(), capture_output=True,
                         text=True, timeout=600)
    return out.returncode, out.stdout + out.stderr


def _probe_url(engine: harness.Engine, probe: dict) -> str:
    get = probe["httpGet"]
    assert get["port"] == k8s_names.EXPORTER_PORT_NAME  # the exporter's port: mapped to the test's port
    return f"http://127.0.0.1:{engine.exporter_port}{get['path']}"


class Timed:
    """A call in a thread, with when it ended (monotonic) and its result or error."""

    def __init__(self, fn, *args) -> None:
        self.result, self.error, self.ended = None, None, None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self.thread.start()

    def _run(self, fn, *args) -> None:
        try:
            self.result = fn(*args)
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
        self.ended = time.monotonic()

    def join(self, timeout: float) -> Timed:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running"
        return self


class Streamed:
    """A streamed completion in a thread: ``first`` is set when its first token arrives (so it is in
    flight for sure, whatever vLLM's gauges say yet), ``usage`` is the final chunk's token count."""

    def __init__(self, engine: harness.Engine, prompt: str, max_tokens: int) -> None:
        self.first = threading.Event()
        self.usage, self.error, self.ended = None, None, None
        body = {"model": engine.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        self._req = urllib.request.Request(f"{engine.url}/v1/completions", data=json.dumps(body).encode(),
                                           headers={"Content-Type": "application/json"})
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def result(self) -> dict | None:
        """The completion's final usage, shaped as a non-streamed response's (``{"usage": ...}``)."""
        return None if self.usage is None else {"usage": self.usage}

    def join(self, timeout: float) -> Streamed:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running"
        return self

    def in_flight(self, timeout: float = 60.0) -> Streamed:
        """Until its first token came (it is in flight for sure); fails if it never came or the
        request already ended (too short a generation for this machine's speed)."""
        assert self.first.wait(timeout), "the first token never came"
        assert self.ended is None, f"the request ended before the test could act on it: {self.error or self.usage}"
        return self

    def _run(self) -> None:
        try:
            with urllib.request.urlopen(self._req, timeout=300) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if chunk.get("choices"):
                        self.first.set()
                    if chunk.get("usage"):
                        self.usage = chunk["usage"]
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
        self.ended = time.monotonic()
        self.first.set()


@pytest.fixture(scope="module")
def pod(cpu_wheel, tiny_model, bridge_dir, engine_root):
    """One engine for the module, started from the rendered args and env; the liveness check's stuck
    limit cut to 3 s (a forward here takes milliseconds) and the drain's minimum to 0.5 s (a cluster
    waits 5 s for the endpoints first)."""
    work = os.path.join(engine_root, "drain")
    os.makedirs(work, exist_ok=True)
    rendered = harness.render(harness.manifest("full"), work)
    engine = harness.Engine(rendered, tiny_model, bridge_dir, work,
                            extra_env={"MOE_EPLB_DRAIN_MIN_SECONDS": "0.5", "MOE_EPLB_STUCK_SECONDS": "3"})
    try:
        engine.start()
        record_time("drain engine: start until /health (s)", engine.ready_seconds)
        engine.complete("warm up", 4)
        yield engine
    finally:
        engine.stop()


def _wait_probe(url: str, status: int, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = _get(url, 10)
        if last[0] == status:
            return last[1]
        time.sleep(0.2)
    raise AssertionError(f"{url} never answered {status} (last: {last})")


def test_a_stuck_worker_fails_liveness_and_recovers(pod):
    """Each worker process keeps a heartbeat; freezing one worker (SIGSTOP) mid-generation leaves its
    tensor-parallel peer waiting inside a forward pass: ``/livez`` turns 503 naming a stuck worker,
    and once the worker runs again (SIGCONT) it is live again and the request completes."""
    c = pod.rendered.container
    live_url = _probe_url(pod, c["livenessProbe"])
    beats = read_beats(pod.exporter_dir)
    assert len(beats) == 2 and all(b.last_step > 0 and pid_alive(b.pid) for b in beats), beats  # TP 2: two workers
    assert _get(live_url, 10) == (200, "live\n")
    # streamed: its first token proves it is in flight (vLLM's running gauge missed a whole 440-token
    # request twice on a loaded 2-core machine, polled every 50 ms)
    long = Streamed(pod, "a story that is interrupted", LONG).in_flight()
    frozen = max(b.pid for b in beats)
    os.kill(frozen, signal.SIGSTOP)
    try:
        text = _wait_probe(live_url, 503, timeout=60)
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert "is stuck: a forward pass began" in text, text
    _wait_probe(live_url, 200, timeout=60)
    long.join(300)
    assert long.error is None, long.error
    assert long.result["usage"]["completion_tokens"] == LONG


def test_a_request_in_flight_when_the_pod_stops_completes(pod):
    """(Runs last: it stops the engine.)"""
    engine, rendered = pod, pod.rendered
    c = rendered.container
    args = c["args"]
    assert args[args.index("--shutdown-timeout") + 1] == "30"  # vLLM 0.32 has the flag
    assert rendered.env[k8s_names.DRAIN_SECONDS_ENV] == "600"
    grace = int(rendered.yaml_text.split("terminationGracePeriodSeconds: ")[1].split()[0])
    assert grace == 600 + 30 + 30
    ready_url, live_url = _probe_url(engine, c["readinessProbe"]), _probe_url(engine, c["livenessProbe"])
    hook_spec = c["lifecycle"]["preStop"]
    assert hook_spec == {"exec": {"command": list(k8s_names.DRAIN_COMMAND)}}
    assert _get(ready_url)[0] == 200 and _get(live_url)[0] == 200
    # a GET of the drain path (what a scraper or a curious curl sends) changes nothing
    assert _get(f"http://127.0.0.1:{engine.exporter_port}{k8s_names.EXPORTER_DRAIN_PATH}", 10)[0] == 405
    assert _get(ready_url)[0] == 200

    # traffic while the pod is ready, as a Service sends it: two long requests in flight, staggered
    # (one more whenever one ends), so that some request runs whenever the drain arrives. The hook is
    # a process of its own (python3 -m moe_eplb.exporter.drain): it posts the drain only once it has
    # started, which took seconds beside the busy engine here, longer than one request runs.
    traffic: list[Timed | Streamed] = [Streamed(engine, "a long story about a mixture of experts", LONG).in_flight()]
    hook_started = time.monotonic()
    hook = Timed(_run_hook, engine, hook_spec)  # the kubelet's preStop: exec, and wait for it
    deadline = time.monotonic() + 60
    ready_during = _get(ready_url, 10)
    while ready_during[0] == 200 and hook.ended is None and time.monotonic() < deadline:
        if sum(r.ended is None for r in traffic) < 2:
            traffic.append(Timed(engine.complete, f"story number {len(traffic)} about experts", LONG))
        time.sleep(0.1)
        ready_during = _get(ready_url, 10)
    unready_at = time.monotonic()
    live_during = _get(live_url, 10)
    for request in traffic:
        request.join(300)
    hook.join(120)
    hook_seconds = hook.ended - hook_started

    assert ready_during == (503, "draining\n") and live_during[0] == 200, (ready_during, hook.result)
    # every request completed with all its tokens; some were still running when the pod turned
    # unready, and the hook returned only after the last of them had ended
    assert all(r.error is None for r in traffic), [r.error for r in traffic]
    assert all(r.result["usage"]["completion_tokens"] == LONG for r in traffic)
    in_flight = [r for r in traffic if r.ended > unready_at]
    assert in_flight, [r.ended - hook_started for r in traffic]
    assert hook.result[0] == 0 and "moe-eplb preStop: drained: no request in flight" in hook.result[1], hook.result
    # The hook returns once vLLM counts no request running; the client's thread marks its end only
    # after the response has crossed the socket and been parsed, which can come a little later (50 ms
    # in one CI run). An early hook would return seconds before: 440 tokens were still to come.
    last = max(r.ended for r in in_flight)
    assert hook.ended >= last - 0.5, (hook.ended - hook_started, last - hook_started)
    record_time("drain engine: preStop hook (s)", hook_seconds)

    # a straggler (routed before the endpoints caught up), then SIGTERM as the kubelet sends it:
    # vLLM's --shutdown-timeout lets it finish before the process exits. As long as the first one, so
    # that it is still running when SIGTERM comes (64 tokens ended before the first poll in CI)
    # (streamed: its first token proves it is in flight; vLLM's running gauge once missed a 440-token
    # request entirely on a loaded CI machine)
    straggler = Streamed(engine, "one more", LONG).in_flight()
    proc = engine.proc
    assert proc is not None
    term_at = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=grace - hook_seconds)
    record_time("drain engine: SIGTERM until exit (s)", time.monotonic() - term_at)
    straggler.thread.join(60)
    assert not straggler.thread.is_alive(), "the straggler is still running"
    assert straggler.error is None, f"{straggler.error}; log tail:\n{engine.tail()}"
    assert straggler.usage is not None and straggler.usage["completion_tokens"] == LONG, straggler.usage
    assert code == 0, engine.tail()
    assert "EngineCore: draining in-flight requests count=1" in engine.log()  # vLLM 0.32's own words
