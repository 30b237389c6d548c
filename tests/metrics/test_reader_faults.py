"""Faults between the operator and Prometheus, through a proxy in front of a real Prometheus 2.42
(skipped without the binary): transient errors are retried inside the read's budget, and a pod's
series missing from some answers is refused -- never read as less load -- for a Deployment's pods
and for a LeaderWorkerSet group (``IncompleteGroup``, naming the group and the pod).

The counters of two single-node pods (MoEInference ``dep``) and of one two-pod replica group
(``grp``: leader ``grp-0`` and worker ``grp-0-1``, with the group labels the PodMonitor copies) are
backfilled with ``promtool``; the reader reads them through the proxy exactly as from Prometheus.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from moe_eplb.contracts import metric_names
from moe_eplb.metrics.errors import LoadReadError
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.reader import read_load_trace
from tests.metrics.backfill import backfilled_prometheus, openmetrics_text

pytestmark = [
    pytest.mark.integration,
    pytest.mark.prometheus,
]

T, L, E, SCRAPE, BUCKET = 6, 2, 4, 5, 15
RNG = np.random.default_rng(5)
PODS = {  # pod -> (moeinference, extra labels, load [T, L, E])
    "dep-a": ("dep", {}, RNG.integers(10, 60, (T, L, E)) * 3.0),
    "dep-b": ("dep", {}, RNG.integers(10, 60, (T, L, E)) * 3.0),
    "grp-0": ("grp", {metric_names.GROUP_LABEL: "0", metric_names.GROUP_WORKER_LABEL: "0",
                      metric_names.GROUP_SIZE_LABEL: "2"}, RNG.integers(10, 60, (T, L, E)) * 3.0),
    "grp-0-1": ("grp", {metric_names.GROUP_LABEL: "0", metric_names.GROUP_WORKER_LABEL: "1",
                        metric_names.GROUP_SIZE_LABEL: "2"}, RNG.integers(10, 60, (T, L, E)) * 3.0),
}
STEPS = np.full(T, 300)


def _openmetrics(t0: int) -> str:
    per = BUCKET // SCRAPE
    times = [t0 + i * SCRAPE for i in range(T * per + 1)]
    fams = {metric_names.EXPERT_TOKENS: [], metric_names.ENGINE_STEPS: [], metric_names.EXPORTER_START_TIME: []}
    for pod, (inf, extra, load) in PODS.items():
        labels = ",".join(f'{k}="{v}"' for k, v in {"namespace": "ns", "moeinference": inf, "pod": pod,
                                                    "model_name": "m", **extra}.items())
        for l in range(L):
            for e in range(E):
                values = 1e5 + np.concatenate([[0.0], np.cumsum(np.repeat(load[:, l, e] / per, per))])
                fams[metric_names.EXPERT_TOKENS] += [
                    f'{metric_names.EXPERT_TOKENS}{{{labels},layer="{l}",expert="{e}"}} {v:.1f} {ts}'
                    for ts, v in zip(times, values)]
        values = 4e4 + np.concatenate([[0.0], np.cumsum(np.repeat(STEPS / per, per))])
        fams[metric_names.ENGINE_STEPS] += [f'{metric_names.ENGINE_STEPS}{{{labels}}} {v:.1f} {ts}'
                                            for ts, v in zip(times, values)]
        fams[metric_names.EXPORTER_START_TIME] += [f'{metric_names.EXPORTER_START_TIME}{{{labels}}} {t0 - 600} {ts}'
                                                   for ts in times]
    return openmetrics_text(fams)


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    work = tmp_path_factory.mktemp("prom-faults")
    t0 = (int(time.time()) - 3 * 3600) // BUCKET * BUCKET
    with backfilled_prometheus(work, _openmetrics(t0)) as base:
        yield base, t0


class Proxy:
    """A loopback proxy in front of Prometheus. ``fail``: request numbers (1-based) answered with
    HTTP 503; ``drop``: a pod whose series are removed from every other answer (the 1st, 3rd, ...)."""

    def __init__(self, upstream: str) -> None:
        self.upstream, self.fail, self.drop = upstream, set(), None
        self.requests = 0
        proxy = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.requests += 1
                n = proxy.requests
                if n in proxy.fail:
                    return self._send(503, b"upstream connect error or disconnect/reset before headers")
                req = urllib.request.Request(proxy.upstream + self.path, data=body, method="POST",
                                             headers={"Content-Type": "application/x-www-form-urlencoded"})
                try:
                    with urllib.request.urlopen(req, timeout=10) as r:
                        status, data = r.status, r.read()
                except urllib.error.HTTPError as exc:
                    status, data = exc.code, exc.read()
                if proxy.drop and n % 2 == 1 and status == 200:
                    answer = json.loads(data)
                    answer["data"]["result"] = [x for x in answer["data"]["result"]
                                                if x.get("metric", {}).get("pod") != proxy.drop]
                    data = json.dumps(answer).encode()
                self._send(status, data)

            def _send(self, status, data):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def proxy(prom):
    p = Proxy(prom[0])
    yield p
    p.close()


def _read(prom, name, url, **kw):
    _, t0 = prom
    return read_load_trace(prometheus_url=url, namespace="ns", name=name, window_seconds=T * BUCKET,
                           bucket_seconds=BUCKET, now=t0 + T * BUCKET + 1, num_layers=L, num_experts=E, **kw)


@pytest.mark.parametrize("name,pods_per_engine", [("dep", 1), ("grp", 2)])
def test_transient_errors_are_retried_within_the_budget(prom, proxy, name, pods_per_engine):
    exact = _read(prom, name, prom[0], pods_per_engine=pods_per_engine)
    want = sum(load for inf, _, load in PODS.values() if inf == name)
    np.testing.assert_array_equal(exact.load, want)  # the group's load is the sum over its pods
    np.testing.assert_array_equal(exact.bucket_steps, STEPS * (2 // pods_per_engine))

    proxy.fail = {2, 5, 9}  # three of the ~10 queries of one read fail
    client = PrometheusClient(proxy.url, timeout=5, backoff=0.05, budget=10)
    got = _read(prom, name, proxy.url, pods_per_engine=pods_per_engine, client=client)
    np.testing.assert_array_equal(got.load, exact.load)
    assert client.retried == 3

    proxy.requests, proxy.fail = 0, {2}  # without retries one failed query spoils the read
    with pytest.raises(LoadReadError) as ei:
        _read(prom, name, proxy.url, pods_per_engine=pods_per_engine,
              client=PrometheusClient(proxy.url, timeout=5, retries=0))
    assert ei.value.reason == "PrometheusUnavailable"


def test_retries_stop_at_the_budget_and_never_for_a_refused_query(proxy):
    clock = [0.0]
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        clock[0] += s

    proxy.fail = set(range(1, 100))
    client = PrometheusClient(proxy.url, timeout=5, retries=10, backoff=1.0, budget=5.0, sleep=sleep,
                              clock=lambda: clock[0])
    with pytest.raises(LoadReadError, match=r"after 3 attempts") as ei:
        client.query("up")
    assert ei.value.reason == "PrometheusUnavailable" and sleeps == [1.0, 2.0]  # the next (4 s) would pass 5 s
    proxy.fail = set()
    bad = PrometheusClient(proxy.url, timeout=5, backoff=0.01)
    with pytest.raises(LoadReadError) as ei:
        bad.query("sum(")  # bad_data: Prometheus refuses the query itself
    assert ei.value.reason == "PrometheusQueryFailed" and bad.attempts == 1


@pytest.mark.parametrize("name,pod,reason,words", [
    ("dep", "dep-b", "InconsistentSeries", ["dep-b"]),
    ("grp", "grp-0-1", "IncompleteGroup", ["replica group 0", "grp-0-1"]),
    ("grp", "grp-0", "IncompleteGroup", ["replica group 0", "grp-0"]),
])
def test_a_pod_missing_from_every_other_answer_is_refused(prom, proxy, name, pod, reason, words):
    proxy.drop = pod
    with pytest.raises(LoadReadError) as ei:
        _read(prom, name, proxy.url, pods_per_engine=2 if name == "grp" else 1)
    assert ei.value.reason == reason, ei.value.message
    for w in words:
        assert w in ei.value.message
