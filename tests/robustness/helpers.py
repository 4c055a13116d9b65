"""Helpers of the robustness suite: module builders per kind and mode, the
dequantized weight computed independently from the stored tensors (by the
contract's names and formulas), and "nothing changed" snapshots."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtype_policies import apply_policy, layers, quantize
from dtype_policies._core.module_state import state_of
from dtype_policies.quantization import Int4QuantizationConfig, Int8QuantizationConfig

CONTEXTS = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": contextlib.nullcontext,
}
FLOAT_POLICIES = ("mixed_bfloat16", "bfloat16", "float32")
QUANT_MODES = ("int8", "int8_wo", "int4_128", "int4_pc", "float8")
INTEGER_MODES = ("int8", "int8_wo", "int4_128", "int4_pc")
LINEAR_KINDS = ("linear", "dense", "einsum")
EMBEDDING_KINDS = ("nn_embedding", "embedding")
# Relative output error against float32 (random weights; bfloat16 adds ~1%).
TOLERANCE = {"int8": 0.05, "int8_wo": 0.03, "int4_128": 0.2, "int4_pc": 0.25, "float8": 0.15}

IN_FEATURES, OUT_FEATURES = 256, 48  # int4/128: two groups, CPU int4 kernel shapes
VOCAB, EMBED_DIM = 40, 256


def mode_and_config(name: str):
    """`(mode, config)` for a mode label of this suite."""
    return {
        "int8": ("int8", Int8QuantizationConfig()),  # Keras's W8A8 (the default is weight-only)
        "int8_wo": ("int8", Int8QuantizationConfig(activation_quantizer=None)),
        "int4_128": ("int4", Int4QuantizationConfig(block_size=128)),
        "int4_pc": ("int4", Int4QuantizationConfig(block_size=-1)),
        "float8": ("float8", None),
    }[name]


def quantize_with(model: nn.Module, mode_name: str, **kwargs):
    mode, config = mode_and_config(mode_name)
    return quantize(model, mode, config, **kwargs)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(
        a.detach().double().flatten(), b.detach().double().flatten(), 0
    ).item()


def compute_dtype_of(policy_name: str) -> torch.dtype:
    return torch.float32 if policy_name == "float32" else torch.bfloat16


# ---------------------------------------------------------------- builders


def make_linear(kind: str, policy: str = "float32", seed: int = 0, k=IN_FEATURES, n=OUT_FEATURES):
    """`(model, leaf, reference)`: a model holding one linear-like leaf of
    `kind` under the float `policy`, and `reference(x)`: the float32 output
    of the same weights (computed from copies taken now)."""
    torch.manual_seed(seed)
    if kind == "linear":
        model = nn.Sequential(nn.Linear(k, n))
        with torch.no_grad():
            model[0].bias.normal_()
        leaf = model[0]
        w_nk, b = leaf.weight.detach().float().clone(), leaf.bias.detach().float().clone()
        apply_policy(model, policy)
    elif kind in ("dense", "einsum"):
        if kind == "dense":
            leaf = layers.Dense(n, dtype=policy)
        else:
            leaf = layers.EinsumDense("...b,bc->...c", output_shape=n, bias_axes="c", dtype=policy)
        leaf.build((None, k))
        with torch.no_grad():
            leaf.bias.normal_()
        model = leaf
        w_nk, b = leaf.kernel.detach().t().float().clone(), leaf.bias.detach().float().clone()
    else:
        raise ValueError(kind)

    def reference(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.detach().float(), w_nk, b)

    reference.weight_nk = w_nk
    reference.bias = b
    return model, leaf, reference


def make_embedding(kind: str, policy: str = "float32", seed: int = 0, v=VOCAB, d=EMBED_DIM):
    torch.manual_seed(seed)
    if kind == "nn_embedding":
        model = nn.Sequential(nn.Embedding(v, d))
        leaf = model[0]
        table = leaf.weight.detach().float().clone()
        apply_policy(model, policy)
    elif kind == "embedding":
        leaf = layers.Embedding(v, d, dtype=policy)
        leaf.build()
        model = leaf
        table = leaf.embeddings.detach().float().clone()
    else:
        raise ValueError(kind)

    def reference(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    reference.table = table
    return model, leaf, reference


# ------------------------------------------------- stored tensors (contract)


def unpack_int4(packed: torch.Tensor, length: int, axis: int) -> torch.Tensor:
    """Two signed 4-bit values per byte, element 2i in the low nibble (Keras)."""
    p = packed.movedim(axis, -1).view(torch.uint8).to(torch.int16)
    values = torch.stack([p & 0xF, (p >> 4) & 0xF], dim=-1).flatten(-2)[..., :length]
    values = torch.where(values > 7, values - 16, values).to(torch.int8)
    return values.movedim(-1, axis)


def int_values_nk(leaf: nn.Module, kind: str, mode: str, n: int, k: int) -> torch.Tensor:
    """The stored integer weight values as an (N, K) int8 matrix."""
    buffers = dict(leaf.named_buffers(recurse=False))
    if kind == "linear":
        if mode == "int8":
            return buffers["weight_int8"]
        return unpack_int4(buffers["weight_int4"], k, axis=1)
    if mode == "int8":
        return buffers["kernel_int8"].reshape(k, n).t()
    values = leaf.kernel  # the contract: unpacked int4 values, as Keras gives them
    return values.reshape(k, n).t()


def dequantized_nk(leaf: nn.Module, kind: str, mode_name: str, n=OUT_FEATURES, k=IN_FEATURES):
    """The float32 (N, K) weight a quantized linear-like leaf represents,
    computed from its stored tensors by the contract's formulas."""
    mode = mode_and_config(mode_name)[0]
    prefix = "weight" if kind == "linear" else "kernel"
    buffers = dict(leaf.named_buffers(recurse=False))
    q = int_values_nk(leaf, kind, mode, n, k).float()
    scale = buffers[f"{prefix}_scale"].float()
    zero = buffers.get(f"{prefix}_zero")
    if mode == "int4" and zero is not None:  # grouped: (q - zero) * scale
        if kind == "linear":  # laid out like the (out, in) weight: (N, G)
            scale, zero = scale.t(), zero.t()
        groups = scale.shape[0]
        block = -(-k // groups)
        group_of_k = torch.arange(k) // block
        return (q - zero.float().t()[:, group_of_k]) * scale.t()[:, group_of_k]
    return q / scale[:, None]  # symmetric: W = q / scale


# ---------------------------------------------------------------- snapshots


def _policy_name(module: nn.Module):
    try:
        policy = module.dtype_policy
    except AttributeError:
        return None
    return getattr(policy, "name", repr(policy))


def snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "classes": {name: type(m) for name, m in model.named_modules()},
        "policies": {name: _policy_name(m) for name, m in model.named_modules()},
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["classes"] == before["classes"], "module classes changed"
    assert after["policies"] == before["policies"], "policies changed"
    assert list(after["state"]) == list(before["state"]), "state_dict keys changed"
    for key, value in before["state"].items():
        now = after["state"][key]
        assert now.dtype == value.dtype, f"{key}: dtype {value.dtype} -> {now.dtype}"
        assert _same_values(now, value), f"{key}: values changed"


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, a NaN matching a NaN in the same place."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


# ---------------------------------------------------------------- isolation


def run_isolated(code: str, timeout: float = 120):
    """Runs `code` in a fresh interpreter (a segfault there cannot take pytest
    down); returns the CompletedProcess. The package is found as in this one."""
    import os
    import subprocess
    import sys

    import dtype_policies

    source_root = os.path.dirname(os.path.dirname(os.path.abspath(dtype_policies.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([source_root, env.get("PYTHONPATH", "")])
    env["DTYPE_POLICIES_COMPILE"] = "0"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )


# ---------------------------------------------------------------- first-generation builders

QUANTIZE_ARGS = {
    "int8": ("int8", Int8QuantizationConfig()),  # Keras's W8A8 (the default is weight-only)
    "int8_weight_only": ("int8", Int8QuantizationConfig(activation_quantizer=None)),
    "int4": ("int4", None),
    "int4_per_channel": ("int4", Int4QuantizationConfig(block_size=-1)),
    "float8": ("float8", None),
}
"""`quantize(model, *QUANTIZE_ARGS[label])` for each label (int4 in its default blocks)."""


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def snapshot_with_call_states(module: nn.Module) -> tuple:
    """State dict values, module classes and each module's derived call state."""
    return (
        {k: v.clone() for k, v in module.state_dict().items()},
        [type(m) for m in module.modules()],
        [getattr(state_of(m), "call", None) for m in module.modules()],
    )


def unchanged_with_call_states(module: nn.Module, before: tuple) -> bool:
    tensors, classes, states = before
    after = module.state_dict()
    return (
        list(after) == list(tensors)
        and all(torch.equal(after[k], tensors[k]) for k in tensors)
        and [type(m) for m in module.modules()] == classes
        and [getattr(state_of(m), "call", None) for m in module.modules()] == states
    )
