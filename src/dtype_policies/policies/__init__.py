"""Dtype policy objects (mirror of `keras.dtype_policies`): `DTypePolicy`, the
quantized policies, `DTypePolicyMap`, and `get`/`serialize`/`deserialize`.

>>> from dtype_policies import policies
>>> policies.get("int4/64_from_mixed_bfloat16").block_size
64
>>> "int4" in policies.QUANTIZATION_MODES
True
"""

from typing import Any

from dtype_policies._modes import module_attribute as _module_attribute
from dtype_policies.policies.calibrated import AWQDTypePolicy, GPTQDTypePolicy
from dtype_policies.policies.dtype_policy import DTypePolicy, FloatDTypePolicy
from dtype_policies.policies.names import parse_policy_name
from dtype_policies.policies.policy_map import DTypePolicyMap
from dtype_policies.policies.quantized import (
    Int4DTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
    policy_for_config,
)
from dtype_policies.policies.serialization import default_policy, deserialize, get, serialize


def __getattr__(name: str) -> Any:
    # QUANTIZATION_MODES: the implemented modes, a tuple read from the mode records.
    return _module_attribute(__name__, name)


__all__ = [
    "QUANTIZATION_MODES",
    "AWQDTypePolicy",
    "DTypePolicy",
    "DTypePolicyMap",
    "FloatDTypePolicy",
    "GPTQDTypePolicy",
    "Int4DTypePolicy",
    "QuantizedDTypePolicy",
    "QuantizedFloat8DTypePolicy",
    "default_policy",
    "deserialize",
    "get",
    "parse_policy_name",
    "policy_for_config",
    "serialize",
]
