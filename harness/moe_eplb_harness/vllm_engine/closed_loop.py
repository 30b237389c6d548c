"""The closed autotune loop with ONE REAL vLLM engine as the pod ("vLLM on CPU with the test bridge").

    PYTHONPATH=operator:harness python -m moe_eplb_harness.vllm_engine.closed_loop [--workdir DIR] [--keep] [--timeout S]

(run by ``make demo-vllm-cpu`` -> ``scripts/demo_vllm_cpu.sh``). What runs, all on loopback:

* the simulated cluster of ``moe-eplb demo`` (:class:`moe_eplb_harness.cluster.world.SimWorld`: the emulated
  Kubernetes API, the fake kubelet, a real Prometheus scraping the pods' exporter ports with the
  labels a PodMonitor adds, and the real operator with the autotune loop) on the REAL clock
  (scale 1.0);
* but the fake kubelet's engine for the one pod is a real ``vllm serve`` (vLLM 0.32.0's CPU wheel,
  TP 2 = EP 2, sync EPLB, the tiny Qwen3-MoE built locally, the exporter plugin inside it and the
  test-only CPU EPLB bridge): :class:`RealPodEngine`, built by the kubelet's engine-factory hook
  from the pod spec the operator rendered -- the container's args as rendered, with the CPU
  adaptations of :mod:`moe_eplb_harness.vllm_engine.harness` (launcher, local model path, loopback ports,
  bridge plugin); so a tuner change that rolls the Deployment stops this engine and starts a new
  one with the new ``--eplb-config``;
* a load generator (:class:`LoadGenerator`) sending completions with 4 in flight, all the time,
  to whichever engine is ready (a real engine runs no steps when idle, and EPLB counts steps).

The loop then does what it does on a cluster (docs/autotune.md): evaluate (read the load from
Prometheus, calibrate the cost model on the engine's telemetry, tune) -> ``Apply`` -> roll the pod
(the real engine restarts with the new settings) -> observe -> measure the new engine's
balancedness from its real counters -> keep or roll back. The run ends when the first applied
change is judged (and, if rolled back, the old settings are serving again), or fails at
``--timeout`` (default 600 s) saying where it was stuck.

Why these settings (:func:`resource`). The engine starts with the real-engine tier's settings
(window 16, interval 32, 2 redundant experts: chosen there to make vLLM rearrange many times in a
short test). On two CPU cores this engine runs ~150-200 steps/s, so it rearranges ~5 times a
second, and each sync rearrangement stalls it ~10 ms; the loop's calibration measures that stall
from the exporter's rearrangement histogram and the tuner predicts that rearranging far less often
pays. Nothing is faked: the decision, the new settings, the measured balancedness and the verdict
are whatever the loop computes from this engine's counters. Autotune: ``Apply``, evaluation every
30 s and observe 30 s (CRD minimums: 10 and 0), ``minGain`` 0.5 % (the restart cost, 300 s over a
6 h horizon = 1.4 %, is added by the tuner), cooldown 1 h (one change per run), bounds around the
tuner's ladder, the tiny model's true expert size (3 x 128 x 64 float32 = 96 KiB per layer) and a
16 MiB budget. The runtime (not the spec): a 1 s tick, 5 s buckets over the last 300 s, Prometheus
scraping every 1 s, and the operator's own 2000-step minimum (~10-15 s of this load).

Prints progress, then as its LAST line one JSON object (:func:`summary`): ``engine``,
``vllm_version``, ``resource``, ``start`` (the knobs it started with), ``decisions`` (every
evaluation: ``at_s``, ``decision``, ``recommended``, ``predicted_gain``, ``reason``),
``applied_change`` (``from``/``to`` knobs, ``at_s``, ``predicted_gain``, ``outcome`` Kept or
RolledBack, ``reason``, ``balancedness_before`` -- the baseline the judge measured before the
change -- and ``balancedness_after`` -- measured on the new engine --, ``measured_gain``),
``engines`` (each engine started: its ``--eplb-config``, its exporter's ``moe_eplb_config_info``,
seconds to ready, requests served), ``engine_restarts``, ``requests``, ``completed``, ``error``,
``wall_seconds``. Exit 0 when the change was judged, 1 otherwise (the JSON line is printed either
way), 2 when the CPU wheel or Prometheus is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from moe_eplb.api.convert import from_crd, to_crd
from moe_eplb.api.knobs import Knobs

from . import harness
from . import tiny_model as tm

NAME = "tiny-loop"
NAMESPACE = harness.NAMESPACE
START = {"windowSize": harness.WINDOW, "stepInterval": harness.INTERVAL, "numRedundantExperts": harness.REDUNDANT}
#: bytes of one expert of one MoE layer of the tiny model: gate, up and down projections, float32
BYTES_PER_EXPERT = 3 * tm.HIDDEN * tm.config_dict()["moe_intermediate_size"] * 4
AUTOTUNE: dict[str, Any] = {
    "mode": "Apply",
    "bounds": {"windowSize": {"min": 16, "max": 4000}, "stepInterval": {"min": 32, "max": 8000},
               "numRedundantExperts": {"min": 0, "max": 4}},
    "memoryBudgetPerGpu": "16Mi",
    "evaluationIntervalSeconds": 30,
    "cooldownSeconds": 3600,
    "maxRestartsPerDay": 4,
    "minGain": 0.005,
    "rollbackTolerance": 0.02,
    "observeSeconds": 30,
}
#: the autotune runtime (clock seconds = wall seconds here)
TICK_SECONDS, BUCKET_SECONDS, LOOKBACK_SECONDS, SCRAPE_SECONDS = 1.0, 5.0, 300.0, 1.0
CONCURRENCY = 4


def resource(prometheus_url: str, **autotune: Any) -> dict:
    """The MoEInference of the loop: the tier's "full" resource (TP 2 = EP 2, sync EPLB, CPU
    settings in ``spec.engine``) with autotune ``Apply`` and the world's Prometheus."""
    res = harness.manifest("full")
    res["metadata"]["name"] = NAME
    spec = res["spec"]
    spec["model"]["moe"]["bytesPerExpert"] = BYTES_PER_EXPERT
    spec["eplb"].update(START)
    spec["autotune"] = {**copy.deepcopy(AUTOTUNE), **autotune}
    spec["rollout"] = {"maxSurge": 0, "maxUnavailable": 1}  # one engine at a time on this machine
    # the world's Prometheus scrapes the pods itself (file_sd, the PodMonitor's labels): no PodMonitor
    spec["monitoring"] = {"prometheusUrl": prometheus_url, "podMonitor": {"enabled": False}}
    return res


def _eplb_knobs(cfg: dict) -> dict:
    """The knobs of a rendered ``--eplb-config`` (which carries more keys, e.g. ``use_async``)."""
    return Knobs(cfg["window_size"], cfg["step_interval"], cfg["num_redundant_experts"]).to_dict()


class RealPodEngine:
    """The engine the fake kubelet runs for one pod: a real ``vllm serve`` started from the pod
    spec's ``vllm`` container (rendered by the operator) with the harness's CPU adaptations.

    The kubelet's engine interface: ``start()`` launches the process and returns at once (readiness
    is polled in a thread), ``ready`` (``/health`` answered and the process alive), ``ports`` (the
    exporter's port: the pod's ``eplb-metrics`` port), ``stop()`` (SIGTERM, then the process group)."""

    def __init__(self, request: Any, model_dir: str, bridge_dir: str, workdir: str, index: int) -> None:
        containers = [c for c in request.pod_spec.get("containers") or [] if c.get("name") == "vllm"]
        if len(containers) != 1:
            raise ValueError("the pod spec has no `vllm` container")
        self.request, self.index = request, index
        self.settings = request.settings
        self.rendered = harness.Rendered(container=containers[0], pod_labels={}, namespace=request.namespace,
                                         pod_monitor=None, yaml_text="")
        self.engine = harness.Engine(self.rendered, model_dir, bridge_dir, workdir)
        self.ports = [self.engine.exporter_port]
        self.eplb_config = self.rendered.eplb_config()
        self.created = time.time()
        self.ready_at: float | None = None
        self.stopped_at: float | None = None
        self.failed: str | None = None
        self.config_info: dict | None = None  # the exporter's moe_eplb_config_info labels
        self.requests = 0
        self._stopping = False
        self._wait: asyncio.Future | None = None

    @property
    def ready(self) -> bool:
        proc = self.engine.proc
        return self.ready_at is not None and not self._stopping and proc is not None and proc.poll() is None

    async def start(self) -> None:
        self.engine.launch()
        self._wait = asyncio.ensure_future(asyncio.to_thread(self._wait_ready))

    def _wait_ready(self) -> None:
        try:
            self.engine.wait_ready(harness.START_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - reported by the driver, the pod stays unready
            if not self._stopping:
                self.failed = f"{type(exc).__name__}: {exc}"
            return
        self.ready_at = time.time()

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.to_thread(self.engine.stop)
        if self._wait is not None:
            with contextlib.suppress(Exception):
                await self._wait
        self.stopped_at = self.stopped_at or time.time()

    def read_config_info(self) -> dict | None:
        """The labels of the exporter's ``moe_eplb_config_info`` (None until it exports it)."""
        from moe_eplb.contracts import metric_names as mn

        try:
            got = harness.Samples(self.engine.exporter_text()).select(mn.CONFIG_INFO)
        except OSError:
            return None
        if len(got) == 1:
            self.config_info = got[0][0]
        return self.config_info

    def vllm_parsed(self) -> bool:
        """vLLM's "non-default args" log line carries this engine's EPLB config."""
        c = self.eplb_config
        try:
            return (f"EPLBConfig(window_size={c['window_size']}, step_interval={c['step_interval']}, "
                    f"num_redundant_experts={c['num_redundant_experts']}") in self.engine.log()
        except OSError:
            return False

    def record(self, t0: float) -> dict:
        return {"eplb_config": _eplb_knobs(self.eplb_config), "use_async": self.eplb_config.get("use_async"),
                "vllm_parsed_eplb_config": self.vllm_parsed(),
                "config_info": ({k: v for k, v in self.config_info.items() if k != "model_name"}
                                if self.config_info else None),
                "started_at_s": round(self.created - t0, 1),
                "ready_seconds": round(self.ready_at - self.created, 1) if self.ready_at else None,
                "stopped_at_s": round(self.stopped_at - t0, 1) if self.stopped_at else None,
                "requests": self.requests, "failed": self.failed, "log": self.engine.log_path}


class RealEngineFactory:
    """The kubelet's engine factory: one :class:`RealPodEngine` per pod it starts, all kept."""

    def __init__(self, model_dir: str, bridge_dir: str, workdir: str) -> None:
        self.model_dir, self.bridge_dir, self.workdir = model_dir, bridge_dir, workdir
        self.engines: list[RealPodEngine] = []

    def __call__(self, request: Any) -> RealPodEngine:
        if request.pods != 1:
            raise ValueError("the real-engine demo runs single-node pods only")
        n = len(self.engines)
        engine = RealPodEngine(request, self.model_dir, self.bridge_dir, os.path.join(self.workdir, f"engine-{n}"), n)
        self.engines.append(engine)
        return engine

    def current(self) -> RealPodEngine | None:
        ready = [e for e in self.engines if e.ready]
        return ready[-1] if ready else None

    async def stop_all(self) -> None:
        for e in self.engines:
            if e.engine.proc is not None:
                await e.stop()


@dataclass
class LoadGenerator:
    """Completions with ``concurrency`` in flight, all the time, to the engine that is ready now;
    requests to an engine being stopped fail and are retried on the next one."""

    factory: RealEngineFactory
    concurrency: int = CONCURRENCY
    ok: int = 0
    failed: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for k in range(self.concurrency):
            t = threading.Thread(target=self._run, args=(k,), name=f"load-{k}", daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self, k: int) -> None:
        counter = itertools.count(k)
        while not self._stop.is_set():
            engine = self.factory.current()
            if engine is None:
                self._stop.wait(0.2)
                continue
            i = next(counter)
            try:
                engine.engine.complete(harness.PROMPTS[(3 * i) % len(harness.PROMPTS)], 16 + 8 * (i % 4), timeout=60)
            except Exception:  # noqa: BLE001 - the engine went away (a roll): try the next one
                with self._lock:
                    self.failed += 1
                self._stop.wait(0.2)
                continue
            with self._lock:
                self.ok += 1
                engine.requests += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=70)


@dataclass
class LoopResult:
    summary: dict
    final: dict | None  # the MoEInference at the end
    engines: list[RealPodEngine]


def log(msg: str, t0: float | None = None) -> None:
    stamp = time.strftime("%H:%M:%S") if t0 is None else f"{time.time() - t0:6.1f}s"
    print(f"[loop {stamp}] {msg}", flush=True)


def _kn(x: dict | None) -> str:
    """``W/I/R`` of the status' knobs (camelCase), ``-`` when absent."""
    return from_crd(Knobs, x).label if x else "-"


def _snake(x: dict | None) -> dict | None:
    """The status' knobs (camelCase) as the summary's snake_case mapping."""
    return from_crd(Knobs, x).to_dict() if x else None


async def run_loop(workdir: str, *, timeout: float = 600.0, autotune: dict | None = None,
                   echo=print) -> LoopResult:
    """Run the loop until the first applied change is judged (see the module doc); raises
    TimeoutError (with where it was) after ``timeout`` seconds."""
    import vllm

    from moe_eplb_harness.cluster.world import SimWorld

    logging.getLogger("kopf").setLevel(logging.ERROR)
    logging.getLogger("aiohttp").setLevel(logging.ERROR)
    t0 = time.time()
    model = tm.build_tiny_moe(os.path.join(workdir, "tiny-qwen3-moe"))
    bridge = harness.bridge_site(os.path.join(workdir, "bridge-site"))
    factory = RealEngineFactory(model, bridge, workdir)
    decisions: list[dict] = []

    def observer(kind: str, res: Any, record: Any) -> None:
        payload = to_crd(record)
        at = round(time.time() - t0, 1)
        if kind == "evaluation":
            gain = payload.get("predictedGain")
            decisions.append({"at_s": at, "decision": payload.get("decision"), "current": _snake(payload.get("current")),
                              "recommended": _snake(payload.get("recommended")), "predicted_gain": gain,
                              "reason": payload.get("reason", "")})
            g = f"{100 * gain:+.2f}%" if isinstance(gain, (int, float)) else "-"
            echo(f"[loop {at:6.1f}s] evaluation: {payload.get('decision')} (best {_kn(payload.get('recommended'))}, "
                 f"predicted gain {g}): {payload.get('reason', '')}")
        elif kind == "rollout":
            echo(f"[loop {at:6.1f}s] rollout {payload.get('kind')} -> {payload.get('phase')}")
        elif kind == "history":
            echo(f"[loop {at:6.1f}s] {payload.get('action')}: {payload.get('reason', '')}")

    world = SimWorld(workload={}, scale=1.0, prometheus=True, scrape_interval=SCRAPE_SECONDS,
                     tick_seconds=TICK_SECONDS, lookback_seconds=LOOKBACK_SECONDS, bucket_seconds=BUCKET_SECONDS,
                     min_steps=2000, observer=observer, http_timeout=10.0, kubelet_poll=0.5,
                     engine_factory=factory)
    load = LoadGenerator(factory)
    final = None
    error = None
    judged = None
    try:
        async with world.run():
            await world.start_operator()
            res = resource(world.prometheus_url, **(autotune or {}))
            await world.apply(res)
            echo(f"[loop {time.time() - t0:6.1f}s] MoEInference {NAMESPACE}/{NAME} applied: TP 2 = EP 2, sync EPLB, "
                 f"start {_kn(START)}, autotune Apply every {res['spec']['autotune']['evaluationIntervalSeconds']} s, "
                 f"observe {res['spec']['autotune']['observeSeconds']} s; Prometheus {world.prometheus_url}")
            load.start()
            seen_ready: set[int] = set()
            deadline = t0 + timeout
            while True:
                await asyncio.sleep(1.0)
                for e in factory.engines:
                    if e.failed:
                        raise RuntimeError(f"engine {e.index} ({_eplb_knobs(e.eplb_config)}) failed: {e.failed}")
                    if e.ready and e.index not in seen_ready:
                        seen_ready.add(e.index)
                        echo(f"[loop {time.time() - t0:6.1f}s] engine {e.index} ready in {e.ready_at - e.created:.1f} s "
                             f"({harness.LABEL}): --eplb-config {json.dumps(_eplb_knobs(e.eplb_config))}; "
                             f"log {e.engine.log_path}")
                    if e.ready and e.config_info is None:
                        await asyncio.to_thread(e.read_config_info)
                final = await world.get(NAME, NAMESPACE)
                at = (final.get("status") or {}).get("autotune") or {}
                judged = next((h for h in at.get("history") or [] if h.get("action") in ("Kept", "RolledBack")), None)
                current = factory.current()
                if judged is not None and at.get("rollout") is None and current is not None \
                        and current.config_info is not None:
                    break
                if time.time() > deadline:
                    where = (f"rollout {at['rollout'].get('phase')}" if at.get("rollout") else
                             f"last evaluation {(at.get('lastEvaluation') or {}).get('decision')}: "
                             f"{(at.get('lastEvaluation') or {}).get('reason')}")
                    raise TimeoutError(f"no applied change judged within {timeout:.0f} s ({where}; "
                                       f"{len(factory.engines)} engine(s) started)")
            final = await world.get(NAME, NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - reported in the summary; the caller decides
        error = f"{type(exc).__name__}: {exc}"
    finally:
        load.stop()
        await factory.stop_all()
    summary = build_summary(t0, final, decisions, factory, load, judged, error, vllm.__version__)
    return LoopResult(summary, final, factory.engines)


def build_summary(t0: float, final: dict | None, decisions: list[dict], factory: RealEngineFactory,
                  load: LoadGenerator, judged: dict | None, error: str | None, vllm_version: str) -> dict:
    from moe_eplb.api.autotune_status import parse_iso

    change = None
    if judged is not None:
        base, meas = judged.get("baseline") or {}, judged.get("measured") or {}
        before, after = base.get("balancedness"), meas.get("balancedness")
        started = parse_iso(judged.get("startedAt")) if judged.get("startedAt") else None
        change = {"from": _snake(judged.get("from")), "to": _snake(judged.get("to")),
                  "at_s": round(started - t0, 1) if started is not None else None,
                  "predicted_gain": judged.get("predictedGain"), "outcome": judged.get("action"),
                  "reason": judged.get("reason", ""),
                  "balancedness_before": before, "balancedness_after": after,
                  "measured_gain": round(after / before - 1.0, 6) if before and after is not None else None,
                  "tokens_per_second_before": base.get("tokensPerSecond"),
                  "tokens_per_second_after": meas.get("tokensPerSecond")}
    return {
        "engine": f"vllm-cpu ({harness.LABEL})", "vllm_version": vllm_version, "resource": f"{NAMESPACE}/{NAME}",
        "start": _snake(START), "decisions": decisions, "applied_change": change,
        "engines": [e.record(t0) for e in factory.engines],
        "engine_restarts": max(0, len(factory.engines) - 1),
        "requests": {"ok": load.ok, "failed": load.failed},
        "completed": error is None and change is not None, "error": error,
        "wall_seconds": round(time.time() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the closed autotune loop with one real vLLM engine (CPU) as the pod")
    ap.add_argument("--workdir", help="where to put the model, engine logs, Prometheus data (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds (default 600)")
    args = ap.parse_args(argv)
    problem = harness.cpu_wheel_problem()
    if problem:
        print(f"demo-vllm-cpu: {problem}", file=sys.stderr)
        return 2
    from moe_eplb_harness.floor.prometheus import find_prometheus

    found = find_prometheus()
    if found.server is None:
        print(f"demo-vllm-cpu: {found.problem}", file=sys.stderr)
        return 2
    work = args.workdir or tempfile.mkdtemp(prefix="demo-vllm-cpu-")
    os.makedirs(work, exist_ok=True)
    log(f"the closed autotune loop on one REAL vLLM engine ({harness.LABEL}); work dir {work}")
    try:
        result = asyncio.run(run_loop(work, timeout=args.timeout))
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    s = result.summary
    if s["error"]:
        log(f"FAILED: {s['error']}")
        for e in result.engines:
            log(f"engine {e.index} log: {e.engine.log_path}" + ("" if args.keep or args.workdir else " (removed)"))
    c = s["applied_change"]
    if c:
        log(f"applied {_kn_snake(c['from'])} -> {_kn_snake(c['to'])} (predicted {_pct(c['predicted_gain'])}); "
            f"measured balancedness {_num(c['balancedness_before'])} -> {_num(c['balancedness_after'])}: {c['outcome']}")
    log(f"{len(s['decisions'])} evaluation(s), {s['engine_restarts']} engine restart(s), "
        f"{s['requests']['ok']} requests served, {s['wall_seconds']:.0f} s wall")
    print(json.dumps(s), flush=True)
    return 0 if s["completed"] else 1


def _kn_snake(x: dict | None) -> str:
    return Knobs(**x).label if x else "-"


def _pct(x: Any) -> str:
    return f"{100 * x:+.2f}%" if isinstance(x, (int, float)) else "-"


def _num(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else "-"


if __name__ == "__main__":
    sys.exit(main())
