"""Mirror of `keras.mixed_precision` (and the tf.keras 2 names from the seeds).

`Policy` is `DTypePolicy`; `set_global_policy` / `global_policy` are the
tf.keras names of `set_dtype_policy` / `dtype_policy`.

>>> from dtype_policies import mixed_precision
>>> mixed_precision.set_global_policy("mixed_bfloat16")
>>> mixed_precision.global_policy()
<DTypePolicy "mixed_bfloat16">
>>> mixed_precision.Policy("float32") == mixed_precision.DTypePolicy("float32")
True
>>> mixed_precision.set_global_policy("float32")
"""

from typing import Any

from dtype_policies.default_policy import dtype_policy, set_dtype_policy
from dtype_policies.optimizers import LossScaleOptimizer
from dtype_policies.policies import DTypePolicy

Policy = DTypePolicy
set_global_policy = set_dtype_policy
global_policy = dtype_policy


def get_layer_policy(layer: Any) -> DTypePolicy:
    """The dtype policy of a layer (the tf.keras 2 name).

    >>> from dtype_policies import layers, mixed_precision
    >>> mixed_precision.get_layer_policy(layers.Dense(2, dtype="mixed_bfloat16"))
    <DTypePolicy "mixed_bfloat16">
    """
    policy = getattr(layer, "dtype_policy", None)
    if not isinstance(policy, DTypePolicy):
        raise TypeError(
            f"get_layer_policy() expects a dtype_policies layer (or a module prepared with "
            f"apply_policy). Received: {type(layer).__name__}"
        )
    return policy


__all__ = [
    "DTypePolicy",
    "LossScaleOptimizer",
    "Policy",
    "dtype_policy",
    "get_layer_policy",
    "global_policy",
    "set_dtype_policy",
    "set_global_policy",
]
