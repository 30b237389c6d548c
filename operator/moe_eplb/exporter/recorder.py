"""Worker side: accumulate vLLM's per-step expert load on the device and read it back rarely.

Per engine step and model (called from the patched ``EplbState.step``, before vLLM's own step):

* ``acc_logical[l, e] += pass[l, p]`` for ``e = physical_to_logical[l, p]`` (one ``scatter_add_``;
  done in logical space every step so a rearrangement never mixes old and new slot meanings);
* ``acc_physical[l, p] += pass[l, p]`` (slot ``p`` belongs to EP rank ``p // (P / EP)`` for good,
  so tokens per destination rank can be summed later).

Both are int32 device tensors holding the tokens since the last read-back. Every
``flush_seconds`` the recorder enqueues a non-blocking copy to pinned host memory, records an event
and zeroes the accumulators (stream order keeps that exact); a later step polls the event and, once
it has fired, adds the copy to float64 host totals and hands a snapshot to a writer thread. Nothing
here waits for the GPU. Per step that is 2 small kernels (+1 ``zero_`` and +1 ``fill_`` on layouts
that gate recording), measured by ``bench/bench_exporter.py``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.layout import Layout, ModelHandle

log = logging.getLogger("moe_eplb.exporter")


def default_ep_info() -> tuple[int, int] | None:
    """(ep_rank, ep_size) from vLLM's EP group, or None when it is not initialised."""
    try:
        from vllm.distributed.parallel_state import get_ep_group

        group = get_ep_group()
        return int(group.rank_in_group), int(group.world_size)
    except Exception:  # noqa: BLE001 - any failure means "unknown"
        return None


class ModelAccumulator:
    """Device accumulators and host totals for one model on one EP rank."""

    def __init__(self, handle: ModelHandle, ep_rank: int, ep_size: int, layout: Layout):
        import torch

        self.torch = torch
        self.handle = handle
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.layout = layout
        load_pass = handle.load_pass
        self.device = load_pass.device
        L, E = handle.num_layers, handle.num_experts
        self.shape_physical = tuple(load_pass.shape)
        self.acc_logical = torch.zeros((L, E + 1), dtype=torch.int32, device=self.device)
        self.acc_physical = torch.zeros(self.shape_physical, dtype=torch.int32, device=self.device)
        self._idx = None
        self._idx_key: tuple | None = None
        self.expert_tokens = np.zeros((L, E), np.float64)
        self.rank_tokens = np.zeros((L, ep_size), np.float64)
        self.replicas = np.ones((L, E), np.int64)
        self.steps = 0
        self.rearrangements = 0
        self.duration_buckets = np.zeros(len(snap.DURATION_BUCKETS) + 1, np.int64)
        self.duration_sum = 0.0
        self.start_time = time.time()
        self._rank_warned = False
        self.host_buffers = None  # pinned copies of (acc_logical, acc_physical, replica_count)

    def _index(self):
        """physical_to_logical as int64 with empty slots (-1) sent to column E (dropped later).
        Recomputed only when vLLM changed the map (tensor identity or in-place version)."""
        p2l = self.handle.physical_to_logical
        key = (id(p2l), p2l._version, tuple(p2l.shape))
        if key != self._idx_key:
            E = self.handle.num_experts
            self._idx = self.torch.where(p2l >= 0, p2l, E).to(self.torch.int64)
            self._idx_key = key
        return self._idx

    def add_pass(self) -> None:
        load_pass = self.handle.load_pass
        if tuple(load_pass.shape) != self.shape_physical:  # elastic EP resized the slots
            self.shape_physical = tuple(load_pass.shape)
            self.acc_physical = self.torch.zeros(self.shape_physical, dtype=self.torch.int32, device=self.device)
        self.acc_logical.scatter_add_(1, self._index(), load_pass.to(self.torch.int32))
        self.acc_physical.add_(load_pass)

    def add_host(self, logical: np.ndarray, physical: np.ndarray, replicas: np.ndarray) -> None:
        """Fold one read-back (host copies of the accumulators) into the cumulative totals."""
        self.expert_tokens += logical[:, : self.handle.num_experts]
        L, P = physical.shape
        if self.ep_size > 0 and P % self.ep_size == 0:
            self.rank_tokens += physical.reshape(L, self.ep_size, P // self.ep_size).sum(axis=2)
        elif not self._rank_warned:
            self._rank_warned = True
            log.warning("moe-eplb exporter: %d physical slots do not split over %d EP ranks; "
                        "rank token counters are not updated", P, self.ep_size)
        self.replicas = replicas.astype(np.int64, copy=True)

    def observe_duration(self, seconds: float) -> None:
        self.duration_sum += seconds
        idx = int(np.searchsorted(np.asarray(snap.DURATION_BUCKETS), seconds, side="left"))
        self.duration_buckets[idx] += 1

    def to_snapshot(self) -> snap.ModelSnapshot:
        return snap.ModelSnapshot(
            name=self.handle.name,
            ep_rank=self.ep_rank,
            ep_size=self.ep_size,
            expert_tokens=self.expert_tokens.copy(),
            rank_tokens=self.rank_tokens.copy(),
            replicas=self.replicas.copy(),
            steps=self.steps,
            rearrangements=self.rearrangements,
            duration_buckets=self.duration_buckets.copy(),
            duration_sum=self.duration_sum,
            window_size=self.layout.window_size,
            step_interval=self.layout.step_interval,
            num_redundant_experts=self.layout.num_redundant_experts,
            num_physical_experts=self.shape_physical[1],
            start_time=self.start_time,
        )


class SnapshotWriter:
    """Writes the newest snapshot of this process in a daemon thread (the step loop never does I/O)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, name="moe-eplb-snapshot", daemon=True)
        self._thread.start()

    def submit(self, snapshot: snap.WorkerSnapshot) -> None:
        try:
            self._queue.get_nowait()  # drop an unwritten older snapshot: only the newest matters
            self._queue.task_done()
        except queue.Empty:
            pass
        try:
            self._queue.put_nowait(snapshot)
        except queue.Full:
            pass

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until the queued snapshot is on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return
            time.sleep(0.005)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                os.makedirs(self.directory, exist_ok=True)
                snap.write(self.directory, item)
            except Exception:  # noqa: BLE001
                log.exception("moe-eplb exporter: could not write %s", self.directory)
            finally:
                self._queue.task_done()


class StateRecorder:
    """Everything the exporter does for one ``EplbState`` (one worker process)."""

    def __init__(
        self,
        eplb_state: Any,
        layout: Layout,
        writer: SnapshotWriter | None,
        flush_seconds: float = 1.0,
        ep_info: Callable[[], tuple[int, int] | None] = default_ep_info,
        clock: Callable[[], float] = time.monotonic,
        vllm_version: str = "",
    ):
        import torch

        self.torch = torch
        self.eplb_state = eplb_state
        self.layout = layout
        self.writer = writer
        self.flush_seconds = flush_seconds
        self.clock = clock
        self.vllm_version = vllm_version
        info = ep_info()
        models = []
        for h in layout.models:
            if info is None:
                local = getattr(h.state.model, "num_local_physical_experts", None)
                P = h.num_physical_experts
                ep_rank, ep_size = 0, (P // int(local)) if local else 1
            else:
                ep_rank, ep_size = info
            models.append(ModelAccumulator(h, ep_rank, ep_size, layout))
        self.models = models
        self._model_keys = [h.key for h in layout.models]
        self._pending = None  # (event or None, host tensors per model)
        self._last_flush = clock()
        self._rearrange_started: float | None = None
        self._async_pending: float | None = None

    # --- called around vLLM's step -------------------------------------------------------------
    def before_step(self, is_dummy: bool) -> None:
        for m in self.models:
            if not is_dummy:
                m.add_pass()
            m.steps += 1

    def after_step(self) -> None:
        st = self.eplb_state
        if self.layout.gated:
            # vLLM left the pass untouched on steps it does not keep in its window; we already
            # counted it, so clear it (vLLM's window never sees more than this step's load), and
            # keep the router recording every step.
            for m in self.models:
                m.handle.load_pass.zero_()
            flag = getattr(st, "should_record_tensor", None)
            if flag is not None:
                flag.fill_(True)
        if self._async_pending is not None and not any(m.handle.rebalancing for m in self.models):
            seconds = self.clock() - self._async_pending
            self._async_pending = None
            for m in self.models:
                m.observe_duration(seconds)
        self.poll()
        if self._pending is None and self.clock() - self._last_flush >= self.flush_seconds:
            self.start_readback()

    def rearrange_started(self) -> None:
        self._rearrange_started = self.clock()

    def rearrange_finished(self) -> None:
        start, self._rearrange_started = self._rearrange_started, None
        if start is None:
            return
        for m in self.models:
            m.rearrangements += 1
        if self.layout.is_async and any(m.handle.rebalancing for m in self.models):
            self._async_pending = start  # finished when the last layer is committed
        else:
            seconds = self.clock() - start
            for m in self.models:
                m.observe_duration(seconds)

    # --- read-back ------------------------------------------------------------------------------
    def start_readback(self) -> None:
        torch = self.torch
        self._last_flush = self.clock()
        copies = []
        event = None
        for m in self.models:
            srcs = (m.acc_logical, m.acc_physical, m.handle.replica_count)
            if m.device.type == "cpu":
                copies.append(tuple(s.clone() for s in srcs))
            else:
                # pinned host buffers, allocated once (one read-back is in flight at a time)
                if m.host_buffers is None or any(b.shape != s.shape for b, s in zip(m.host_buffers, srcs)):
                    m.host_buffers = tuple(torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in srcs)
                for d, s in zip(m.host_buffers, srcs):
                    d.copy_(s, non_blocking=True)
                copies.append(m.host_buffers)
            m.acc_logical.zero_()
            m.acc_physical.zero_()
        if any(m.device.type != "cpu" for m in self.models):
            event = torch.cuda.Event() if torch.cuda.is_available() else torch.Event()
            event.record()
        self._pending = (event, copies)
        self.poll()

    def poll(self) -> bool:
        """Fold a finished read-back into the totals and submit a snapshot; True if it did."""
        if self._pending is None:
            return False
        event, copies = self._pending
        if event is not None and not event.query():
            return False
        self._pending = None
        for m, (logical, physical, replicas) in zip(self.models, copies):
            m.add_host(logical.numpy().astype(np.float64), physical.numpy().astype(np.float64), replicas.numpy())
        if self.writer is not None:
            self.writer.submit(self.snapshot())
        return True

    def flush_now(self) -> None:
        """Read back synchronously (tests and shutdown only: this waits for the device)."""
        if self._pending is None:
            self.start_readback()
        if self._pending is not None:
            event = self._pending[0]
            if event is not None:
                event.synchronize()
            self.poll()

    def snapshot(self) -> snap.WorkerSnapshot:
        return snap.WorkerSnapshot(
            pid=os.getpid(),
            time=time.time(),
            models=[m.to_snapshot() for m in self.models],
            vllm=self.vllm_version,
            layout=self.layout.name,
        )
