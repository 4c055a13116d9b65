"""dtype-policies: Keras-style dtype policies (mixed precision and quantization,
per layer) for PyTorch.

>>> import dtype_policies
>>> dtype_policies.DTypePolicy("mixed_bfloat16").compute_dtype
'bfloat16'
"""

from dtype_policies import config, layers, mixed_precision, optimizers, quantization, saving
from dtype_policies.apply import PolicyHandle, apply_policy, summary
from dtype_policies.default_policy import dtype_policy, policy_scope, set_dtype_policy
from dtype_policies.policies import (
    QUANTIZATION_MODES,
    DTypePolicy,
    FloatDTypePolicy,
    Int4DTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
)
from dtype_policies.policy_map import DTypePolicyMap
from dtype_policies.quantization.api import quantize
from dtype_policies.serialization import deserialize, get, serialize

__version__ = "0.1.0"

__all__ = [
    "QUANTIZATION_MODES",
    "DTypePolicy",
    "DTypePolicyMap",
    "FloatDTypePolicy",
    "Int4DTypePolicy",
    "PolicyHandle",
    "QuantizedDTypePolicy",
    "QuantizedFloat8DTypePolicy",
    "apply_policy",
    "config",
    "deserialize",
    "dtype_policy",
    "get",
    "layers",
    "mixed_precision",
    "optimizers",
    "policy_scope",
    "quantization",
    "quantize",
    "saving",
    "serialize",
    "set_dtype_policy",
    "summary",
]
