"""Worker side: accumulate vLLM's per-step expert load on the device and read it back rarely.

Per engine step and model (called from the patched ``EplbState.step``, before vLLM's own step):
``acc_epoch[l, p] += pass[l, p]`` -- one ``add_`` (and nothing else on the device) as long as the
expert map stays the same. Whenever vLLM changes the map (a rearrangement, detected by the map
tensor's in-place version counter) and at every read-back, the epoch is folded, with the map it was
recorded under:

* ``acc_logical[l, e] += acc_epoch[l, p]`` for ``e = physical_to_logical[l, p]`` (one
  ``scatter_add_`` per map, so old and new slot meanings never mix);
* ``acc_physical[l, p] += acc_epoch[l, p]`` (slot ``p`` belongs to EP rank ``p // (P / EP)`` for
  good, so tokens per destination rank can be summed later).

The pass of step ``n`` was recorded in forward ``n`` with the map that step ``n - 1`` (its
rearrangement included) left, and is added before step ``n`` may rearrange: so the fold at the
first step after a map change attributes every token to the map it was routed with.

The accumulators are int32 device tensors holding the tokens since the last read-back. Every
``flush_seconds`` the recorder enqueues a non-blocking copy to pinned host memory, records an event
and zeroes the accumulators (stream order keeps that exact); a later step polls the event and, once
it has fired, adds the copy to float64 host totals and hands a snapshot to a writer thread. Nothing
here waits for the GPU. Per step that is 1 small kernel (+1 ``zero_`` and +1 ``fill_`` on layouts
that gate recording), measured by ``bench/bench_exporter.py`` and, inside a real engine,
``bench/bench_exporter_real.py``.

An idle engine runs no steps, so no step can start the last read-back. With ``idle_flush`` (the
plugin turns it on) a daemon thread does it once no step has run for ``flush_seconds`` and counts
are pending; it waits on the device event itself, never in the step loop. A lock serialises it with
the per-step methods (uncontended while the engine runs: the thread only acts when it is idle).

Step telemetry, per model on this rank, host-side only (no device work, no sync):

* step duration: wall time from the end of the previous EPLB step to the end of this one, i.e.
  the engine's whole step (scheduling, forward, sampling, a sync rearrangement). If the engine
  waited for work -- more than ``IDLE_GAP_SECONDS`` between the previous step's end and this step's
  start (its first ``prepare_forward``; the EPLB step itself for dummy steps) -- the step is timed
  from that start instead, so waiting for requests never counts as a step;
* step tokens: the real (unpadded) tokens of this rank's forward in the step, as vLLM passes them
  to ``EplbState.prepare_forward``: the tokens its router dispatched, each to ``top_k`` experts
  (so ``tokens * top_k`` is the step's load pass summed over the slots of any MoE layer). Dummy
  steps count 0.

``exporter_seconds`` (in the snapshot) is the CPU time the step thread spent in the exporter's
per-step code (its part of the patched ``step`` and ``prepare_forward``), so the exporter's cost can
be read off a running engine (``bench/bench_exporter_real.py``).
"""

from __future__ import annotations

import bisect
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from moe_eplb.contracts import metric_names, vllm_facts
from moe_eplb.exporter import rebalance_signals
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.layout import EplbLayout, ModelHandle

log = logging.getLogger("moe_eplb.exporter")

#: A gap longer than this between a step's end and the next step's start is the engine waiting for
#: requests: the next step is timed from its own start (see the module docstring).
IDLE_GAP_SECONDS = 1.0
#: Attribute of the ``EplbState`` where the hook keeps the worker's ``VllmConfig``.
VLLM_CONFIG_ATTR = "_moe_eplb_vllm_config"


def default_ep_info() -> tuple[int, int] | None:
    """(ep_rank, ep_size) from vLLM's EP group, or None when it is not initialised."""
    try:
        from vllm.distributed.parallel_state import get_ep_group

        group = get_ep_group()
        return int(group.rank_in_group), int(group.world_size)
    except Exception:  # noqa: BLE001 - any failure means "unknown"
        return None


def kv_cache_bytes(vllm_config: Any) -> int | None:
    """Bytes of the KV cache this worker allocated: the distinct storages of the ``kv_cache``
    tensors of the attention layers in ``compilation_config.static_forward_context`` (where vLLM's
    model runner binds them). None before the cache exists or when the config is unknown."""
    if vllm_config is None:
        return None
    try:
        context = vllm_config.compilation_config.static_forward_context
    except AttributeError:
        return None
    seen: dict[int, int] = {}
    for layer in list(context.values()):
        kv = getattr(layer, "kv_cache", None)
        tensors = kv if isinstance(kv, (list, tuple)) else [kv]
        for t in tensors:
            if t is None or not hasattr(t, "untyped_storage"):
                continue
            try:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = int(storage.nbytes())
            except Exception:  # noqa: BLE001 - a placeholder tensor without storage
                continue
    total = sum(seen.values())
    return total if total > 0 else None


class ModelAccumulator:
    """Device accumulators and host totals for one model on one EP rank."""

    def __init__(self, handle: ModelHandle, ep_rank: int, ep_size: int, layout: EplbLayout,
                 start_time: float | None = None):
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
        self.acc_epoch = torch.zeros(self.shape_physical, dtype=torch.int32, device=self.device)
        self._idx = None
        self._idx_key: tuple | None = None
        self.expert_tokens = np.zeros((L, E), np.float64)
        self.rank_tokens = np.zeros((L, ep_size), np.float64)
        self.replicas = np.ones((L, E), np.int64)
        self.steps = 0
        self.rearrangements = 0
        self.duration_buckets = np.zeros(len(snap.DURATION_BUCKETS) + 1, np.int64)
        self.duration_sum = 0.0
        self.start_time = time.time() if start_time is None else start_time
        self.step_seconds_buckets = np.zeros(len(metric_names.STEP_SECONDS_BUCKETS) + 1, np.int64)
        self.step_seconds_sum = 0.0
        self.step_tokens_buckets = np.zeros(len(metric_names.STEP_TOKENS_BUCKETS) + 1, np.int64)
        self.step_tokens_sum = 0.0
        self.forward_tokens = 0  # tokens of the forward(s) of the step under way (prepare_forward)
        self.kv_cache_bytes: int | None = None
        # vLLM's own health signals (layout.health_signals: vLLM >= 0.34; exported only then)
        self.async_buckets = np.zeros(len(snap.DURATION_BUCKETS) + 1, np.int64)
        self.async_sum = 0.0
        self.rebalance_failures = 0
        self._rank_warned = False
        self.host_buffers = None  # pinned copies of (acc_logical, acc_physical, replica_count)

    def add_pass(self) -> None:
        load_pass = self.handle.load_pass
        p2l = self.handle.physical_to_logical
        key = (id(p2l), p2l._version, tuple(p2l.shape))
        if key != self._idx_key:  # first step, or vLLM changed the map during the previous step
            self.fold()  # the epoch so far was routed with the old map (self._idx)
            if tuple(load_pass.shape) != self.shape_physical:  # elastic EP resized the slots
                self.shape_physical = tuple(load_pass.shape)
                zeros = lambda: self.torch.zeros(self.shape_physical, dtype=self.torch.int32, device=self.device)  # noqa: E731
                self.acc_physical, self.acc_epoch = zeros(), zeros()
            E = self.handle.num_experts
            self._idx = self.torch.where(p2l >= 0, p2l, E).to(self.torch.int64)  # empty slots -> column E
            self._idx_key = key
        self.acc_epoch.add_(load_pass)

    def fold(self) -> None:
        """Move the epoch's tokens into the logical and per-slot accumulators (device ops only)."""
        if self._idx is None or tuple(self._idx.shape) != tuple(self.acc_epoch.shape):
            return  # nothing recorded yet
        self.acc_logical.scatter_add_(1, self._idx, self.acc_epoch)
        self.acc_physical.add_(self.acc_epoch)
        self.acc_epoch.zero_()

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

    def observe_step(self, seconds: float, tokens: int) -> None:
        """One engine step on this rank (host only: two bisections of short tuples)."""
        self.step_seconds_sum += seconds
        self.step_seconds_buckets[bisect.bisect_left(metric_names.STEP_SECONDS_BUCKETS, seconds)] += 1
        self.step_tokens_sum += tokens
        self.step_tokens_buckets[bisect.bisect_left(metric_names.STEP_TOKENS_BUCKETS, tokens)] += 1

    def observe_duration(self, seconds: float) -> None:
        self.duration_sum += seconds
        idx = int(np.searchsorted(np.asarray(snap.DURATION_BUCKETS), seconds, side="left"))
        self.duration_buckets[idx] += 1

    def observe_async(self, seconds: float) -> None:
        """One async rearrangement cycle as vLLM timed it (its "Async EPLB rearranged" line)."""
        self.async_sum += seconds
        self.async_buckets[int(np.searchsorted(np.asarray(snap.DURATION_BUCKETS), seconds, side="left"))] += 1

    def to_snapshot(self) -> snap.ModelSnapshot:
        signals = self.layout.health_signals
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
            use_async=self.layout.is_async,
            num_physical_experts=self.shape_physical[1],
            start_time=self.start_time,
            step_seconds_buckets=self.step_seconds_buckets.copy(),
            step_seconds_sum=self.step_seconds_sum,
            step_tokens_buckets=self.step_tokens_buckets.copy(),
            step_tokens_sum=self.step_tokens_sum,
            top_k=self.handle.top_k,
            kv_cache_bytes=self.kv_cache_bytes,
            rebalance_failures=self.rebalance_failures if signals else None,
            async_duration_buckets=self.async_buckets.copy() if signals and self.layout.is_async else None,
            async_duration_sum=self.async_sum,
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

    def write_now(self, snapshot: snap.WorkerSnapshot) -> None:
        """Write ``snapshot`` from the calling thread (the worker may be about to die)."""
        os.makedirs(self.directory, exist_ok=True)
        snap.write(self.directory, snapshot)

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
        layout: EplbLayout,
        writer: SnapshotWriter | None,
        flush_seconds: float = 1.0,
        ep_info: Callable[[], tuple[int, int] | None] = default_ep_info,
        clock: Callable[[], float] = time.monotonic,
        vllm_version: str = "",
        idle_flush: bool = False,
        start_time: float | None = None,
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
            models.append(ModelAccumulator(h, ep_rank, ep_size, layout, start_time))
        self.models = models
        self._by_state = {id(m.handle.state): m for m in models}
        self._model_keys = [h.key for h in layout.models]
        self._pending = None  # (event or None, host tensors per model)
        self._last_flush = clock()
        self._rearrange_started: float | None = None
        self._async_pending: float | None = None
        # step telemetry
        self._forward_t: float | None = None  # start of the step under way (first prepare_forward)
        self._step_begin = 0.0
        self._step_dummy = False
        self._last_step_end: float | None = None
        self.exporter_seconds = 0.0  # CPU time the hook spent in exporter code around vLLM's step
        self.recorded_steps = 0
        self._steps_read = 0  # recorded_steps at the last read-back
        # idle flush
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle_thread = None
        # vLLM's own health signals (.rebalance_signals): the async cycles it logs, the failures seen (by id)
        self._tap = rebalance_signals.attach_tap() if layout.health_signals and layout.is_async else None
        self._failures_seen: set[int] = set()
        if idle_flush:
            self._idle_thread = threading.Thread(target=self._idle_loop, name="moe-eplb-idle-flush", daemon=True)
            self._idle_thread.start()

    # --- called by the hook around vLLM's methods ----------------------------------------------
    def forward_started(self, model_state: Any, num_unpadded_tokens: int) -> None:
        """``EplbState.prepare_forward`` ran for ``model_state`` with this many real tokens."""
        if self._forward_t is None:
            self._forward_t = self.clock()
        m = self._by_state.get(id(model_state))
        if m is not None:
            m.forward_tokens += num_unpadded_tokens

    def before_step(self, is_dummy: bool) -> None:
        self._step_begin = self.clock()
        self._step_dummy = is_dummy
        with self._lock:
            for m in self.models:
                if not is_dummy:
                    m.add_pass()
                m.steps += 1

    def after_step(self) -> None:
        end = self.clock()
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
        start = self._forward_t if self._forward_t is not None else self._step_begin
        last = self._last_step_end
        seconds = end - start if last is None or start - last > IDLE_GAP_SECONDS else end - last
        for m in self.models:
            m.observe_step(seconds, 0 if self._step_dummy else m.forward_tokens)
            m.forward_tokens = 0
        self._forward_t = None
        self._last_step_end = end
        self.recorded_steps += 1
        self._health_after_step(st)
        if self._async_pending is not None and not any(m.handle.rebalancing for m in self.models):
            seconds = self.clock() - self._async_pending
            self._async_pending = None
            for m in self.models:
                m.observe_duration(seconds)
        with self._lock:
            self.poll()
            if self._pending is None and self.clock() - self._last_flush >= self.flush_seconds:
                self.start_readback()

    def _health_after_step(self, st: Any) -> None:
        """Take vLLM's async cycle timings logged since the last step, and a dead async worker."""
        if self._tap is not None:
            for name, _done, _total, seconds in self._tap.drain():  # vLLM logs its EplbModelState.model_name
                for m in self.models:
                    if getattr(m.handle.state, "model_name", None) == name:
                        m.observe_async(seconds)
        error = getattr(st, vllm_facts.ASYNC_WORKER_ERROR_ATTR, None) if self.layout.health_signals else None
        if error is not None:
            self.rebalance_failed(error)

    def step_failed(self, exc: BaseException) -> None:
        """vLLM's step raised ``exc`` (the hook re-raises it): count it when it is the async
        worker's failure."""
        failure = rebalance_signals.failure_of(exc)
        if failure is not None:
            self.rebalance_failed(failure)

    def rebalance_failed(self, failure: BaseException) -> None:
        """Count one async worker failure (each exception once) and write the snapshot at once: vLLM
        is about to stop this worker unless fault tolerance keeps it."""
        if id(failure) in self._failures_seen:
            return
        self._failures_seen.add(id(failure))
        for m in self.models:
            m.rebalance_failures += 1
        log.error("moe-eplb exporter: vLLM's async EPLB worker failed (%s: %s)", type(failure).__name__, failure)
        if self.writer is not None:
            self.writer.write_now(self.snapshot())

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

    # --- read-back (callers hold self._lock) --------------------------------------------------
    def start_readback(self) -> None:
        torch = self.torch
        self._last_flush = self.clock()
        self._steps_read = self.recorded_steps
        kv = kv_cache_bytes(self.eplb_state.__dict__.get(VLLM_CONFIG_ATTR))
        copies = []
        event = None
        for m in self.models:
            m.kv_cache_bytes = kv
            m.fold()
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
        # the host counters as of this read-back travel with it: the snapshot written when it lands
        # shows exactly the steps whose tokens it holds (later steps wait for the next read-back)
        self._pending = (event, copies, self.snapshot())
        self.poll()

    def poll(self) -> bool:
        """Fold a finished read-back into the totals and submit a snapshot; True if it did."""
        if self._pending is None:
            return False
        event, copies, snapshot = self._pending
        if event is not None and not event.query():
            return False
        self._pending = None
        for m, (logical, physical, replicas), ms in zip(self.models, copies, snapshot.models):
            m.add_host(logical.numpy().astype(np.float64), physical.numpy().astype(np.float64), replicas.numpy())
            ms.expert_tokens, ms.rank_tokens = m.expert_tokens.copy(), m.rank_tokens.copy()
            ms.replicas = m.replicas.copy()
        if self.writer is not None:
            self.writer.submit(snapshot)
        return True

    def flush_now(self) -> None:
        """Read back synchronously (tests, idle flush and shutdown: this waits for the device)."""
        with self._lock:
            if self._pending is None:
                self.start_readback()
            pending = self._pending
        if pending is not None and pending[0] is not None:
            pending[0].synchronize()  # outside the lock: steps may go on meanwhile
        with self._lock:
            self.poll()

    def _idle_loop(self) -> None:
        """Read back what the last steps left on the device once the engine has gone idle."""
        while not self._stop.wait(self.flush_seconds):
            try:
                last = self._last_step_end
                idle = last is not None and self.clock() - last >= self.flush_seconds
                if idle and (self.recorded_steps != self._steps_read or self._pending is not None):
                    # vLLM steps under torch.inference_mode(), so the accumulators are inference
                    # tensors: updating them in place is allowed only in that mode (thread-local)
                    with self.torch.inference_mode():
                        self.flush_now()
            except Exception:  # noqa: BLE001 - never take the worker down
                log.exception("moe-eplb exporter: idle flush failed; it stops")
                return

    def close(self) -> None:
        """Stop the idle-flush thread and the log tap (tests)."""
        self._stop.set()
        if self._tap is not None:
            rebalance_signals.detach_tap(self._tap)
            self._tap = None

    def snapshot(self) -> snap.WorkerSnapshot:
        """The host counters now (tokens: as of the last read-back that landed)."""
        models = [m.to_snapshot() for m in self.models]
        # the window and interval in force (changed live, :mod:`moe_eplb.exporter.live`), not only
        # the ones the engine was started with: moe_eplb_config_info shows what runs
        window = getattr(self.eplb_state, "expert_load_window_size", None)
        interval = getattr(self.eplb_state, "expert_rearrangement_step_interval", None)
        for ms in models:
            if isinstance(window, int) and window > 0:
                ms.window_size = window
            if isinstance(interval, int) and interval > 0:
                ms.step_interval = interval
        return snap.WorkerSnapshot(
            pid=os.getpid(),
            time=time.time(),
            models=models,
            vllm=self.vllm_version,
            layout=self.layout.name,
            exporter_seconds=self.exporter_seconds,
            recorded_steps=self.recorded_steps,
        )
