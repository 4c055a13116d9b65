"""The benchmark workloads: each builds its variants on the same model and
inputs and returns `{variant: callable}` plus notes."""

from __future__ import annotations

import contextlib
import copy
import os
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import dtype_policies
from benchmarks.harness import Timed
from dtype_policies import apply_policy, layers, quantize
from dtype_policies.quantization import Int4QuantizationConfig

os.environ.setdefault("KERAS_BACKEND", "torch")

Variants = dict[str, Callable[[], object]]


def _optional(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except Exception:
        return None


def keras_module():
    keras = _optional("keras")
    if keras is None or keras.backend.backend() != "torch":
        return None
    return keras


def mlp() -> nn.Sequential:
    """4 Linear layers alternating 1024 -> 4096 -> 1024 with GELU."""
    return nn.Sequential(
        nn.Linear(1024, 4096),
        nn.GELU(),
        nn.Linear(4096, 1024),
        nn.GELU(),
        nn.Linear(1024, 4096),
        nn.GELU(),
        nn.Linear(4096, 1024),
    )


def layers_mlp(policy: str) -> layers.Sequential:
    return layers.Sequential(
        [
            layers.Dense(4096, activation="gelu", dtype=policy),
            layers.Dense(1024, activation="gelu", dtype=policy),
            layers.Dense(4096, activation="gelu", dtype=policy),
            layers.Dense(1024, dtype=policy),
        ],
        name="mlp",
    )


def keras_mlp(keras, policy: str):
    model = keras.Sequential(
        [
            keras.Input((1024,)),
            keras.layers.Dense(4096, activation="gelu", dtype=policy),
            keras.layers.Dense(1024, activation="gelu", dtype=policy),
            keras.layers.Dense(4096, activation="gelu", dtype=policy),
            keras.layers.Dense(1024, dtype=policy),
        ]
    )
    return model


def _copy_weights_into_keras(model: nn.Sequential, keras_model) -> None:
    linears = [m for m in model if isinstance(m, nn.Linear)]
    dense = [layer for layer in keras_model.layers if hasattr(layer, "kernel")]
    for linear, layer in zip(linears, dense):
        layer.kernel.assign(linear.weight.detach().t().numpy())
        layer.bias.assign(linear.bias.detach().numpy())


def _train_step(model, x, target, optimizer, context=None) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with context() if context else contextlib.nullcontext():
            out = model(x)
        F.mse_loss(out.float(), target).backward()
        optimizer.step()

    return step


def mlp_train_factories(batch: int = 256) -> dict[str, Callable[[], Callable[[], None]]]:
    """Each variant of the MLP train step, built only when its factory is called
    (so that memory can be measured one variant at a time)."""
    torch.manual_seed(0)
    base = mlp()
    x, target = torch.randn(batch, 1024), torch.randn(batch, 1024)

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=1e-3)

    def plain(policy=None, weight_cache=False, context=None, bf16=False):
        def build():
            model = copy.deepcopy(base)
            if bf16:
                model = model.bfloat16()
            if policy is not None:
                apply_policy(model, policy, weight_cache=weight_cache)
            return _train_step(model, x.bfloat16() if bf16 else x, target, sgd(model), context)

        return build

    def with_layers():
        model = layers_mlp("mixed_bfloat16")
        model(x)
        return _train_step(model, x, target, sgd(model))

    factories = {
        "float32": plain(),
        "dtype_policies mixed_bfloat16": plain("mixed_bfloat16"),
        "dtype_policies mixed_bfloat16, weight_cache": plain("mixed_bfloat16", True),
        "torch.autocast bfloat16": plain(context=lambda: torch.autocast("cpu", torch.bfloat16)),
        "whole model bfloat16 (no master weights)": plain(bf16=True),
        "dtype_policies.layers mixed_bfloat16": with_layers,
    }
    keras = keras_module()
    if keras is not None:

        def with_keras():
            km = keras_mlp(keras, "mixed_bfloat16")
            _copy_weights_into_keras(base, km)
            optimizer = torch.optim.SGD([v.value for v in km.trainable_variables], lr=1e-3)
            return _train_step(km, x, target, optimizer)

        factories["Keras 3 (torch backend) mixed_bfloat16"] = with_keras
    return factories


def mlp_train(batch: int = 256) -> tuple[Variants, dict[str, str]]:
    variants = {name: build() for name, build in mlp_train_factories(batch).items()}
    notes = {
        "dtype_policies mixed_bfloat16, weight_cache": "+50% weight memory",
        "whole model bfloat16 (no master weights)": "the limit",
    }
    return variants, notes


def _inference(model, x) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return model(x)

    return run


def torchao_int8(model: nn.Module) -> nn.Module | None:
    torchao = _optional("torchao.quantization")
    if torchao is None or not hasattr(torchao, "Int8DynamicActivationInt8WeightConfig"):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchao.quantize_(model, torchao.Int8DynamicActivationInt8WeightConfig())
    return model


def mlp_inference(batch: int = 256) -> tuple[Variants, dict[str, str]]:
    torch.manual_seed(0)
    base = mlp().eval()
    x = torch.randn(batch, 1024)
    variants: Variants = {}
    notes: dict[str, str] = {}
    variants["float32"] = _inference(copy.deepcopy(base), x)
    m = copy.deepcopy(base)
    apply_policy(m, "mixed_bfloat16")
    variants["dtype_policies mixed_bfloat16"] = _inference(m, x)
    m = copy.deepcopy(base)
    apply_policy(m, "mixed_bfloat16", weight_cache=True)
    variants["dtype_policies mixed_bfloat16, weight_cache"] = _inference(m, x)
    notes["dtype_policies mixed_bfloat16, weight_cache"] = "+50% weight memory"
    m = copy.deepcopy(base)

    def autocast_run(model=m):
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            return model(x)

    variants["torch.autocast bfloat16"] = autocast_run
    variants["whole model bfloat16"] = _inference(copy.deepcopy(base).bfloat16(), x.bfloat16())
    m = copy.deepcopy(base)
    apply_policy(m, "int8_from_mixed_bfloat16")
    variants["dtype_policies int8_from_mixed_bfloat16"] = _inference(m, x)
    m = copy.deepcopy(base)
    quantize(m, "int8")
    variants["dtype_policies int8_from_float32"] = _inference(m, x)
    m = copy.deepcopy(base)
    apply_policy(m, "mixed_bfloat16")
    quantize(m, "int4")
    variants["dtype_policies int4/128_from_mixed_bfloat16"] = _inference(m, x)
    ao = torchao_int8(copy.deepcopy(base))
    if ao is not None:
        variants["torchao Int8DynamicActivationInt8Weight"] = _inference(ao, x)
        compiled = torch.compile(torchao_int8(copy.deepcopy(base)))
        variants["torchao Int8DynamicActivationInt8Weight, compiled"] = _inference(compiled, x)
    keras = keras_module()
    if keras is not None:
        km = keras_mlp(keras, "mixed_bfloat16")
        _copy_weights_into_keras(base, km)
        variants["Keras 3 mixed_bfloat16"] = _inference(km, x)
        kq = keras_mlp(keras, "float32")
        _copy_weights_into_keras(base, kq)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kq.quantize("int8")
        variants["Keras 3 int8"] = _inference(kq, x)
    return variants, notes


def mlp_decode() -> tuple[Variants, dict[str, str]]:
    """Batch 1: memory-bound decoding."""
    torch.manual_seed(0)
    base = mlp().eval()
    x = torch.randn(1, 1024)
    variants: Variants = {
        "float32": _inference(copy.deepcopy(base), x),
        "whole model bfloat16": _inference(copy.deepcopy(base).bfloat16(), x.bfloat16()),
    }
    m = copy.deepcopy(base)
    apply_policy(m, "mixed_bfloat16", weight_cache=True)
    variants["dtype_policies mixed_bfloat16, weight_cache"] = _inference(m, x)
    m = copy.deepcopy(base)
    apply_policy(m, "int8_from_mixed_bfloat16")
    variants["dtype_policies int8_from_mixed_bfloat16"] = _inference(m, x)
    m = copy.deepcopy(base)
    apply_policy(m, "mixed_bfloat16")
    quantize(m, "int4")
    variants["dtype_policies int4/128_from_mixed_bfloat16"] = _inference(m, x)
    m = copy.deepcopy(base)
    apply_policy(m, "mixed_bfloat16")
    quantize(m, "int4", Int4QuantizationConfig(block_size=-1))
    variants["dtype_policies int4/-1_from_mixed_bfloat16"] = _inference(m, x)
    ao = torchao_int8(copy.deepcopy(base))
    if ao is not None:
        variants["torchao Int8DynamicActivationInt8Weight, compiled"] = _inference(
            torch.compile(ao), x
        )
    return variants, {}


def transformer_train() -> tuple[Variants, dict[str, str]]:
    """A small transformer encoder: d_model 256, 4 heads, ff 1024, 2 layers,
    batch 16 x 128 tokens."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    base = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x, target = torch.randn(16, 128, 256), torch.randn(16, 128, 256)
    variants: Variants = {}

    def adam(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-4)

    m = copy.deepcopy(base)
    variants["float32"] = _train_step(m, x, target, adam(m))
    m = copy.deepcopy(base)
    apply_policy(m, "mixed_bfloat16")
    variants["dtype_policies mixed_bfloat16"] = _train_step(m, x, target, adam(m))
    m = copy.deepcopy(base)
    variants["torch.autocast bfloat16"] = _train_step(
        m, x, target, adam(m), lambda: torch.autocast("cpu", torch.bfloat16)
    )
    m = copy.deepcopy(base).bfloat16()
    variants["whole model bfloat16 (no master weights)"] = _train_step(
        m, x.bfloat16(), target, adam(m)
    )
    return variants, {}


def call_overhead(grad: bool) -> tuple[Variants, dict[str, str]]:
    """One call of a 64x64 layer on a (1, 64) input."""
    torch.manual_seed(0)
    x = torch.randn(1, 64)
    linear = nn.Linear(64, 64)
    applied = copy.deepcopy(linear)
    apply_policy(applied, "mixed_bfloat16")
    dense = layers.Dense(64, dtype="mixed_bfloat16")
    dense(x)
    variants: Variants = {}

    def timed(fn):
        def run():
            with torch.set_grad_enabled(grad):
                for _ in range(100):
                    fn(x)

        return run

    variants["nn.Linear float32"] = timed(linear)
    variants["nn.Linear + apply_policy mixed_bfloat16"] = timed(applied)
    variants["dtype_policies.layers.Dense mixed_bfloat16"] = timed(dense)
    keras = keras_module()
    if keras is not None:
        keras_dense = keras.layers.Dense(64, dtype="mixed_bfloat16")
        keras_dense(x)
        variants["Keras 3 Dense mixed_bfloat16"] = timed(keras_dense)
    return variants, {"*": "time of 100 calls"}


def quantization_accuracy() -> list[dict]:
    """Relative error of the MLP's output against float32, and weight bytes."""
    torch.manual_seed(0)
    base = mlp().eval()
    x = torch.randn(64, 1024)
    with torch.no_grad():
        reference = base(x)
    weight_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.dim() > 1)
    rows = []
    cases = [
        ("int8_from_float32", "int8", None),
        ("int8_from_mixed_bfloat16", "int8", None),
        ("float8_from_mixed_bfloat16", "float8", None),
        ("int4/128_from_mixed_bfloat16", "int4", Int4QuantizationConfig(block_size=128)),
        ("int4/-1_from_mixed_bfloat16", "int4", Int4QuantizationConfig(block_size=-1)),
    ]
    for name, mode, config in cases:
        model = copy.deepcopy(base)
        apply_policy(model, name.split("_from_")[1])
        quantize(model, mode, config)
        if mode == "float8":
            # Delayed scaling learns its scales in training steps: two steps
            # (forward in training mode and backward) fill the amax histories.
            model.train()
            for _ in range(2):
                model(x).float().sum().backward()
            model.eval()
        with torch.no_grad():
            out = model(x).float()
        error = ((out - reference).norm() / reference.norm()).item()
        stored = sum(
            t.numel() * t.element_size()
            for key, t in model.state_dict().items()
            if key.rsplit(".", 1)[-1] in ("weight", "weight_scale", "weight_zero")
        )
        rows.append(
            {
                "policy": name,
                "relative_error": error,
                "weight_bytes_vs_float32": stored / weight_bytes,
            }
        )
    return rows


# ---------------------------------------------------------------- Llama-style LLM

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
    torchao = _optional("torchao.quantization")
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
    apply_policy(model, "mixed_bfloat16", weight_cache="weight_cache" in name)
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
    "dtype_policies mixed_bfloat16, weight_cache": (_INFERENCE, None),
    "dtype_policies int8_from_mixed_bfloat16": (_INFERENCE, True),
    "dtype_policies int8_from_mixed_bfloat16, COMPILE=0": (_INFERENCE, False),
    "dtype_policies int8_from_mixed_bfloat16, no_grad": (torch.no_grad, True),
    "dtype_policies int8_from_mixed_bfloat16, no_grad, COMPILE=0": (torch.no_grad, False),
    "dtype_policies int4/128_from_mixed_bfloat16": (_INFERENCE, None),
    "dtype_policies int4/-1_from_mixed_bfloat16": (_INFERENCE, None),
    "torchao Int8WeightOnly (bfloat16 model)": (_INFERENCE, None),
    "torchao Int8DynamicActivationInt8Weight (bfloat16 model)": (_INFERENCE, None),
}

LLM_NOTES = {
    "dtype_policies mixed_bfloat16, weight_cache": "+50% weight memory",
    "dtype_policies int8_from_mixed_bfloat16, COMPILE=0": "DTYPE_POLICIES_COMPILE=0",
    "dtype_policies int8_from_mixed_bfloat16, no_grad": "no_grad, not inference_mode",
    "dtype_policies int8_from_mixed_bfloat16, no_grad, COMPILE=0": (
        "no_grad, DTYPE_POLICIES_COMPILE=0"
    ),
}


@contextlib.contextmanager
def _epilogue_compile(enabled: bool | None):
    """Sets the int8 epilogue compilation for the duration of a call
    (`None`: leave it as it is)."""
    if enabled is None:
        yield
        return
    from dtype_policies.quantization import kernels

    previous = kernels._compile_enabled
    kernels.set_compile_epilogues(enabled)
    try:
        yield
    finally:
        kernels.set_compile_epilogues(previous)


class _TokenClock:
    """A `generate` streamer that records when each new token is produced."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _decode_call(model, context, compile_setting) -> Callable[[], Timed]:
    """One greedy `generate` of LLM_NEW_TOKENS tokens after a LLM_PROMPT-token
    prompt; returns the time per new token after the first (the prefill and
    the first token are excluded)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (1, LLM_PROMPT), generator=generator)
    mask = torch.ones_like(ids)

    def run() -> Timed:
        clock = _TokenClock()
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


WORKLOADS = {
    "mlp_train": ("MLP train step (batch 256, SGD)", lambda: mlp_train()),
    "mlp_inference": ("MLP inference (batch 256)", lambda: mlp_inference()),
    "mlp_decode": ("MLP inference at batch 1 (decoding)", lambda: mlp_decode()),
    "transformer_train": ("Transformer encoder train step (AdamW)", lambda: transformer_train()),
    "overhead_no_grad": (
        "Per-call overhead, 64x64 layer, (1, 64), no_grad",
        lambda: call_overhead(False),
    ),
    "overhead_grad": (
        "Per-call overhead, 64x64 layer, (1, 64), grad enabled",
        lambda: call_overhead(True),
    ),
    "llm_decode": (
        f"Llama-style LM decode (batch 1, prompt {LLM_PROMPT}, greedy), ms per new token",
        lambda: llm_workload("decode"),
    ),
    "llm_prefill": (
        f"Llama-style LM prefill ({LLM_PREFILL[0]} x {LLM_PREFILL[1]} tokens), ms per forward",
        lambda: llm_workload("prefill"),
    ),
}

_ = dtype_policies  # the package under test
