"""Parsing policy names: float names and quantized names alike."""

from __future__ import annotations

from dtype_policies._dtypes import ALLOWED_DTYPES
from dtype_policies.policies.dtype_policy import DTypePolicy
from dtype_policies.policies.quantized import (
    Int4DTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
)
from dtype_policies.quantizers.config import QUANTIZATION_MODES

# Keras modes recognised by name but not implemented; they get a specific error.
UNSUPPORTED_KERAS_MODES = ("gptq", "awq", "ternary")


def parse_policy_name(name: str) -> DTypePolicy:
    """Parses any policy name.

    `"int8_from_float32"`, `"int4/128_from_mixed_bfloat16"`, `"float8_from_X"` and
    the legacy per-channel `"int4_from_X"` give quantized policies; plain dtype
    names (including `"int8"` and `"float8_e4m3fn"`) give a `DTypePolicy`.

    >>> parse_policy_name("int4/64_from_float32")
    <Int4DTypePolicy "int4/64_from_float32">
    >>> parse_policy_name("int8")
    <DTypePolicy "int8">
    """
    if not isinstance(name, str):
        raise TypeError(f"`policy` must be a string. Received: policy={name!r}")
    if name in ALLOWED_DTYPES or not name.startswith(QUANTIZATION_MODES + UNSUPPORTED_KERAS_MODES):
        return DTypePolicy(name)
    return parse_quantized_policy_name(name)


def parse_quantized_policy_name(policy: str) -> QuantizedDTypePolicy:
    """Parses `"<mode>_from_<source>"` (Keras's rules and messages)."""
    if not isinstance(policy, str):
        raise TypeError(f"`policy` must be a string. Received: policy={policy!r}")
    if policy.startswith(UNSUPPORTED_KERAS_MODES):
        mode = policy.split("/")[0].split("_")[0]
        raise ValueError(
            f"Quantization mode '{mode}' (from policy '{policy}') is a Keras mode that "
            f"dtype_policies does not implement. Supported modes: {QUANTIZATION_MODES}."
        )
    if not policy.startswith(QUANTIZATION_MODES):
        raise ValueError("`policy` is incompatible with the current supported quantization.")
    parts = policy.split("_from_")
    if len(parts) != 2:
        raise ValueError(
            "Cannot convert `policy` into a valid pair (`mode`, `source_name`) to "
            f"instantiate `QuantizedDTypePolicy`. Received: policy={policy}"
        )
    mode, source_name = parts
    if mode.startswith("int4") and "/" in mode:
        return Int4DTypePolicy(mode, source_name)
    if mode == "float8":
        return QuantizedFloat8DTypePolicy(mode, source_name)
    return QuantizedDTypePolicy(mode, source_name)
