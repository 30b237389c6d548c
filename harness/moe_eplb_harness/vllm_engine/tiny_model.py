"""A tiny Qwen3-MoE checkpoint built at test time: no hub, no internet, a few seconds on one core.

``build_tiny_moe(directory)`` writes a ``transformers`` Qwen3-MoE model (2 MoE layers, 8 experts,
top-2, hidden 128, float32, random weights from a fixed seed) and a BPE tokenizer trained locally
with ``tokenizers`` on a handful of sentences, saved as a ``PreTrainedTokenizerFast``. vLLM loads
the directory like any Hugging Face checkpoint (``config.json``, ``model.safetensors``,
``tokenizer.json``). The weights are random, so the text it generates is noise; the routing is
deterministic for a given prompt (greedy sampling), and uneven across experts, which is what the
EPLB tests need.
"""

from __future__ import annotations

import json
import os

SEED = 1234
NUM_LAYERS = 2
NUM_EXPERTS = 8
TOP_K = 2
HIDDEN = 128
VOCAB = 512
EOS = "<|endoftext|>"

CORPUS = [
    "Mixture of experts models route every token to a few experts.",
    "Expert parallel load balancing moves hot experts between ranks.",
    "The engine steps, the router counts tokens, and the exporter publishes them.",
    "Prometheus scrapes the exporter and the operator reads the load back.",
    "A tiny model on two cores is enough to watch the balancer work.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Kubernetes operators reconcile the desired state of custom resources.",
    "Balancedness is the mean load over ranks divided by the maximum load.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
    "hello world, this is a test of the emergency broadcast system.",
]


def config_dict() -> dict:
    """The model's ``transformers`` config (also what the tests assert shapes against)."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        torch_dtype="float32",
    )


def build_tokenizer(directory: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   unk_token=EOS, model_max_length=1024)
    fast.save_pretrained(directory)
    return fast


def build_tiny_moe(directory: str) -> str:
    """Write the checkpoint into ``directory`` (created) and return it. Idempotent per directory."""
    marker = os.path.join(directory, ".complete")
    if os.path.exists(marker):
        return directory
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(directory, exist_ok=True)
    fast = build_tokenizer(directory)
    assert len(fast) <= VOCAB, f"tokenizer has {len(fast)} tokens > vocab {VOCAB}"
    eos_id = fast.convert_tokens_to_ids(EOS)
    torch.manual_seed(SEED)
    config = Qwen3MoeConfig(**config_dict(), bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        # The routers' default init (std 0.02) gives nearly uniform routing; a wider spread makes
        # some experts hot, which is the imbalance EPLB exists for.
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos_id, "bos_token_id": eos_id, "do_sample": False}, f)
    with open(marker, "w") as f:
        f.write("ok\n")
    return directory


if __name__ == "__main__":
    import sys

    print(build_tiny_moe(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-qwen3-moe"))
