"""Dtype policy objects: which dtype a layer computes in, stores its variables in,
and whether (and how) its weights are quantized.

Names, semantics, repr and config format follow Keras 3 so that a Keras user
recognises them and a Keras config can be read here. Unlike Keras, policies are
immutable and hashable.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from dtype_policies._dtypes import (
    ALLOWED_DTYPES,
    COMPUTE_FLOAT_DTYPES,
    standardize_dtype,
    to_torch_dtype,
)

QUANTIZATION_MODES = ("int8", "float8", "int4")
"""The quantization modes this library implements."""

# Keras modes we recognise by name but do not implement; they get a specific error.
_UNSUPPORTED_KERAS_MODES = ("gptq", "awq", "ternary")


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

    _quantization_mode: str | None = None

    def __init__(self, name: str | torch.dtype | None = None) -> None:
        if name is None:
            name = _default_float_source_name()
        name, compute, variable = _parse_name(name)
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
        """
        target = to_torch_dtype(standardize_dtype(dtype))
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

    def _init_args(self) -> tuple:
        return (self._name,)

    def __reduce__(self):
        return (type(self), self._init_args())

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


class QuantizedDTypePolicy(DTypePolicy):
    """A policy whose layers hold quantized weights.

    The name is `f"{mode}_from_{source_name}"`; compute and variable dtypes come
    from `source_name`. `mode="int4"` here means per-channel int4 (the legacy
    `"int4_from_X"` form); use `Int4DTypePolicy` for grouped int4.

    Args:
        mode: `"int8"`, `"int4"` or `"float8"`.
        source_name: The floating policy the quantized layer computes with, e.g.
            `"mixed_bfloat16"`. `None` takes the default policy in force (its
            source, if the default is itself quantized).

    >>> from dtype_policies import QuantizedDTypePolicy
    >>> policy = QuantizedDTypePolicy("int8", "mixed_bfloat16")
    >>> policy
    <QuantizedDTypePolicy "int8_from_mixed_bfloat16">
    >>> policy.quantization_mode, policy.compute_dtype, policy.variable_dtype
    ('int8', 'bfloat16', 'float32')
    """

    def __init__(self, mode: str, source_name: str | torch.dtype | None = None) -> None:
        if source_name is None:
            source_name = _default_float_source_name()
        source_name, compute, variable = _parse_source_name(source_name)
        _check_quantization_mode(mode, compute)
        self._set("_name", f"{mode}_from_{source_name}")
        self._set("_source_name", source_name)
        self._set("_compute_dtype", compute)
        self._set("_variable_dtype", variable)
        self._set("_quantization_mode", mode)

    @property
    def source_name(self) -> str:
        """The name of the floating policy this quantized policy computes with."""
        return self._source_name

    @property
    def source_policy(self) -> DTypePolicy:
        """The floating `DTypePolicy` this quantized policy computes with."""
        return DTypePolicy(self._source_name)

    def get_config(self) -> dict[str, Any]:
        return {"mode": self._quantization_mode, "source_name": self._source_name}

    def _init_args(self) -> tuple:
        return (self._quantization_mode, self._source_name)

    def _equality_key(self) -> tuple:
        return (self._name, self._quantization_mode, self._source_name)


class QuantizedFloat8DTypePolicy(QuantizedDTypePolicy):
    """A float8 policy: quantize-dequantize training with delayed scaling.

    Inputs and kernels are quantized in float8_e4m3fn, output gradients in
    float8_e5m2, with scales taken from the maximum of the last
    `amax_history_length` absolute maxima.

    >>> from dtype_policies import QuantizedFloat8DTypePolicy
    >>> policy = QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=16)
    >>> policy, policy.amax_history_length
    (<QuantizedFloat8DTypePolicy "float8_from_float32">, 16)
    """

    default_amax_history_length: ClassVar[int] = 1024

    def __init__(
        self,
        mode: str,
        source_name: str | torch.dtype | None = None,
        amax_history_length: int = 1024,
    ) -> None:
        if not isinstance(amax_history_length, int) or isinstance(amax_history_length, bool):
            raise TypeError(
                "`amax_history_length` must be an integer. "
                f"Received: amax_history_length={amax_history_length!r}"
            )
        if amax_history_length < 1:
            raise ValueError(
                "`amax_history_length` must be a positive integer. "
                f"Received: amax_history_length={amax_history_length}"
            )
        if mode != "float8":
            raise ValueError(
                f"QuantizedFloat8DTypePolicy only supports mode='float8'. Received: mode={mode!r}"
            )
        super().__init__(mode, source_name)
        self._set("_amax_history_length", amax_history_length)

    @property
    def amax_history_length(self) -> int:
        """How many past absolute maxima the delayed scaling looks at."""
        return self._amax_history_length

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["amax_history_length"] = self._amax_history_length
        return config

    def _init_args(self) -> tuple:
        return (*super()._init_args(), self._amax_history_length)

    def _equality_key(self) -> tuple:
        return (*super()._equality_key(), self._amax_history_length)


class Int4DTypePolicy(QuantizedDTypePolicy):
    """An int4 policy with an explicit block size.

    `mode` is `"int4/<block_size>"`: a positive block size quantizes weights in
    groups of that many input features (asymmetric, with a zero point); `-1`
    means per output channel (symmetric). The legacy `"int4/None"` means `-1`.

    >>> from dtype_policies import Int4DTypePolicy
    >>> policy = Int4DTypePolicy("int4/128", "mixed_bfloat16")
    >>> policy.name, policy.block_size, policy.quantization_mode
    ('int4/128_from_mixed_bfloat16', 128, 'int4')
    >>> Int4DTypePolicy("int4/None", "float32").name
    'int4/-1_from_float32'
    """

    def __init__(self, mode: str, source_name: str | torch.dtype | None = None) -> None:
        block_size = _parse_int4_mode(mode)
        super().__init__("int4", source_name)
        self._set("_block_size", block_size)
        self._set("_name", f"int4/{block_size}_from_{self._source_name}")

    @property
    def block_size(self) -> int:
        """Group size along the input axis; `-1` means per output channel."""
        return self._block_size

    @property
    def mode(self) -> str:
        return "int4"

    def get_config(self) -> dict[str, Any]:
        return {"mode": f"int4/{self._block_size}", "source_name": self._source_name}

    def _init_args(self) -> tuple:
        return (f"int4/{self._block_size}", self._source_name)

    def _equality_key(self) -> tuple:
        return (*super()._equality_key(), self._block_size)


def int4_block_size(policy: DTypePolicy) -> int:
    """The int4 block size a policy asks for: `-1` (per channel) for the legacy
    `QuantizedDTypePolicy("int4", ...)`, the policy's own for `Int4DTypePolicy`."""
    return getattr(policy, "block_size", -1)


def _is_plain_float(policy: DTypePolicy) -> bool:
    return type(policy) in (DTypePolicy, FloatDTypePolicy)


def _policy_map_class():
    from dtype_policies.policy_map import DTypePolicyMap

    return DTypePolicyMap


def _default_float_source_name() -> str:
    """The name of the default policy's float part (used when a name is omitted)."""
    from dtype_policies.default_policy import dtype_policy

    default = dtype_policy()
    default = getattr(default, "default_policy", default)  # a map: its default
    return getattr(default, "source_name", default.name)


_INVALID_NAME_MESSAGE = (
    "Cannot convert '{name}' to a mixed precision DTypePolicy. Valid policies "
    "include 'mixed_float16', 'mixed_bfloat16', and the name of any float dtype "
    "such as 'float32'."
)


def _parse_name(name: Any) -> tuple[str, str, str]:
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


def _parse_source_name(source: Any) -> tuple[str, str, str]:
    """Parses the float policy a quantized policy starts from."""
    if isinstance(source, DTypePolicy):
        if source.quantization_mode is not None or isinstance(source, _policy_map_class()):
            raise ValueError(
                "The source of a quantized policy must be a float policy such as "
                f"'mixed_bfloat16'. Received: source_name={source!r}"
            )
        source = source.name
    name, compute, variable = _parse_name(source)
    if compute not in COMPUTE_FLOAT_DTYPES or variable not in COMPUTE_FLOAT_DTYPES:
        raise ValueError(
            "The source of a quantized policy must compute in a floating dtype "
            f"({', '.join(sorted(COMPUTE_FLOAT_DTYPES))}, or mixed_float16 / "
            f"mixed_bfloat16). Received: source_name='{name}'"
        )
    return name, compute, variable


def _check_quantization_mode(mode: Any, compute_dtype: str) -> None:
    if mode not in QUANTIZATION_MODES:
        raise ValueError(
            f"Invalid quantization mode. Expected one of {QUANTIZATION_MODES}. "
            f"Received: mode={mode}"
        )
    if mode == "int8" and compute_dtype == "float16":
        raise ValueError(
            "Quantization mode='int8' doesn't work well with compute_dtype='float16'. "
            "Use a bfloat16 or float32 source policy such as 'mixed_bfloat16'."
        )


def _parse_int4_mode(mode: Any) -> int:
    expected = f"Expected format 'int4/<block_size>', but got '{mode}'."
    parts = mode.split("/") if isinstance(mode, str) else []
    if len(parts) != 2 or parts[0] != "int4":
        raise ValueError(f"Invalid mode for Int4DTypePolicy. {expected}")
    if parts[1] == "None":
        return -1
    try:
        block_size = int(parts[1])
    except ValueError:
        raise ValueError(
            f"Invalid mode for Int4DTypePolicy. <block_size> must be an integer. {expected}"
        ) from None
    if block_size < -1 or block_size == 0:
        raise ValueError(
            "Invalid block_size in mode. Supported values are -1 (per-channel) or a "
            f"positive integer (sub-channel), but got {block_size} from '{mode}'."
        )
    return block_size


def parse_policy_name(name: str) -> DTypePolicy:
    """Parses any policy name: float names and quantized names alike.

    `"int8_from_float32"`, `"int4/128_from_mixed_bfloat16"`, `"float8_from_X"` and
    the legacy per-channel `"int4_from_X"` give quantized policies; plain dtype
    names (including `"int8"` and `"float8_e4m3fn"`) give a `DTypePolicy`.
    """
    if not isinstance(name, str):
        raise TypeError(f"`policy` must be a string. Received: policy={name!r}")
    if name in ALLOWED_DTYPES or not name.startswith(QUANTIZATION_MODES + _UNSUPPORTED_KERAS_MODES):
        return DTypePolicy(name)
    return _parse_quantized_policy_name(name)


def _parse_quantized_policy_name(policy: str) -> QuantizedDTypePolicy:
    if not isinstance(policy, str):
        raise TypeError(f"`policy` must be a string. Received: policy={policy!r}")
    if policy.startswith(_UNSUPPORTED_KERAS_MODES):
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
