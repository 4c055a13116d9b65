"""`LayerNormalization`, computed in float32 whatever the compute dtype."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies import constraints, initializers, regularizers
from dtype_policies._derivatives import derivative_free
from dtype_policies.layers.layer import Layer


class LayerNormalization(Layer):
    """Normalizes over `axis`: statistics in float32, output in the compute dtype.

    Under `mixed_bfloat16` or `mixed_float16`, inputs are upcast to float32,
    normalized with the float32 `gamma` and `beta`, and the result is cast to
    the compute dtype (float64 inputs compute in float64).

    Args:
        axis: Axis or list of axes to normalize over (default: the last).
        epsilon: Added to the variance.
        center, scale: Whether to learn `beta` / `gamma`.
        rms_scaling: Deprecated, as in Keras 3.15 (a warning says so): divide
            the inputs by the square root of their variance, without
            subtracting the mean, then scale by `gamma` (always learned) and
            add no `beta`. Not RMS normalization, which divides by the root
            mean square: `torch.nn.RMSNorm` under `apply_policy` is that.
        beta_initializer, gamma_initializer, beta_regularizer,
        gamma_regularizer, beta_constraint, gamma_constraint: For the weights.

    >>> import torch
    >>> from dtype_policies.layers import LayerNormalization
    >>> layer = LayerNormalization(dtype="mixed_bfloat16")
    >>> y = layer(torch.randn(2, 8))
    >>> y.dtype, layer.gamma.dtype
    (torch.bfloat16, torch.float32)
    """

    def __init__(
        self,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        beta_initializer: Any = "zeros",
        gamma_initializer: Any = "ones",
        beta_regularizer: Any = None,
        gamma_regularizer: Any = None,
        beta_constraint: Any = None,
        gamma_constraint: Any = None,
        *,
        rms_scaling: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs["autocast"] = False
        super().__init__(**kwargs)
        if isinstance(axis, (list, tuple)):
            self.axis: int | tuple[int, ...] = tuple(int(a) for a in axis)
        elif isinstance(axis, int):
            self.axis = axis
        else:
            raise TypeError(f"`axis` must be an int or a list of ints. Received: axis={axis!r}")
        self.epsilon = float(epsilon)
        self.center = bool(center)
        self.scale = bool(scale)
        self.rms_scaling = bool(rms_scaling)
        if self.rms_scaling:
            warnings.warn(
                "You passed `rms_scaling=True`, which is deprecated (as in Keras). It "
                "scales the inputs by their variance, not their root mean square; for RMS "
                "normalization use torch.nn.RMSNorm (under apply_policy).",
                stacklevel=2,
            )
        self.beta_initializer = initializers.get(beta_initializer)
        self.gamma_initializer = initializers.get(gamma_initializer)
        self.beta_regularizer = regularizers.get(beta_regularizer)
        self.gamma_regularizer = regularizers.get(gamma_regularizer)
        self.beta_constraint = constraints.get(beta_constraint)
        self.gamma_constraint = constraints.get(gamma_constraint)

    def build(self, input_shape: tuple[int, ...]) -> None:
        rank = len(input_shape)
        axes = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        normalized = []
        for axis in axes:
            if not -rank <= axis < rank:
                raise ValueError(f"Invalid axis {axis} for inputs of rank {rank}.")
            normalized.append(axis % rank)
        param_shape = tuple(input_shape[a] for a in sorted(set(normalized)))
        if self.scale or self.rms_scaling:
            self.gamma = self.add_weight(
                shape=param_shape,
                initializer=self.gamma_initializer,
                regularizer=self.gamma_regularizer,
                constraint=self.gamma_constraint,
                name="gamma",
                autocast=False,
            )
        else:
            self.register_parameter("gamma", None)
        if self.center and not self.rms_scaling:
            self.beta = self.add_weight(
                shape=param_shape,
                initializer=self.beta_initializer,
                regularizer=self.beta_regularizer,
                constraint=self.beta_constraint,
                name="beta",
                autocast=False,
            )
        else:
            self.register_parameter("beta", None)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        """The output shape for `input_shape`: the same, as Keras's.

        >>> LayerNormalization().compute_output_shape((None, 3))
        (None, 3)
        """
        return tuple(input_shape)

    def _axes_of(self, inputs: torch.Tensor) -> tuple[tuple[int, ...], bool]:
        """The axes normalized for `inputs` (`axis` as given, read at the
        call's rank, as Keras: `-1` is the last axis of any input, not the
        build's rank's) and whether they are the trailing ones."""
        rank = inputs.dim()
        given = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        for axis in given:
            if not -rank <= axis < rank:
                raise ValueError(
                    f"Invalid axis {axis} for inputs of rank {rank} (shape {tuple(inputs.shape)})."
                )
        axes = tuple(sorted({axis % rank for axis in given}))
        return axes, axes == tuple(range(rank - len(axes), rank))

    def call(self, inputs: torch.Tensor) -> torch.Tensor:
        compute = self._compute_torch_dtype
        axes, trailing = self._axes_of(inputs)
        if (
            trailing
            and not self.rms_scaling
            and inputs.dtype == compute
            and compute in (torch.bfloat16, torch.float16)
            and all(  # not after `.double()` or `.half()` of the layer
                w is None or w.dtype == torch.float32 for w in self._parameters.values()
            )
            # its gamma and beta gradients would be summed in the half dtype
            and (not torch.is_grad_enabled() or derivative_free(self.gamma, self.beta))
        ):
            # torch's mixed-dtype kernel: half-precision in and out, float32
            # statistics and float32 gamma/beta, with no extra pass over the data.
            shape = tuple(inputs.shape[a] for a in axes)
            return F.layer_norm(inputs, shape, self.gamma, self.beta, self.epsilon)
        x = inputs if inputs.dtype in (torch.float32, torch.float64) else inputs.float()
        gamma = self.gamma.to(x.dtype) if self.gamma is not None else None
        beta = self.beta.to(x.dtype) if self.beta is not None else None
        broadcast = tuple(x.shape[i] if i in axes else 1 for i in range(x.dim()))
        if self.rms_scaling:
            # Keras's deprecated rule: the variance, with the mean left in the inputs.
            variance = x.var(dim=axes, keepdim=True, correction=0)
            outputs = x * torch.rsqrt(variance + self.epsilon)
            if gamma is not None:
                outputs = outputs * gamma.reshape(broadcast)
        elif trailing:
            shape = tuple(x.shape[a] for a in axes)
            outputs = F.layer_norm(x, shape, gamma, beta, self.epsilon)
        else:
            mean = x.mean(dim=axes, keepdim=True)
            variance = (x - mean).square().mean(dim=axes, keepdim=True)
            outputs = (x - mean) * torch.rsqrt(variance + self.epsilon)
            if gamma is not None:
                outputs = outputs * gamma.reshape(broadcast)
            if beta is not None:
                outputs = outputs + beta.reshape(broadcast)
        return outputs.to(compute)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "axis": list(self.axis) if isinstance(self.axis, tuple) else self.axis,
            "epsilon": self.epsilon,
            "center": self.center,
            "scale": self.scale,
            "rms_scaling": self.rms_scaling,
            "beta_initializer": initializers.serialize(self.beta_initializer),
            "gamma_initializer": initializers.serialize(self.gamma_initializer),
            "beta_regularizer": regularizers.serialize(self.beta_regularizer),
            "gamma_regularizer": regularizers.serialize(self.gamma_regularizer),
            "beta_constraint": constraints.serialize(self.beta_constraint),
            "gamma_constraint": constraints.serialize(self.gamma_constraint),
        }
