"""Quantizing plain `torch.nn.Linear` and `torch.nn.Embedding` modules in place.

The module keeps its class name and `isinstance` checks (a mixin is put in
front of its class, as `apply_policy` does); its `weight` parameter becomes
int8 buffers (`weight`, `weight_scale`, `weight_zero`, in torch's `(out, in)`
orientation), or, for float8, stays and gains the six scaling buffers.
"""

from __future__ import annotations

from typing import Any

import torch

from dtype_policies._casting import cast_tensor, cast_weight
from dtype_policies.apply import policy_module
from dtype_policies.policies import DTypePolicy
from dtype_policies.quantization import float8
from dtype_policies.quantization.config import QuantizationConfig
from dtype_policies.quantization.embedding import EmbeddingQuantization
from dtype_policies.quantization.linear import LinearQuantization, quantized_policy_name

SUPPORTED_MODES = {
    torch.nn.Linear: ("int8", "int4", "float8"),
    torch.nn.Embedding: ("int8", "int4"),
}


def _compute_dtype(module: torch.nn.Module) -> torch.dtype:
    compute = module.__dict__.get("_dp_compute")
    return compute if compute is not None else module.__dict__["_dp_quantized_compute"]


class QuantizedLinear:
    """Mixin: the forward of a quantized `nn.Linear`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        d = self.__dict__
        compute = _compute_dtype(self)
        if input.is_floating_point() and input.dtype != compute:
            input = cast_tensor(input, compute)
        bias = d["_parameters"]["bias"]
        if bias is not None and bias.dtype != compute:
            bias = cast_weight(d["_dp_quantized_casts"], "bias", bias, compute)
        return d["_dp_quantization"].forward(self, input, bias, compute, self.training)

    def extra_repr(self) -> str:
        quantization = self.__dict__["_dp_quantization"]
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, quantization={quantization.mode}"
        )


class QuantizedEmbedding:
    """Mixin: the lookup of a quantized `nn.Embedding`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        quantization = self.__dict__["_dp_quantization"]
        return quantization.lookup(self, input, _compute_dtype(self))

    def extra_repr(self) -> str:
        quantization = self.__dict__["_dp_quantization"]
        return f"{self.num_embeddings}, {self.embedding_dim}, quantization={quantization.mode}"


def supported_modes(module: torch.nn.Module) -> tuple[str, ...]:
    original, _ = policy_module.class_parts(module)
    for cls, modes in SUPPORTED_MODES.items():
        if issubclass(original, cls):
            return modes
    return ()


def is_quantized(module: torch.nn.Module) -> bool:
    return "_dp_quantization" in module.__dict__


def source_policy(module: torch.nn.Module) -> DTypePolicy:
    """The policy a module computes with now: `apply_policy`'s, else its weight dtype."""
    policy = module.__dict__.get("_dp_policy")
    if policy is not None:
        return policy
    return DTypePolicy(str(module.weight.dtype).removeprefix("torch."))


def quantize_module(
    module: torch.nn.Module, mode: str, config: QuantizationConfig, history_length: int = 1024
) -> DTypePolicy:
    """Quantizes an `nn.Linear` or `nn.Embedding` in place; returns its new policy.

    Raises `NotImplementedError` for other modules or unsupported modes and
    `ValueError` for invalid states; on any error the module is unchanged.
    """
    modes = supported_modes(module)
    if mode not in modes:
        raise NotImplementedError(
            f"{type(module).__name__} does not support quantization mode '{mode}'"
            + (f" (supported: {modes})." if modes else ".")
        )
    if is_quantized(module):
        raise ValueError(
            f"{type(module).__name__} is already quantized in mode "
            f"'{module.__dict__['_dp_quantization'].mode}'. Received: mode={mode}"
        )
    policy = source_policy(module)
    source = policy.source_policy if policy.quantization_mode else policy
    if mode == "int8" and source.compute_dtype == "float16":
        raise ValueError(
            "Quantization mode='int8' doesn't work well with compute_dtype='float16'. "
            "Use a bfloat16 or float32 policy for this module."
        )
    weight = module._parameters["weight"]
    original, _ = policy_module.class_parts(module)
    if issubclass(original, torch.nn.Embedding):
        if module.max_norm is not None:
            raise NotImplementedError("Quantizing an nn.Embedding with max_norm is not supported.")
        quantization: Any = EmbeddingQuantization(
            mode, "weight", module.num_embeddings, module.embedding_dim, config
        )
        mixin: type = QuantizedEmbedding
    else:
        out_features, in_features = weight.shape
        quantization = LinearQuantization(
            mode, "weight", "nk", in_features, out_features, config, history_length
        )
        mixin = QuantizedLinear
    tensors = None if mode == "float8" else quantization.quantize(weight)
    compute_name = source.compute_dtype
    new_policy = quantized_policy_name(mode, config, source.name)

    # Commit: nothing above changed the module.
    if "_dp_policy" in module.__dict__:
        module.__dict__["_dp_policy"] = new_policy
        if tensors is not None:
            module.__dict__["_dp_cast_names"] = module.__dict__["_dp_cast_names"] - {"weight"}
    if tensors is None:
        float8.register_float8_state(module, history_length, weight.device)
    else:
        del module._parameters["weight"]
        for name, tensor in tensors.items():
            module.register_buffer(name, tensor)
    module.__dict__["_dp_quantization"] = quantization
    module.__dict__["_dp_quantized_compute"] = getattr(torch, compute_name)
    module.__dict__["_dp_quantized_casts"] = {}
    if mode != "float8" and "_dp_policy" in module.__dict__:
        module.__dict__["_dp_no_scope"] = True  # its forward casts the bias itself
    module.__class__ = policy_module.module_class(
        original, mixin, policy=policy_module.is_policy_module(module)
    )
    return new_policy
