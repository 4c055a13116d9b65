"""`QuantizableLayer`: Keras's `quantize()` flow for `Dense`, `EinsumDense` and
`Embedding`, on the library's one transactional attach path
(`dtype_policies.quantization.attach`)."""

from __future__ import annotations

from typing import Any

from dtype_policies._core.module_state import STATE_KEY, quantization_of
from dtype_policies.layers.layer import Layer
from dtype_policies.policies import get as get_policy
from dtype_policies.policies import policy_for_config
from dtype_policies.quantization import attach
from dtype_policies.quantization.kinds import (
    ModuleKind,
    SpecFunction,
    kind_of,
    register_module_kind,
)
from dtype_policies.quantization.modules import (
    adapt_state_dict,
    apply_keeping_stored_dtypes,
)
from dtype_policies.quantization.schemes import QuantizedWeight
from dtype_policies.quantizers.config import (
    QuantizationConfig,
    deserialize_config,
    serialize_config,
    validate_and_resolve_config,
)


class QuantizableLayer(Layer):
    """A layer with `quantize(mode, config=None, type_check=True)`.

    Subclasses register their weight's kind with `register_layer_kind`; their
    `call` dispatches to `self._quantized.linear(...)` (or `.lookup`) once
    quantized.
    """

    def __init__(self, *, quantization_config: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.quantization_config: QuantizationConfig | None = deserialize_config(
            quantization_config
        )

    @property
    def _quantized(self) -> QuantizedWeight | None:
        return self.__dict__[STATE_KEY].quantization

    @property
    def is_quantized(self) -> bool:
        return self.__dict__[STATE_KEY].quantization is not None

    @property
    def quantization_mode(self) -> str | None:
        quantized = self._quantized
        if quantized is not None:
            return quantized.mode
        mode = self._resolve_policy().quantization_mode
        return mode if mode in kind_of(self).modes else None

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
        attach.commit(attach.plan(self, config, path=self._path or "", type_check=type_check))

    def _quantize_from_policy(self) -> None:
        mode = self.quantization_mode
        if mode is None or self.is_quantized or not self.built:
            return
        config = self.quantization_config
        if config is None or config.mode != mode:
            config = self._resolve_policy().quantization_config
        self.quantize(mode, config, type_check=False)

    def _after_build(self) -> None:
        super()._after_build()
        self._quantize_from_policy()

    def _on_policy_change(self) -> None:
        super()._on_policy_change()
        self._quantize_from_policy()

    @property
    def dtype_policy(self) -> Any:
        return Layer.dtype_policy.fget(self)

    @dtype_policy.setter
    def dtype_policy(self, value: Any) -> None:
        policy = get_policy(value)
        quantized = self._quantized
        if (
            quantized is not None
            and not policy.is_map
            and policy.quantization_mode != quantized.mode
        ):
            raise ValueError(
                f"Layer '{self.name}' is quantized in mode '{quantized.mode}'; it cannot "
                f"take the policy '{policy.name}'. Build a new layer instead."
            )
        Layer.dtype_policy.fset(self, policy)

    def __getattr__(self, name: str) -> Any:
        quantized = quantization_of(self)
        if (
            quantized is not None
            and name == quantized.weight_name
            and not quantized.scheme.keeps_float_weight
        ):
            return quantized.integer_values(self)  # Keras: the quantized integer values
        return super().__getattr__(name)

    def _adapt_checkpoint(self, state_dict: dict, prefix: str) -> None:
        quantized = self._quantized
        if quantized is not None:
            adapt_state_dict(self, quantized, state_dict, prefix)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return apply_keeping_stored_dtypes(self, fn, super()._apply, args, kwargs)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["quantization_config"] = serialize_config(self.quantization_config)
        return config


def _after_quantized(layer: QuantizableLayer, plan: attach.Plan) -> None:
    """Keras's bookkeeping once a layer's weight is quantized: the float
    weight's tracking goes, the config is kept, and the policy becomes
    `<mode>_from_<policy>` unless it already was quantized."""
    name = plan.spec.weight
    if not plan.scheme.keeps_float_weight:
        layer._autocast_weight_names.discard(name)
        for table in (
            layer._declared_trainable,
            layer._weight_regularizers,
            layer._weight_constraints,
        ):
            table.pop(name, None)
    layer.quantization_config = plan.config
    policy = layer._resolve_policy()
    if policy.quantization_mode is None:
        layer._set_policy(policy_for_config(plan.config, policy.name))
    layer._refresh_policy_state()


def register_layer_kind(
    cls: type[QuantizableLayer], spec: SpecFunction, modes: tuple[str, ...]
) -> None:
    """Registers a quantizable layer class (subclasses need `type_check=False`)."""
    register_module_kind(
        cls,
        ModuleKind(spec, modes, exact=True, forward=None, after_commit=_after_quantized),
    )
