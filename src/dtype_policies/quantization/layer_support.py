"""`QuantizableLayer`: the `quantize()` flow shared by `Dense`, `EinsumDense`
and `Embedding` (validation, atomic swap of the weights, policy renaming, and
quantizing when a quantized policy is given)."""

from __future__ import annotations

from typing import Any

from dtype_policies.layers.layer import Layer
from dtype_policies.quantization import float8
from dtype_policies.quantization.config import (
    QuantizationConfig,
    deserialize_config,
    serialize_config,
    validate_and_resolve_config,
)
from dtype_policies.quantization.linear import default_config, quantized_policy_name


class QuantizableLayer(Layer):
    """A layer with a `quantize(mode, config=None, type_check=True)` method.

    Subclasses implement `_quantization_for(mode, config)`, returning the
    quantization object (see `linear.py`, `embedding.py`), and
    `_float_weight(quantization)`, returning the float weight to quantize.
    """

    _quantization_base: type[QuantizableLayer]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_quantization_for" in cls.__dict__:
            cls._quantization_base = cls  # `type_check` accepts this class only

    def history_length(self, config: Any) -> int:
        """The float8 amax history length: the config's, else the policy's."""
        length = getattr(config, "amax_history_length", None)
        return length or getattr(self._resolve_policy(), "amax_history_length", 1024)

    def __init__(self, *, quantization_config: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._quantization = None
        self.quantization_config: QuantizationConfig | None = deserialize_config(
            quantization_config
        )

    @property
    def is_quantized(self) -> bool:
        return self._quantization is not None

    def quantize(
        self, mode: str | None = None, config: Any = None, type_check: bool = True
    ) -> None:
        """Quantizes this built layer's weights in place.

        Args:
            mode: `"int8"`, `"int4"` or `"float8"` (not needed when `config`
                is given).
            config: An `Int8QuantizationConfig`, `Int4QuantizationConfig` or
                `Float8QuantizationConfig`; `None` means the mode's default.
            type_check: Refuse subclasses (whose `call` may not dispatch to the
                quantized product); pass `False` to quantize one anyway.

        On success the layer's policy becomes `"<mode>_from_<previous>"` (unless
        it already was a quantized policy). On any error the layer is left
        exactly as it was.
        """
        config = validate_and_resolve_config(mode, config)
        mode = config.mode
        base = type(self)._quantization_base
        if type_check and type(self) is not base:
            raise NotImplementedError(
                f"Layer {type(self).__name__} does not have a `quantize` method implemented. "
                "Pass `type_check=False` to quantize a subclass whose `call` is the "
                f"{base.__name__} one."
            )
        if not self.built:
            raise ValueError(
                "Cannot quantize a layer that isn't yet built. "
                f"Layer '{self.name}' (of type '{type(self).__name__}') is not built yet."
            )
        if self._quantization is not None:
            raise ValueError(
                f"Layer '{self.name}' is already quantized with "
                f"dtype_policy='{self._resolve_policy().name}'. Received: mode={mode}"
            )
        if mode not in self._supported_quantization_modes:
            raise NotImplementedError(
                f"Invalid quantization mode. Expected one of "
                f"{self._supported_quantization_modes}. Received: quantization_mode={mode}"
            )
        if mode == "int8" and self.compute_dtype == "float16":
            raise ValueError(
                "Quantization mode='int8' doesn't work well with compute_dtype='float16'. "
                "Consider loading model/layer with another dtype policy such as "
                "'mixed_bfloat16' before calling `quantize()`."
            )
        quantization = self._quantization_for(mode, config)
        if mode == "float8":
            tensors = None
        else:
            tensors = quantization.quantize(self._float_weight(quantization))
        self._commit_quantization(quantization, tensors)
        self.quantization_config = config
        policy = self._resolve_policy()
        if policy.quantization_mode is None:
            self._set_policy_quietly(quantized_policy_name(mode, config, policy.name))
        self._refresh_policy_state()

    def _commit_quantization(self, quantization: Any, tensors: dict | None) -> None:
        prefix = quantization.prefix
        if tensors is None:  # float8: the float weight stays; add the scaling state
            device = self._parameters[prefix].device
            float8.register_float8_state(self, quantization.history_length, device)
        else:
            del self._parameters[prefix]
            self._autocast_weight_names.discard(prefix)
            self._small_weight_casts.pop(prefix, None)
            for table in (
                self._declared_trainable,
                self._weight_regularizers,
                self._weight_constraints,
            ):
                table.pop(prefix, None)
            for name, tensor in tensors.items():
                self.register_buffer(name, tensor)
        self._quantization = quantization
        self._casts_own_weights = False  # quantized calls read weights through the scope

    def _set_policy_quietly(self, policy: Any) -> None:
        """Sets the policy like the `dtype_policy` setter, without re-quantizing."""
        from dtype_policies.policy_map import DTypePolicyMap

        current = self._dtype_policy
        if isinstance(current, DTypePolicyMap) and self._path is not None:
            if self._path in current:
                del current[self._path]
            current[self._path] = policy
        else:
            self._dtype_policy = policy

    def _quantize_from_policy(self) -> None:
        mode = self.quantization_mode
        if mode is None or self._quantization is not None or not self.built:
            return
        config = self.quantization_config
        if config is None or config.mode != mode:
            config = default_config(mode, self._resolve_policy())
        self.quantize(mode, config, type_check=False)

    def _after_build(self) -> None:
        super()._after_build()
        self._quantize_from_policy()

    def _on_policy_change(self) -> None:
        super()._on_policy_change()
        quantization = self._quantization
        mode = self.quantization_mode
        if quantization is not None and mode is not None and mode != quantization.mode:
            raise ValueError(
                f"Layer '{self.name}' is quantized in mode '{quantization.mode}'; it cannot "
                f"switch to a '{mode}' policy. Build a new layer instead."
            )
        self._quantize_from_policy()

    @property
    def dtype_policy(self) -> Any:
        return Layer.dtype_policy.fget(self)

    @dtype_policy.setter
    def dtype_policy(self, value: Any) -> None:
        from dtype_policies.serialization import get

        policy = get(value)
        quantization = self._quantization
        new_mode = getattr(policy, "quantization_mode", None)
        if (
            quantization is not None
            and new_mode != quantization.mode
            and not hasattr(policy, "matching_key")
        ):
            raise ValueError(
                f"Layer '{self.name}' is quantized in mode '{quantization.mode}'; it cannot "
                f"take the policy '{policy.name}'. Build a new layer instead."
            )
        Layer.dtype_policy.fset(self, policy)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["quantization_config"] = serialize_config(self.quantization_config)
        return config
