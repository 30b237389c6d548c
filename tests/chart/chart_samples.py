"""Test support for tests/chart: the catalog of every metric the project exports (type + labels),
a small HTTP server that exposes all of them with changing sample values in Prometheus' classic
text format, and a real Prometheus server (``/usr/bin/prometheus``) scraping it on loopback.

The sample values are chosen so that the shipped alerts have something to find: one MoEInference
(``team-a/demo``) is badly balanced and was rolled back, one (``team-a/noexporter``) serves vLLM
metrics but no exporter metrics, one (``team-a/failing``) only ever fails to tune and one
(``team-a/stale``) has not tuned successfully for a long time, and one (``team-a/stalled``) keeps
stepping with EPLB on but never rearranges.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from moe_eplb.contracts import k8s_names, metric_names
from moe_eplb_harness.floor import prometheus
from moe_eplb_harness.floor.prometheus import RunningPrometheus
from scripts import vllm_metric_names as v
from tests.polling import wait_until

# --- catalog: every pinned moe-eplb metric, its type and its labels -------------------------------
# Names from metric_names.py; tests/chart/test_chart_promql.py checks that the names are exactly the
# pinned ones and that types and label names are exactly what the real exporter
# (moe_eplb.exporter.collector) and the operator's registry emit.
M, LAYER, EXPERT, RANK = metric_names.LABEL_MODEL, metric_names.LABEL_LAYER, metric_names.LABEL_EXPERT, metric_names.LABEL_RANK
EXPORTER_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    metric_names.EXPERT_TOKENS: ("counter", (M, LAYER, EXPERT)),
    metric_names.RANK_TOKENS: ("counter", (M, LAYER, RANK)),
    metric_names.EXPERT_REPLICAS: ("gauge", (M, LAYER, EXPERT)),
    metric_names.REARRANGEMENTS: ("counter", (M,)),
    metric_names.SETTINGS_WINDOW_SIZE: ("gauge", (M, RANK)),
    metric_names.SETTINGS_STEP_INTERVAL: ("gauge", (M, RANK)),
    metric_names.SETTINGS_SINCE_STEP: ("gauge", (M, RANK)),
    metric_names.REARRANGEMENT_SECONDS: ("histogram", (M,)),
    metric_names.ENGINE_STEPS: ("counter", (M,)),
    metric_names.STEP_SECONDS: ("histogram", (M, RANK)),
    metric_names.STEP_TOKENS: ("histogram", (M, RANK)),
    metric_names.KV_CACHE_BYTES: ("gauge", (M, RANK)),
    metric_names.BALANCEDNESS: ("gauge", (M, LAYER)),
    metric_names.CONFIG_INFO: ("gauge", (M, *metric_names.CONFIG_INFO_LABELS)),
    metric_names.EXPORTER_START_TIME: ("gauge", (M,)),
    metric_names.EXPORTER_RANKS: ("gauge", (M,)),
    metric_names.EXPORTER_GROUP_PODS: ("gauge", (M,)),
    metric_names.REBALANCE_FAILURES: ("counter", (M,)),
    metric_names.ASYNC_REARRANGEMENT_SECONDS: ("histogram", (M,)),
}
OPERATOR_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    metric_names.TUNER_EVALUATIONS: ("counter", ("namespace", "name", "result")),
    metric_names.TUNER_DECISIONS: ("counter", ("namespace", "name", "decision")),
    metric_names.TUNER_PREDICTED_GAIN: ("gauge", ("namespace", "name")),
    metric_names.TUNER_DURATION_SECONDS: ("histogram", ()),
    metric_names.TUNER_LAST_SUCCESS: ("gauge", ("namespace", "name")),
    metric_names.ROLLBACKS: ("counter", ("namespace", "name", "reason")),
    metric_names.RECONCILES: ("counter", ("result",)),
    metric_names.CALIBRATION_VALUE: ("gauge", ("namespace", "name", "parameter", "source")),
    metric_names.CALIBRATION_UNCERTAINTY: ("gauge", ("namespace", "name", "parameter")),
    metric_names.REPLICAS: ("gauge", ("namespace", "name", "state")),
    metric_names.AUTOSCALER_MIN_REPLICAS: ("gauge", ("namespace", "name")),
    metric_names.AUTOSCALER_MAX_REPLICAS: ("gauge", ("namespace", "name")),
    metric_names.AUTOSCALER_TARGET: ("gauge", ("namespace", "name", "metric")),
    metric_names.RECOVERY_PHASE: ("gauge", ("namespace", "name", "phase")),
    metric_names.RECOVERY_LOST_RANKS: ("gauge", ("namespace", "name")),
    metric_names.RECOVERY_ROUNDS: ("counter", ("namespace", "name", "instruction", "result")),
    metric_names.RECOVERY_ROUND_SECONDS: ("histogram", ("instruction", "result")),
    metric_names.RECOVERY_DEADLINE: ("gauge", ("namespace", "name", "group")),
    metric_names.ELASTIC_DATA_PARALLEL: ("gauge", ("namespace", "name")),
    metric_names.ELASTIC_TARGET_DATA_PARALLEL: ("gauge", ("namespace", "name")),
    metric_names.ELASTIC_PHASE: ("gauge", ("namespace", "name", "phase")),
    metric_names.ELASTIC_RESIZE_SECONDS: ("gauge", ("namespace", "name")),
    metric_names.ELASTIC_RESIZE_DEADLINE: ("gauge", ("namespace", "name")),
    metric_names.ELASTIC_RESIZES: ("counter", ("namespace", "name", "direction", "result")),
    metric_names.ELASTIC_RESIZE_DURATION: ("histogram", ("namespace", "name", "direction", "result")),
    metric_names.REPLICA_LOAD_DIVERGENCE: ("gauge", ("namespace", "name")),
}
#: Labels Prometheus adds at scrape time: the PodMonitor's (exporter and vLLM series; moeinference
#: from the pod label eplb.ai/name) and the ServiceMonitor's (operator series, honorLabels keeps the
#: tuner's own namespace).
SCRAPE_LABELS = frozenset({"namespace", "pod", "container", "endpoint", "job", "instance", "service",
                           metric_names.MOEINFERENCE_LABEL})
# Series Prometheus makes itself for every target.
PROMETHEUS_BUILTIN = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})


def _series(name: str, kind: str) -> tuple[str, ...]:
    if kind == "counter":
        return (name,) if name.endswith("_total") else (name + "_total",)
    if kind == "histogram":
        return (name + "_bucket", name + "_sum", name + "_count")
    return (name,)


def series_labels() -> dict[str, frozenset[str]]:
    """Series name -> the label names it carries in Prometheus (its own and scrape-time labels,
    ``le`` on histogram buckets): what a dashboard or alert may select or group by."""
    out: dict[str, frozenset[str]] = {}
    for cat in (EXPORTER_METRICS, OPERATOR_METRICS):
        for name, (kind, labels) in cat.items():
            for s in _series(name, kind):
                extra = {"le"} if s.endswith("_bucket") else set()
                out[s] = frozenset(labels) | SCRAPE_LABELS | extra
    for name, kind in v.VLLM_METRICS.items():
        for s in v.exposed_series(name, kind):
            extra = {"le"} if s.endswith("_bucket") else set()
            out[s] = frozenset(v.VLLM_LABELS) | frozenset(v.VLLM_EXTRA_LABELS.get(name, ())) | SCRAPE_LABELS | extra
    for s in PROMETHEUS_BUILTIN:
        out[s] = SCRAPE_LABELS
    return out


def known_series() -> frozenset[str]:
    """Every series name a dashboard or alert may use: exporter, operator, vLLM, Prometheus."""
    ours = {s for cat in (EXPORTER_METRICS, OPERATOR_METRICS) for name, (kind, _) in cat.items()
            for s in _series(name, kind)}
    return frozenset(ours) | v.all_exposed_series() | PROMETHEUS_BUILTIN


# --- sample values ------------------------------------------------------------------------------
MODEL = "Qwen/Qwen3-30B-A3B"
LAYERS, EXPERTS, RANKS = 4, 16, 4
NS, OP_NS, OP_JOB = "team-a", "moe-system", "moe-eplb-metrics"
DEMO, NOEXPORTER, FAILING, STALE = "demo", "noexporter", "failing", "stale"
STALLED = "stalled"  # steps 20/s with step_interval 10 and never rearranges
CALIBRATION_PARAMETERS = ("moe_time_share", "sync_stall_s", "async_s_per_moved_byte", "kv_throughput_elasticity")
MULTINODE = "multinode"  # an engine spanning pods: the exporter has no balancedness gauge
BALANCEDNESS = (0.55, 0.6, 0.65, 0.62)  # per layer; mean 0.605 < the default threshold 0.7
BUCKETS = (0.05, 0.1, 0.5, 1.0, 5.0)
STEP_BUCKETS, TOKEN_BUCKETS = metric_names.STEP_SECONDS_BUCKETS, metric_names.STEP_TOKENS_BUCKETS


def _counter(name: str, doc: str, labels: Iterable[str]) -> CounterMetricFamily:
    base = name.removesuffix("_total")
    return CounterMetricFamily(base, doc, labels=list(labels))


def _hist(fam: HistogramMetricFamily, labels: list[str], count: float, mean: float,
          bounds: Iterable[float] | None = None) -> None:
    """Add one histogram child with ``count`` observations spread around ``mean``."""
    buckets = [(str(b), count * (1.0 if b >= 2 * mean else 0.6 if b >= mean else 0.2)) for b in bounds or BUCKETS]
    fam.add_metric(labels, buckets + [("+Inf", count)], sum_value=count * mean)


class SampleCollector:
    """A prometheus_client collector whose counters grow with wall time (so rates are > 0)."""

    def __init__(self, part: str, t0: float) -> None:
        self.part, self.t0 = part, t0

    def collect(self) -> Iterable[Any]:
        dt = time.time() - self.t0 + 1.0
        if self.part == "exporter-multinode":
            return [f for f in self._exporter(dt) if f.name != metric_names.BALANCEDNESS]
        if self.part == "exporter-stalled":
            return self._exporter(dt, step_interval="10", rearranging=False)
        return {"exporter": self._exporter, "vllm": self._vllm, "operator": self._operator}[self.part](dt)

    @staticmethod
    def _family(name: str, doc: str) -> Any:
        kind, labels = EXPORTER_METRICS.get(name) or OPERATOR_METRICS[name]
        if kind == "counter":
            return _counter(name, doc, labels)
        cls = GaugeMetricFamily if kind == "gauge" else HistogramMetricFamily
        return cls(name, doc, labels=list(labels))

    def _exporter(self, dt: float, step_interval: str = "3000", rearranging: bool = True) -> list[Any]:
        f = self._family
        tok, rep = f(metric_names.EXPERT_TOKENS, "tokens per expert"), f(metric_names.EXPERT_REPLICAS, "replicas")
        for layer in range(LAYERS):
            for e in range(EXPERTS):
                rate = 1000.0 / (1 + e + layer)  # expert 0 is hot
                tok.add_metric([MODEL, str(layer), str(e)], rate * dt)
                rep.add_metric([MODEL, str(layer), str(e)], 2.0 if e < 2 else 1.0)
        rank = f(metric_names.RANK_TOKENS, "tokens per rank")
        for layer in range(LAYERS):
            for r in range(RANKS):
                # layer 2 is the most imbalanced (max / mean 1.9), the others 1.6
                busy = 1200.0 if layer == 2 else 800.0
                rank.add_metric([MODEL, str(layer), str(r)], (busy if r == 0 else 400.0) * dt)
        bal = f(metric_names.BALANCEDNESS, "balancedness")
        for layer, b in enumerate(BALANCEDNESS):
            bal.add_metric([MODEL, str(layer)], b)
        rea = f(metric_names.REARRANGEMENTS, "rearrangements")
        rea.add_metric([MODEL], dt / 2 if rearranging else 3.0)
        steps = f(metric_names.ENGINE_STEPS, "steps")
        steps.add_metric([MODEL], 20.0 * dt)
        dur = f(metric_names.REARRANGEMENT_SECONDS, "rearrangement duration")
        _hist(dur, [MODEL], dt / 2, 0.3)
        step_s, step_tok = f(metric_names.STEP_SECONDS, "step duration"), f(metric_names.STEP_TOKENS, "step tokens")
        kv = f(metric_names.KV_CACHE_BYTES, "kv cache bytes")
        for r in range(RANKS):
            _hist(step_s, [MODEL, str(r)], 20.0 * dt, 0.08 if r == 0 else 0.04, STEP_BUCKETS)
            _hist(step_tok, [MODEL, str(r)], 20.0 * dt, 256.0, TOKEN_BUCKETS)
            kv.add_metric([MODEL, str(r)], 40e9)
        info = f(metric_names.CONFIG_INFO, "config")
        info.add_metric([MODEL, "1000", step_interval, "4", "4", "true"], 1.0)
        start = f(metric_names.EXPORTER_START_TIME, "start time")
        start.add_metric([MODEL], self.t0)
        ranks = f(metric_names.EXPORTER_RANKS, "ranks")
        ranks.add_metric([MODEL], float(RANKS))
        # vLLM >= 0.34's own signals: async cycles vLLM saw finish; the stalled engine's async worker
        # failed (its failures grow, and no cycle finishes)
        fails = f(metric_names.REBALANCE_FAILURES, "async worker failures")
        fails.add_metric([MODEL], 0.0 if rearranging else dt / 5)
        async_dur = f(metric_names.ASYNC_REARRANGEMENT_SECONDS, "async rearrangement duration")
        _hist(async_dur, [MODEL], dt / 2 if rearranging else 3.0, 0.8)
        # the settings in force on each rank (live apply): window 1000, the interval, since step 0
        window, interval = f(metric_names.SETTINGS_WINDOW_SIZE, "window"), f(metric_names.SETTINGS_STEP_INTERVAL, "interval")
        since = f(metric_names.SETTINGS_SINCE_STEP, "since step")
        for r in range(RANKS):
            window.add_metric([MODEL, str(r)], 1000.0)
            interval.add_metric([MODEL, str(r)], float(step_interval))
            since.add_metric([MODEL, str(r)], 0.0)
        return [tok, rep, rank, bal, rea, steps, dur, step_s, step_tok, kv, info, start, ranks, fails, async_dur,
                window, interval, since]

    def _vllm(self, dt: float) -> list[Any]:
        out: list[Any] = []
        labels = list(v.VLLM_LABELS)
        for name, kind in v.VLLM_METRICS.items():
            extra = list(v.VLLM_EXTRA_LABELS.get(name, ()))
            values = [MODEL, "0"] + ["stop"] * len(extra)
            if kind == v.COUNTER:
                fam = CounterMetricFamily(name, name, labels=labels + extra)
                fam.add_metric(values, 50.0 * dt)
                if extra == ["finished_reason"]:  # requests a fault (or a client) aborted
                    fam.add_metric([MODEL, "0", "abort"], 2.0 * dt)
            elif kind == v.GAUGE:
                fam = GaugeMetricFamily(name, name, labels=labels + extra)
                fam.add_metric(values, 0.4 if "perc" in name else 3.0)
            else:
                fam = HistogramMetricFamily(name, name, labels=labels + extra)
                _hist(fam, values, dt * 5, 0.08)
            out.append(fam)
        return out

    def _operator(self, dt: float) -> list[Any]:
        now = time.time()
        ev = _counter(metric_names.TUNER_EVALUATIONS, "evaluations", ["namespace", "name", "result"])
        dec = _counter(metric_names.TUNER_DECISIONS, "decisions", ["namespace", "name", "decision"])
        gain = GaugeMetricFamily(metric_names.TUNER_PREDICTED_GAIN, "gain", labels=["namespace", "name"])
        last = GaugeMetricFamily(metric_names.TUNER_LAST_SUCCESS, "last success", labels=["namespace", "name"])
        for name, decision, result in ((DEMO, "Recommend", "ok"), (DEMO, "Apply", "ok"),
                                       (FAILING, "Error", "error"), (STALE, "Defer", "ok")):
            ev.add_metric([NS, name, result], dt)
            dec.add_metric([NS, name, decision], dt)
        for name, age in ((DEMO, 10.0), (STALE, 5000.0)):
            gain.add_metric([NS, name], 0.08)
            last.add_metric([NS, name], now - age)
        rb = _counter(metric_names.ROLLBACKS, "rollbacks", ["namespace", "name", "reason"])
        rb.add_metric([NS, DEMO, "regression"], dt / 4)
        rec = _counter(metric_names.RECONCILES, "reconciles", ["result"])
        rec.add_metric(["ok"], 3 * dt)
        rec.add_metric(["invalid"], dt / 5)
        rec.add_metric(["error"], dt / 10)
        dur = HistogramMetricFamily(metric_names.TUNER_DURATION_SECONDS, "tuner duration", labels=[])
        _hist(dur, [], dt, 0.2)
        cal = self._family(metric_names.CALIBRATION_VALUE, "calibration")
        unc = self._family(metric_names.CALIBRATION_UNCERTAINTY, "uncertainty")
        for i, param in enumerate(CALIBRATION_PARAMETERS):
            measured = i % 2 == 0  # every other parameter kept at its default
            cal.add_metric([NS, DEMO, param, "measured" if measured else "default"], 0.5 + 0.1 * i)
            if measured:
                unc.add_metric([NS, DEMO, param], 0.05)
        # demo runs 4 of at most 4 replicas with requests waiting: MoEEPLBAutoscalerAtMax (for 15m: pending)
        reps = self._family(metric_names.REPLICAS, "replicas")
        reps.add_metric([NS, DEMO, "desired"], 4)
        reps.add_metric([NS, DEMO, "ready"], 4)
        lo = self._family(metric_names.AUTOSCALER_MIN_REPLICAS, "min")
        lo.add_metric([NS, DEMO], 1)
        hi = self._family(metric_names.AUTOSCALER_MAX_REPLICAS, "max")
        hi.add_metric([NS, DEMO], 4)
        target = self._family(metric_names.AUTOSCALER_TARGET, "target")
        target.add_metric([NS, DEMO, "RequestsWaiting"], 8)
        div = self._family(metric_names.REPLICA_LOAD_DIVERGENCE, "divergence")
        div.add_metric([NS, DEMO], 0.04)  # the demo's replicas see different loads (above the 0.01 bits threshold)
        return [ev, dec, gain, last, rb, rec, dur, cal, unc, reps, lo, hi, target, div, *self._recovery(dt, now)] + self._elastic(dt)

    def _recovery(self, dt: float, now: float) -> list[Any]:
        """demo's group 0 runs degraded (8 ranks lost: MoEEPLBRecoveryDegraded, for 1h: pending) and a
        round of its group 1 is 100 s past its deadline (MoEEPLBRecoveryStuck: firing)."""
        phase = self._family(metric_names.RECOVERY_PHASE, "recovery phase")
        for p in ("Healthy", "Recovering", "Degraded", "Restoring", "Failed"):
            phase.add_metric([NS, DEMO, p], 1.0 if p == "Degraded" else 0.0)
        lost = self._family(metric_names.RECOVERY_LOST_RANKS, "lost ranks")
        lost.add_metric([NS, DEMO], 8)
        rounds = self._family(metric_names.RECOVERY_ROUNDS, "rounds")
        rounds.add_metric([NS, DEMO, "scale_down", "Succeeded"], dt / 10)
        took = self._family(metric_names.RECOVERY_ROUND_SECONDS, "round duration")
        _hist(took, ["scale_down", "Succeeded"], dt / 10, 20.0, metric_names.RECOVERY_SECONDS_BUCKETS)
        deadline = self._family(metric_names.RECOVERY_DEADLINE, "deadline")
        deadline.add_metric([NS, DEMO, "1"], now - 100.0)
        return [phase, lost, rounds, took, deadline]

    def _elastic(self, dt: float) -> list:
        """demo, an elastic group growing 16 -> 32 ranks for 90 s of a 1022 s deadline, one grow done and
        one rolled back before."""
        dp = self._family(metric_names.ELASTIC_DATA_PARALLEL, "dp")
        dp.add_metric([NS, DEMO], 16)
        target = self._family(metric_names.ELASTIC_TARGET_DATA_PARALLEL, "target dp")
        target.add_metric([NS, DEMO], 32)
        phase = GaugeMetricFamily(metric_names.ELASTIC_PHASE, "phase", labels=["namespace", "name", "phase"])
        phase.add_metric([NS, DEMO, "Preparing"], 1)
        running = self._family(metric_names.ELASTIC_RESIZE_SECONDS, "running")
        running.add_metric([NS, DEMO], 90)
        deadline = self._family(metric_names.ELASTIC_RESIZE_DEADLINE, "deadline")
        deadline.add_metric([NS, DEMO], 1022)
        done = _counter(metric_names.ELASTIC_RESIZES, "resizes", ["namespace", "name", "direction", "result"])
        done.add_metric([NS, DEMO, "grow", "completed"], dt / 10)
        done.add_metric([NS, DEMO, "grow", "rolled_back"], dt / 20)
        took = HistogramMetricFamily(metric_names.ELASTIC_RESIZE_DURATION, "resize duration",
                                     labels=["namespace", "name", "direction", "result"])
        _hist(took, [NS, DEMO, "grow", "completed"], dt / 10, 60.0)
        return [dp, target, phase, running, deadline, done, took]


class _Handler(http.server.BaseHTTPRequestHandler):
    registries: ClassVar[dict[str, CollectorRegistry]] = {}

    def do_GET(self) -> None:
        reg = self.registries.get(self.path.strip("/"))
        if reg is None:
            self.send_error(404)
            return
        body = generate_latest(reg)  # classic text format keeps vLLM's colon names
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def start_sample_server() -> tuple[http.server.ThreadingHTTPServer, int]:
    """Serve /exporter, /exporter-multinode, /exporter-stalled, /vllm and /operator on a free loopback port."""
    t0 = time.time()
    regs = {}
    for part in ("exporter", "exporter-multinode", "exporter-stalled", "vllm", "operator"):
        reg = CollectorRegistry(auto_describe=False)
        reg.register(SampleCollector(part, t0))
        regs[part] = reg
    handler = type("Handler", (_Handler,), {"registries": regs})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, int(server.server_address[1])


def prometheus_config(target_port: int, rule_files: list[str]) -> dict[str, Any]:
    """Scrape jobs labelled as the PodMonitor / ServiceMonitor would label them."""
    tgt = f"127.0.0.1:{target_port}"

    def job(name: str, path: str, labels: dict[str, str], honor: bool = False) -> dict[str, Any]:
        return {"job_name": name, "metrics_path": path, "honor_labels": honor,
                "static_configs": [{"targets": [tgt], "labels": labels}]}

    pod = {"namespace": NS, "moeinference": DEMO, "pod": "demo-0"}
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": rule_files,
        "scrape_configs": [
            job(f"{NS}/demo-exporter", "/exporter", {**pod, "endpoint": k8s_names.EXPORTER_PORT_NAME}),
            job(f"{NS}/demo-vllm", "/vllm", {**pod, "endpoint": "http"}),
            job(f"{NS}/multinode-exporter", "/exporter-multinode",
                {"namespace": NS, "moeinference": MULTINODE, "pod": "multinode-0",
                 "endpoint": k8s_names.EXPORTER_PORT_NAME}),
            job(f"{NS}/stalled-exporter", "/exporter-stalled",
                {"namespace": NS, "moeinference": STALLED, "pod": "stalled-0",
                 "endpoint": k8s_names.EXPORTER_PORT_NAME}),
            job(f"{NS}/noexporter-vllm", "/vllm",
                {"namespace": NS, "moeinference": NOEXPORTER, "pod": "noexporter-0", "endpoint": "http"}),
            job(OP_JOB, "/operator", {"namespace": OP_NS, "pod": "moe-eplb-0"}, honor=True),
        ],
    }


@dataclass
class PrometheusServer:
    """A running Prometheus on loopback and a tiny client for its HTTP API."""

    url: str
    server: RunningPrometheus

    def stop(self) -> None:
        self.server.stop()

    def api(self, path: str, **params: str) -> Any:
        q = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus answered {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        res = data["result"]
        return res if isinstance(res, list) else [res]

    def query_range(self, expr: str, seconds: float = 30, step: str = "1s") -> list[dict[str, Any]]:
        end = time.time()
        return self.api("query_range", query=expr, start=str(end - seconds), end=str(end), step=step)["result"]

    def wait_for(self, expr: str, pred: Callable[[list[dict[str, Any]]], bool], timeout: float = 30) -> None:
        """Until ``pred`` holds for the answer to ``expr`` (errors while Prometheus warms up: not yet)."""
        wait_until(lambda: pred(self.query(expr)), timeout=timeout, interval=0.3, what=f"Prometheus: {expr!r}",
                   not_yet=lambda exc: isinstance(exc, (OSError, AssertionError)))


def start_prometheus(workdir: Path, config: dict[str, Any]) -> PrometheusServer:
    running = prometheus.start_prometheus(workdir, config, timeout=20)
    return PrometheusServer(running.url, running)
