"""Wide expert parallelism in vLLM: all2all backends, the EPLB communicator, fault tolerance, and the
redundancy each of them needs (facts read from vLLM's code, and pure arithmetic on them).

Sources (the released wheels' Python code):

* ``config/parallel.py``: ``All2AllBackend`` (the ``--all2all-backend`` choices) and
  ``EPLBCommunicatorBackend`` per version; ``ParallelConfig.compute_eplb_num_redundant_experts``
  (0.34: an omitted ``num_redundant_experts`` becomes ``(EP - L % EP) % EP``; before, it is 0).
* ``v1/worker/sentinel/gpu_worker_sentinel.py``: fault tolerance needs an all2all backend in
  ``FT_BACKEND_SET`` and (0.34) no MoE draft model and no prefill-context parallelism;
  ``scale_down`` needs EPLB with ``num_redundant_experts > 0``.
* ``v1/worker/sentinel/eplb_redistribute.py`` (0.34): ``scale_down`` marks the dead ranks' slots
  ``-1`` and refills each missing expert from a slot of an expert that still has more than one
  replica; it raises "EPLB redundancy insufficient" when a layer runs out.
* ``engine/arg_utils.py`` / ``config/parallel.py``: fault tolerance refuses vLLM's internal data-
  parallel load balancing and more than one API server.
* ``distributed/device_communicators/all2all.py``: the DeepEP low-latency buffer is sized by
  DeepEP's ``Buffer.get_low_latency_rdma_size_hint(T, hidden, ranks, experts)`` with ``experts``
  the physical experts (logical + redundant) and ``T`` the scheduler's ``max_num_batched_tokens``
  (default 256 with DeepEP low latency and data parallel, ``engine/arg_utils.py``).
"""

from __future__ import annotations

import re

from moe_eplb.api import vllm_cli
from moe_eplb.api.versions import Version
from moe_eplb.contracts import vllm_facts

#: ``--all2all-backend`` choices and the first release of each, as each release's own parser offers
#: them (:mod:`moe_eplb.api.vllm_cli`, generated from the releases' code and checked by the launch-logic
#: tier): 0.32 and 0.33 have the same list, 0.34 adds ``mori`` (and documents ``mori_high_throughput`` /
#: ``mori_low_latency`` as deprecated: they still work). ``passthrough`` is a value of vLLM's
#: ``All2AllBackend`` but no release's CLI offers it ("not selectable from the CLI": vLLM binds it
#: itself for MoE backends that dispatch on their own), so it is refused. ``pplx`` and ``naive`` are
#: still parsed in 0.32-0.34, but ``ParallelConfig`` replaces them with ``allgather_reducescatter`` and
#: a warning ("has been removed"). Older engines than the oldest release read: leave the field out.
ALL2ALL_SINCE: dict[str, Version] = vllm_cli.since("all2all_backends")
ALL2ALL_BACKENDS: tuple[str, ...] = vllm_cli.all_offered("all2all_backends")
#: choices a later release no longer offers: choice -> the first release without it (none so far)
ALL2ALL_DROPPED: dict[str, Version] = vllm_cli.dropped("all2all_backends")
#: all2all backends that run on one GPU vendor's hardware only, read from vLLM 0.34's code
#: (``distributed/device_communicators/all2all.py``, ``cuda_communicator.py``, ``utils/import_utils.py``):
#: DeepEP (``deep_ep``, NVSHMEM) and its v2 (needs NCCL >= 2.30.4), FlashInfer's all2all kernels, MoonEP
#: (NVSwitch multicast) and NIXL EP (``nixl_ep``'s GPU-initiated kernels) are NVIDIA's; MoRI asserts a
#: gfx942/gfx950 GPU (MI300/MI325, MI350/MI355), so AMD's. vLLM itself gates only MoRI's architecture;
#: for the others it fails at startup when the package is missing, which it is on the other vendor.
NVIDIA_ONLY: tuple[str, ...] = ("deepep_high_throughput", "deepep_low_latency", "deepep_v2", "flashinfer_all2allv",
                                "flashinfer_nvlink_one_sided", "flashinfer_nvlink_two_sided", "moonep", "nixl_ep")
AMD_ONLY: tuple[str, ...] = ("mori", "mori_high_throughput", "mori_low_latency")
#: the domain of ``spec.engine.gpuResourceName`` (the device plugin's) -> the vendor
VENDOR_DOMAINS = {"nvidia.com": "nvidia", "amd.com": "amd"}


def gpu_vendor(resource_name: str | None) -> str | None:
    """``nvidia`` / ``amd`` from the GPU resource name's domain (``nvidia.com/gpu``, ``amd.com/gpu``,
    ``nvidia.com/mig-1g.10gb``); None for another device plugin or none."""
    return VENDOR_DOMAINS.get((resource_name or "").strip().lower().split("/", 1)[0])


def backend_vendor(backend: str) -> str | None:
    """The only vendor ``backend`` runs on, or None (any: ``allgather_reducescatter``)."""
    return "nvidia" if backend in NVIDIA_ONLY else "amd" if backend in AMD_ONLY else None


#: Parsed but replaced by allgather_reducescatter (with a warning) in every release the operator supports.
ALL2ALL_REMOVED = ("naive", "pplx")
#: Deprecated from 0.34 (in favour of ``mori``); still accepted there.
ALL2ALL_DEPRECATED_SINCE: dict[str, Version] = {"mori_high_throughput": (0, 34, 0), "mori_low_latency": (0, 34, 0)}
MORI_UNIFIED = (0, 34, 0)
#: vLLM's default backend (what runs when ``--all2all-backend`` is not given).
ALL2ALL_DEFAULT = "allgather_reducescatter"
#: ``moonep`` refuses EPLB, quantized checkpoints and any dtype but bfloat16 (``config/vllm.py``).
MOONEP = "moonep"
DEEPEP_LOW_LATENCY = "deepep_low_latency"

#: ``EPLBConfig.communicator`` choices and the first release of each (from the releases' code:
#: :mod:`moe_eplb.api.vllm_cli`); ``symm_mem`` (0.34) needs CUDA and every EP rank in one NVLink domain
#: (MNNVL across nodes), else ``ValueError`` at the first rearrangement.
COMMUNICATOR_SINCE: dict[str, Version] = vllm_cli.since("communicators")
COMMUNICATORS: tuple[str, ...] = vllm_cli.all_offered("communicators")
SYMM_MEM = "symm_mem"
#: Communicators async EPLB refuses ("NCCL multi-stream conflicts"); async is the default from 0.24.
ASYNC_REFUSED_COMMUNICATORS = ("torch_nccl", "pynccl")
ASYNC_DEFAULT_SINCE = (0, 24, 0)

#: ``--enable-fault-tolerance`` (``retry`` only) is in the oldest release we read (0.32); ``scale_down``
#: (re-host a lost data-parallel rank's experts in the redundant slots) is new in 0.34.
FAULT_TOLERANCE_SINCE: Version = (0, 32, 0)
FT_SCALE_DOWN_SINCE: Version = (0, 34, 0)
#: ``FT_BACKEND_SET`` of ``gpu_worker_sentinel.py`` (the same in 0.32 - 0.34).
FT_ALL2ALL_BACKENDS = ("deepep_low_latency", "nixl_ep")

#: 0.34: ``num_redundant_experts`` omitted -> the minimum valid value; before, 0.
REDUNDANCY_AUTO_MIN_SINCE: Version = (0, 34, 0)

#: ``SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP``: the tokens per rank DeepEP low
#: latency is sized for when ``--max-num-batched-tokens`` is not given (data parallel > 1).
BATCHED_DP_DEFAULT_TOKENS = 256
#: The largest DeepEP low-latency buffer that works (above it the buffer registration fails).
DEEPEP_LL_BUFFER_LIMIT = 32 * 2**30

#: Shared-expert overlap under EPLB (``model_executor/layers/fused_moe/runner/shared_experts.py``,
#: ``SharedExperts._disable_shared_experts_overlap``, the same rule in 0.32, 0.33 and 0.34): vLLM runs a
#: model's shared experts overlapped with the routed experts' dispatch/combine (or on a side stream), but
#: turns that overlap off when EPLB is enabled and the all2all backend is not one of these ("because of
#: correctness issues"). Checked against each release's own code by
#: tests/api/test_api_vllm_contract.py (the wheel, and through tests/test_vllm_sources.py 0.33's and
#: 0.34's sources), release by release.
EPLB_OVERLAP_SAFE: dict[Version, tuple[str, ...]] = {
    (0, 32, 0): ("allgather_reducescatter", "deepep_v2", "flashinfer_nvlink_one_sided"),
    (0, 33, 0): ("allgather_reducescatter", "deepep_v2", "flashinfer_nvlink_one_sided"),
    (0, 34, 0): ("allgather_reducescatter", "deepep_v2", "flashinfer_nvlink_one_sided"),
}
#: Backends whose all2all kernels drop the overlap whatever EPLB does (the same property's
#: ``use_fi_nvl_two_sided_kernels``: with data parallel > 1): turning EPLB on costs them no overlap.
OVERLAP_DROPPED_WITHOUT_EPLB: dict[Version, tuple[str, ...]] = {
    (0, 32, 0): ("flashinfer_all2allv", "flashinfer_nvlink_two_sided"),
    (0, 33, 0): ("flashinfer_all2allv", "flashinfer_nvlink_two_sided"),
    (0, 34, 0): ("flashinfer_all2allv", "flashinfer_nvlink_two_sided"),
}
#: Which GPUs an overlap-safe backend runs on (None: any): DeepEP (``deepep_v2``) is built on NVSHMEM for
#: NVIDIA GPUs, FlashInfer's NVLink all2all needs NVIDIA NVLink (every EP rank in one NVLink domain: one
#: node, or a multi-node NVLink system such as GB200 NVL72); ``allgather_reducescatter`` is plain
#: collectives (NCCL or RCCL). On AMD GPUs that leaves ``allgather_reducescatter``.
OVERLAP_SAFE_VENDOR: dict[str, str | None] = {
    "allgather_reducescatter": None,
    "deepep_v2": "nvidia",
    "flashinfer_nvlink_one_sided": "nvidia",
}
#: The backends that need every EP rank in one NVLink domain.
NVLINK_DOMAIN_BACKENDS = ("flashinfer_nvlink_one_sided",)
#: GPU vendor by the extended resource the GPUs are requested as (``spec.engine.gpuResourceName``).


def _rule(table: dict[Version, tuple[str, ...]], version: Version | None) -> tuple[str, ...]:
    rel = vllm_cli.release_for(version) or min(table)
    return table[max(v for v in table if v <= rel)]


def eplb_overlap_safe(version: Version | None) -> tuple[str, ...]:
    """The backends on which release ``version`` keeps the shared-expert overlap with EPLB on."""
    return _rule(EPLB_OVERLAP_SAFE, version)


def eplb_drops_shared_overlap(backend: str | None, version: Version | None, *, data_parallel: int = 2) -> bool:
    """Whether turning EPLB on makes vLLM ``version`` run a model's shared experts without overlap on
    ``backend`` (None: vLLM's default, ``allgather_reducescatter``): the backend is not EPLB-overlap-safe,
    and it keeps the overlap without EPLB (the FlashInfer two-sided kernels drop it anyway once data
    parallel > 1 uses all2all kernels). A version older than every release read is taken as the oldest."""
    b = backend or ALL2ALL_DEFAULT
    if b in _rule(EPLB_OVERLAP_SAFE, version):
        return False
    return not (data_parallel > 1 and b in _rule(OVERLAP_DROPPED_WITHOUT_EPLB, version))


def overlap_safe_backends(version: Version | None, vendor: str | None, *, nodes: int = 1) -> list[tuple[str, str]]:
    """The backends that keep the shared-expert overlap with EPLB on, that release ``version`` offers
    and GPUs of ``vendor`` (None: any) run: ``(backend, condition)`` pairs, the condition empty or
    what the backend needs beyond that (one NVLink domain across ``nodes`` > 1)."""
    offered = vllm_cli.offered("all2all_backends", version) or ALL2ALL_BACKENDS
    out = []
    for b in _rule(EPLB_OVERLAP_SAFE, version):
        need = OVERLAP_SAFE_VENDOR.get(b)
        if b not in offered or (vendor is not None and need is not None and need != vendor):
            continue
        cond = "needs one NVLink domain across the nodes" if b in NVLINK_DOMAIN_BACKENDS and nodes > 1 else ""
        out.append((b, cond))
    return out


#: How vLLM 0.34 reports a committed ``scale_down``: only a log line of each surviving engine core,
#: ``[FT] Engine N scale_down complete: removed [..], cumulative dead_dp_ranks=[..]``. No metric or
#: API field keeps it (``GET /v1/fault_tolerance/status`` is reset to ``healthy`` once recovery
#: succeeds), and the workers' ``eep_eplb_suppressed`` flag (EPLB no longer steps) is in-process.
_SCALE_DOWN_LINE = re.compile(r"\[FT\] Engine (\d+) scale_down complete: removed \[([0-9, ]*)\]")


def scale_downs_in_log(text: str) -> list[tuple[int, tuple[int, ...]]]:
    """(engine index, data-parallel ranks removed) of every ``[FT] Engine N scale_down complete:
    removed [...]`` line vLLM 0.34's engine core logged in ``text`` (``engine_core_sentinel.py``)."""
    return [(int(m.group(1)), tuple(int(x) for x in m.group(2).replace(" ", "").split(",") if x))
            for m in _SCALE_DOWN_LINE.finditer(text)]


def backend_since(backend: str) -> Version:
    return ALL2ALL_SINCE[backend]


def smallest_valid_redundancy(num_experts: int, ep_size: int) -> int:
    """``(EP - L % EP) % EP``: vLLM 0.34's value for an omitted ``num_redundant_experts``."""
    return vllm_facts.smallest_valid_redundant(num_experts, ep_size)


def lost_slots(num_experts: int, redundant: int, data: int, ranks_lost: int) -> int:
    """Physical expert slots per MoE layer that ``ranks_lost`` data-parallel ranks hold:
    ``k x TP x (L + R) / EP`` = ``k x (L + R) / DP`` (each DP rank owns TP x PCP consecutive EP ranks,
    ``compute_dead_ep_ranks``; the spec has no PCP)."""
    return ranks_lost * (num_experts + redundant) // data


def survives(num_experts: int, redundant: int, data: int, ranks_lost: int) -> bool:
    """Whether ``scale_down`` can re-host every expert after losing ``ranks_lost`` DP ranks, for
    every placement EPLB may have chosen.

    After the loss the survivors hold ``L + R - D`` slots (D = :func:`lost_slots`). With M logical
    experts left without a replica, the slots that can be given up (replicas beyond an expert's
    first) number ``(L + R - D) - (L - M) = M + R - D``, and refilling needs M of them: so
    ``R >= D``, whatever M is. EPLB can put all replicas of an expert on the lost ranks, so the
    bound is also necessary."""
    if ranks_lost <= 0:
        return True
    if ranks_lost >= data:
        return False
    return redundant >= lost_slots(num_experts, redundant, data, ranks_lost)


def fault_tolerance_floor(num_experts: int, tensor: int, data: int, ranks_lost: int) -> int | None:
    """The smallest valid R (``(L + R) % EP == 0``, ``R <= 1023``) that survives ``ranks_lost`` lost
    DP ranks (:func:`survives`: ``R >= k (L + R) / DP``, i.e. ``R >= k L / (DP - k)``); 0 when none
    must be survived; None when no R up to vLLM's limit does (or ``k >= DP``)."""
    if ranks_lost <= 0:
        return 0
    if ranks_lost >= data:
        return None
    ep = tensor * data
    r = smallest_valid_redundancy(num_experts, ep)
    while r <= vllm_facts.MAX_REDUNDANT_EXPERTS:
        if survives(num_experts, r, data, ranks_lost):
            return r
        r += ep
    return None


def deepep_ll_buffer_bytes(tokens_per_rank: int, hidden: int, physical_experts: int) -> int:
    """DeepEP's low-latency RDMA buffer (``get_low_latency_rdma_size_hint``; ``LowLatencyLayout``):
    two send, two receive and two signalling buffers, with H = hidden, s = H / 128 scales,
    T = tokens per rank and N = physical experts (logical + redundant):

    * dispatch message ``16 + max(2H, H + 4s)`` bytes, combine message ``4s + 2H``;
    * send ``max(T x dispatch, N x T x combine)``, receive ``N x T x max(dispatch, combine)``;
    * signalling ``align128(8N + 4 N / EP)`` (taken as ``align128(12N)``, an upper bound);
    * total ``2 (send + receive + signalling)``, rounded up to 128 bytes.
    """
    scales = hidden // 128
    dispatch = 16 + max(2 * hidden, hidden + 4 * scales)
    combine = 4 * scales + 2 * hidden
    t, n = tokens_per_rank, physical_experts
    send = max(t * dispatch, n * t * combine)
    recv = n * t * max(dispatch, combine)
    signal = -(-(12 * n) // 128) * 128
    total = 2 * (send + recv + signal)
    return -(-total // 128) * 128


def largest_deepep_ll_redundancy(num_experts: int, ep_size: int, tokens_per_rank: int, hidden: int) -> int | None:
    """The largest valid R whose DeepEP low-latency buffer fits :data:`DEEPEP_LL_BUFFER_LIMIT`
    (None when not even the smallest valid R does)."""
    best = None
    r = smallest_valid_redundancy(num_experts, ep_size)
    while r <= vllm_facts.MAX_REDUNDANT_EXPERTS:
        if deepep_ll_buffer_bytes(tokens_per_rank, hidden, num_experts + r) > DEEPEP_LL_BUFFER_LIMIT:
            break
        best = r
        r += ep_size
    return best
