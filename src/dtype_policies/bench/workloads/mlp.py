"""The MLP workloads (1024 -> 4096 -> 1024 -> 4096 -> 1024, GELU): train step,
inference at batch 256 and at batch 1, and quantization accuracy."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn

from dtype_policies import apply_policy, layers, quantize
from dtype_policies.bench.registry import Variants, register
from dtype_policies.bench.workloads.common import (
    inference_call,
    keras_module,
    policied_copy,
    torchao_int8,
    train_step,
)
from dtype_policies.quantization import Int4QuantizationConfig


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


def mlp_train_factories(batch: int = 256) -> dict[str, Callable[[], Callable[[], None]]]:
    """Each variant of the MLP train step, built only when its factory is called
    (so that memory can be measured one variant at a time)."""
    torch.manual_seed(0)
    base = mlp()
    x, target = torch.randn(batch, 1024), torch.randn(batch, 1024)

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=1e-3)

    def plain(policy=None, context=None, bf16=False):
        def build():
            model = copy.deepcopy(base)
            if bf16:
                model = model.bfloat16()
            if policy is not None:
                apply_policy(model, policy)
            return train_step(model, x.bfloat16() if bf16 else x, target, sgd(model), context)

        return build

    def with_layers():
        model = layers_mlp("mixed_bfloat16")
        model(x)
        return train_step(model, x, target, sgd(model))

    factories = {
        "float32": plain(),
        "dtype_policies mixed_bfloat16": plain("mixed_bfloat16"),
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
            return train_step(km, x, target, optimizer)

        factories["Keras 3 (torch backend) mixed_bfloat16"] = with_keras
    return factories


def mlp_train(batch: int = 256) -> tuple[Variants, dict[str, str]]:
    variants: Variants = {name: build() for name, build in mlp_train_factories(batch).items()}
    notes = {"whole model bfloat16 (no master weights)": "the limit"}
    return variants, notes


def mlp_inference(batch: int = 256) -> tuple[Variants, dict[str, str]]:
    torch.manual_seed(0)
    base = mlp().eval()
    x = torch.randn(batch, 1024)
    variants: Variants = {}
    notes: dict[str, str] = {}
    variants["float32"] = inference_call(copy.deepcopy(base), x)
    m = policied_copy(base, "mixed_bfloat16")
    variants["dtype_policies mixed_bfloat16"] = inference_call(m, x)
    notes["dtype_policies mixed_bfloat16"] = "keeps a bf16 copy: +50% weight memory"
    m = policied_copy(base, "mixed_bfloat16", weight_cache=False)
    variants["dtype_policies mixed_bfloat16, weight_cache=False"] = inference_call(m, x)
    m = copy.deepcopy(base)

    def autocast_run(model=m):
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            return model(x)

    variants["torch.autocast bfloat16"] = autocast_run
    variants["whole model bfloat16"] = inference_call(copy.deepcopy(base).bfloat16(), x.bfloat16())
    m = policied_copy(base, "int8_from_mixed_bfloat16")
    variants["dtype_policies int8_from_mixed_bfloat16"] = inference_call(m, x)
    m = copy.deepcopy(base)
    quantize(m, "int8")
    variants["dtype_policies int8_from_float32"] = inference_call(m, x)
    m = policied_copy(base, "mixed_bfloat16", "int4")
    variants["dtype_policies int4/128_from_mixed_bfloat16"] = inference_call(m, x)
    ao = torchao_int8(copy.deepcopy(base))
    if ao is not None:
        variants["torchao Int8DynamicActivationInt8Weight"] = inference_call(ao, x)
        compiled = torch.compile(torchao_int8(copy.deepcopy(base)))
        variants["torchao Int8DynamicActivationInt8Weight, compiled"] = inference_call(compiled, x)
    keras = keras_module()
    if keras is not None:
        km = keras_mlp(keras, "mixed_bfloat16")
        _copy_weights_into_keras(base, km)
        variants["Keras 3 mixed_bfloat16"] = inference_call(km, x)
        kq = keras_mlp(keras, "float32")
        _copy_weights_into_keras(base, kq)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kq.quantize("int8")
        variants["Keras 3 int8"] = inference_call(kq, x)
    return variants, notes


def mlp_decode() -> tuple[Variants, dict[str, str]]:
    """Batch 1: memory-bound decoding."""
    torch.manual_seed(0)
    base = mlp().eval()
    x = torch.randn(1, 1024)
    variants: Variants = {
        "float32": inference_call(copy.deepcopy(base), x),
        "whole model bfloat16": inference_call(copy.deepcopy(base).bfloat16(), x.bfloat16()),
    }
    per_channel = Int4QuantizationConfig(block_size=-1)
    for name, policy, mode, config in (
        ("mixed_bfloat16", "mixed_bfloat16", None, None),
        ("int8_from_mixed_bfloat16", "int8_from_mixed_bfloat16", None, None),
        ("int4/128_from_mixed_bfloat16", "mixed_bfloat16", "int4", None),
        ("int4/-1_from_mixed_bfloat16", "mixed_bfloat16", "int4", per_channel),
    ):
        m = policied_copy(base, policy, mode, config)
        variants[f"dtype_policies {name}"] = inference_call(m, x)
    ao = torchao_int8(copy.deepcopy(base))
    if ao is not None:
        variants["torchao Int8DynamicActivationInt8Weight, compiled"] = inference_call(
            torch.compile(ao), x
        )
    return variants, {}


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
        model = policied_copy(base, name.split("_from_")[1], mode, config)
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
            if key.rsplit(".", 1)[-1]
            in ("weight", "weight_int8", "weight_int4", "weight_scale", "weight_zero")
        )
        rows.append(
            {
                "policy": name,
                "relative_error": error,
                "weight_bytes_vs_float32": stored / weight_bytes,
            }
        )
    return rows


register(
    "mlp_train",
    "MLP train step (batch 256, SGD)",
    mlp_train,
    baseline="torch.autocast bfloat16",
)
register(
    "mlp_inference",
    "MLP inference (batch 256)",
    mlp_inference,
    baseline="whole model bfloat16",
)
register(
    "mlp_decode",
    "MLP inference at batch 1 (decoding)",
    mlp_decode,
    baseline="whole model bfloat16",
)
