"""Saving and loading: layer (de)serialization in the Keras dict format.

>>> from dtype_policies import layers, saving
>>> config = saving.serialize_layer(layers.Dense(3, dtype="mixed_bfloat16", name="d"))
>>> saving.deserialize_layer(config).dtype_policy
<DTypePolicy "mixed_bfloat16">
"""

from dtype_policies.layers.serialization import (
    deserialize_layer,
    register_serializable,
    serialize_layer,
)

__all__ = ["deserialize_layer", "register_serializable", "serialize_layer"]
