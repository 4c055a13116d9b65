"""Quantization configs: what `quantize(mode, config=...)` may change per mode."""

from __future__ import annotations

from typing import Any, ClassVar

from dtype_policies.policies import QUANTIZATION_MODES
from dtype_policies.quantization.quantizers import EPSILON, INT4_RANGE, INT8_RANGE


class AbsMaxQuantizer:
    """Symmetric abs-max quantizer settings (Keras's `AbsMaxQuantizer`).

    `value_range` bounds the integer values; `epsilon` is added to the absolute
    maximum before dividing.

    >>> AbsMaxQuantizer(value_range=(-8, 7)).get_config()
    {'value_range': (-8, 7), 'epsilon': 1e-07, 'output_dtype': 'int8'}
    """

    def __init__(
        self,
        value_range: tuple[int, int] = INT8_RANGE,
        epsilon: float = EPSILON,
        output_dtype: str = "int8",
    ) -> None:
        value_range = tuple(int(v) for v in value_range)
        if len(value_range) != 2 or value_range[0] >= value_range[1]:
            raise ValueError(f"`value_range` must be (low, high). Received: {value_range!r}")
        if output_dtype == "int8" and (value_range[0] < -128 or value_range[1] > 127):
            raise ValueError(
                f"value_range {value_range} does not fit output_dtype='int8' ([-128, 127])."
            )
        if epsilon <= 0:
            raise ValueError(f"`epsilon` must be positive. Received: {epsilon}")
        self.value_range = value_range
        self.epsilon = float(epsilon)
        self.output_dtype = output_dtype

    def get_config(self) -> dict[str, Any]:
        return {
            "value_range": self.value_range,
            "epsilon": self.epsilon,
            "output_dtype": self.output_dtype,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AbsMaxQuantizer:
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AbsMaxQuantizer) and self.get_config() == other.get_config()

    def __repr__(self) -> str:
        return f"AbsMaxQuantizer(value_range={self.value_range}, epsilon={self.epsilon})"


def _quantizer(value: Any, default: AbsMaxQuantizer | None, name: str) -> AbsMaxQuantizer | None:
    if isinstance(value, str) and value == "default":
        return default
    if value is None or isinstance(value, AbsMaxQuantizer):
        return value
    if isinstance(value, dict):
        return AbsMaxQuantizer.from_config(value)
    raise TypeError(
        f"`{name}` must be an AbsMaxQuantizer, its config dict, 'default' or None. "
        f"Received: {value!r}"
    )


class QuantizationConfig:
    """Base class of the per-mode configs."""

    mode: ClassVar[str]

    def get_config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class Int8QuantizationConfig(QuantizationConfig):
    """int8: weights per output channel; activations per token unless
    `activation_quantizer=None` (weight-only int8).

    >>> Int8QuantizationConfig().weight_only, Int8QuantizationConfig(None).weight_only
    (False, False)
    >>> Int8QuantizationConfig(activation_quantizer=None).weight_only
    True
    """

    mode = "int8"

    def __init__(self, weight_quantizer: Any = None, activation_quantizer: Any = "default") -> None:
        self.weight_quantizer = _quantizer(weight_quantizer, None, "weight_quantizer") or (
            AbsMaxQuantizer()
        )
        if self.weight_quantizer.output_dtype != "int8":
            raise ValueError(
                "Int8QuantizationConfig requires a weight_quantizer with output_dtype='int8'. "
                f"Received: output_dtype={self.weight_quantizer.output_dtype}"
            )
        self.activation_quantizer = _quantizer(
            activation_quantizer, AbsMaxQuantizer(), "activation_quantizer"
        )

    @property
    def weight_only(self) -> bool:
        return self.activation_quantizer is None

    def get_config(self) -> dict[str, Any]:
        return {
            "weight_quantizer": self.weight_quantizer.get_config(),
            "activation_quantizer": (
                None
                if self.activation_quantizer is None
                else self.activation_quantizer.get_config()
            ),
        }


class Int4QuantizationConfig(QuantizationConfig):
    """int4 weight-only: grouped along the input axis in blocks of `block_size`
    (asymmetric, with a zero point), or per output channel (symmetric) with
    `block_size=-1` or `None`.

    >>> Int4QuantizationConfig().block_size, Int4QuantizationConfig(block_size=None).block_size
    (128, -1)
    """

    mode = "int4"

    def __init__(
        self,
        weight_quantizer: Any = None,
        activation_quantizer: Any = "default",
        block_size: int | None = 128,
    ) -> None:
        if block_size is None:
            block_size = -1
        if (
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
        if block_size > 0 and (weight is not None or activation is not None):
            raise ValueError(
                "Int4 sub-channel quantization (block_size > 0) does not support custom "
                "quantizers. Use block_size=-1 for a custom per-channel quantizer."
            )
        if activation is not None:
            raise ValueError(
                "int4 is weight-only here: activation_quantizer must be None or 'default'."
            )
        if weight is not None and (
            weight.value_range != INT4_RANGE or weight.output_dtype != "int8"
        ):
            raise ValueError(
                "An int4 weight_quantizer needs value_range=(-8, 7) and output_dtype='int8'. "
                f"Received: {weight!r}"
            )
        self.block_size = block_size
        self.weight_quantizer = weight or AbsMaxQuantizer(value_range=INT4_RANGE)
        self.activation_quantizer = None

    def get_config(self) -> dict[str, Any]:
        return {"block_size": self.block_size}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int4QuantizationConfig:
        # Configs without a block size come from per-channel-only versions.
        return cls(block_size=config.get("block_size"))


class Float8QuantizationConfig(QuantizationConfig):
    """float8 quantize-dequantize training with delayed scaling.

    `amax_history_length=None` takes the layer policy's length (default 1024).
    """

    mode = "float8"

    def __init__(self, amax_history_length: int | None = None) -> None:
        if amax_history_length is not None and (
            not isinstance(amax_history_length, int) or amax_history_length < 1
        ):
            raise ValueError(
                "`amax_history_length` must be a positive integer or None. "
                f"Received: {amax_history_length!r}"
            )
        self.amax_history_length = amax_history_length

    def get_config(self) -> dict[str, Any]:
        return {"amax_history_length": self.amax_history_length}


_CONFIGS: dict[str, type[QuantizationConfig]] = {
    "int8": Int8QuantizationConfig,
    "int4": Int4QuantizationConfig,
    "float8": Float8QuantizationConfig,
}


def validate_and_resolve_config(mode: Any, config: Any) -> QuantizationConfig:
    """The config a `quantize(mode, config)` call runs with, or a ValueError
    with Keras's wording. A string `config` is taken as the mode (legacy)."""
    if isinstance(config, str):
        mode, config = config, None
    if mode is None and config is None:
        raise ValueError("You must provide either `mode` or `config` to `quantize`.")
    if config is None:
        if mode not in QUANTIZATION_MODES:
            raise ValueError(
                f"Invalid quantization mode. Expected one of {QUANTIZATION_MODES}. "
                f"Received: mode={mode}"
            )
        return _CONFIGS[mode]()
    if not isinstance(config, QuantizationConfig):
        raise ValueError(
            "Argument `config` must be an instance of `QuantizationConfig`. "
            f"Received: config={config!r} (of type {type(config)})"
        )
    if mode is not None and mode != config.mode:
        raise ValueError(f"Contradictory arguments: mode='{mode}' but config.mode='{config.mode}'")
    return config


def serialize_config(config: QuantizationConfig | None) -> dict[str, Any] | None:
    if config is None:
        return None
    return {"class_name": type(config).__name__, "config": config.get_config()}


def deserialize_config(data: Any) -> QuantizationConfig | None:
    if data is None or isinstance(data, QuantizationConfig):
        return data
    classes = {cls.__name__: cls for cls in _CONFIGS.values()}
    cls = classes.get(data.get("class_name")) if isinstance(data, dict) else None
    if cls is None:
        raise ValueError(f"Unknown quantization config {data!r}.")
    return cls.from_config(data.get("config", {}))
