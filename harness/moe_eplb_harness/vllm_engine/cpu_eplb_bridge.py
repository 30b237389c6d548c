"""TEST-ONLY vLLM general plugin: bridges the five gaps that keep vLLM 0.32.0's CPU backend from
running expert parallelism with (sync) EPLB. Never shipped: it lives under ``harness/moe_eplb_harness/vllm_engine/``
(outside the product package) and is loaded only by the real-engine tests, the e2e script and the
benchmark. Every result obtained with
it is "vLLM on CPU with the test bridge", not stock vLLM.

How it is loaded: vLLM calls the entry points of the group ``vllm.general_plugins`` (filtered by
``VLLM_PLUGINS``) in every process it starts, before any config or worker is built. The bridge is
not installed, so :mod:`moe_eplb_harness.vllm_engine.plugin_dist` copies this file into a temporary directory
next to a generated ``cpu_eplb_bridge-0.0.0+test.dist-info`` (``METADATA`` + ``entry_points.txt``) and
that directory goes on the engine's ``PYTHONPATH``; ``VLLM_PLUGINS`` gets ``cpu_eplb_bridge``
added. Nothing in vLLM's files is edited: each gap is bridged by replacing one attribute at load
time.

The gaps (vLLM 0.32.0, see ../shared/notes/real-vllm-on-cpu.md) and what each point does:

1. ``model_executor/layers/fused_moe/experts/cpu_moe.py`` ``CPUUnquantizedExperts.apply`` ignores
   ``expert_map``: with EP the (physical) expert ids index past the rank's local weights. The
   bridge maps ids to local ids and gives non-local ids weight 0 (the layer's existing all-reduce
   sums the ranks' partial outputs).
2. ``config/parallel.py`` ``ParallelConfig._validate_parallel_config`` refuses ``enable_eplb``
   unless CUDA/ROCm/XPU. The bridge answers ``is_xpu() -> True`` to exactly that one ``if``
   (caller's code object and line), nowhere else.
3. ``v1/worker/cpu_model_runner.py`` ``CPUModelRunner.load_model`` never creates ``eplb_state`` /
   ``_moe_model`` (the GPU runner's does). The bridge does it after the CPU load, as the GPU runner
   does (``EplbState(parallel_config, device)``, ``add_model(moe_model, model_config)``).
4. ``model_executor/layers/fused_moe/router/base_router.py`` defines the logical->physical mapping
   and load recording (a Triton kernel) only for CUDA/ROCm/XPU; elsewhere it returns the logical
   ids and records nothing. The bridge installs :func:`eplb_map_to_physical_and_record`, a torch
   port of ``_eplb_map_and_record_i32_kernel`` (same hash, same masking).
5. Sync rearrangement calls ``torch.accelerator.current_stream()``
   (``distributed/eplb/eplb_communicator.py``) and times itself with ``torch.Event``
   (``distributed/eplb/eplb_state.py``); neither works on CPU. The bridge gives those two modules a
   ``torch`` whose ``Event`` is ``perf_counter``-based and whose ``accelerator.current_stream()``
   is a no-op stream (everything else is the real torch).

Each point first checks that vLLM still has the code it bridges (the vLLM version AND the
attribute/behaviour) and raises :class:`BridgeOutdated` otherwise. vLLM does not catch exceptions
from a plugin's function, so the engine fails to start with that message: an upgrade that fixes
or moves a gap is noticed, never silently double-bridged. Async EPLB (``use_async``, default on in
0.32) is not bridged: ``load_model`` refuses it with a clear error (use ``"use_async": false``).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import types

PLUGIN_NAME = "cpu_eplb_bridge"
VLLM_VERSION = "0.32.0"
KNUTH_MULTIPLIER = 2654435769
READY_LINE = "cpu-eplb-bridge: 5/5 gaps bridged"

log = logging.getLogger("cpu_eplb_bridge")
_done: dict = {}


class BridgeOutdated(RuntimeError):
    """vLLM no longer has the code a bridge point was written for."""


def _outdated(point: str, what: str) -> BridgeOutdated:
    return BridgeOutdated(
        f"cpu-eplb-bridge point {point}: {what}. The test bridge was written for vLLM {VLLM_VERSION}'s CPU "
        "backend; vLLM changed here (the gap may be fixed or moved): update or drop this point "
        "(harness/moe_eplb_harness/vllm_engine/cpu_eplb_bridge.py)."
    )


def _body(func) -> str:
    """Source of ``func`` after its signature (the part that does the work)."""
    src = inspect.getsource(func)
    idx = src.find(":\n", src.find(")"))
    return src[idx:]


# --- 0. version ------------------------------------------------------------------------------------
def check_version() -> str:
    import vllm

    version = getattr(vllm, "__version__", "")
    if version != VLLM_VERSION:
        raise _outdated("0 (version)", f"vLLM is {version!r}, not {VLLM_VERSION}")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise _outdated("0 (platform)", f"current platform is {type(current_platform).__name__}, not CPU")
    return version


# --- 1. expert_map in CPUUnquantizedExperts.apply -------------------------------------------------
def bridge_expert_map() -> None:
    import torch
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cls = cpu_moe.CPUUnquantizedExperts
    orig = cls.apply
    params = list(inspect.signature(orig).parameters)
    if "expert_map" not in params or "topk_ids" not in params or "topk_weights" not in params:
        raise _outdated("1 (expert_map)", f"CPUUnquantizedExperts.apply{tuple(params)} changed")
    body = _body(orig)
    if "expert_map" in body or "cpu_fused_moe(" not in body:
        raise _outdated("1 (expert_map)", "CPUUnquantizedExperts.apply now reads expert_map (or no longer calls "
                        "cpu_fused_moe)")
    sig = inspect.signature(orig)

    def apply(self, *args, **kwargs):
        if args:  # vLLM 0.32 calls it with keywords only; bind positional calls the slow way
            kwargs = dict(sig.bind(self, *args, **kwargs).arguments)
            kwargs.pop("self")
        expert_map = kwargs.get("expert_map")
        if expert_map is not None:
            ids, weights = kwargs["topk_ids"], kwargs["topk_weights"]
            local = expert_map[ids.long()]
            foreign = local < 0
            kwargs["topk_ids"] = torch.where(foreign, torch.zeros_like(local), local).to(ids.dtype)
            kwargs["topk_weights"] = torch.where(foreign, torch.zeros_like(weights), weights)
            kwargs["expert_map"] = None
        return orig(self, **kwargs)

    apply.__wrapped__ = orig
    cls.apply = apply


# --- 2. the enable_eplb platform check --------------------------------------------------------------
class _PlatformProxy:
    """``current_platform`` for ``vllm.config.parallel`` only: ``is_xpu()`` is True for the one
    caller line that refuses EPLB on CPU, the real answer everywhere else."""

    def __init__(self, real, code, lineno):
        self._real, self._code, self._lineno = real, code, lineno

    def is_xpu(self):
        f = sys._getframe(1)
        if f.f_code is self._code and f.f_lineno == self._lineno:
            return True
        return self._real.is_xpu()

    def __getattr__(self, name):
        return getattr(self._real, name)


def bridge_platform_check() -> None:
    from vllm.config import parallel

    func = parallel.ParallelConfig.__dict__.get("_validate_parallel_config")
    if func is None:
        raise _outdated("2 (platform check)", "ParallelConfig._validate_parallel_config is gone")
    lines, first = inspect.getsourcelines(func)
    target = None
    for i, line in enumerate(lines):
        if "Expert parallelism load balancing is only supported on" in line:
            for j in range(i, -1, -1):
                if "current_platform.is_xpu()" in lines[j] and lines[j].lstrip().startswith("if "):
                    target = first + j
                    break
            break
    if target is None:
        raise _outdated("2 (platform check)", "the EPLB platform refusal in _validate_parallel_config is gone")
    if parallel.current_platform.is_cuda_alike() or parallel.current_platform.is_xpu():
        raise _outdated("2 (platform check)", "the platform already passes the check")
    if isinstance(parallel.current_platform, _PlatformProxy):
        return
    parallel.current_platform = _PlatformProxy(parallel.current_platform, func.__code__, target)


# --- 3. CPUModelRunner.load_model creates the EPLB state ---------------------------------------------
def bridge_load_model() -> None:
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    cls = cpu_model_runner.CPUModelRunner
    orig = cls.__dict__.get("load_model")
    if orig is None:
        raise _outdated("3 (load_model)", "CPUModelRunner no longer overrides load_model")
    if "eplb_state" in _body(orig):
        raise _outdated("3 (load_model)", "CPUModelRunner.load_model now creates the EPLB state")
    if "eplb_state.add_model" not in inspect.getsource(gpu_model_runner.GPUModelRunner.load_model):
        raise _outdated("3 (load_model)", "GPUModelRunner.load_model no longer calls eplb_state.add_model")
    EplbState = gpu_model_runner.EplbState
    get_moe = gpu_model_runner.get_mixture_of_experts_model

    def load_model(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        pc = self.parallel_config
        if pc.enable_eplb:
            if pc.eplb_config.use_async:
                raise RuntimeError("cpu-eplb-bridge: async EPLB is not bridged on CPU "
                                   "(eplb_state.py sets device_index only for cuda/xpu); use "
                                   '--eplb-config \'{..., "use_async": false}\'')
            moe = get_moe(self.model)
            if moe is None:
                raise RuntimeError(f"cpu-eplb-bridge: {self.model_config.model} is not a MixtureOfExperts model")
            self.eplb_state = EplbState(pc, self.device)
            self._moe_model = moe
            self.eplb_state.add_model(moe, self.model_config)
            log.info("cpu-eplb-bridge: EPLB state created for %s (%d MoE layers, %d physical experts)",
                     self.model_config.model, moe.num_moe_layers, moe.num_physical_experts)
        return result

    load_model.__wrapped__ = orig
    cls.load_model = load_model


# --- 4. logical -> physical mapping and load recording ---------------------------------------------
def eplb_map_to_physical_and_record(topk_ids, expert_load_view, logical_to_physical_map,
                                    logical_replica_count, record_enabled, num_unpadded_tokens=None):
    """Torch port of vLLM 0.32's ``_eplb_map_and_record_i32_kernel`` (router/base_router.py).

    ``topk_ids [N, k]`` logical ids -> physical ids: replica ``hash(token) % count`` of the expert,
    ``hash(t) = (t * 2654435769) & 0xFFFFFFFF`` (t = token index = flat index // k). When
    ``record_enabled`` is true, add 1 to ``expert_load_view[physical]`` for each (token, slot) of
    the first ``num_unpadded_tokens`` tokens with a valid physical id. Invalid logical ids map to -1
    and are not counted, as in the kernel.
    """
    import torch

    numel = topk_ids.numel()
    if numel == 0:
        return topk_ids
    ids = topk_ids.to(torch.int64)
    num_logical = logical_replica_count.shape[0]
    valid = (ids >= 0) & (ids < num_logical)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    count = logical_replica_count[safe].to(torch.int64).clamp(min=1)
    k = topk_ids.shape[-1]
    offs = torch.arange(numel, device=ids.device, dtype=torch.int64).reshape(ids.shape)
    replica = ((offs // k) * KNUTH_MULTIPLIER & 0xFFFFFFFF) % count
    physical = logical_to_physical_map[safe, replica].to(torch.int64)
    physical = torch.where(valid, physical, torch.full_like(physical, -1))
    record = (physical >= 0) & (physical < expert_load_view.shape[0]) & record_enabled.to(torch.bool)
    if num_unpadded_tokens is not None:
        record = record & (offs < num_unpadded_tokens.reshape(-1)[0].to(torch.int64) * k)
    hits = physical[record]
    if hits.numel():
        expert_load_view.index_add_(0, hits, torch.ones_like(hits, dtype=expert_load_view.dtype))
    return physical.to(topk_ids.dtype)


def bridge_router() -> None:
    from vllm.model_executor.layers.fused_moe.router import base_router

    current = base_router.eplb_map_to_physical_and_record
    if current is eplb_map_to_physical_and_record:
        return
    if hasattr(base_router, "_eplb_map_and_record_triton"):
        raise _outdated("4 (router)", "the Triton mapping kernel is defined on this platform")
    if _body(current).strip(": \n") != "return topk_ids":
        raise _outdated("4 (router)", "the non-CUDA eplb_map_to_physical_and_record is no longer a no-op")
    if "eplb_map_to_physical_and_record(" not in inspect.getsource(base_router.BaseRouter._apply_eplb_mapping):
        raise _outdated("4 (router)", "BaseRouter._apply_eplb_mapping no longer calls eplb_map_to_physical_and_record")
    base_router.eplb_map_to_physical_and_record = eplb_map_to_physical_and_record


# --- 5. streams and events for sync rearrangement ----------------------------------------------------
class PerfCounterEvent:
    """``torch.Event(enable_timing=True)`` on CPU: records ``perf_counter()``; work is synchronous."""

    def __init__(self, *args, **kwargs):
        self.t = None

    def record(self, *args, **kwargs):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


class _NoopStream:
    def synchronize(self):
        pass

    def wait_stream(self, *args, **kwargs):
        pass


class _Accelerator:
    """``torch.accelerator`` with a no-op ``current_stream()``; the rest is the real module."""

    def __init__(self, real):
        self._real = real

    def current_stream(self, *args, **kwargs):
        return _NoopStream()

    def __getattr__(self, name):
        return getattr(self._real, name)


def _torch_for_eplb(real_torch):
    proxy = types.ModuleType("torch")  # a module, so `import torch`-style attribute access works

    def __getattr__(name):
        return getattr(real_torch, name)

    proxy.__getattr__ = __getattr__
    proxy.Event = PerfCounterEvent
    proxy.accelerator = _Accelerator(real_torch.accelerator)
    proxy._cpu_eplb_bridge = True
    return proxy


def bridge_streams_and_events() -> None:
    import torch
    from vllm.distributed.eplb import eplb_communicator, eplb_state

    if getattr(eplb_state.torch, "_cpu_eplb_bridge", False):
        return
    if "torch.Event(enable_timing=True)" not in inspect.getsource(eplb_state.EplbState.rearrange):
        raise _outdated("5 (events)", "EplbState.rearrange no longer times itself with torch.Event")
    if "torch.accelerator.current_stream().synchronize()" not in inspect.getsource(eplb_communicator):
        raise _outdated("5 (streams)", "eplb_communicator no longer calls torch.accelerator.current_stream()")
    try:
        torch.Event(enable_timing=True).record()
    except RuntimeError:
        pass
    else:
        raise _outdated("5 (events)", "torch.Event works on this CPU build now")
    try:
        torch.accelerator.current_stream()
    except RuntimeError:
        pass
    else:
        raise _outdated("5 (streams)", "torch.accelerator.current_stream() works without an accelerator now")
    proxy = _torch_for_eplb(torch)
    eplb_state.torch = proxy
    eplb_communicator.torch = proxy


def register() -> None:
    """vLLM general-plugin entry point (every vLLM process). Raises :class:`BridgeOutdated`."""
    if _done.get("ok"):
        return
    version = check_version()
    bridge_expert_map()
    bridge_platform_check()
    bridge_load_model()
    bridge_router()
    bridge_streams_and_events()
    _done["ok"] = True
    # one line per process, on stderr, so the tests can check every process loaded the bridge
    print(f"{READY_LINE} (vLLM {version}, pid {os.getpid()}); results are 'vLLM on CPU with the test bridge'",
          file=sys.stderr, flush=True)
