"""Trace capture writes the project's trace format, bucket by bucket."""

from __future__ import annotations

import numpy as np

from moe_eplb.eplb.workload.tracefile import load_trace
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.capture import TraceCapture


def _write(d, pid, tokens, steps, rank=0):
    import os

    os.makedirs(d, exist_ok=True)
    snap.write(d, snap.WorkerSnapshot(pid=pid, time=0, models=[snap.ModelSnapshot(
        name="org/Model-1", ep_rank=rank, ep_size=2, expert_tokens=np.asarray(tokens, float),
        rank_tokens=np.zeros((2, 2)), replicas=np.ones((2, 3), np.int64), steps=steps)]))


def test_capture_buckets_and_restart(tmp_path):
    sd, td = str(tmp_path / "snap"), str(tmp_path / "traces")
    cap = TraceCapture(sd, td, bucket_seconds=5, max_buckets=3, host="pod-a")
    a = np.array([[1, 2, 3], [4, 5, 6]])
    _write(sd, 1, a, 10)
    _write(sd, 2, a * 10, 11, rank=1)  # the pod's second rank: load adds up, steps do not (the
    # most advanced rank's count is taken: rank 1's snapshot is one step ahead)
    (path,) = cap.tick()
    _write(sd, 1, a * 3, 30)
    _write(sd, 2, a * 20, 31, rank=1)
    cap.tick()
    tr = load_trace(path)
    assert path.endswith("-0000.npz") and "org_Model-1-pod-a-" in path
    np.testing.assert_array_equal(tr.load, [a * 11, a * 12])
    np.testing.assert_array_equal(tr.bucket_steps, [11, 20])
    assert tr.bucket_seconds == 5 and tr.model == "org/Model-1"
    # the engine restarts: counters drop -> a new file part counting from zero
    _write(sd, 1, a, 2)
    _write(sd, 2, a, 2, rank=1)
    (path2,) = cap.tick()
    assert path2.endswith("-0001.npz")
    np.testing.assert_array_equal(load_trace(path2).load, [a * 2])
    # max_buckets rolls over to a new part
    for i in range(3):
        _write(sd, 1, a * (2 + i), 3 + i)
        last = cap.tick()[0]
    assert last.endswith("-0002.npz") and load_trace(last).num_buckets == 1
