"""A mixture-of-experts decoder at the widths of Qwen3-30B-A3B (hidden 2048,
experts of 768, 8 chosen per token; 2 layers of 64 experts instead of 48 of
128, a 32,000-token vocabulary; random weights): decode at batch 1 and a
256-token prefill, transformers' fused experts (float) against this
library's experts quantized one linear each."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn as nn

from dtype_policies import apply_policy, compile_for_generation, quantize
from dtype_policies.bench.harness import Timed, TokenClock
from dtype_policies.bench.registry import Variants, register

NEW_TOKENS = 32
PROMPT = 16
PREFILL = 256
VOCAB = 32000


def moe_model() -> nn.Module:
    """The model, float32, eval mode (about 1.3 G parameters, 2.4 of them in experts)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    widths: dict = dict(
        vocab_size=VOCAB,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=64,
        num_experts_per_tok=8,
    )
    config = Qwen3MoeConfig(**widths)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


VARIANTS = (
    "float32",
    "whole model bfloat16",
    "dtype_policies mixed_bfloat16",
    "dtype_policies int8_from_mixed_bfloat16",
    "dtype_policies int4/128_from_mixed_bfloat16",
    "dtype_policies int8_from_mixed_bfloat16, compile_for_generation",
)


def _variant(name: str) -> nn.Module:
    model = moe_model()
    if name == "float32":
        return model
    if name == "whole model bfloat16":
        return model.to(torch.bfloat16)
    apply_policy(model, "mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if "int8" in name:
            quantize(model, "int8")
        elif "int4" in name:
            quantize(model, "int4")
    if "compile_for_generation" in name:
        compile_for_generation(model)
    return model


def _decode(model: nn.Module) -> Callable[[], Timed]:
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))

    def run() -> Timed:
        clock = TokenClock()
        with torch.inference_mode():
            model.generate(  # type: ignore[operator]
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )
        times = clock.times
        return Timed((times[-1] - times[0]) / (len(times) - 1))

    return run


def _prefill(model: nn.Module) -> Callable[[], object]:
    ids = torch.randint(0, VOCAB, (1, PREFILL), generator=torch.Generator().manual_seed(1))

    def run() -> object:
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=False).logits

    return run


def moe_workload(kind: str) -> tuple[Variants, dict[str, str]]:
    """Each variant built, called once (one that raises is reported, not timed)."""
    variants: Variants = {}
    notes = {
        "float32": "transformers' fused experts (grouped_mm)",
        "dtype_policies int8_from_mixed_bfloat16, compile_for_generation": (
            "the experts as one operator in the compiled step"
        ),
    }
    make = _decode if kind == "decode" else _prefill
    for name in VARIANTS:
        if kind == "prefill" and "compile_for_generation" in name:
            continue
        try:
            run = make(_variant(name))
            run()
        except Exception as e:  # reported in the table, not fatal
            notes[name] = f"failed: {type(e).__name__}: {e}".splitlines()[0][:160]
            continue
        variants[name] = run
    return variants, notes


register(
    "moe_decode",
    f"Mixture-of-experts decode (Qwen3-30B-A3B widths, 2 layers of 64 experts, batch 1, "
    f"prompt {PROMPT}, greedy), ms per new token",
    lambda: moe_workload("decode"),
    baseline="whole model bfloat16",
    heavy=True,
)
register(
    "moe_prefill",
    f"Mixture-of-experts prefill (the same model, 1 x {PREFILL} tokens), ms per forward",
    lambda: moe_workload("prefill"),
    baseline="whole model bfloat16",
    heavy=True,
)
