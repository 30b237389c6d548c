"""The exporter's per-rank step and KV series, its registry (no ``*_created`` series), its process's
clean-up on SIGTERM and engine-wide counters while ranks report one by one: the parts of the
telemetry that need no vLLM (tests/exporter/test_telemetry.py runs the rest against vLLM's real
``EplbState``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from prometheus_client import Counter, Histogram
from prometheus_client.exposition import generate_latest

from moe_eplb.contracts import metric_names
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.collector import PodCollector
from moe_eplb.exporter.server import make_registry
from moe_eplb_harness.floor.procs import free_port
from tests.exporter.exporter_helpers import env_without_exporter


def test_step_and_kv_series_per_rank(tmp_path):
    for rank in (0, 1):
        m = snap.ModelSnapshot(name="tiny", ep_rank=rank, ep_size=2, expert_tokens=np.ones((1, 2)),
                               rank_tokens=np.ones((1, 2)), replicas=np.ones((1, 2), np.int64), steps=3)
        m.step_seconds_buckets[3] = 2  # 2 steps in (0.005, 0.01]
        m.step_seconds_buckets[4] = 1  # 1 step in (0.01, 0.02]
        m.step_seconds_sum = 0.03
        m.step_tokens_buckets[2] = 3  # (4, 16]
        m.step_tokens_sum = 30.0 + rank
        m.kv_cache_bytes = 1 << 30
        snap.write(str(tmp_path), snap.WorkerSnapshot(pid=10 + rank, time=0, models=[m]))
    samples = [s for f in PodCollector(str(tmp_path)).collect() for s in f.samples]

    def value(name, **labels):
        (v,) = [s.value for s in samples if s.name == name and all(s.labels.get(k) == x for k, x in labels.items())]
        return v

    for rank in ("0", "1"):
        assert value(metric_names.STEP_SECONDS + "_count", rank=rank, model_name="tiny") == 3
        assert value(metric_names.STEP_SECONDS + "_bucket", rank=rank, le="0.01") == 2
        assert value(metric_names.STEP_SECONDS + "_bucket", rank=rank, le="0.02") == 3
        assert value(metric_names.STEP_TOKENS + "_sum", rank=rank) == 30 + int(rank)
        assert value(metric_names.KV_CACHE_BYTES, rank=rank) == float(1 << 30)


def test_no_created_series():
    """prometheus_client adds a ``*_created`` series to every counter and histogram unless told not to."""
    from moe_eplb.exporter import collector

    d = tempfile.mkdtemp()
    registry = make_registry(collector.PodCollector(d))
    Counter("moe_eplb_probe_total", "a plain counter in the exporter's registry", registry=registry).inc()
    Histogram("moe_eplb_probe_seconds", "a plain histogram", registry=registry).observe(0.1)
    m = snap.ModelSnapshot(name="tiny", ep_rank=0, ep_size=1, expert_tokens=np.ones((1, 2)),
                           rank_tokens=np.ones((1, 1)), replicas=np.ones((1, 2), np.int64), steps=3,
                           rearrangements=1)
    snap.write(d, snap.WorkerSnapshot(pid=1, time=0, models=[m]))
    text = generate_latest(registry).decode()
    assert "moe_eplb_probe_total 1.0" in text and metric_names.REARRANGEMENTS in text
    assert "_created" not in text


SERVER_ON_SIGTERM = r"""
import sys
from moe_eplb.exporter import server
sys.exit(server.run_forever(None, poll_seconds=0.05))
"""


def test_exporter_process_cleans_up_on_sigterm(tmp_path):
    """Stopping a pod (or a test's process group) sends SIGTERM to every process: the exporter
    process removes the directory it owns instead of dying with it in /dev/shm."""
    directory = tmp_path / "pod"
    directory.mkdir()
    env = env_without_exporter()
    env.update(MOE_EPLB_EXPORTER_DIR=str(directory), MOE_EPLB_EXPORTER_DIR_OWNED="1",
               MOE_EPLB_EXPORTER_PORT=str(free_port()), MOE_EPLB_EXPORTER_ADDRESS="127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-c", SERVER_ON_SIGTERM], env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any("serving" in line for line in lines):
            time.sleep(0.05)
        assert any("serving" in line for line in lines), lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not os.path.exists(directory)
    finally:
        proc.kill()


def _rank_snapshot(rank, steps, rearrangements, start):
    m = snap.ModelSnapshot(name="tiny", ep_rank=rank, ep_size=2, expert_tokens=np.full((1, 2), float(steps)),
                           rank_tokens=np.full((1, 2), float(steps)), replicas=np.ones((1, 2), np.int64),
                           steps=steps, rearrangements=rearrangements, start_time=start)
    return snap.WorkerSnapshot(pid=100 + rank, time=0, models=[m])


def test_engine_wide_counters_never_go_down_as_ranks_report(tmp_path):
    """Seen on the real engine: the two workers' first snapshots land milliseconds apart; a scrape in
    between saw one rank. Taking engine-wide values from a fixed rank (the lowest) or the start time
    from whichever ranks are present then made the pod look restarted to Prometheus and the load
    reader (which counted the first snapshot twice)."""
    from moe_eplb.exporter.collector import aggregate

    seen = []
    # rank 1 reports first, then rank 0 (a step behind), then both move on
    rounds = [[_rank_snapshot(1, 10, 1, 50.0)],
              [_rank_snapshot(1, 10, 1, 50.0), _rank_snapshot(0, 9, 1, 50.0)],
              [_rank_snapshot(1, 11, 1, 50.0), _rank_snapshot(0, 12, 2, 50.0)]]
    for snapshots in rounds:
        (pm,) = aggregate(snapshots).values()
        seen.append((pm.steps, pm.rearrangements, pm.start_time))
    assert seen == [(10, 1, 50.0), (10, 1, 50.0), (12, 2, 50.0)]
