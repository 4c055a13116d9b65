"""Mirror of `keras.config` for dtype policies: `set_dtype_policy`, `dtype_policy`.

>>> from dtype_policies import config
>>> config.set_dtype_policy("mixed_float16")
>>> config.dtype_policy()
<DTypePolicy "mixed_float16">
>>> config.set_dtype_policy("float32")
"""

from dtype_policies.default_policy import dtype_policy, policy_scope, set_dtype_policy

__all__ = ["dtype_policy", "policy_scope", "set_dtype_policy"]
