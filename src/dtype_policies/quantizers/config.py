"""Quantization configs (Keras's `keras.quantizers` configs): what a
`quantize(mode, config=...)` call, or a quantized policy, may change per mode.

Configs are plain, immutable-by-convention settings. The quantized policies
own them: `QuantizedDTypePolicy(...).quantization_config` is the config a
policy implies. Which modes exist, their config classes and which compute
dtypes each refuses come from the mode records (`dtype_policies._modes`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, ClassVar, overload

import torch

from dtype_policies._modes import (
    mode_record,
    module_attribute,
    policy_name_hint,
    registered_modes,
)
from dtype_policies.quantizers.math import EPSILON, INT4_RANGE, INT8_RANGE, abs_max_quantize


def __getattr__(name: str) -> Any:
    # QUANTIZATION_MODES: the implemented modes, a tuple read from the mode records.
    return module_attribute(__name__, name)


DEFAULT_AMAX_HISTORY_LENGTH = 1024
"""float8 delayed scaling: how many past absolute maxima a scale looks at (Keras's default)."""

FLOAT8_SCALINGS = ("delayed", "dynamic", "weight_only")

_INTEGER_DTYPES = {"int8": torch.int8, "int16": torch.int16, "int32": torch.int32}


def check_mode(mode: Any) -> str:
    """`mode` if it is one of `QUANTIZATION_MODES`, else Keras's ValueError."""
    return mode_record(mode).name


def check_mode_and_compute_dtype(mode: str, compute_dtype: str) -> None:
    """The one rule on modes and compute dtypes, from the mode's record: int8
    does not compute in float16 (Keras refuses it; use a bfloat16 or float32
    source such as 'mixed_bfloat16')."""
    mode_record(mode).check_compute_dtype(compute_dtype)


class Quantizer:
    """Base class of the quantizers (Keras's `keras.quantizers.Quantizer`):
    calling the base returns its input; a subclass quantizes and describes
    itself with `get_config` (`from_config` reads it back).

    >>> import torch
    >>> class Sign(Quantizer):
    ...     def __call__(self, x):
    ...         return torch.sign(x).to(torch.int8)
    ...     def get_config(self):
    ...         return {"output_dtype": self.output_dtype}
    >>> Sign()(torch.tensor([-0.5, 2.0])), Sign.from_config({"output_dtype": "int8"}).output_dtype
    (tensor([-1,  1], dtype=torch.int8), 'int8')
    """

    def __init__(self, output_dtype: str = "int8") -> None:
        self.output_dtype = output_dtype

    def __call__(self, x: Any) -> Any:
        return x

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Quantizer:
        return cls(**config)

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{self} does not implement get_config()")


class AbsMaxQuantizer(Quantizer):
    """Symmetric abs-max quantizer (Keras's `AbsMaxQuantizer`).

    Calling it quantizes a tensor over `axis` (the call's `axis`, else the
    constructor's, else the last axis): `q = clip(round(x * scale), *value_range)`
    with `scale = value_range[1] / (max|x| + epsilon)`, so `x ~= q / scale`.

    Args:
        axis: Default axis (or axes) to reduce over. Keras deprecates passing
            it here in favour of the call argument; both work.
        value_range: `(low, high)` bounds of the integer values.
        epsilon: Added to the absolute maximum before dividing.
        output_dtype: The integer dtype name of `q` (`"int8"`).

    >>> import torch
    >>> quantizer = AbsMaxQuantizer(value_range=(-8, 7))
    >>> q, scale = quantizer(torch.tensor([[1.0, -2.0], [0.5, 0.25]]), axis=-1)
    >>> q
    tensor([[ 4, -7],
            [ 7,  3]], dtype=torch.int8)
    >>> quantizer.get_config()
    {'value_range': (-8, 7), 'epsilon': 1e-07, 'output_dtype': 'int8'}
    >>> AbsMaxQuantizer(axis=0).axis
    (0,)
    """

    def __init__(
        self,
        axis: int | tuple[int, ...] | None = None,
        value_range: Sequence[int] = INT8_RANGE,
        epsilon: float = EPSILON,
        output_dtype: str = "int8",
    ) -> None:
        try:
            value_range = tuple(int(v) for v in value_range)
        except (TypeError, ValueError):
            raise ValueError(
                f"`value_range` must be a pair of ints (low, high). Received: {value_range!r}"
            ) from None
        if len(value_range) != 2 or value_range[0] >= value_range[1]:
            raise ValueError(f"`value_range` must be (low, high). Received: {value_range!r}")
        if output_dtype not in _INTEGER_DTYPES:
            raise ValueError(
                f"`output_dtype` must be one of {sorted(_INTEGER_DTYPES)}. "
                f"Received: output_dtype={output_dtype!r}"
            )
        if output_dtype == "int8" and (value_range[0] < -128 or value_range[1] > 127):
            raise ValueError(
                f"value_range {value_range} does not fit output_dtype='int8' ([-128, 127])."
            )
        if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not epsilon > 0:
            raise ValueError(f"`epsilon` must be a positive number. Received: {epsilon!r}")
        if axis is not None:  # Keras keeps a tuple: AbsMaxQuantizer(axis=0).axis == (0,)
            axes = (axis,) if isinstance(axis, int) else axis
            if not isinstance(axes, (tuple, list)) or not all(
                isinstance(a, int) and not isinstance(a, bool) for a in axes
            ):
                raise TypeError(
                    f"`axis` must be an int, a tuple of ints or None. Received: {axis!r}"
                )
            axis = tuple(axes)
        self.axis: tuple[int, ...] | None = axis
        self.value_range: tuple[int, int] = (value_range[0], value_range[1])
        self.epsilon: float = float(epsilon)
        self.output_dtype = output_dtype

    def __call__(
        self, x: torch.Tensor, axis: int | tuple[int, ...] | None = None, to_numpy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(q, scale)` for `x`, reducing over `axis` (kept with size 1 in `scale`)."""
        if axis is None:
            axis = self.axis if self.axis is not None else -1
        dtype = _INTEGER_DTYPES[self.output_dtype]
        return abs_max_quantize(torch.as_tensor(x), axis, self.value_range, dtype, self.epsilon)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "value_range": self.value_range,
            "epsilon": self.epsilon,
            "output_dtype": self.output_dtype,
        }
        if self.axis is not None:
            config["axis"] = self.axis
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AbsMaxQuantizer:
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AbsMaxQuantizer) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, str(v)) for k, v in self.get_config().items())))

    def __repr__(self) -> str:
        axis = f"axis={self.axis}, " if self.axis is not None else ""
        return f"AbsMaxQuantizer({axis}value_range={self.value_range}, epsilon={self.epsilon})"


def _quantizer(value: Any, default: AbsMaxQuantizer | None, name: str) -> AbsMaxQuantizer | None:
    if isinstance(value, str) and value == "default":
        return default
    if value is None or isinstance(value, AbsMaxQuantizer):
        return value
    if isinstance(value, dict):
        if "class_name" in value:  # Keras's form: {"module", "class_name", "config", ...}
            if value["class_name"] not in ("AbsMaxQuantizer", "abs_max_quantizer"):
                raise ValueError(
                    f"`{name}` must be an AbsMaxQuantizer's config. Received a "
                    f"{value['class_name']!r}: {value!r}"
                )
            value = value.get("config", {})
        return AbsMaxQuantizer.from_config(dict(value))
    raise TypeError(
        f"`{name}` must be an AbsMaxQuantizer, its config dict, 'default' or None. "
        f"Received: {value!r}"
    )


class QuantizationConfig:
    """Base class of the per-mode configs (Keras's `QuantizationConfig`).

    Subclasses set `mode` (the base class's raises `NotImplementedError`, as
    Keras's) and may take a `weight_quantizer` and an `activation_quantizer`.

    Two configs are equal when they store the same tensors and compute the
    same way; settings that only change how `quantize()` chooses the stored
    values (`quantize_time_settings`, e.g. int4's `scale_search`) are
    serialized but not compared, so a checkpoint quantized with them loads
    into a model quantized without them.

    >>> QuantizationConfig().weight_quantizer is None
    True
    >>> try:
    ...     QuantizationConfig().mode
    ... except NotImplementedError as e:
    ...     print(e)
    Subclasses must implement this property. Do not instantiate QuantizationConfig directly.
    """

    quantize_time_settings: ClassVar[tuple[str, ...]] = ()

    def __init__(self, weight_quantizer: Any = None, activation_quantizer: Any = None) -> None:
        self.weight_quantizer = _quantizer(weight_quantizer, None, "weight_quantizer")
        self.activation_quantizer = _quantizer(activation_quantizer, None, "activation_quantizer")

    @property
    def mode(self) -> str:
        raise NotImplementedError(
            "Subclasses must implement this property. Do not instantiate "
            "QuantizationConfig directly."
        )

    @staticmethod
    def weight_quantizer_or_default(config: Any, default: Any) -> Any:
        """`config.weight_quantizer` if there is one, else `default` (Keras's rule)."""
        if config is not None and config.weight_quantizer is not None:
            return config.weight_quantizer
        return default

    @staticmethod
    def activation_quantizer_or_default(config: Any, default: Any) -> Any:
        """`config.activation_quantizer` when there is a config (even `None`), else `default`."""
        return config.activation_quantizer if config is not None else default

    def get_config(self) -> dict[str, Any]:
        return {
            "weight_quantizer": _quantizer_config(self.weight_quantizer),
            "activation_quantizer": _quantizer_config(self.activation_quantizer),
        }

    def tied_embeddings_config(self) -> QuantizationConfig:
        """The config model-level `quantize()` gives a weight shared by an
        embedding table and a linear (a tied LM head); this one by default."""
        return self

    @property
    def rounds_inputs(self) -> bool:
        """Whether the product rounds its inputs to integers (W8A8, W4A8), so
        that it costs the same from any float dtype; `False` by default."""
        return False

    @property
    def own_input_rounding(self) -> bool:
        """Whether an activation quantizer of the config's own rounds the
        inputs (int8's); `False` by default."""
        return False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        return cls(**config)

    def _identity(self) -> dict[str, Any]:
        config = self.get_config()
        return {k: v for k, v in config.items() if k not in self.quantize_time_settings}

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self._identity())))

    def __repr__(self) -> str:
        # quantizers shown as objects; None shown where the class's default is a quantizer
        quantizers = ("weight_quantizer", "activation_quantizer")
        try:
            default = type(self)()
        except Exception:  # a config with required arguments (GPTQ's dataset)
            default = None
        config = {
            k: getattr(self, k) if k in quantizers else v
            for k, v in self.get_config().items()
            if k not in quantizers
            or getattr(self, k) is not None
            or getattr(default, k, None) is not None
        }
        args = ", ".join(f"{k}={v!r}" for k, v in config.items())
        return f"{type(self).__name__}({args})"


def _quantizer_config(quantizer: AbsMaxQuantizer | None) -> dict[str, Any] | None:
    return serialize(quantizer)  # Keras's form, so that Keras reads it back


def _stored_values(quantizer: AbsMaxQuantizer | None) -> tuple | None:
    """What of a quantizer changes stored values (the schemes choose the axes)."""
    if quantizer is None:
        return None
    return (quantizer.value_range, quantizer.epsilon, quantizer.output_dtype)


_DEFAULT_ROUNDING = _stored_values(AbsMaxQuantizer())
"""What Keras's default activation quantizer rounds by (the kernels' rule)."""


def _check_activation_block_size(value: Any) -> None:
    if value is not None and (isinstance(value, bool) or value not in ACTIVATION_BLOCK_SIZES):
        raise ValueError(
            f"`activation_block_size` must be None or one of {ACTIVATION_BLOCK_SIZES}. "
            f"Received: activation_block_size={value!r}"
        )


class Int8QuantizationConfig(QuantizationConfig):
    """int8: weights per output channel; activations per token (W8A8 dynamic,
    Keras's) unless `activation_quantizer=None` (weight-only int8) or
    `activation_block_size` is set. Without a `weight_quantizer` (`None`,
    Keras's default) weights use `AbsMaxQuantizer()`.

    Args:
        weight_quantizer: The weights' `AbsMaxQuantizer` (output_dtype int8).
        activation_quantizer: The inputs' `AbsMaxQuantizer` (per row);
            `"default"` for `AbsMaxQuantizer()`, `None` for weight-only.
        activation_block_size: This library's extension (not in Keras):
            round the inputs to int8 in blocks of this many consecutive
            inputs instead of per row, by llama.cpp's Q8_0 rule (bfloat16
            inputs, `step = max|x| / 127`, as int4's W4A8); the activation
            quantizer must be the default one. Integer products per block:
            nearly weight-only accuracy (SmolLM2-135M: +0.7% perplexity
            against +0.5% weight-only and +4% per row) at W8A8 speed.
        block_size: This library's extension (not in Keras): the weights'
            steps per block of this many inputs of each output channel (a
            multiple of 32) instead of one per channel; needs
            `activation_block_size`, whose products go block by block.
            `None` or `-1`: per channel (Keras's). With both at 32 the
            product is llama.cpp's Q8_0 x Q8_0, the default of
            `quantize(model, "int8")`: on SmolLM2-135M top-1 agreement with
            float32 0.95 against 0.935 per channel, 12.5% more stored bytes.

    >>> Int8QuantizationConfig().weight_only, Int8QuantizationConfig(None).weight_only
    (False, False)
    >>> Int8QuantizationConfig(activation_quantizer=None).weight_only
    True
    >>> Int8QuantizationConfig().weight_quantizer is None
    True
    >>> Int8QuantizationConfig(activation_block_size=32).get_config()["activation_block_size"]
    32
    >>> Int8QuantizationConfig(block_size=32, activation_block_size=32).block_size
    32
    """

    mode = "int8"  # type: ignore[assignment]

    def __init__(
        self,
        weight_quantizer: Any = None,
        activation_quantizer: Any = "default",
        activation_block_size: int | None = None,
        block_size: int | None = None,
    ) -> None:
        activation = _quantizer(activation_quantizer, AbsMaxQuantizer(), "activation_quantizer")
        super().__init__(weight_quantizer, activation)
        if self.weight_quantizer is not None and self.weight_quantizer.output_dtype != "int8":
            raise ValueError(
                "Int8QuantizationConfig requires a weight_quantizer with output_dtype='int8'. "
                f"Received: output_dtype={self.weight_quantizer.output_dtype}"
            )
        _check_activation_block_size(activation_block_size)
        if (
            activation_block_size is not None
            and _stored_values(self.activation_quantizer) != _DEFAULT_ROUNDING
        ):
            raise ValueError(
                "`activation_block_size` rounds the inputs by its own rule (step = max|x| / 127 "
                "per block) and needs the default activation quantizer. Received: "
                f"activation_quantizer={_quantizer_config(self.activation_quantizer)!r}"
            )
        if block_size == -1:
            block_size = None
        if block_size is not None and (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or block_size <= 0
            or block_size % INT8_WEIGHT_BLOCK_MULTIPLE
        ):
            raise ValueError(
                "`block_size` must be None, -1 (per channel) or a positive multiple of "
                f"{INT8_WEIGHT_BLOCK_MULTIPLE}. Received: block_size={block_size!r}"
            )
        if block_size is not None and activation_block_size is None:
            raise ValueError(
                "int8 weights per block (`block_size`) multiply block by block and need "
                "`activation_block_size=32`. Received: "
                f"block_size={block_size!r}, activation_block_size=None"
            )
        self.activation_block_size = activation_block_size
        self.block_size = block_size

    @property
    def weight_only(self) -> bool:
        """True without activation quantization (the product runs in the compute dtype)."""
        return self.activation_quantizer is None

    @property
    def rounds_inputs(self) -> bool:
        """Whether the product rounds its inputs to int8 (every int8 but weight-only)."""
        return not self.weight_only

    @property
    def own_input_rounding(self) -> bool:
        """Whether the inputs are rounded by an activation quantizer other
        than Keras's default (another `value_range` or `epsilon`): by the
        quantizer itself, the product exact in float64, outside the integer
        kernels (which implement the default's rule)."""
        return not self.weight_only and (
            _stored_values(self.activation_quantizer) != _DEFAULT_ROUNDING
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        if self.activation_block_size is not None:  # absent when off, as in Keras
            config["activation_block_size"] = self.activation_block_size
        if self.block_size is not None:
            config["block_size"] = self.block_size
        return config

    def _identity(self) -> dict[str, Any]:
        weights = self.weight_quantizer_or_default(self, AbsMaxQuantizer())
        return {
            "weight_quantizer": _stored_values(weights),
            "activation_quantizer": _stored_values(self.activation_quantizer),
            "activation_block_size": self.activation_block_size,
            "block_size": self.block_size,
        }


def default_int8_config() -> Int8QuantizationConfig:
    """The int8 of `quantize(model, "int8")` and of tied LM heads: weights
    and inputs per block of 32 (llama.cpp's Q8_0 x Q8_0, integer products).

    >>> default_int8_config().get_config()["block_size"]
    32
    """
    return Int8QuantizationConfig(activation_block_size=32, block_size=32)


class Int4QuantizationConfig(QuantizationConfig):
    """int4 weights: grouped along the input axis in blocks of `block_size`
    (asymmetric, with a zero point; Keras's default block, 128), or per output
    channel (symmetric) with `block_size=-1` or `None`.

    Args:
        weight_quantizer: Per channel only: the weights' `AbsMaxQuantizer`
            (`value_range=(-8, 7)`, `output_dtype="int8"`).
        activation_quantizer: Per channel only: an `AbsMaxQuantizer` of the
            inputs (per row, W4A8); `"default"` or `None` leaves them in the
            compute dtype (weight-only, the default).
        block_size: Inputs per group; `-1` or `None` for per channel.
        scale_search: Choose each group's (column's) grid by a search instead
            of min/max: a quantize-time setting, serialized but not compared
            (see `quantizers.search_grouped_int4`).
        refine_zero_points: Grouped only: after the grid is chosen, move
            each group's zero point to minimise the `l0.7` norm of its
            weight error (HQQ's data-free solver; see
            `quantizers.refine_zero_points`). The default; `False` keeps the
            min/max (or searched) zero points. A quantize-time setting.
        tied_embeddings: How `quantize()` stores a weight shared by an
            embedding table and a linear (a tied LM head): `"int8"` (the
            default: the default int8, inputs rounded per block of 32 in the
            head's product, as llama.cpp keeps such tables at 8 bits; int4
            there cost SmolLM2-135M about 5 perplexity points)
            or `"int4"` (like every other weight). A quantize-time setting.
        activation_block_size: Grouped only, this library's extension (not
            in Keras): `32` rounds the inputs of each product to int8 in
            blocks of 32 (`d = max|x| / 127`, `round(x / d)`: llama.cpp's
            Q8_0 rule, which its Q4_0 and Q4_1 products use) and multiplies
            in integers (W4A8), several times faster on x86 CPUs without
            AVX-512 (docs/quantization.md); the values are the weight-only
            product of the rounded inputs. `None` (the default) keeps the
            inputs in the compute dtype. Stored with the model.

    >>> Int4QuantizationConfig().block_size, Int4QuantizationConfig(block_size=None).block_size
    (128, None)
    >>> Int4QuantizationConfig(block_size=None).group_size
    -1
    >>> Int4QuantizationConfig(scale_search=True).get_config()
    {'weight_quantizer': None, 'activation_quantizer': None, 'block_size': 128, \
'scale_search': True}
    >>> Int4QuantizationConfig().tied_embeddings_config().activation_block_size
    32
    >>> Int4QuantizationConfig(block_size=32, activation_block_size=32).get_config()
    {'weight_quantizer': None, 'activation_quantizer': None, 'block_size': 32, \
'activation_block_size': 32}
    """

    mode = "int4"  # type: ignore[assignment]
    quantize_time_settings = ("scale_search", "tied_embeddings", "refine_zero_points")

    def __init__(
        self,
        weight_quantizer: Any = None,
        activation_quantizer: Any = "default",
        block_size: int | None = 128,
        scale_search: bool = False,
        tied_embeddings: str = "int8",
        refine_zero_points: bool = True,
        activation_block_size: int | None = None,
    ) -> None:
        if not isinstance(scale_search, bool):
            raise ValueError(
                f"`scale_search` must be True or False. Received: scale_search={scale_search!r}"
            )
        if not isinstance(refine_zero_points, bool):
            raise ValueError(
                "`refine_zero_points` must be True or False. "
                f"Received: refine_zero_points={refine_zero_points!r}"
            )
        if tied_embeddings not in TIED_EMBEDDINGS:
            raise ValueError(
                f"`tied_embeddings` must be one of {TIED_EMBEDDINGS}. "
                f"Received: tied_embeddings={tied_embeddings!r}"
            )
        if block_size is not None and (
            not isinstance(block_size, int)
            or isinstance(block_size, bool)
            or (block_size <= 0 and block_size != -1)
        ):
            raise ValueError(
                "block_size must be None, -1, or a positive integer. "
                f"Received: block_size={block_size!r}"
            )
        weight = _quantizer(weight_quantizer, None, "weight_quantizer")
        activation = _quantizer(activation_quantizer, None, "activation_quantizer")
        if (
            block_size is not None
            and block_size > 0
            and (weight is not None or activation is not None)
        ):
            raise ValueError(
                "Int4 sub-channel quantization (block_size > 0) does not support custom "
                "quantizers. Either set block_size to None or -1 for per-channel quantization, "
                f"or remove the custom quantizer arguments. Received: block_size={block_size}"
            )
        if weight is not None and weight.value_range != INT4_RANGE:
            raise ValueError(
                "Int4QuantizationConfig requires a weight_quantizer with value_range=(-8, 7). "
                f"Received: value_range={weight.value_range}"
            )
        if weight is not None and weight.output_dtype != "int8":
            raise ValueError(
                "Int4QuantizationConfig requires a weight_quantizer with output_dtype='int8'. "
                f"Received: output_dtype={weight.output_dtype}"
            )
        if activation is not None and activation.output_dtype != "int8":
            raise ValueError(
                "Int4QuantizationConfig requires an activation_quantizer with "
                f"output_dtype='int8'. Received: output_dtype={activation.output_dtype}"
            )
        _check_activation_block_size(activation_block_size)
        if activation_block_size is not None and (
            block_size is None or block_size <= 0 or block_size % activation_block_size != 0
        ):
            raise ValueError(
                "`activation_block_size` needs grouped int4 with a block_size that is a "
                f"multiple of it. Received: block_size={block_size!r}, "
                f"activation_block_size={activation_block_size!r}"
            )
        super().__init__(weight, activation)
        self.block_size = block_size
        self.activation_block_size = activation_block_size
        self.scale_search = scale_search
        self.tied_embeddings = tied_embeddings
        self.refine_zero_points = refine_zero_points

    @property
    def group_size(self) -> int:
        """The block size as a number: `-1` for per channel (`block_size` None or -1)."""
        return -1 if self.block_size is None else self.block_size

    @property
    def rounds_inputs(self) -> bool:
        """Whether the product rounds its inputs to int8 (W4A8: per block of
        `activation_block_size`, or per row with an `activation_quantizer`)."""
        return self.activation_block_size is not None or self.activation_quantizer is not None

    def tied_embeddings_config(self) -> QuantizationConfig:
        """The config `quantize()` gives a weight shared by an embedding table and a linear."""
        if self.tied_embeddings == "int8":
            return default_int8_config()
        return self

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()  # the quantizers, as Keras writes them
        config["block_size"] = self.block_size
        if self.scale_search:  # absent when off: Keras's configs have no such key
            config["scale_search"] = True
        if self.tied_embeddings != "int8":
            config["tied_embeddings"] = self.tied_embeddings
        if not self.refine_zero_points:
            config["refine_zero_points"] = False
        if self.activation_block_size is not None:  # absent when off, as in Keras
            config["activation_block_size"] = self.activation_block_size
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int4QuantizationConfig:
        # Configs without a block size come from per-channel-only versions.
        return cls(
            weight_quantizer=config.get("weight_quantizer"),
            activation_quantizer=config.get("activation_quantizer"),
            block_size=config.get("block_size"),
            scale_search=config.get("scale_search", False),
            tied_embeddings=config.get("tied_embeddings", "int8"),
            refine_zero_points=config.get("refine_zero_points", True),
            activation_block_size=config.get("activation_block_size"),
        )

    def _identity(self) -> dict[str, Any]:
        weights = self.weight_quantizer_or_default(self, AbsMaxQuantizer(value_range=INT4_RANGE))
        return {
            "block_size": self.group_size,
            "weight_quantizer": _stored_values(weights),
            "activation_quantizer": _quantizer_config(self.activation_quantizer),
            "activation_block_size": self.activation_block_size,
        }


TIED_EMBEDDINGS = ("int8", "int4")
"""How `Int4QuantizationConfig(tied_embeddings=...)` stores a tied table."""
ACTIVATION_BLOCK_SIZES = (32,)
# int8 weight blocks are whole blocks of activations (the kernel's steps per 32).
INT8_WEIGHT_BLOCK_MULTIPLE = 32
"""The input blocks `activation_block_size` accepts (int4's and int8's configs)."""


class Float8QuantizationConfig(QuantizationConfig):
    """float8 quantize-dequantize training.

    Args:
        amax_history_length: Delayed scaling's window (`None`: the policy's,
            default 1024).
        scaling: `"delayed"` (Keras: scales from the maximum of past absolute
            maxima, advanced by training steps), `"dynamic"` (scales from
            the current tensor; needs no calibration) or `"weight_only"`
            (only the weight is rounded to float8 e4m3, with a scale per
            output channel; inputs and gradients stay in the compute dtype:
            the most accurate, for serving a float8 checkpoint).

    >>> Float8QuantizationConfig(scaling="weight_only").get_config()
    {'scaling': 'weight_only'}
    """

    mode = "float8"  # type: ignore[assignment]

    def __init__(self, amax_history_length: int | None = None, scaling: str = "delayed") -> None:
        super().__init__(None, None)
        if amax_history_length is not None and (
            not isinstance(amax_history_length, int) or isinstance(amax_history_length, bool)
        ):
            raise TypeError(  # as QuantizedFloat8DTypePolicy
                "`amax_history_length` must be a positive integer or None. "
                f"Received: {amax_history_length!r}"
            )
        if amax_history_length is not None and amax_history_length < 1:
            raise ValueError(
                "`amax_history_length` must be a positive integer or None. "
                f"Received: {amax_history_length!r}"
            )
        if scaling not in FLOAT8_SCALINGS:
            raise ValueError(
                f"`scaling` must be one of {FLOAT8_SCALINGS}. Received: scaling={scaling!r}"
            )
        self.amax_history_length = amax_history_length
        self.scaling = scaling

    def _identity(self) -> dict[str, Any]:
        # `None` means the default window: the same stored state and scales
        return {"amax_history_length": self.history_length, "scaling": self.scaling}

    @property
    def history_length(self) -> int:
        """The history length in use (the default when none was given)."""
        return self.amax_history_length or DEFAULT_AMAX_HISTORY_LENGTH

    def tied_embeddings_config(self) -> QuantizationConfig:
        """Weight-only float8 gives a table tied to a linear head the default
        int8 (as int4 does; float8 rows of a tied head cost SmolLM2-135M 2.5%
        perplexity); the training scalings leave the head float8 and the table
        in float."""
        if self.scaling == "weight_only":
            return default_int8_config()
        return self

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {}  # Keras's (no settings) when nothing is set
        if self.amax_history_length is not None:
            config["amax_history_length"] = self.amax_history_length
        if self.scaling != "delayed":
            config["scaling"] = self.scaling
        return config


class CalibratedQuantizationConfig(QuantizationConfig):
    """Base of the configs of calibrated modes (GPTQ, AWQ: quantization that
    needs the activations each weight sees on calibration data). Such a
    config carries the data and the model's block structure; neither is a
    setting of the stored tensors, so neither is serialized or compared.

    Args:
        dataset: The calibration data: an iterable of model inputs, each a
            tensor (called as `model(x)`), a tuple of positional arguments or
            a dict of keyword arguments. Subclasses may take other forms
            (text and a tokenizer) and override `calibration_batches`.
        quantization_layer_structure: The blocks calibration runs one at a
            time, in the order the model runs them: a sequence of submodules
            or their paths, or Keras's `{"sequential_blocks": [...]}`;
            `None` makes the whole model one block.

    >>> import torch
    >>> from dtype_policies.quantizers import GPTQConfig
    >>> config = GPTQConfig(dataset=[torch.ones(1, 8, dtype=torch.long)], tokenizer=None)
    >>> isinstance(config, CalibratedQuantizationConfig), config.get_config()["dataset"]
    (True, None)
    """

    def __init__(
        self,
        dataset: Any = None,
        *,
        quantization_layer_structure: Any = None,
        weight_quantizer: Any = None,
        activation_quantizer: Any = None,
    ) -> None:
        super().__init__(weight_quantizer, activation_quantizer)
        self.dataset = dataset
        self.quantization_layer_structure = quantization_layer_structure

    def calibration_batches(self, model: torch.nn.Module) -> list[Any]:
        """The model inputs to calibrate on, one batch each."""
        if self.dataset is None:
            raise ValueError(
                f"{type(self).__name__} has no calibration `dataset`: pass one to quantize "
                f"in mode '{self.mode}'."
            )
        if isinstance(self.dataset, (torch.Tensor, dict)):
            return [self.dataset]
        return list(self.dataset)

    def get_config(self) -> dict[str, Any]:
        return {}


def validate_and_resolve_config(mode: Any, config: Any) -> QuantizationConfig:
    """The config a `quantize(mode, config)` call runs with, or a ValueError
    with Keras's wording. A string `config` is taken as the mode (legacy).

    >>> validate_and_resolve_config("int4", None)
    Int4QuantizationConfig(block_size=128)
    """
    if isinstance(config, str):
        mode, config = config, None
    if mode is None and config is None:
        raise ValueError("You must provide either `mode` or `config` to `quantize`.")
    if mode is not None:
        try:
            mode_record(mode)  # an unknown mode is the first error, as in Keras
        except ValueError as error:
            raise ValueError(f"{error}{policy_name_hint(mode)}") from None
    if config is None:
        return mode_record(mode).default_config()
    if not isinstance(config, QuantizationConfig):
        raise ValueError(
            "Argument `config` must be an instance of `QuantizationConfig`. "
            f"Received: config={config!r} (of type {type(config)})"
        )
    if mode is not None and mode != config.mode:
        raise ValueError(f"Contradictory arguments: mode='{mode}' but config.mode='{config.mode}'")
    record = mode_record(config.mode)
    if not isinstance(config, record.config_class):
        raise ValueError(
            f"Mode '{record.name}' requires a valid `config` argument of type "
            f"`{record.config_class.__name__}`. Received: {type(config)}"
        )
    return config


@overload
def serialize_config(config: QuantizationConfig) -> dict[str, Any]: ...
@overload
def serialize_config(config: None) -> None: ...
def serialize_config(config: QuantizationConfig | None) -> dict[str, Any] | None:
    """Keras's `{"module", "class_name", "config", "registered_name"}` for a
    config (`None` stays `None`).

    >>> serialize_config(Int4QuantizationConfig(block_size=32))["config"]["block_size"]
    32
    """
    return serialize(config)


def deserialize_config(data: Any) -> QuantizationConfig | None:
    """Inverse of `serialize_config` (a config object is returned as is).

    >>> deserialize_config(serialize_config(Int4QuantizationConfig(block_size=32)))
    Int4QuantizationConfig(block_size=32)
    """
    if data is None or isinstance(data, QuantizationConfig):
        return data
    # (looked up by the data's 'class_name', whatever it holds)
    classes: dict[Any, Any] = {
        record.config_class.__name__: record.config_class for record in registered_modes()
    }
    cls = classes.get(data.get("class_name")) if isinstance(data, dict) else None
    if cls is None:
        raise ValueError(
            f"Unknown quantization config {data!r}. Expected a dict with 'class_name' in "
            f"{sorted(classes)} and 'config'."
        )
    config = data.get("config", {})
    if not isinstance(config, dict):
        raise ValueError(f"A quantization config's 'config' must be a dict. Received: {config!r}")
    try:
        return cls.from_config(config)
    except TypeError as e:
        raise ValueError(f"Cannot rebuild {cls.__name__} from {config!r}: {e}") from None


def _quantizer_classes() -> dict[str, type]:
    """Keras's `keras.quantizers` object names: class names and their snake_case."""
    classes: list[type] = [Quantizer, AbsMaxQuantizer, QuantizationConfig]
    classes += [record.config_class for record in registered_modes()]
    names = {cls.__name__: cls for cls in classes}
    names.update({_snake_case(cls.__name__): cls for cls in classes})
    return names


def _snake_case(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def serialize(initializer: Any) -> dict[str, Any] | None:
    """A quantizer's or a quantization config's serialized form, as Keras's
    `keras.quantizers.serialize` writes it (so that each library reads the
    other's; the argument's name is Keras's).

    >>> serialize(AbsMaxQuantizer(axis=0))
    {'module': 'keras.quantizers', 'class_name': 'AbsMaxQuantizer', \
'config': {'value_range': (-127, 127), 'epsilon': 1e-07, 'output_dtype': 'int8', 'axis': (0,)}, \
'registered_name': None}
    """
    if initializer is None:
        return None
    return {
        "module": "keras.quantizers",
        "class_name": type(initializer).__name__,
        "config": initializer.get_config(),
        "registered_name": None,
    }


def deserialize(config: Any, custom_objects: dict[str, Any] | None = None) -> Any:
    """Inverse of `serialize` (Keras's `keras.quantizers.deserialize`);
    `custom_objects` maps class names to classes of your own, looked up
    first.

    >>> deserialize(serialize(Int4QuantizationConfig(block_size=64)))
    Int4QuantizationConfig(block_size=64)
    """
    if config is None:
        return None
    # (looked up by the config's 'class_name', whatever it holds)
    classes: dict[Any, Any] = {**_quantizer_classes(), **(custom_objects or {})}
    cls = classes.get(config.get("class_name")) if isinstance(config, dict) else None
    if cls is None:
        raise ValueError(
            f"Could not interpret quantizer config {config!r}: expected a dict with "
            f"'class_name' in {sorted(n for n in classes if n[0].isupper())} and 'config'."
        )
    return cls.from_config(dict(config.get("config", {})))


def get(identifier: Any, **kwargs: Any) -> Any:
    """A quantizer or quantization config from an identifier (Keras's
    `keras.quantizers.get`): `None`, an object (returned as is), a serialized
    dict, or a class name (`"abs_max_quantizer"`, `"Int8QuantizationConfig"`)
    giving an instance made with `kwargs`.

    >>> get("abs_max_quantizer")
    AbsMaxQuantizer(value_range=(-127, 127), epsilon=1e-07)
    >>> get(None) is None
    True
    """
    if identifier is None:
        return None
    if isinstance(identifier, dict):
        return deserialize(identifier)
    if isinstance(identifier, str):
        cls = _quantizer_classes().get(identifier)
        if cls is None:
            raise ValueError(f"Could not interpret quantizer identifier: {identifier}")
        return cls(**kwargs)
    if callable(identifier) or isinstance(identifier, (AbsMaxQuantizer, QuantizationConfig)):
        return identifier
    raise ValueError(f"Could not interpret quantizer identifier: {identifier}")
