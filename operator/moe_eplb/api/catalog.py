"""Built-in catalog of MoE models and of vLLM's EPLB support (data in code).

Three tables:

* :data:`ARCHITECTURES` — per vLLM architecture class: from which vLLM version the model class
  implements ``MixtureOfExperts`` (so ``--enable-eplb`` works), and whether it is multimodal.
* :data:`QUANTIZATIONS` — per MoE quantization method: bytes per weight (incl. scales) and from
  which vLLM version its ``FusedMoE`` method has ``supports_eplb`` (None = never).
* :data:`MODELS` — per model family: shape of the MoE part (experts, MoE layers, top-k, expert
  groups, hidden and expert intermediate sizes, shared experts) and the Hugging Face ids it covers.

Shapes come from the models' Hugging Face ``config.json`` (shared experts: ``n_shared_experts`` for
DeepSeek-V2/V3 and GLM-4.5, whose shared MLP is ``n_shared_experts x moe_intermediate_size`` wide as
vLLM's ``deepseek_v2.py`` / ``glm4_moe.py`` build it; Llama 4's one ``shared_expert`` of
``intermediate_size``, vLLM's ``llama4.py``; Qwen3-MoE's ``shared_expert_intermediate_size`` is absent,
i.e. 0); version thresholds from vLLM's source and
release history (``/work/shared/notes/vllm-eplb.md``). Where the exact first release is not known,
the threshold is the first release we are sure of (conservative: a later version, never an
earlier one). docs/resource.md renders these tables for users.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from moe_eplb.api.versions import Version

# vLLM PR #33807 added --moe-backend (Feb 2026); PR #44570 (Jun 2026) made WNA16 EPLB depend on the
# Triton backend. Estimated first release where the flag is both accepted and needed for WNA16 + EPLB.
MOE_BACKEND_FLAG_SINCE: Version = (0, 26, 0)


@dataclass(frozen=True)
class ArchitectureInfo:
    """A vLLM model class. ``eplb_since`` None = no EPLB in any vLLM release we know."""

    name: str
    eplb_since: Version | None
    multimodal: bool = False
    note: str = ""


@dataclass(frozen=True)
class QuantizationInfo:
    """An MoE weight format: ``bytes_per_weight`` includes its scales (e.g. int4 + fp16 per 128)."""

    name: str
    bytes_per_weight: float | None
    eplb_since: Version | None
    vllm_method: str
    note: str = ""
    eplb_moe_backend: str | None = None  # MoE kernel backend EPLB needs (passed as --moe-backend)


ARCHITECTURES: dict[str, ArchitectureInfo] = {
    a.name: a
    for a in (
        ArchitectureInfo("DeepseekV2ForCausalLM", (0, 9, 0), note="EPLB's first model (with V3)"),
        ArchitectureInfo("DeepseekV3ForCausalLM", (0, 9, 0), note="also DeepSeek-R1"),
        ArchitectureInfo("Qwen3MoeForCausalLM", (0, 10, 1)),
        ArchitectureInfo(
            "Qwen3VLMoeForConditionalGeneration",
            (0, 12, 0),
            multimodal=True,
            note="vLLM PR #28849 (first release v0.12.0); earlier versions fail at load",
        ),
        ArchitectureInfo("Llama4ForConditionalGeneration", (0, 11, 1), multimodal=True, note="vLLM PR #25311"),
        ArchitectureInfo("Llama4ForCausalLM", (0, 11, 1), note="vLLM PR #25311"),
        ArchitectureInfo("Glm4MoeForCausalLM", (0, 10, 2), note="GLM-4.5 and GLM-4.5-Air"),
        ArchitectureInfo(
            "MixtralForCausalLM",
            (0, 11, 0),
            note="no EPLB before vLLM PR #22842 (Aug 2025); older engines reject --enable-eplb",
        ),
        ArchitectureInfo("Ernie4_5_MoeForCausalLM", (0, 11, 0)),
        ArchitectureInfo("AliceAIForCausalLM", (0, 33, 0),
                         note="new in vLLM 0.33 (hybrid linear-attention MoE; no pipeline parallelism)"),
        ArchitectureInfo("Qwen3_5MoeForCausalLM", (0, 32, 0),
                         note="Qwen3.5 MoE (oldest release read: 0.32); vLLM 0.34 adds the NVIDIA path "
                              "(vllm/models/qwen3_5/nvidia) with EPLB, and its MTP drafter Qwen3_5MoeMTP"),
        ArchitectureInfo("Qwen3_5MoeForConditionalGeneration", (0, 32, 0), multimodal=True,
                         note="Qwen3.5 MoE with vision; the 0.34 NVIDIA path as for Qwen3_5MoeForCausalLM"),
        ArchitectureInfo("Step5ForCausalLM", (0, 33, 0),
                         note="new in vLLM 0.33 (+ the Step5MTP drafter; AMD from 0.34). The MegaMoE kernel "
                              "(--moe-backend deep_gemm_mega_moe) refuses EPLB"),
        ArchitectureInfo("MuseSparkForConditionalGeneration", (0, 33, 0), multimodal=True,
                         note="new in vLLM 0.33; checkpoints with a post-expert norm refuse EPLB (vLLM raises)"),
    )
}

# int4 with one fp16 scale per 128 weights; fp4 with an fp8 scale per 16 (NVFP4) or 32 (MXFP4)
_INT4_G128 = 0.5 + 2 / 128
QUANTIZATIONS: dict[str, QuantizationInfo] = {
    q.name: q
    for q in (
        QuantizationInfo("none", 2.0, (0, 9, 0), "UnquantizedFusedMoEMethod", "bf16/fp16 weights"),
        QuantizationInfo("fp8", 1.0 + 4 / (128 * 128), (0, 9, 0), "Fp8MoEMethod", "fp8 with 128x128 block scales"),
        QuantizationInfo(
            "compressed-tensors-wna16",
            _INT4_G128,
            (0, 12, 0),
            "CompressedTensorsWNA16MoEMethod",
            "llm-compressor AWQ/GPTQ W4A16 checkpoints; vLLM PR #28849 (v0.12.0). "
            "v0.11.x gave wrong outputs with int4 Marlin + EPLB (vLLM issue #32388). In current vLLM "
            "supports_eplb holds only for the Triton MoE backend while auto-selection prefers Marlin, "
            "so the operator adds --moe-backend triton (see MOE_BACKEND_FLAG_SINCE)",
            eplb_moe_backend="triton",
        ),
        QuantizationInfo("compressed-tensors-w8a8-fp8", 1.0, (0, 11, 0), "CompressedTensorsW8A8Fp8MoEMethod"),
        QuantizationInfo("compressed-tensors-w4a8-fp8", _INT4_G128, None, "CompressedTensorsW4A8Fp8MoEMethod",
                         "supports_eplb is False (vLLM 0.32, 0.33)"),
        QuantizationInfo("compressed-tensors-nvfp4", 0.5 + 1 / 16, (0, 11, 0), "CompressedTensorsW4A4Nvfp4MoEMethod",
                         "EPLB only with the NVFP4 MoE backends vLLM lists as EPLB-capable (backend-dependent)"),
        QuantizationInfo("compressed-tensors-mxfp4", 0.5 + 1 / 32, (0, 12, 0), "CompressedTensorsW4A4Mxfp4MoEMethod",
                         "EPLB only with FlashInfer MoE-EP MXFP4 backends (backend-dependent)"),
        QuantizationInfo("modelopt-fp8", 1.0, None, "ModelOptFp8MoEMethod", "supports_eplb is False (vLLM 0.32, 0.33)"),
        QuantizationInfo("modelopt-nvfp4", 0.5 + 1 / 16, (0, 11, 0), "ModelOptNvFp4FusedMoE"),
        QuantizationInfo("mxfp4", 0.5 + 1 / 32, (0, 11, 0), "Mxfp4MoEMethod"),
        QuantizationInfo("quark-mxfp4", 0.5 + 1 / 32, (0, 11, 0), "QuarkOCP_MX_MoEMethod"),
        QuantizationInfo("quark-mxfp8", 1.0 + 1 / 32, (0, 33, 0), "QuarkW8A8Mxfp8MoEMethod",
                         "Quark W8A8 MXFP8 checkpoints; the method is new in vLLM 0.33 (with supports_eplb)"),
        QuantizationInfo(
            "awq",
            _INT4_G128 + 0.5 / 128,
            None,
            "AutoAWQMoEMethod",
            "AutoAWQ-format checkpoints; llm-compressor AWQ checkpoints are compressed-tensors-wna16",
        ),
        QuantizationInfo("gptq", _INT4_G128 + 0.5 / 128, None, "AutoGPTQMoEMethod",
                         "AutoGPTQ-format checkpoints; llm-compressor GPTQ checkpoints are compressed-tensors-wna16"),
        QuantizationInfo("bitsandbytes", 0.5 + 4 / 64, None, "BitsAndBytesMoEMethod"),
        QuantizationInfo("gguf", None, None, "GGUFMoEMethod", "bytes depend on the GGUF type"),
    )
}


@dataclass(frozen=True)
class ModelInfo:
    """One MoE model family.

    ``bytes_per_expert`` is the weight size of ONE routed expert in ONE MoE layer: gate, up and
    down projections, ``3 * hidden_size * moe_intermediate_size`` weights.
    """

    key: str
    display_name: str
    architecture: str
    num_experts: int
    num_moe_layers: int
    top_k: int
    num_expert_groups: int
    hidden_size: int
    moe_intermediate_size: int
    default_quantization: str = "none"
    hf_ids: tuple[str, ...] = ()
    #: for the per-GPU memory estimate (:mod:`moe_eplb.api.memory`), from the model card and
    #: ``config.json``: all parameters (billions; the dense part is what the routed experts leave), the
    #: KV cache of one token in bf16 over every attention layer, the KV heads (0: MLA, one latent
    #: replicated on every tensor-parallel rank) and ``max_position_embeddings`` (vLLM's default
    #: ``--max-model-len``)
    total_params_b: float = 0.0
    kv_bytes_per_token: int = 0
    kv_heads: int = 0
    context_length: int = 0
    #: shared experts per MoE layer (``n_shared_experts`` in config.json; Llama 4's one ``shared_expert``)
    #: and the intermediate size of each (None: ``moe_intermediate_size``, as in DeepSeek and GLM, whose
    #: shared MLP is ``moe_intermediate_size x n_shared_experts`` wide; Llama 4's is ``intermediate_size``,
    #: the routed experts' size). 0 for Qwen3-MoE / Qwen3-VL-MoE (no ``shared_expert_intermediate_size``)
    #: and Mixtral.
    shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    # RE2-compatible regexes (no look-around) searched in the lower-cased last path component;
    # the same regexes appear in the CRD's generated CEL rules (moe_eplb.api.cel_catalog)
    name_patterns: tuple[str, ...] = field(default=(), repr=False)
    exclude_patterns: tuple[str, ...] = field(default=(), repr=False)

    def matches_name(self, model_name: str) -> bool:
        """Whether ``model_name`` (HF id or path) is this family by its last path component."""
        base = model_name.rstrip("/").rsplit("/", 1)[-1].lower()
        return any(re.search(p, base) for p in self.name_patterns) and not any(
            re.search(p, base) for p in self.exclude_patterns
        )

    @property
    def shared_expert_ratio(self) -> float:
        """The shared experts' compute per token over the routed experts' (``top_k`` routed experts of
        ``moe_intermediate_size``): DeepSeek-V3 1 / 8, DeepSeek-V2 2 / 6, Llama 4 1 / 1, 0 without
        shared experts. What EPLB costs where vLLM stops overlapping them (:mod:`moe_eplb.api.wide_ep`)
        scales with it."""
        if not self.shared_experts:
            return 0.0
        width = self.shared_expert_intermediate_size or self.moe_intermediate_size
        return self.shared_experts * width / (self.top_k * self.moe_intermediate_size)

    @property
    def weights_per_expert(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def bytes_per_expert(self, quantization: str | None = None) -> int | None:
        """Bytes of one expert in one MoE layer with ``quantization`` (default: the checkpoint's).

        None when the format has no fixed size (gguf) or is unknown.
        """
        q = QUANTIZATIONS.get(quantization or self.default_quantization)
        if q is None or q.bytes_per_weight is None:
            return None
        return int(round(self.weights_per_expert * q.bytes_per_weight))

    @property
    def routed_params(self) -> int:
        """Parameters of every routed expert of every MoE layer."""
        return self.num_experts * self.num_moe_layers * self.weights_per_expert

    @property
    def dense_params(self) -> int:
        """Parameters outside the routed experts (attention, shared experts, dense layers, embeddings)."""
        return max(0, int(self.total_params_b * 1e9) - self.routed_params)

    @property
    def architecture_info(self) -> ArchitectureInfo:
        return ARCHITECTURES[self.architecture]


MODELS: tuple[ModelInfo, ...] = (
    ModelInfo(
        "deepseek-v3", "DeepSeek-V3 / R1 (671B)", "DeepseekV3ForCausalLM",
        num_experts=256, num_moe_layers=58, top_k=8, num_expert_groups=8,
        hidden_size=7168, moe_intermediate_size=2048, default_quantization="fp8", shared_experts=1,
        hf_ids=("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3-0324", "deepseek-ai/DeepSeek-V3.1",
                "deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-R1-0528"),
        total_params_b=671, kv_bytes_per_token=61 * 576 * 2, kv_heads=0, context_length=163840,
        name_patterns=(r"deepseek-v3", r"deepseek-r1"),
        exclude_patterns=(r"distill",),
    ),
    ModelInfo(
        "deepseek-v2-lite", "DeepSeek-V2-Lite (16B)", "DeepseekV2ForCausalLM",
        num_experts=64, num_moe_layers=26, top_k=6, num_expert_groups=1,
        hidden_size=2048, moe_intermediate_size=1408, shared_experts=2,
        hf_ids=("deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite-Chat"),
        total_params_b=15.7, kv_bytes_per_token=27 * 576 * 2, kv_heads=0, context_length=163840,
        name_patterns=(r"deepseek-v2-lite",),
    ),
    ModelInfo(
        "deepseek-v2", "DeepSeek-V2 / V2.5 (236B)", "DeepseekV2ForCausalLM",
        num_experts=160, num_moe_layers=59, top_k=6, num_expert_groups=8,
        hidden_size=5120, moe_intermediate_size=1536, shared_experts=2,
        hf_ids=("deepseek-ai/DeepSeek-V2", "deepseek-ai/DeepSeek-V2-Chat", "deepseek-ai/DeepSeek-V2.5"),
        total_params_b=236, kv_bytes_per_token=60 * 576 * 2, kv_heads=0, context_length=163840,
        name_patterns=(r"deepseek-v2",),
    ),
    ModelInfo(
        "qwen3-vl-30b-a3b", "Qwen3-VL-30B-A3B", "Qwen3VLMoeForConditionalGeneration",
        num_experts=128, num_moe_layers=48, top_k=8, num_expert_groups=1,
        hidden_size=2048, moe_intermediate_size=768,
        hf_ids=("Qwen/Qwen3-VL-30B-A3B-Instruct", "Qwen/Qwen3-VL-30B-A3B-Thinking"),
        total_params_b=31.1, kv_bytes_per_token=48 * 4 * 128 * 4, kv_heads=4, context_length=262144,
        name_patterns=(r"qwen3-vl-30b-a3b",),
    ),
    ModelInfo(
        "qwen3-vl-235b-a22b", "Qwen3-VL-235B-A22B", "Qwen3VLMoeForConditionalGeneration",
        num_experts=128, num_moe_layers=94, top_k=8, num_expert_groups=1,
        hidden_size=4096, moe_intermediate_size=1536,
        hf_ids=("Qwen/Qwen3-VL-235B-A22B-Instruct", "Qwen/Qwen3-VL-235B-A22B-Thinking"),
        total_params_b=236, kv_bytes_per_token=94 * 4 * 128 * 4, kv_heads=4, context_length=262144,
        name_patterns=(r"qwen3-vl-235b-a22b",),
    ),
    ModelInfo(
        "qwen3-30b-a3b", "Qwen3-30B-A3B", "Qwen3MoeForCausalLM",
        num_experts=128, num_moe_layers=48, top_k=8, num_expert_groups=1,
        hidden_size=2048, moe_intermediate_size=768,
        hf_ids=("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B-Instruct-2507", "Qwen/Qwen3-30B-A3B-Thinking-2507"),
        total_params_b=30.5, kv_bytes_per_token=48 * 4 * 128 * 4, kv_heads=4, context_length=40960,
        name_patterns=(r"qwen3-30b-a3b",),
    ),
    ModelInfo(
        "qwen3-235b-a22b", "Qwen3-235B-A22B", "Qwen3MoeForCausalLM",
        num_experts=128, num_moe_layers=94, top_k=8, num_expert_groups=1,
        hidden_size=4096, moe_intermediate_size=1536,
        hf_ids=("Qwen/Qwen3-235B-A22B", "Qwen/Qwen3-235B-A22B-Instruct-2507", "Qwen/Qwen3-235B-A22B-Thinking-2507"),
        total_params_b=235, kv_bytes_per_token=94 * 4 * 128 * 4, kv_heads=4, context_length=40960,
        name_patterns=(r"qwen3-235b-a22b",),
    ),
    ModelInfo(
        "llama4-scout", "Llama 4 Scout 17B-16E", "Llama4ForConditionalGeneration",
        num_experts=16, num_moe_layers=48, top_k=1, num_expert_groups=1,
        hidden_size=5120, moe_intermediate_size=8192, shared_experts=1,
        hf_ids=("meta-llama/Llama-4-Scout-17B-16E", "meta-llama/Llama-4-Scout-17B-16E-Instruct"),
        total_params_b=109, kv_bytes_per_token=48 * 8 * 128 * 4, kv_heads=8, context_length=10485760,
        name_patterns=(r"llama-4-scout",),
    ),
    ModelInfo(
        "llama4-maverick", "Llama 4 Maverick 17B-128E", "Llama4ForConditionalGeneration",
        num_experts=128, num_moe_layers=24, top_k=1, num_expert_groups=1,
        hidden_size=5120, moe_intermediate_size=8192, shared_experts=1,
        hf_ids=("meta-llama/Llama-4-Maverick-17B-128E", "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
                "meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8"),
        total_params_b=400, kv_bytes_per_token=48 * 8 * 128 * 4, kv_heads=8, context_length=1048576,
        name_patterns=(r"llama-4-maverick",),
    ),
    ModelInfo(
        "glm-4.5-air", "GLM-4.5-Air (106B)", "Glm4MoeForCausalLM",
        num_experts=128, num_moe_layers=45, top_k=8, num_expert_groups=1,
        hidden_size=4096, moe_intermediate_size=1408, shared_experts=1,
        hf_ids=("zai-org/GLM-4.5-Air", "zai-org/GLM-4.5-Air-FP8"),
        total_params_b=106, kv_bytes_per_token=46 * 8 * 128 * 4, kv_heads=8, context_length=131072,
        name_patterns=(r"glm-4[.]5-air",),
    ),
    ModelInfo(
        "glm-4.5", "GLM-4.5 (355B)", "Glm4MoeForCausalLM",
        num_experts=160, num_moe_layers=89, top_k=8, num_expert_groups=1,
        hidden_size=5120, moe_intermediate_size=1536, shared_experts=1,
        hf_ids=("zai-org/GLM-4.5", "zai-org/GLM-4.5-FP8"),
        total_params_b=355, kv_bytes_per_token=92 * 8 * 128 * 4, kv_heads=8, context_length=131072,
        name_patterns=(r"glm-4[.]5",),
        exclude_patterns=(r"glm-4[.]5v",),
    ),
    ModelInfo(
        "mixtral-8x7b", "Mixtral 8x7B", "MixtralForCausalLM",
        num_experts=8, num_moe_layers=32, top_k=2, num_expert_groups=1,
        hidden_size=4096, moe_intermediate_size=14336,
        hf_ids=("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
        total_params_b=46.7, kv_bytes_per_token=32 * 8 * 128 * 4, kv_heads=8, context_length=32768,
        name_patterns=(r"mixtral-8x7b",),
    ),
)

_BY_ID = {hf_id.lower(): m for m in MODELS for hf_id in m.hf_ids}
_QUANTIZED_NAME = re.compile(r"(awq|gptq|int4|w4a16|4bit|4-bit|bnb|nf4)", re.IGNORECASE)
_FP8_NAME = re.compile(r"fp8", re.IGNORECASE)


#: MoE kernel backends (``--moe-backend``) that refuse EPLB for an architecture, from the version on:
#: Step5's DeepGEMM MegaMoE ("Step5 MegaMoE does not yet support EPLB", vLLM 0.33+).
MOE_BACKEND_EPLB_REFUSALS: dict[tuple[str, str], Version] = {
    ("Step5ForCausalLM", "deep_gemm_mega_moe"): (0, 33, 0),
}


def lookup(model_name: str) -> ModelInfo | None:
    """Catalog entry for an HF id or a path (case-insensitive).

    Exact HF ids first; then the last path component against each family's name patterns, so
    quantized re-uploads and local paths (``/models/Qwen3-VL-30B-A3B-Instruct-AWQ``) are found.
    """
    if not model_name:
        return None
    exact = _BY_ID.get(model_name.strip().lower())
    if exact:
        return exact
    for model in MODELS:
        if model.matches_name(model_name):
            return model
    return None


def lookup_architecture(name: str) -> ArchitectureInfo | None:
    """Architecture entry by exact class name (e.g. ``Qwen3MoeForCausalLM``)."""
    return ARCHITECTURES.get(name)


def guess_quantization(model_name: str, model: ModelInfo | None) -> str | None:
    """The checkpoint's MoE quantization when the name and catalog say it clearly, else None.

    ``...-FP8`` -> fp8; a name hinting at a 4-bit format (AWQ, GPTQ, int4, ...) -> None, because
    such checkpoints come in formats with different EPLB support (ask the user); otherwise the
    catalog's default (e.g. fp8 for DeepSeek-V3) or ``none``.
    """
    base = model_name.rstrip("/").rsplit("/", 1)[-1]
    if _QUANTIZED_NAME.search(base):
        return None
    if _FP8_NAME.search(base):
        return "fp8"
    return model.default_quantization if model else "none"


def _v(version: Version | None) -> str:
    return "no" if version is None else "≥ " + ".".join(map(str, version))


def markdown_tables() -> str:
    """The catalog as Markdown tables (docs/resource.md embeds this text; a test keeps them equal)."""
    lines = ["| model family | Hugging Face ids | architecture | experts | MoE layers | top-k | groups "
             "| shared experts (of routed compute) | MiB/expert (bf16) | checkpoint |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for m in MODELS:
        ids = "<br>".join(f"`{i}`" for i in m.hf_ids)
        mib = m.bytes_per_expert("none") / 2**20
        shared = f"{m.shared_experts} ({m.shared_expert_ratio:.1%})" if m.shared_experts else "none"
        lines.append(f"| {m.display_name} | {ids} | `{m.architecture}` | {m.num_experts} | {m.num_moe_layers} "
                     f"| {m.top_k} | {m.num_expert_groups} | {shared} | {mib:.1f} | {m.default_quantization} |")
    lines += ["", "| architecture | EPLB in vLLM | multimodal | note |", "| --- | --- | --- | --- |"]
    for a in ARCHITECTURES.values():
        lines.append(f"| `{a.name}` | {_v(a.eplb_since)} | {'yes' if a.multimodal else 'no'} | {a.note} |")
    lines += ["", "| `quantization` | vLLM MoE method | bytes/weight | EPLB in vLLM | note |",
              "| --- | --- | ---: | --- | --- |"]
    for q in QUANTIZATIONS.values():
        bpw = "varies" if q.bytes_per_weight is None else f"{q.bytes_per_weight:.4g}"
        lines.append(f"| `{q.name}` | `{q.vllm_method}` | {bpw} | {_v(q.eplb_since)} | {q.note} |")
    return "\n".join(lines) + "\n"
