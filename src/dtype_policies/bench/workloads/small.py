"""A small transformer encoder's train step, and the per-call overhead of a
64x64 layer."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from dtype_policies import apply_policy, layers
from dtype_policies.bench.registry import Variants, register
from dtype_policies.bench.workloads.common import keras_module, train_step


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
    variants["float32"] = train_step(m, x, target, adam(m))
    m = copy.deepcopy(base)
    apply_policy(m, "mixed_bfloat16")
    variants["dtype_policies mixed_bfloat16"] = train_step(m, x, target, adam(m))
    m = copy.deepcopy(base)
    variants["torch.autocast bfloat16"] = train_step(
        m, x, target, adam(m), lambda: torch.autocast("cpu", torch.bfloat16)
    )
    m = copy.deepcopy(base).bfloat16()
    variants["whole model bfloat16 (no master weights)"] = train_step(
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


register(
    "transformer_train",
    "Transformer encoder train step (AdamW)",
    transformer_train,
    baseline="torch.autocast bfloat16",
)
register(
    "overhead_no_grad",
    "Per-call overhead, 64x64 layer, (1, 64), no_grad",
    lambda: call_overhead(False),
    reference="nn.Linear float32",
    baseline="nn.Linear float32",
)
register(
    "overhead_grad",
    "Per-call overhead, 64x64 layer, (1, 64), grad enabled",
    lambda: call_overhead(True),
    reference="nn.Linear float32",
    baseline="nn.Linear float32",
)
