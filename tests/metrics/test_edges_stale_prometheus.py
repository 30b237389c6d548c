"""A failed scrape does not push the load read off the bucket edges (a real Prometheus, live scrapes).

When a scrape fails, Prometheus writes a staleness marker for every series of that target: until
the next good scrape an instant vector has nothing for them, so a sum at a bucket edge would lose the
pod and the reader would fall back to reading every raw sample (about 15x the numbers; for
DeepSeek-V3 in the demo, reads of 10-30 s instead of 3). Here pod ``b`` refuses the scrape that comes
in the last scrape interval before each bucket edge inside the window read; the reader still sums at the edges
(``last_over_time`` within :func:`moe_eplb.metrics.edges.edge_reach`) and gets the raw read's trace.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from moe_eplb.contracts import metric_names
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.reader import read_load_trace, selector
from moe_eplb_harness.cluster.world import LocalPrometheus
from tests.exposition_server import serve_exposition
from tests.require import prometheus_tools

pytestmark = [pytest.mark.integration, pytest.mark.prometheus]

L, E = 2, 4
BUCKET = 2.0
SCRAPE = 0.5
WINDOW = 6  # buckets read
REFUSE = SCRAPE  # pod b refuses the scrape that comes in the last scrape interval before an edge


class Pod:
    """One engine's exporter: counters that grow every 0.1 s, served over HTTP."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.refuse_before: set[float] = set()  # the edges before which this pod's scrapes fail
        self.registry = CollectorRegistry()
        label = metric_names.LABEL_MODEL
        self.tokens = Counter(metric_names.EXPERT_TOKENS.removesuffix("_total"), "tokens",
                              [label, metric_names.LABEL_LAYER, metric_names.LABEL_EXPERT], registry=self.registry)
        self.steps = Counter(metric_names.ENGINE_STEPS.removesuffix("_total"), "steps", [label], registry=self.registry)
        Gauge(metric_names.EXPORTER_START_TIME, "start", [label], registry=self.registry).labels("m").set(time.time())
        self.rng = np.random.default_rng(seed)
        self.refused = self.served = 0
        self.server = serve_exposition(self.body)
        self.port = self.server.server_address[1]

    def body(self) -> bytes | None:
        """The exposition, or None (a failed scrape) in the last ``REFUSE`` seconds before an edge of
        ``refuse_before``."""
        t = time.time()
        edge = math.ceil(t / BUCKET) * BUCKET
        if edge in self.refuse_before and edge - t <= REFUSE:
            self.refused += 1
            return None
        self.served += 1
        return generate_latest(self.registry)

    def step(self) -> None:
        self.steps.labels("m").inc(5)
        for l in range(L):
            for e in range(E):
                self.tokens.labels("m", str(l), str(e)).inc(int(self.rng.integers(1, 20)))


async def test_a_failed_scrape_before_an_edge_keeps_the_read_at_the_edges(tmp_path):
    binary = prometheus_tools().server
    pods = [Pod("a", 1), Pod("b", 2)]
    stop = threading.Event()

    def grow():
        while not stop.is_set():
            for p in pods:
                p.step()
            time.sleep(0.1)

    grower = threading.Thread(target=grow, daemon=True)
    grower.start()
    prom = LocalPrometheus(binary, scrape_interval=SCRAPE, workdir=str(tmp_path))
    try:
        await prom.start()
        prom.update([{"namespace": "ns", "pod": p.name, "moeinference": "moe", "port": p.port} for p in pods])
        client = PrometheusClient(prom.url)
        count = f"count({metric_names.ENGINE_STEPS}{selector('ns', 'moe')})"
        for _ in range(120):  # both pods scraped: the window starts after that
            got = (await asyncio.to_thread(client.query, count))["data"]["result"]
            if got and float(got[0]["value"][1]) == 2:
                break
            await asyncio.sleep(0.25)
        # the window read: from two buckets on; pod b's scrapes fail before each edge inside it
        grid_start = (math.ceil(time.time() / BUCKET) + 2) * BUCKET
        grid_end = grid_start + WINDOW * BUCKET
        pods[1].refuse_before = {grid_start + k * BUCKET for k in range(1, WINDOW)}
        await asyncio.sleep(grid_end + 1.5 - time.time())
        now = grid_end + 0.5  # the newest edge long ingested
        kw = dict(namespace="ns", name="moe", window_seconds=WINDOW * BUCKET, bucket_seconds=BUCKET,
                  prometheus_url=prom.url, now=now, num_layers=L, num_experts=E)
        at_edges = await asyncio.to_thread(read_load_trace, **kw)
        raw = await asyncio.to_thread(read_load_trace, **kw, at_edges=False)
        # the failed scrapes did hide pod b from an instant vector at some edge: an instant sum at the
        # edges (the way the reader read before) would not stand for the raw samples
        counts = client.query_range(count, grid_end - WINDOW * BUCKET, grid_end, BUCKET)
        present = [float(v) for _, v in counts["data"]["result"][0]["values"]]
    finally:
        stop.set()
        prom.stop()
        for p in pods:
            p.server.shutdown()
    assert pods[1].refused >= WINDOW - 2 and pods[0].refused == 0, [(p.served, p.refused) for p in pods]
    assert present[0] == present[-1] == 2.0 and min(present) == 1.0, present  # pod b missing at inner edges
    assert at_edges.meta["read"] == "edges" and at_edges.meta["pods_at_edges"] == 2, at_edges.meta
    assert raw.meta["read"].startswith("raw"), raw.meta["read"]
    np.testing.assert_array_equal(at_edges.load, raw.load)
    np.testing.assert_array_equal(at_edges.bucket_steps, raw.bucket_steps)
    assert at_edges.load.sum() > 0 and at_edges.num_buckets == WINDOW
