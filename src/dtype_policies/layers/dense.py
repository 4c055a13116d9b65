"""`Dense`: a densely connected layer, `activation(inputs @ kernel + bias)`."""

from __future__ import annotations

from typing import Any

import torch

from dtype_policies import activations
from dtype_policies._core.call import leaf_weights
from dtype_policies._core.module_state import STATE_KEY
from dtype_policies._core.weight_casts import cast_pair
from dtype_policies.layers._quantizable import QuantizableLayer, register_layer_kind
from dtype_policies.layers._weight_arguments import (
    add_kernel_and_bias,
    kernel_bias_config,
    set_kernel_bias_arguments,
)
from dtype_policies.quantization.schemes import WeightSpec


def _check_positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return value


class Dense(QuantizableLayer):
    """A densely connected layer: `activation(inputs @ kernel + bias)`.

    The kernel has the Keras shape `(input_dim, units)`; it is created in the
    variable dtype and used in the compute dtype.

    Args:
        units: Size of the last output axis.
        activation: Activation name (`"relu"`, `"gelu"`, ...) or callable.
        use_bias: Whether to add a bias vector.
        kernel_initializer, bias_initializer: Initializers (names or objects).
        kernel_regularizer, bias_regularizer: Optional weight regularizers.
        activity_regularizer: Optional regularizer on the outputs.
        kernel_constraint, bias_constraint: Optional weight constraints.
        **kwargs: Base `Layer` arguments (`dtype`, `name`, `trainable`, ...),
            and `quantization_config`.

    A quantized policy (`dtype="int8_from_mixed_bfloat16"`, ...) quantizes the
    kernel when the layer is built; `layer.quantize("int8")` does it later.

    >>> import torch
    >>> from dtype_policies.layers import Dense
    >>> layer = Dense(3, activation="relu", dtype="mixed_bfloat16")
    >>> y = layer(torch.ones(2, 4))
    >>> y.dtype, layer.kernel.dtype, tuple(layer.kernel.shape)
    (torch.bfloat16, torch.float32, (4, 3))
    """

    def __init__(
        self,
        units: int,
        activation: Any = None,
        use_bias: bool = True,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        activity_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.units = _check_positive_int("units", units)
        self.activation = activations.get(activation)
        self.use_bias = bool(use_bias)
        set_kernel_bias_arguments(
            self,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
        )
        self._linear_activation = self.activation is activations.linear

    @property
    def _casts_own_weights(self) -> bool:  # type: ignore[override]  # the base's attribute, per instance
        # Dense's own `call` casts its weights itself (no autocast scope needed),
        # which keeps small layers cheap; a subclass's `call` gets the scope, and
        # so does a parametrized weight (a property of torch's class on the layer).
        return type(self).call is Dense.call and "parametrizations" not in self._modules

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        """The output shape for `input_shape`, as Keras's.

        >>> Dense(4).compute_output_shape((None, 7, 3))
        (None, 7, 4)
        """
        return (*tuple(input_shape)[:-1], self.units)

    def build(self, input_shape: tuple[int, ...]) -> None:
        if input_shape is not None and len(input_shape) < 2:  # Keras's input spec
            raise ValueError(
                f'Input 0 of layer "{self.name}" is incompatible with the layer: expected '
                f"min_ndim=2, found ndim={len(input_shape)}. Full shape received: "
                f"{tuple(input_shape)}"
            )
        if not input_shape or input_shape[-1] is None:
            raise ValueError(
                f"Dense layer '{self.name}' needs inputs with a known last axis. "
                f"Received input_shape={input_shape}"
            )
        add_kernel_and_bias(
            self, (input_shape[-1], self.units), (self.units,) if self.use_bias else None
        )

    def call(self, inputs: torch.Tensor) -> torch.Tensor:
        quantized = self._quantized
        compute = self._call_state.compute
        bias: torch.Tensor | None
        if not inputs.is_floating_point():  # not autocast; Keras's product promotes them
            inputs = inputs.to(compute or torch.promote_types(inputs.dtype, self._kernel_dtype()))
        if quantized is not None:
            if compute is None:
                raise self._no_float_compute()
            parametrized_bias = "bias" not in self._parameters
            bias = self.bias if parametrized_bias else self._parameters["bias"]
            if bias is not None and compute is not None:
                bias = leaf_weights(self.__dict__[STATE_KEY].casts, bias, None, compute, "bias")[0]
            outputs = quantized.linear(self, inputs, bias, compute)
            return outputs if self._linear_activation else self.activation(outputs)
        kernel: torch.Tensor | None
        if self._casts_own_weights:
            kernel, bias = self._parameters["kernel"], self._parameters["bias"]
            if kernel is None:
                raise self._missing_weight("kernel")
            if self._autocast and compute is not None and kernel.dtype is not compute:
                kernel, bias, product = cast_pair(
                    self.__dict__[STATE_KEY].casts,
                    kernel,
                    bias,
                    compute,
                    pack=True,
                    transposed=True,
                )
                if product is not None:  # the path this CPU runs it by (`_core.products`)
                    outputs = product(inputs, bias)
                    return outputs if self._linear_activation else self.activation(outputs)
        else:
            kernel, bias = self.kernel, self.bias
            if kernel is None:
                raise self._missing_weight("kernel")
        if inputs.dtype is not kernel.dtype:
            # `autocast=False`: promoted, as Keras's product
            inputs = inputs.to(torch.promote_types(inputs.dtype, kernel.dtype))
            kernel, bias = _as(kernel, inputs.dtype), _as(bias, inputs.dtype)
        if inputs.dim() == 2:  # one op, and no transposed view of the kernel
            outputs = inputs @ kernel if bias is None else torch.addmm(bias, inputs, kernel)
        else:  # folded to 2-D here: torch's matmul may copy the kernel for strided inputs
            flat = inputs.reshape(-1, inputs.shape[-1])
            flat = flat @ kernel if bias is None else torch.addmm(bias, flat, kernel)
            outputs = flat.reshape(*inputs.shape[:-1], flat.shape[-1])
        return outputs if self._linear_activation else self.activation(outputs)

    def _kernel_dtype(self) -> torch.dtype:
        kernel = self._parameters.get("kernel")
        return torch.float32 if kernel is None else kernel.dtype

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "units": self.units,
            "activation": activations.serialize(self.activation),
            "use_bias": self.use_bias,
            **kernel_bias_config(self),
        }


def _dense_spec(layer: Dense, mode: str) -> WeightSpec:
    kernel = layer._parameters["kernel"]
    if kernel is None:
        raise layer._missing_weight("kernel")
    in_features, units = kernel.shape
    return WeightSpec(
        weight="kernel",
        layout="in_out",
        role="linear",
        in_features=in_features,
        out_features=units,
        bias="bias" if layer._parameters.get("bias") is not None else None,
        float_shape=(in_features, units),
    )


register_layer_kind(Dense, _dense_spec, role="linear")


def _as(tensor: Any, dtype: torch.dtype) -> Any:
    return tensor if tensor is None or tensor.dtype is dtype else tensor.to(dtype)
