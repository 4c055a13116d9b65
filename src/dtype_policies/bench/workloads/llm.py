"""A Llama-style causal LM (168M parameters, random weights): decode at
batch 1 and prefill of 4 x 128 tokens."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn

from dtype_policies import apply_policy, quantize
from dtype_policies.bench.harness import Timed, TokenClock
from dtype_policies.bench.registry import Variants, register
from dtype_policies.bench.workloads.common import optional_module
from dtype_policies.quantization import Int4QuantizationConfig
from dtype_policies.quantization.kernels import epilogues

LLM_NEW_TOKENS = 32
LLM_PROMPT = 16
LLM_PREFILL = (4, 128)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=1024,
        num_hidden_layers=8,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    )


def llama() -> nn.Module:
    """A Llama-style causal LM (168M parameters, 8 layers, hidden 1024) with random
    weights, in float32, in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config()).eval()


def _torchao_config(name: str):
    torchao = optional_module("torchao.quantization")
    if torchao is None or not hasattr(torchao, name):
        return None
    return getattr(torchao, name)()


def _llm_variant(name: str) -> nn.Module:
    """The Llama model prepared as variant `name` (see `LLM_VARIANTS`)."""
    model = llama()
    if name == "float32":
        return model
    if name == "whole model bfloat16" or name.startswith("torchao"):
        model = model.to(torch.bfloat16)
        if name.startswith("torchao"):
            config_name = (
                "Int8WeightOnlyConfig"
                if "weight-only" in name
                else "Int8DynamicActivationInt8WeightConfig"
            )
            config = _torchao_config(config_name)
            if config is None:
                raise RuntimeError(f"torchao.quantization.{config_name} is not available")
            import torchao.quantization

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torchao.quantization.quantize_(model, config)
        return model
    apply_policy(model, "mixed_bfloat16", weight_cache="weight_cache=False" not in name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name.startswith("dtype_policies int8"):
            quantize(model, "int8")
        elif name.startswith("dtype_policies int4/128"):
            quantize(model, "int4")
        elif name.startswith("dtype_policies int4/-1"):
            quantize(model, "int4", Int4QuantizationConfig(block_size=-1))
    return model


# Variant name -> (context manager factory for the call, epilogue compile setting or None).
_INFERENCE = torch.inference_mode
LLM_VARIANTS: dict[str, tuple[Callable, bool | None]] = {
    "float32": (_INFERENCE, None),
    "whole model bfloat16": (_INFERENCE, None),
    "dtype_policies mixed_bfloat16": (_INFERENCE, None),
    "dtype_policies mixed_bfloat16, weight_cache=False": (_INFERENCE, None),
    "dtype_policies int8_from_mixed_bfloat16": (_INFERENCE, None),
    "dtype_policies int8_from_mixed_bfloat16, compiled epilogues": (_INFERENCE, True),
    "dtype_policies int4/128_from_mixed_bfloat16": (_INFERENCE, None),
    "dtype_policies int4/-1_from_mixed_bfloat16": (_INFERENCE, None),
    "torchao Int8WeightOnly (bfloat16 model)": (_INFERENCE, None),
    "torchao Int8DynamicActivationInt8Weight (bfloat16 model)": (_INFERENCE, None),
}

LLM_NOTES = {
    "dtype_policies mixed_bfloat16": "keeps a bf16 copy of the weights",
    "dtype_policies mixed_bfloat16, weight_cache=False": "casts every call",
    "dtype_policies int8_from_mixed_bfloat16, compiled epilogues": (
        "set_compile_epilogues(True), opt-in"
    ),
}


@contextlib.contextmanager
def _epilogue_compile(enabled: bool | None):
    """Sets the int8 epilogue compilation for the duration of a call
    (`None`: leave it as it is)."""
    if enabled is None:
        yield
        return
    previous = epilogues.compile_epilogues_enabled()
    epilogues.set_compile_epilogues(enabled)
    try:
        yield
    finally:
        epilogues.set_compile_epilogues(previous)


def _decode_call(model, context, compile_setting) -> Callable[[], Timed]:
    """One greedy `generate` of LLM_NEW_TOKENS tokens after a LLM_PROMPT-token
    prompt; returns the time per new token after the first (the prefill and
    the first token are excluded)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (1, LLM_PROMPT), generator=generator)
    mask = torch.ones_like(ids)

    def run() -> Timed:
        clock = TokenClock()
        with _epilogue_compile(compile_setting), context():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=LLM_NEW_TOKENS,
                min_new_tokens=LLM_NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )
        assert out.shape[1] == LLM_PROMPT + LLM_NEW_TOKENS, out.shape
        times = clock.times
        return Timed((times[-1] - times[0]) / (len(times) - 1))

    return run


def _prefill_call(model, context, compile_setting) -> Callable[[], object]:
    """One forward of a (4, 128) batch of token ids, no KV cache, all logits."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, LLM_PREFILL, generator=generator)

    def run():
        with _epilogue_compile(compile_setting), context():
            return model(input_ids=ids, use_cache=False).logits

    return run


def llm_factories(kind: str) -> dict[str, Callable[[], Callable[[], object]]]:
    """`kind` "decode" or "prefill": each variant's call, built when its factory
    is called (the first-call time is measured in a fresh process)."""
    make_call = _decode_call if kind == "decode" else _prefill_call

    def factory(name):
        context, compile_setting = LLM_VARIANTS[name]

        def build():
            return make_call(_llm_variant(name), context, compile_setting)

        return build

    return {name: factory(name) for name in LLM_VARIANTS}


def llm_workload(kind: str) -> tuple[Variants, dict[str, str]]:
    """Builds every variant, calls each once (variants that raise are reported
    as failed, not timed), and returns the working ones."""
    variants: Variants = {}
    notes = dict(LLM_NOTES)
    for name, build in llm_factories(kind).items():
        try:
            run = build()
            run()
        except Exception as e:  # reported in the table, not fatal
            message = f"{type(e).__name__}: {e}".splitlines()[0][:160]
            notes[name] = f"failed: {message}"
            continue
        variants[name] = run
    return variants, notes


_TITLES = {
    "decode": f"Llama-style LM decode (batch 1, prompt {LLM_PROMPT}, greedy), ms per new token",
    "prefill": (
        f"Llama-style LM prefill ({LLM_PREFILL[0]} x {LLM_PREFILL[1]} tokens), ms per forward"
    ),
}
for _kind, _title in _TITLES.items():
    register(
        f"llm_{_kind}",
        _title,
        functools.partial(llm_workload, _kind),
        baseline="whole model bfloat16",
        heavy=True,
        first_call=_kind,
    )
