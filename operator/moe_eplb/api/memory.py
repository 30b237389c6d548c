"""A per-GPU memory estimate of a layout, and the GPU's memory (pure).

What one GPU of a replica group must hold before vLLM can serve one full-length request
(:func:`estimate`):

* the dense weights (everything but the routed experts: attention, shared experts, dense layers,
  embeddings), split over the tensor-parallel ranks;
* the routed experts: ``(experts + R) / EP`` per MoE layer, EP = tensor x data (R the redundant experts);
* the all2all buffers: DeepEP low latency's RDMA buffer (:func:`moe_eplb.api.wide_ep.deepep_ll_buffer_bytes`)
  plus its 1 GiB NVLink buffer, DeepEP high throughput's 1 GiB NVLink (+ 1 GiB RDMA across pods)
  buffers (``VLLM_DEEPEP_BUFFER_SIZE_MB``, vLLM 0.32-0.34's ``distributed/device_communicators/all2all.py``);
* the KV cache of one ``--max-model-len`` sequence (vLLM refuses to start when the cache cannot
  hold one), bf16, the KV heads split over the tensor-parallel ranks (MLA's latent is not);
* :data:`ACTIVATION_RESERVE` for activations and CUDA graphs.

It errs low (the dense part in the checkpoint's MoE format, no fragmentation, a small activation
reserve): a layout it finds over the memory vLLM may use (``--gpu-memory-utilization`` x the GPU's
memory) cannot start, while one under it may still be tight.

The GPU's memory comes from ``spec.engine.gpuMemory``, else from the node selector: NVIDIA's GPU
feature discovery label ``nvidia.com/gpu.memory`` (MiB), or the product label
(``nvidia.com/gpu.product``, ``amd.com/gpu.product-name``) of a GPU in :data:`GPU_PRODUCTS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moe_eplb.api import catalog, wide_ep

GIB = 2**30
MIB = 2**20
#: vLLM's ``--gpu-memory-utilization`` default (``CacheConfig``, 0.32-0.34)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
#: activations and CUDA graphs (a low estimate; vLLM measures its own peak at startup)
ACTIVATION_RESERVE = 1 * GIB
#: ``VLLM_DEEPEP_BUFFER_SIZE_MB``'s default: DeepEP's NVLink buffer (and high throughput's RDMA one)
DEEPEP_BUFFER = 1024 * MIB
MEMORY_LABEL = "nvidia.com/gpu.memory"  # GPU feature discovery: MiB
PRODUCT_LABELS = ("nvidia.com/gpu.product", "amd.com/gpu.product-name", "amd.com/gpu.product")
#: (pattern searched in a product label's value, case-insensitive; memory in MiB as the driver
#: reports it), most specific first
GPU_PRODUCTS: tuple[tuple[str, int], ...] = (
    (r"GB200", 189_471), (r"B200", 183_359), (r"H200", 143_771), (r"H100.*NVL", 95_830), (r"H100.*94GB", 95_830),
    (r"H100", 81_559), (r"H20\b|H20-", 97_871), (r"A100.*40GB", 40_960), (r"A100", 81_920), (r"L40S", 46_068),
    (r"MI355X", 294_912), (r"MI325X", 262_144), (r"MI300X", 196_592), (r"MI300A", 131_072),
)


def product_memory(product: str) -> int | None:
    """Bytes of memory of the GPU a product label names (``NVIDIA-H100-80GB-HBM3``), or None."""
    for pattern, mib in GPU_PRODUCTS:
        if re.search(pattern, product, re.IGNORECASE):
            return mib * MIB
    return None


@dataclass(frozen=True)
class GpuMemory:
    nbytes: int
    source: str  # where it was read: the field, or the label and its value


def gpu_memory(spec_value: int | None, node_selector: dict[str, str]) -> GpuMemory | None:
    """One GPU's memory: ``spec.engine.gpuMemory`` (bytes, parsed), else the node selector's labels."""
    if spec_value:
        return GpuMemory(spec_value, "spec.engine.gpuMemory")
    mib = node_selector.get(MEMORY_LABEL, "")
    if mib.isdigit():
        return GpuMemory(int(mib) * MIB, f"{MEMORY_LABEL}={mib}")
    for label in PRODUCT_LABELS:
        value = node_selector.get(label)
        if value and product_memory(value):
            return GpuMemory(product_memory(value), f"{label}={value}")  # type: ignore[arg-type]
    return None


@dataclass(frozen=True)
class Estimate:
    """Bytes one GPU needs, by part, and what vLLM may use of it."""

    dense: int
    experts: int
    all2all: int
    kv: int
    usable: int
    reserve: int = ACTIVATION_RESERVE

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.all2all + self.kv + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def describe(self) -> str:
        return (f"{self.total / GIB:.0f} GiB per GPU ({self.dense / GIB:.0f} dense weights, {self.experts / GIB:.0f} "
                f"routed experts, {self.all2all / GIB:.0f} all2all buffers, {self.kv / GIB:.0f} KV of one full-length "
                f"request, {self.reserve / GIB:.0f} activations) of {self.usable / GIB:.0f} GiB usable")


def estimate(model: catalog.ModelInfo, *, quantization: str | None, tensor: int, data: int, nodes: int,
             redundant: int, backend: str | None, tokens_per_rank: int, max_model_len: int | None,
             gpu_bytes: int, utilization: float | None) -> Estimate | None:
    """The estimate of the module doc for ``model`` on one GPU of ``gpu_bytes``; None when the
    catalog lacks what it needs (the format's size, the model's totals)."""
    per_expert = model.bytes_per_expert(quantization)
    q = catalog.QUANTIZATIONS.get(quantization or model.default_quantization)
    if per_expert is None or q is None or q.bytes_per_weight is None or not model.total_params_b:
        return None
    ep = tensor * data
    dense = int(model.dense_params * q.bytes_per_weight / tensor)
    experts = -(-(model.num_experts + redundant) // ep) * model.num_moe_layers * per_expert
    all2all = 0
    if data > 1 and backend == wide_ep.DEEPEP_LOW_LATENCY:
        all2all = DEEPEP_BUFFER + wide_ep.deepep_ll_buffer_bytes(tokens_per_rank, model.hidden_size,
                                                                 model.num_experts + redundant)
    elif data > 1 and backend == "deepep_high_throughput":
        all2all = DEEPEP_BUFFER * (2 if nodes > 1 else 1)
    heads = model.kv_heads
    share = 1.0 if heads == 0 else -(-heads // tensor) / heads
    kv = int((max_model_len or model.context_length) * model.kv_bytes_per_token * share)
    util = utilization if utilization is not None and 0 < utilization <= 1 else DEFAULT_GPU_MEMORY_UTILIZATION
    usable = int(gpu_bytes * util)  # (a utilization out of range, NaN included, is refused by the schema)
    return Estimate(dense=dense, experts=experts, all2all=all2all, kv=kv, usable=usable)
