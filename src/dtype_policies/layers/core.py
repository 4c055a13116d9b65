"""`Dropout` and `Activation`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies import activations
from dtype_policies.layers.layer import Layer


class Dropout(Layer):
    """Randomly zeroes a fraction `rate` of the inputs during training.

    `training=None` follows the module's own mode (`layer.train()` /
    `layer.eval()`). `noise_shape` broadcasts one dropout mask over the axes
    where it is 1 (`None` entries take the input's size). `seed` makes the
    masks reproducible.

    >>> import torch
    >>> from dtype_policies.layers import Dropout
    >>> layer = Dropout(0.5).eval()
    >>> bool((layer(torch.ones(4)) == 1).all())
    True
    """

    def __init__(
        self, rate: float, noise_shape: Any = None, seed: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(
                f"Invalid value received for argument `rate`. Expected a float value "
                f"between 0 and 1. Received: rate={rate!r}"
            )
        self.rate = float(rate)
        self.noise_shape = tuple(noise_shape) if noise_shape is not None else None
        self.seed = seed
        self._generator: torch.Generator | None = None

    def _generator_for(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        """The output shape for `input_shape`: the same, as Keras's.

        >>> Dropout(0.5).compute_output_shape((None, 3))
        (None, 3)
        """
        return tuple(input_shape)

    def call(self, inputs: torch.Tensor, training: bool | None = None) -> torch.Tensor:
        if training is None:
            training = self.training
        if not training or self.rate == 0:
            return inputs
        if self.rate == 1:
            return torch.zeros_like(inputs)
        keep = 1.0 - self.rate
        if self.noise_shape is None and self.seed is None:
            return F.dropout(inputs, self.rate, training=True)
        shape: tuple[int, ...] = inputs.shape
        if self.noise_shape is not None:
            if len(self.noise_shape) != inputs.dim():
                raise ValueError(
                    f"`noise_shape` {self.noise_shape} must have the input's rank {inputs.dim()}."
                )
            shape = tuple(s if n is None else n for s, n in zip(inputs.shape, self.noise_shape))
        generator = self._generator_for(inputs.device)
        mask = torch.rand(shape, generator=generator, device=inputs.device) < keep
        return inputs * mask.to(inputs.dtype) / keep

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "rate": self.rate,
            "noise_shape": list(self.noise_shape) if self.noise_shape is not None else None,
            "seed": self.seed,
        }


class Activation(Layer):
    """Applies an activation function (a name such as `"gelu"`, or a callable).

    >>> import torch
    >>> from dtype_policies.layers import Activation
    >>> Activation("relu")(torch.tensor([-1.0, 1.0]))
    tensor([0., 1.])
    """

    def __init__(self, activation: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.activation = activations.get(activation)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        """The output shape for `input_shape`: the same, as Keras's.

        >>> Activation("relu").compute_output_shape((None, 3))
        (None, 3)
        """
        return tuple(input_shape)

    def call(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.activation(inputs)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "activation": activations.serialize(self.activation)}
