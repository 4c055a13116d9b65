"""dtype-policies: Keras-style dtype policies (mixed precision and quantization,
per layer) for PyTorch.

>>> import dtype_policies
>>> dtype_policies.DTypePolicy("mixed_bfloat16").compute_dtype
'bfloat16'
>>> dtype_policies.QUANTIZATION_MODES  # the registered modes, live
('int8', 'float8', 'int4', 'gptq', 'awq')
>>> dtype_policies.__version__.count(".")
2
"""

from typing import Any

from dtype_policies import (
    activations,
    config,
    constraints,
    distributed,
    initializers,
    layers,
    mixed_precision,
    optimizers,
    policies,
    quantization,
    quantizers,
    regularizers,
    saving,
)
from dtype_policies._core.cpu_float16 import CPUFloat16Warning
from dtype_policies._core.module_state import clear_cast_caches
from dtype_policies._core.scope import checkpoint_contexts
from dtype_policies._modes import module_attribute as _module_attribute
from dtype_policies._version import __version__

# The advisor sits at the top: it imports the rest, nothing imports it.
from dtype_policies.advisor import Advice, advise
from dtype_policies.apply import PolicyHandle, apply_policy, summary
from dtype_policies.default_policy import dtype_policy, policy_scope, set_dtype_policy
from dtype_policies.generation import compile_for_generation
from dtype_policies.inference import CompiledInference, compile_for_inference
from dtype_policies.policies import (
    AWQDTypePolicy,
    DTypePolicy,
    DTypePolicyMap,
    FloatDTypePolicy,
    GPTQDTypePolicy,
    Int4DTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
    deserialize,
    get,
    serialize,
)
from dtype_policies.quantization import quantize


def __getattr__(name: str) -> Any:
    # QUANTIZATION_MODES: the implemented modes, a tuple read from the mode records.
    return _module_attribute(__name__, name)


__all__ = [
    "QUANTIZATION_MODES",
    "AWQDTypePolicy",
    "Advice",
    "CPUFloat16Warning",
    "CompiledInference",
    "DTypePolicy",
    "DTypePolicyMap",
    "FloatDTypePolicy",
    "GPTQDTypePolicy",
    "Int4DTypePolicy",
    "PolicyHandle",
    "QuantizedDTypePolicy",
    "QuantizedFloat8DTypePolicy",
    "__version__",
    "activations",
    "advise",
    "apply_policy",
    "checkpoint_contexts",
    "clear_cast_caches",
    "compile_for_generation",
    "compile_for_inference",
    "config",
    "constraints",
    "deserialize",
    "distributed",
    "dtype_policy",
    "get",
    "initializers",
    "layers",
    "mixed_precision",
    "optimizers",
    "policies",
    "policy_scope",
    "quantization",
    "quantize",
    "quantizers",
    "regularizers",
    "saving",
    "serialize",
    "set_dtype_policy",
    "summary",
]
