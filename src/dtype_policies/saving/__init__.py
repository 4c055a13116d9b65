"""Saving and loading models with their policies and quantization, policy
files, Keras interop, and layer (de)serialization in the Keras dict format.

>>> from dtype_policies import layers, saving
>>> config = saving.serialize_layer(layers.Dense(3, dtype="mixed_bfloat16", name="d"))
>>> saving.deserialize_layer(config).dtype_policy
<DTypePolicy "mixed_bfloat16">
"""

import importlib

from dtype_policies.layers.serialization import (
    deserialize_layer,
    register_serializable,
    serialize_layer,
)
from dtype_policies.saving import _hf_hooks
from dtype_policies.saving.checkpoint import load, save
from dtype_policies.saving.keras_archive import policy_map_from_keras
from dtype_policies.saving.manifest import CheckpointError
from dtype_policies.saving.policy_files import load_policy, save_policy

_hf_hooks.install()  # Hugging Face integration, without importing transformers


def __getattr__(name: str):
    if name == "huggingface":  # imports transformers, so only on demand
        return importlib.import_module("dtype_policies.saving.huggingface")
    raise AttributeError(f"module 'dtype_policies.saving' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "deserialize_layer",
    "load",
    "load_policy",
    "policy_map_from_keras",
    "register_serializable",
    "save",
    "save_policy",
    "serialize_layer",
]
