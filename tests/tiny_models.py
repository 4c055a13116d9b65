"""Tiny Hugging Face decoders from configs (random weights), shared by tests."""

import pytest
import torch


def tiny_decoder(
    family: str = "llama", layers: int = 2, tie: bool = False, **config: object
) -> torch.nn.Module:
    """A causal LM of `family` ("llama"; "qwen3", with float32 q/k norms;
    "qwen3_moe", 4 experts of width 96 choosing 2), 64 wide, 4 heads over 2
    key-value heads, vocabulary 128, eval mode, seed 0; `config`: other
    settings of its config, or these replaced (`attn_implementation="eager"`,
    `vocab_size=4096`)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    widths = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tie,
        **config,
    }
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**widths)).eval()
    if family == "qwen3":
        config = transformers.Qwen3Config(**widths, head_dim=16)
        return transformers.Qwen3ForCausalLM(config).eval()
    if family == "qwen3_moe":
        experts = dict(moe_intermediate_size=96, num_experts=4, num_experts_per_tok=2)
        config = transformers.Qwen3MoeConfig(**widths, head_dim=16, **experts)
        return transformers.Qwen3MoeForCausalLM(config).eval()
    raise ValueError(f"no tiny {family!r}")
