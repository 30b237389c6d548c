"""End to end: known load -> real exporter processes -> REAL Prometheus -> load reader -> the same load.

Pods (``exporter_driver.py`` processes running the real plugin, server and recorder) are driven
phase by phase; each phase runs just after a bucket boundary and is scraped (every 0.5 s) well before
the next one, so the reader must return exactly the phase's load in that bucket. Phases cover a pod
restart (counter reset), a pod joining and a pod leaving. The direct-scrape reader is checked on the
same pods.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from moe_eplb.contracts import k8s_names, metric_names
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.reader import raw_samples, read_load_trace, trace_from_scraped_rounds, with_baselines
from moe_eplb.metrics.scrape import PodScraper, Target
from moe_eplb_harness.floor.procs import free_port
from moe_eplb_harness.floor.prometheus import start_prometheus
from tests import ROOT

pytestmark = [pytest.mark.prometheus, pytest.mark.integration]

B = 3.0  # bucket seconds
L, E = 3, 5
HERE = os.path.dirname(__file__)


class Pod:
    def __init__(self, name, port, tmp, wait=False):
        self.name, self.port = name, port
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_EPLB_")}
        env.update(MOE_EPLB_EXPORTER_PORT=str(port), MOE_EPLB_EXPORTER_ADDRESS="127.0.0.1",
                   MOE_EPLB_EXPORTER_FLUSH_SECONDS="0", MOE_EPLB_EXPORTER_DIR=str(tmp / f"{name}-{time.time_ns()}"),
                   DRIVER_LAYERS=str(L), DRIVER_EXPERTS=str(E), DRIVER_WAIT="1" if wait else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.metrics.exporter_driver"], env=env, cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def go(self):
        """Start the exporter of a pre-warmed pod (imports already done)."""
        assert self.proc.stdout.readline().strip() == "warm"
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.wait_ready()

    def wait_ready(self):
        line = self.proc.stdout.readline()
        assert line.startswith("ready"), f"pod {self.name} did not start: {line!r}"

    def run(self, steps, load):
        self.proc.stdin.write(json.dumps({"steps": steps, "load": load.tolist()}) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def kill(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture()
def cluster(tmp_path):
    pytest.importorskip("torch", reason="the exporter's worker side needs torch")
    ports = {n: free_port() for n in ("a", "b", "c")}
    pods = {n: Pod(n, ports[n], tmp_path) for n in ("a", "b")}
    # the restarted a and the joining c import torch now, and start their exporters when told
    spare = {"a2": Pod("a", ports["a"], tmp_path, wait=True), "c": Pod("c", ports["c"], tmp_path, wait=True)}
    cfg = {"global": {"scrape_interval": "500ms", "scrape_timeout": "400ms"},
           "scrape_configs": [{"job_name": "eplb", "metrics_path": k8s_names.EXPORTER_PATH, "static_configs": [
               {"targets": [f"127.0.0.1:{ports[n]}"],
                "labels": {"namespace": "ns", metric_names.MOEINFERENCE_LABEL: "moe", "pod": n}} for n in ports]}]}
    prom = None
    try:
        prom = start_prometheus(tmp_path / "prometheus", cfg)
        client = PrometheusClient(prom.url, timeout=5)
        for p in pods.values():
            p.wait_ready()
        yield {"pods": pods, "spare": spare, "ports": ports, "client": client, "tmp": tmp_path, "url": client.url,
               "prom": prom.proc}
    finally:
        if prom is not None:
            prom.stop()
        for p in list(pods.values()) + list(spare.values()):
            p.kill()


def _steps_sample(client, pod):
    """(value, timestamp) of the pod's last scraped engine-steps sample, or None."""
    try:
        body = client.query(f'{metric_names.ENGINE_STEPS}{{pod="{pod}"}}')
    except Exception:  # noqa: BLE001 - Prometheus still starting
        return None
    res = body["data"]["result"]
    return (float(res[0]["value"][1]), float(res[0]["value"][0])) if res else None


def _wait_first_scrapes(client, names=("a", "b"), timeout=30.0):
    """Wait until Prometheus has scraped each of the pods ``names`` at least once."""
    deadline = time.time() + timeout
    while not all(_steps_sample(client, p) for p in names):
        assert time.time() < deadline, "Prometheus never scraped the pods"
        time.sleep(0.2)


def _wait_scraped(client, pod, steps, deadline):
    """Wait until Prometheus has scraped ``steps`` for ``pod``; return the sample's timestamp."""
    while time.time() < deadline:
        sel = f'{metric_names.ENGINE_STEPS}{{pod="{pod}"}}'
        body = client.query(f"timestamp({sel}) and on(pod) ({sel} == {steps})")
        if body["data"]["result"]:
            return float(body["data"]["result"][0]["value"][1])
        time.sleep(0.1)
    raise AssertionError(f"Prometheus did not scrape pod {pod} at {steps} steps in time "
                         f"(last sample: {_steps_sample(client, pod)}, now {time.time()})")


def _next_boundary(margin=0.25):
    t = time.time()
    g = math.floor(t / B) * B + B
    time.sleep(g + margin - t)
    return g


def test_known_load_in_same_load_out(cluster):
    client, pods = cluster["client"], cluster["pods"]
    _wait_first_scrapes(client)
    rng = np.random.default_rng(42)
    steps_seen = {"a": 0, "b": 0}
    expected: dict[float, tuple[np.ndarray, int]] = {}
    scraper = PodScraper(timeout=5)

    def targets():
        return [Target(pod=n, url=f"http://127.0.0.1:{cluster['ports'][n]}/metrics") for n in live]

    live = ["a", "b"]
    scraper.scrape(targets())

    def phase(work: dict[str, tuple[int, np.ndarray]]):
        g = _next_boundary()
        scraper.scrape(targets())  # the operator scrapes twice per bucket: before and after the load
        total, total_steps = np.zeros((L, E)), 0
        for n, (steps, per_step) in work.items():
            pods[n].run(steps, per_step)
            steps_seen[n] += steps
            total += steps * per_step
            total_steps += steps
        for n in work:
            ts = _wait_scraped(client, n, steps_seen[n], g + B)
            assert ts < g + B - 0.05, f"scrape of {n} landed in the next bucket; machine too slow?"
        expected[g + B] = (total, total_steps)
        rnd = scraper.scrape(targets())
        assert rnd.time < g + B - 0.01, "the direct scrape landed in the next bucket; machine too slow?"

    def load(hot):
        m = rng.integers(0, 4, size=(L, E))
        m[:, hot] += 20
        return m

    phase({"a": (5, load(0)), "b": (3, load(1))})
    phase({"a": (7, load(2)), "b": (2, load(2))})
    # pod a restarts: new process, same port, counters from zero (less than before)
    pods["a"].kill()
    pods["a"] = cluster["spare"]["a2"]
    pods["c"] = cluster["spare"]["c"]  # joins (idle until its phase)
    pods["a"].go()
    pods["c"].go()
    steps_seen["a"] = steps_seen["c"] = 0
    live[:] = ["a", "b", "c"]
    phase({"a": (2, load(3)), "b": (4, load(3))})
    # pod b leaves
    pods["b"].kill()
    live[:] = ["a", "c"]
    phase({"a": (3, load(4)), "c": (6, load(0))})

    end = max(expected) + 0.5
    first = min(expected) - B
    window = end - first + B
    trace = read_load_trace(prometheus_url=cluster["url"], namespace="ns", name="moe", window_seconds=window,
                            bucket_seconds=B, now=end, num_layers=L, num_experts=E)
    if os.environ.get("E2E_DEBUG"):
        for q in (f'{metric_names.EXPERT_TOKENS}{{layer="0",expert="2"}}', metric_names.ENGINE_STEPS, metric_names.EXPORTER_START_TIME):
            for r in client.query(f"{q}[{int(window) + 10}s]", time=end)["data"]["result"]:
                print("DBG", q, r["metric"].get("pod"), r["values"])
        print("DBG expected", {k: v[1] for k, v in expected.items()})
    grid_ends = trace.meta["start_time"] + B * np.arange(1, trace.num_buckets + 1)  # bucket end times
    assert trace.num_layers == L and trace.num_experts == E and trace.model == "org/moe"
    for t_end, (load_m, steps) in expected.items():
        hits = np.flatnonzero(np.isclose(grid_ends, t_end, rtol=0, atol=1e-3))
        assert hits.size == 1, f"no bucket ends at {t_end}: {grid_ends}"
        idx = int(hits[0])
        np.testing.assert_array_equal(trace.load[idx], load_m, err_msg=f"bucket ending {t_end}")
        assert trace.bucket_steps[idx] == steps, f"bucket ending {t_end}"
    others = [i for i, t in enumerate(grid_ends) if not any(abs(t - k) < 1e-3 for k in expected)]
    assert trace.load[others].sum() == 0, "load leaked into buckets with no phase"
    assert trace.load.sum() == sum(v[0].sum() for v in expected.values())

    # long windows are read in chunks: the same samples, none twice. `end` may still be ahead, and a
    # scrape landing between the two reads adds a sample to the second only: compare the samples
    # both reads surely saw (a flake under load in CI's full run before)
    seen = time.time() - 1.0
    whole = raw_samples(client, metric_names.EXPERT_TOKENS, end - window - 300, end)
    chunked = raw_samples(client, metric_names.EXPERT_TOKENS, end - window - 300, end, chunk_seconds=1.3)

    def samples(series):
        return {(tuple(sorted(s.labels.items())), float(t), float(v)) for s in series for t, v in zip(s.ts, s.vs)
                if t <= seen}

    assert samples(whole) == samples(chunked) and len(samples(whole)) > 0
    assert sum(int((s.ts <= seen).sum()) for s in chunked) == len(samples(whole))  # none twice

    # the baseline of each series is its last sample at or before the window's start, fetched by
    # instant queries instead of 5 minutes of raw samples
    g0 = min(expected)
    settled = time.time() - 1.0  # `end` may still be ahead: compare the samples both reads surely saw
    based = with_baselines(client, metric_names.EXPERT_TOKENS, g0, end)
    again = raw_samples(client, metric_names.EXPERT_TOKENS, end - window - 300, end)
    want = set()
    for s in again:
        pts = list(zip(s.ts.tolist(), s.vs.tolist()))
        before = [p for p in pts if p[0] <= g0]
        key = tuple(sorted(s.labels.items()))
        want |= {(key, t, v) for t, v in before[-1:] + [p for p in pts if p[0] > g0]}
    got = {(tuple(sorted(s.labels.items())), float(t), float(v)) for s in based for t, v in zip(s.ts, s.vs)}
    want, got = {w for w in want if w[1] <= settled}, {g for g in got if g[1] <= settled}
    assert got == want and any(t <= g0 for _, t, _ in got), (g0, sorted(got - want)[:3], sorted(want - got)[:3])

    # the direct-scrape reader on the same pods, as the operator reads them (read_load_trace's pure
    # part), on the Prometheus read's grid: the same trace (a restart, a join and a leave included)
    grid = trace.meta["start_time"] + B * np.arange(trace.num_buckets + 1)
    on_grid = trace_from_scraped_rounds(scraper.since(grid[0]), grid, num_layers=L, num_experts=E)
    np.testing.assert_array_equal(on_grid.load, trace.load)
    np.testing.assert_array_equal(on_grid.bucket_steps, trace.bucket_steps)
    assert on_grid.meta["interpolated_fraction"] == 0.0


def test_steady_pods_are_summed_at_the_bucket_edges_with_the_same_trace(cluster):
    """Two pods scraped since before the window, no restart, no missed scrape: the reader sums their
    counters at the bucket edges on the server (metrics/edges.py) and gets exactly the load the
    pods routed, bucket by bucket -- the same trace as from every raw sample."""
    client, pods = cluster["client"], cluster["pods"]
    _wait_first_scrapes(client)
    rng = np.random.default_rng(5)
    steps_seen = {"a": 0, "b": 0}
    expected = {}
    for _ in range(3):
        g = _next_boundary()
        total, total_steps = np.zeros((L, E)), 0
        for n in ("a", "b"):
            steps, per_step = int(rng.integers(2, 6)), rng.integers(0, 5, size=(L, E))
            pods[n].run(steps, per_step)
            steps_seen[n] += steps
            total, total_steps = total + steps * per_step, total_steps + steps
        for n in ("a", "b"):
            assert _wait_scraped(client, n, steps_seen[n], g + B) < g + B - 0.05, "scrape landed in the next bucket"
        expected[g + B] = (total, total_steps)
    end = max(expected) + 0.5
    _next_boundary(margin=0.6)  # every sample up to `end` is in
    kw = dict(prometheus_url=cluster["url"], namespace="ns", name="moe", window_seconds=3 * B, bucket_seconds=B,
              now=end, num_layers=L, num_experts=E)
    fast, raw = read_load_trace(**kw), read_load_trace(**kw, at_edges=False)
    assert fast.meta["read"] == "edges", fast.meta["read"]
    assert (fast.meta["pods_at_edges"], fast.meta["pods_raw"]) == (2, 0)
    assert fast.meta["read_rank_tokens"] == "edges"  # the telemetry's rank tokens too
    np.testing.assert_array_equal(fast.telemetry.rank_load, raw.telemetry.rank_load)
    np.testing.assert_array_equal(fast.telemetry.rank_load.sum(axis=2), fast.load.sum(axis=2))  # tokens = tokens
    np.testing.assert_array_equal(fast.load, raw.load)
    np.testing.assert_array_equal(fast.bucket_steps, raw.bucket_steps)
    grid_ends = fast.meta["start_time"] + B * np.arange(1, fast.num_buckets + 1)
    for t_end, (load_m, steps) in expected.items():
        (idx,) = np.flatnonzero(np.isclose(grid_ends, t_end, rtol=0, atol=1e-3))
        np.testing.assert_array_equal(fast.load[idx], load_m, err_msg=f"bucket ending {t_end}")
        assert fast.bucket_steps[idx] == steps
    assert fast.load.sum() == sum(v[0].sum() for v in expected.values())


def test_missed_scrapes_are_spread_by_time(cluster):
    """Prometheus is paused (SIGSTOP) for ~2 buckets while pod a routes a known load: the reader
    spreads it over the buckets between the two samples around the pause, in proportion to time,
    keeps the total, reports the share, and refuses the window at the default threshold."""
    from moe_eplb.metrics.errors import LoadReadError
    from moe_eplb.metrics.grid import grid_for, max_gap_for
    from moe_eplb.metrics.increments import overlap_weights

    client, pods, prom = cluster["client"], cluster["pods"], cluster["prom"]
    _wait_first_scrapes(client)
    time.sleep(1.0)  # a few scrapes before the pause
    per_step = np.arange(L * E).reshape(L, E) % 4 + 1
    _next_boundary()
    prom.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)
        pods["a"].run(6, per_step)
        time.sleep(2 * B)
    finally:
        prom.send_signal(signal.SIGCONT)
    _wait_scraped(client, "a", 6, time.time() + 15)
    g_end = _next_boundary(margin=0.6)  # the sample after the pause is inside the window
    grid = grid_for(g_end + 0.1, 6 * B, B)
    trace = read_load_trace(prometheus_url=cluster["url"], namespace="ns", name="moe", window_seconds=6 * B,
                            bucket_seconds=B, now=g_end + 0.1, num_layers=L, num_experts=E,
                            max_interpolated_fraction=1.0)
    # the two samples of pod a around the pause, as Prometheus stored them
    series = raw_samples(client, f'{metric_names.ENGINE_STEPS}{{pod="a"}}', grid[0] - 60, grid[-1])
    pts = np.stack([series[0].ts, series[0].vs], axis=1)
    j = int(np.flatnonzero(np.diff(pts[:, 1]) > 0)[-1])
    t1, t2 = pts[j, 0], pts[j + 1, 0]
    assert t2 - t1 > max_gap_for(pts[:, 0], B), f"no scrape gap around the load: {t1} -> {t2}"
    w = overlap_weights(grid, np.array([t1]), np.array([t2]))[0]  # [T]
    assert np.count_nonzero(w) >= 2 and w.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(trace.load, w[:, None, None] * (6 * per_step)[None], rtol=1e-9, atol=1e-9)
    assert trace.load.sum() == pytest.approx(6 * per_step.sum(), rel=1e-12)
    assert trace.bucket_steps.sum() == 6
    assert trace.meta["interpolated_fraction"] == pytest.approx(1.0)
    with pytest.raises(LoadReadError) as ei:
        read_load_trace(prometheus_url=cluster["url"], namespace="ns", name="moe", window_seconds=6 * B,
                        bucket_seconds=B, now=g_end + 0.1, num_layers=L, num_experts=E)
    assert ei.value.reason == "ScrapeGaps" and "pod a: no samples between" in ei.value.message
