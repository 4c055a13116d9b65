"""Model factories for the command line (`dtype-policies inspect
examples.models:tiny_llama`): each builds a model from a config, with random
weights, offline."""

import torch


def tiny_llama() -> torch.nn.Module:
    """A 2-layer Llama (hidden 256) from a config; needs `transformers`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=4096,
    )
    return LlamaForCausalLM(config).eval()


def mlp() -> torch.nn.Module:
    """The MLP of the README's quickstart."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 10),
    )
