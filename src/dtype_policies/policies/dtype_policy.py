"""`DTypePolicy`: which dtype a layer computes in and stores its variables in.

Names, semantics, repr and config format follow Keras 3 so that a Keras user
recognises them and a Keras config can be read here. Unlike Keras, policies are
immutable and hashable. Each policy class registers itself by name when it is
defined (`POLICY_CLASSES`), which is how serialized policies are rebuilt.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from dtype_policies._dtypes import standardize_dtype, to_torch_dtype
from dtype_policies.policies import _default_state

POLICY_CLASSES: dict[str, type] = {}
"""Policy classes by class name, filled as each class is defined."""

KERAS_MODULES: dict[type, str] = {}
"""The `module` Keras writes in a serialized policy, per class."""


class DTypePolicy:
    """A dtype policy for a layer: its compute dtype and its variable dtype.

    Every layer has a policy. Pass one (or its name) to a layer's `dtype`
    argument, give one to `apply_policy`, or set the default with
    `dtype_policies.set_dtype_policy`.

    Args:
        name: The policy name. Any dtype name such as `"float32"`, `"float64"`
            or `"bfloat16"` makes both dtypes that dtype. `"mixed_float16"` and
            `"mixed_bfloat16"` compute in float16 / bfloat16 and keep variables
            in float32. A torch dtype is accepted too. `None` copies the name of
            the default policy in force (see `dtype_policies.dtype_policy()`).

    Example:

    >>> import torch
    >>> from dtype_policies import DTypePolicy
    >>> policy = DTypePolicy("mixed_bfloat16")
    >>> policy
    <DTypePolicy "mixed_bfloat16">
    >>> policy.compute_dtype, policy.variable_dtype
    ('bfloat16', 'float32')
    >>> policy.torch_compute_dtype
    torch.bfloat16
    >>> DTypePolicy(torch.float64).name
    'float64'
    """

    # Written once, in `__init__`, through `_set` (see `__setattr__`).
    _name: str
    _compute_dtype: str
    _variable_dtype: str
    _quantization_mode: str | None = None
    # A `DTypePolicyMap` is a policy whose entries depend on the layer path.
    is_map: ClassVar[bool] = False
    # Set by each of this library's classes: the module Keras writes for it.
    keras_module: ClassVar[str | None] = "keras"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "keras_module" in cls.__dict__ and cls.keras_module is not None:
            POLICY_CLASSES[cls.__name__] = cls
            KERAS_MODULES[cls] = cls.keras_module

    def __init__(self, name: str | torch.dtype | None = None) -> None:
        if name is None:
            name = default_source_name()
        name, compute, variable = parse_float_name(name)
        self._set("_name", name)
        self._set("_compute_dtype", compute)
        self._set("_variable_dtype", variable)

    # Immutability: attributes are written once, in `__init__`.
    def _set(self, attr: str, value: Any) -> None:
        object.__setattr__(self, attr, value)

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError(
            f"{type(self).__name__} objects are immutable; cannot set '{attr}'. "
            "Create a new policy instead."
        )

    def __delattr__(self, attr: str) -> None:
        raise AttributeError(f"{type(self).__name__} objects are immutable.")

    @property
    def name(self) -> str:
        """The name of this policy, e.g. `"mixed_bfloat16"`."""
        return self._name

    @property
    def compute_dtype(self) -> str:
        """The dtype layers compute in (and cast their inputs to), e.g. `"bfloat16"`."""
        return self._compute_dtype

    @property
    def variable_dtype(self) -> str:
        """The dtype layers create their variables in, e.g. `"float32"`."""
        return self._variable_dtype

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        """`compute_dtype` as a `torch.dtype`."""
        return to_torch_dtype(self.compute_dtype)

    @property
    def torch_variable_dtype(self) -> torch.dtype:
        """`variable_dtype` as a `torch.dtype`."""
        return to_torch_dtype(self.variable_dtype)

    @property
    def quantization_mode(self) -> str | None:
        """`"int8"`, `"int4"` or `"float8"` for quantized policies, else `None`."""
        return self._quantization_mode

    def convert_input(self, x: Any, autocast: bool, dtype: Any) -> Any:
        """Casts `x` to `dtype` if it is a floating tensor and `autocast` is true.

        Arrays (anything with `__array__`) become tensors first. Integer, bool
        and complex tensors and non-tensor values are returned unchanged.
        `dtype=None` means float32 (Keras's `floatx()`).
        """
        target = to_torch_dtype(standardize_dtype("float32" if dtype is None else dtype))
        if not isinstance(x, torch.Tensor):
            if not hasattr(x, "__array__"):
                return x
            x = torch.as_tensor(x)
        if autocast and x.is_floating_point() and x.dtype != target:
            return x.to(target)
        return x

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DTypePolicy:
        return cls(**config)

    def _equality_key(self) -> tuple:
        return ("float", self._name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DTypePolicy):
            return NotImplemented
        if _is_plain_float(self) or _is_plain_float(other):
            # DTypePolicy and its alias FloatDTypePolicy compare by name.
            return _is_plain_float(self) and _is_plain_float(other) and self._name == other._name
        return type(self) is type(other) and self._equality_key() == other._equality_key()

    def __hash__(self) -> int:
        kind = "float" if _is_plain_float(self) else type(self).__name__
        return hash((kind, self._equality_key()))

    def __repr__(self) -> str:
        class_name = "DTypePolicy" if _is_plain_float(self) else type(self).__name__
        return f'<{class_name} "{self._name}">'


class FloatDTypePolicy(DTypePolicy):
    """Alias of `DTypePolicy` kept for Keras compatibility.

    It prints as `DTypePolicy` and equals the `DTypePolicy` of the same name.

    >>> from dtype_policies import DTypePolicy, FloatDTypePolicy
    >>> FloatDTypePolicy("bfloat16") == DTypePolicy("bfloat16")
    True
    """

    keras_module = "keras"


POLICY_CLASSES["DTypePolicy"] = DTypePolicy
POLICY_CLASSES["Policy"] = DTypePolicy  # Keras 2 / tf.keras configs
KERAS_MODULES[DTypePolicy] = "keras"


def _is_plain_float(policy: DTypePolicy) -> bool:
    return type(policy) in (DTypePolicy, FloatDTypePolicy)


def default_source_name() -> str:
    """The name of the default policy's float part (used when a name is omitted):
    the default in force, the default of a default map, the source of a
    quantized default."""
    default = _default_state.current()
    if default is None:
        return "float32"
    default = getattr(default, "default_policy", default)  # a map: its default
    return getattr(default, "source_name", default.name)


_INVALID_NAME_MESSAGE = (
    "Cannot convert '{name}' to a mixed precision DTypePolicy. Valid policies "
    "include 'mixed_float16', 'mixed_bfloat16', and the name of any float dtype "
    "such as 'float32'."
)


def parse_float_name(name: Any) -> tuple[str, str, str]:
    """Returns `(name, compute_dtype, variable_dtype)` for a float policy name."""
    if isinstance(name, torch.dtype) or (
        not isinstance(name, str) and hasattr(name, "name") and hasattr(name, "itemsize")
    ):
        try:
            name = standardize_dtype(name)
        except ValueError:
            raise ValueError(_INVALID_NAME_MESSAGE.format(name=name)) from None
    if not isinstance(name, str):
        raise TypeError(
            "'name' must be a string, such as 'mixed_float16'. "
            f"Received: name={name!r} (of type {type(name)})"
        )
    if name == "mixed_float16":
        return name, "float16", "float32"
    if name == "mixed_bfloat16":
        return name, "bfloat16", "float32"
    try:
        dtype = standardize_dtype(name)
    except ValueError:
        raise ValueError(_INVALID_NAME_MESSAGE.format(name=name)) from None
    return name, dtype, dtype
