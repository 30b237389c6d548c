"""Opt-in trace capture: write the pod's expert load as the project's trace format.

Enabled by ``MOE_EPLB_TRACE_DIR`` (a directory, e.g. on a PVC). The process that serves the port
wakes every ``MOE_EPLB_TRACE_BUCKET_SECONDS``, sums the workers' counters (as the ``/metrics``
server does) and appends one bucket per model: the tokens routed to each (layer, logical expert)
and the engine steps since the previous bucket. After each bucket it rewrites
``<dir>/<model>-<host>-<start>-<part>.npz`` atomically
(:func:`moe_eplb.contracts.trace_format.write_trace_file`), starting a new part every
``MOE_EPLB_TRACE_MAX_BUCKETS`` buckets so no file grows without bound. Read them with
``moe-eplb tune --trace <file>`` (or ``moe_eplb.eplb.workload.tracefile.load_trace``).

A pod holds the load routed by its own EP ranks; for an engine that spans several pods each pod's
file is that pod's share (add the files' ``load`` to get the engine's), or read the whole engine
from Prometheus with the operator's load reader.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time

import numpy as np

from moe_eplb.contracts.trace_format import write_trace_file
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.collector import aggregate

log = logging.getLogger("moe_eplb.exporter")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"


class TraceCapture:
    """Turns successive pod totals into trace buckets and files. ``tick()`` is one bucket."""

    def __init__(self, snapshot_dir: str, trace_dir: str, bucket_seconds: float, max_buckets: int = 360,
                 host: str | None = None, suffix: str = ".npz"):
        self.snapshot_dir = snapshot_dir
        self.trace_dir = trace_dir
        self.bucket_seconds = bucket_seconds
        self.max_buckets = max_buckets
        self.host = _slug(host or socket.gethostname())
        self.started = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.suffix = suffix
        self._last: dict[str, tuple[np.ndarray, int]] = {}
        self._buckets: dict[str, list[tuple[np.ndarray, int]]] = {}
        self._part: dict[str, int] = {}
        self._stop = threading.Event()
        self.paths: list[str] = []

    def tick(self) -> list[str]:
        """Append one bucket per model from the current totals; returns the files written."""
        written = []
        for name, pm in aggregate(snap.read_all(self.snapshot_dir)).items():
            last = self._last.get(name)
            tokens, steps = pm.expert_tokens, pm.steps
            self._last[name] = (tokens.copy(), steps)
            if last is None:
                base_tokens, base_steps = np.zeros_like(tokens), 0  # counters start at 0 with the engine
            else:
                base_tokens, base_steps = last
            if base_tokens.shape != tokens.shape or steps < base_steps or np.any(tokens < base_tokens):
                log.warning("moe-eplb trace capture: counters of %s restarted; starting a new file", name)
                self._buckets[name] = []
                self._part[name] = self._part.get(name, 0) + 1
                base_tokens, base_steps = np.zeros_like(tokens), 0
            buckets = self._buckets.setdefault(name, [])
            if len(buckets) >= self.max_buckets:
                buckets.clear()
                self._part[name] = self._part.get(name, 0) + 1
            buckets.append((tokens - base_tokens, steps - base_steps))
            load = np.stack([b[0] for b in buckets])
            data = {"num_layers": load.shape[1], "num_experts": load.shape[2],
                    "bucket_steps": np.array([b[1] for b in buckets], np.int64), "load": load,
                    "bucket_seconds": float(self.bucket_seconds), "model": name}
            path = os.path.join(
                self.trace_dir, f"{_slug(name)}-{self.host}-{self.started}-{self._part.get(name, 0):04d}{self.suffix}"
            )
            os.makedirs(self.trace_dir, exist_ok=True)
            write_trace_file(data, path)
            if path not in self.paths:
                self.paths.append(path)
            written.append(path)
        return written

    def run(self) -> None:
        while not self._stop.wait(self.bucket_seconds):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - capture must never take the server down
                log.exception("moe-eplb trace capture: writing a bucket failed")

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="moe-eplb-trace", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
