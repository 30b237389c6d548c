"""The Prometheus reader on answers of a real Prometheus 2.42 (skipped without the binary).

The exporter's counters are backfilled with ``promtool tsdb create-blocks-from openmetrics`` (a
sample every 5 s, three hours ago), Prometheus serves them, and the range queries documented in
docs/traces.md go through its HTTP API unchanged into ``trace_from_prometheus``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from moe_eplb.eplb.trace import TraceError
from moe_eplb.eplb.tracefile import trace_from_prometheus
from moe_eplb.exporter import names

PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(not (PROMETHEUS and PROMTOOL), reason="no prometheus/promtool binary (apt-get install prometheus)"),
]

T, L, E = 8, 3, 4
SCRAPE = 5  # seconds between samples
BUCKET = 15
# layer 2 reports no series at all in the second query set; expert (1, 3) never received a token;
# expert (0, 2)'s counter appears at bucket 3
LOAD = (np.arange(T * L * E).reshape(T, L, E) % 7 + 1) * 30.0
LOAD[:, 1, 3] = 0
LOAD[:3, 0, 2] = 0
STEPS = np.array([300, 300, 270, 300, 0, 150, 300, 300])


def _openmetrics(t0: int) -> str:
    """The exporter's counters as OpenMetrics text with timestamps: a sample at ``t0`` and every
    5 s after, so each 15 s bucket holds three equal increments (``increase()`` is then exact)."""
    per = BUCKET // SCRAPE
    times = [t0 + i * SCRAPE for i in range(T * per + 1)]
    lines = [f"# TYPE {names.EXPERT_TOKENS.removesuffix('_total')} counter"]
    for l in range(L):
        for e in range(E):
            if (l, e) == (1, 3):
                continue  # never received a token: the exporter never created the counter
            values = 1e6 + np.concatenate([[0.0], np.cumsum(np.repeat(LOAD[:, l, e] / per, per))])
            first = 3 * per + 1 if (l, e) == (0, 2) else 0  # counter created during bucket 3
            lines += [f'{names.EXPERT_TOKENS}{{model="m",layer="{l}",expert="{e}"}} {v:.1f} {ts}'
                      for ts, v in list(zip(times, values))[first:]]
    lines.append(f"# TYPE {names.ENGINE_STEPS.removesuffix('_total')} counter")
    values = 5e5 + np.concatenate([[0.0], np.cumsum(np.repeat(STEPS / per, per))])
    lines += [f'{names.ENGINE_STEPS}{{model="m"}} {v:.1f} {ts}' for ts, v in zip(times, values)]
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    work = tmp_path_factory.mktemp("prom-trace")
    t0 = (int(time.time()) - 3 * 3600) // BUCKET * BUCKET
    (work / "data.om").write_text(_openmetrics(t0))
    subprocess.run([PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(work / "data.om"), str(work / "data")],
                   check=True, capture_output=True, timeout=60)
    (work / "p.yml").write_text("global:\n  scrape_interval: 1h\n")
    port = _free_port()
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={work / 'p.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("prometheus did not become ready")
            time.sleep(0.1)

        def query_range(expr: str) -> dict:
            params = urllib.parse.urlencode({"query": expr, "start": t0 + BUCKET, "end": t0 + T * BUCKET, "step": BUCKET})
            with urllib.request.urlopen(f"{base}/api/v1/query_range?{params}", timeout=10) as r:
                return json.loads(r.read())

        yield query_range
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_documented_queries_give_the_exact_trace(prom):
    experts = prom(f'sum by (layer, expert) (increase({names.EXPERT_TOKENS}{{model="m"}}[{BUCKET}s]))')
    steps = prom(f'increase({names.ENGINE_STEPS}{{model="m"}}[{BUCKET}s])')
    trace = trace_from_prometheus(experts, steps, num_experts=E, top_k=2, model="m")
    assert trace.load.shape == (T, L, E) and trace.bucket_seconds == BUCKET
    np.testing.assert_array_equal(trace.bucket_steps, STEPS)
    full = np.ones((L, E), dtype=bool)
    full[0, 2] = False  # created late: increase() extrapolates its first window; checked below
    np.testing.assert_allclose(trace.load[:, full], LOAD[:, full], rtol=1e-9)
    np.testing.assert_array_equal(trace.load[:3, 0, 2], 0)  # no counter yet: zero
    np.testing.assert_array_equal(trace.load[:, 1, 3], 0)  # never created: zero
    np.testing.assert_allclose(trace.load[4:, 0, 2], LOAD[4:, 0, 2], rtol=1e-9)


def test_a_layer_the_query_lost_is_an_error(prom):
    experts = prom(f'sum by (layer, expert) (increase({names.EXPERT_TOKENS}{{model="m",layer!="1"}}[{BUCKET}s]))')
    steps = prom(f'increase({names.ENGINE_STEPS}{{model="m"}}[{BUCKET}s])')
    with pytest.raises(TraceError, match=r"layer: no series at all for layer\(s\) \[1\] of 3"):
        trace_from_prometheus(experts, steps)
