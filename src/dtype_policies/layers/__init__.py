"""Keras-style layers as `torch.nn.Module`s whose dtype policy does the casting.

>>> import torch
>>> from dtype_policies import layers
>>> dense = layers.Dense(4, dtype="mixed_bfloat16")
>>> dense(torch.ones(1, 3)).dtype
torch.bfloat16
"""

from dtype_policies.layers.attention import MultiHeadAttention
from dtype_policies.layers.core import Activation, Dropout
from dtype_policies.layers.dense import Dense
from dtype_policies.layers.einsum_dense import EinsumDense
from dtype_policies.layers.embedding import Embedding
from dtype_policies.layers.layer import Layer
from dtype_policies.layers.normalization import LayerNormalization
from dtype_policies.layers.sequential import Sequential
from dtype_policies.layers.serialization import (
    BUILTIN_LAYERS,
    deserialize_layer,
    register_serializable,
    serialize_layer,
)

for _cls in (
    Activation,
    Dense,
    Dropout,
    EinsumDense,
    Embedding,
    Layer,
    LayerNormalization,
    MultiHeadAttention,
    Sequential,
):
    BUILTIN_LAYERS[_cls.__name__] = _cls

__all__ = [
    "Activation",
    "Dense",
    "Dropout",
    "EinsumDense",
    "Embedding",
    "Layer",
    "LayerNormalization",
    "MultiHeadAttention",
    "Sequential",
    "deserialize_layer",
    "register_serializable",
    "serialize_layer",
]
