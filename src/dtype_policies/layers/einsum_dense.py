"""`EinsumDense`: a dense layer whose kernel contraction is an einsum equation."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from dtype_policies import activations, regularizers
from dtype_policies.layers._quantizable import QuantizableLayer, register_layer_kind
from dtype_policies.layers._weight_arguments import (
    add_kernel_and_bias,
    kernel_bias_config,
    set_kernel_bias_arguments,
)
from dtype_policies.quantization.schemes import QuantizedWeight, WeightSpec

_EQUATION = re.compile(
    r"^(\.\.\.)?([a-zA-Z]+)(\.\.\.)?,([a-zA-Z]+)->(\.\.\.)?([a-zA-Z]+)(\.\.\.)?$"
)


@dataclass(frozen=True)
class EinsumSpec:
    """An equation `inputs,kernel->outputs`, optionally with `...` on one side
    (`"left"`: `...ab,bc->...ac`; `"right"`: `ab...,bc->ac...`)."""

    inputs: str
    kernel: str
    outputs: str
    ellipsis: str | None

    @classmethod
    def parse(cls, equation: str) -> EinsumSpec:
        match = _EQUATION.match(equation.replace(" ", "")) if isinstance(equation, str) else None
        if match is not None:
            in_left, inputs, in_right, kernel, out_left, outputs, out_right = match.groups()
            if not (in_left or in_right or out_left or out_right):
                return cls(inputs, kernel, outputs, None)
            if in_left and out_left and not (in_right or out_right):
                return cls(inputs, kernel, outputs, "left")
            if in_right and out_right and not (in_left or out_left):
                return cls(inputs, kernel, outputs, "right")
        raise ValueError(
            f"Invalid einsum equation {equation!r}. Equations must be in the form "
            "[X],[Y]->[Z], ...[X],[Y]->...[Z], or [X]...,[Y]->[Z]..."
        )

    def matmul_plan(self) -> tuple[tuple[int, ...], int] | None:
        """How the contraction is a plain matrix product, if it is one: the
        kernel permutation that puts the contracted axes first, and their count.

        That is the case when the input ends with the contracted letters (in
        kernel order), the output is the input's other letters followed by the
        kernel's other letters, and no letter is shared by all three.
        """
        reduced = "".join(c for c in self.kernel if c not in self.outputs)
        others = "".join(c for c in self.kernel if c in self.outputs)
        if not reduced or self.ellipsis == "right" or not self.inputs.endswith(reduced):
            return None
        prefix = self.inputs[: -len(reduced)]
        if any(c in self.kernel for c in prefix) or any(c in self.inputs for c in others):
            return None
        if self.outputs != prefix + others:
            return None
        return tuple(self.kernel.index(c) for c in reduced + others), len(reduced)

    @property
    def kernel_reduced_axes(self) -> tuple[int, ...]:
        """Kernel axes contracted away (absent from the output)."""
        return tuple(i for i, c in enumerate(self.kernel) if c not in self.outputs)

    def shapes(
        self, input_shape: tuple, output_shape: Any, bias_axes: str | None
    ) -> tuple[tuple[int, ...], tuple[int, ...] | None, tuple]:
        """`(kernel_shape, bias_shape, full_output_shape)` for an input shape.

        `output_shape` is the output shape without its first (batch) axis, with
        `None` for axes taken from the input; under a left `...` it lists only
        the explicit output letters.
        """
        rank, explicit = len(input_shape), len(self.inputs)
        elided_count = rank - explicit
        if elided_count < 0 or (elided_count > 0 and self.ellipsis is None):
            raise ValueError(
                f"Input of rank {rank} does not fit the input spec '{self.inputs}' "
                f"(shape {tuple(input_shape)})."
            )
        if self.ellipsis == "left":
            elided, input_dims = input_shape[:elided_count], input_shape[elided_count:]
        else:
            elided, input_dims = input_shape[explicit:], input_shape[:explicit]
        sizes = dict(zip(self.inputs, input_dims))

        given = [output_shape] if isinstance(output_shape, int) else list(output_shape)
        if self.ellipsis != "left":
            given.insert(0, input_shape[0])
        if len(given) != len(self.outputs):
            raise ValueError(
                f"`output_shape` {output_shape!r} does not fit the output spec "
                f"'{self.outputs}' of equation with ellipsis={self.ellipsis!r}."
            )
        output_dims = []
        for letter, size in zip(self.outputs, given):
            if (
                letter in sizes
                and size is not None
                and sizes[letter] is not None
                and (size != sizes[letter])
            ):
                raise ValueError(
                    f"Output dimension '{letter}' has size {size} but the input has "
                    f"size {sizes[letter]} for it."
                )
            if size is None:
                if letter not in sizes:
                    raise ValueError(
                        f"Output dimension '{letter}' is None in `output_shape` and does "
                        f"not appear in the input spec '{self.inputs}' to infer it from."
                    )
                size = sizes[letter]
            if letter not in self.inputs and letter not in self.kernel:
                raise ValueError(
                    f"Output dimension '{letter}' appears in neither the input spec "
                    f"'{self.inputs}' nor the kernel spec '{self.kernel}'."
                )
            sizes.setdefault(letter, size)
            output_dims.append(size)

        kernel_shape = []
        for letter in self.kernel:
            if letter not in sizes or sizes[letter] is None:
                raise ValueError(
                    f"Kernel dimension '{letter}' matches neither the input spec "
                    f"'{self.inputs}' nor the output spec '{self.outputs}'; the kernel "
                    "must be fully specified."
                )
            kernel_shape.append(int(sizes[letter]))

        bias_shape: tuple[int, ...] | None = None
        if bias_axes:
            for letter in bias_axes:
                if letter not in self.outputs:
                    raise ValueError(
                        f"Bias axis '{letter}' is not in the output spec '{self.outputs}'."
                    )
            first = min(self.outputs.index(letter) for letter in bias_axes)
            bias_dims = [
                int(sizes[letter]) if letter in bias_axes else 1 for letter in self.outputs[first:]
            ]
            if self.ellipsis == "right":
                bias_dims += [1] * elided_count
            bias_shape = tuple(bias_dims)

        full = (*elided, *output_dims) if self.ellipsis == "left" else (*output_dims, *elided)
        return tuple(kernel_shape), bias_shape, full


class EinsumDense(QuantizableLayer):
    """A dense layer computing `activation(einsum(equation, inputs, kernel) + bias)`.

    Args:
        equation: `"ab,bc->ac"`-style equation, optionally with `...` on the
            left or right of the input and output specs.
        output_shape: The output shape without the batch axis (an int for a
            single axis); `None` entries are taken from the input.
        activation: Activation name or callable.
        bias_axes: Output letters that get a bias, e.g. `"c"`; `None` for none.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, kernel_constraint, bias_constraint: As for `Dense`.

    >>> import torch
    >>> from dtype_policies.layers import EinsumDense
    >>> layer = EinsumDense("abc,cde->abde", output_shape=(None, 2, 8), bias_axes="de",
    ...                     dtype="mixed_bfloat16")
    >>> y = layer(torch.ones(4, 5, 16))
    >>> tuple(y.shape), y.dtype, tuple(layer.kernel.shape)
    ((4, 5, 2, 8), torch.bfloat16, (16, 2, 8))
    """

    def __init__(
        self,
        equation: str,
        output_shape: Any,
        activation: Any = None,
        bias_axes: str | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        *,
        activity_regularizer: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.spec = EinsumSpec.parse(equation)
        self.equation = equation
        self.partial_output_shape = (
            (output_shape,) if isinstance(output_shape, int) else tuple(output_shape)
        )
        self.bias_axes = bias_axes
        self.activation = activations.get(activation)
        set_kernel_bias_arguments(
            self,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
        )
        self.full_output_shape: tuple | None = None

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        """The output shape for `input_shape`: Keras's, except that an axis
        `output_shape` leaves `None` takes its size from the input where the
        equation carries it over (Keras answers `None` there).

        >>> EinsumDense("ab,bc->ac", output_shape=5).compute_output_shape((None, 3))
        (None, 5)
        """
        return tuple(self.spec.shapes(tuple(input_shape), self.partial_output_shape, None)[2])

    def build(self, input_shape: tuple[int, ...]) -> None:
        kernel_shape, bias_shape, full = self.spec.shapes(
            tuple(input_shape), self.partial_output_shape, self.bias_axes
        )
        self.full_output_shape = full
        add_kernel_and_bias(self, kernel_shape, bias_shape)

    def _quantized_call(self, inputs: torch.Tensor) -> torch.Tensor:
        quantized = self._quantized
        assert quantized is not None  # called only when quantized
        compute = self._call_state.compute
        if compute is None:
            raise self._no_float_compute()
        plan = self.spec.matmul_plan()
        if plan is None:  # float8 on a general equation: its own contraction
            outputs = quantized.linear(self, inputs, None, compute)
        else:
            # The output is the input's leading axes (any number under `...`,
            # not only the build-time ones) followed by the kernel's free axes.
            self._check_quantized_input(inputs, plan, quantized)
            lead = inputs.shape[: inputs.dim() - plan[1]]
            free_count = len(self.spec.kernel) - plan[1]
            full = self.full_output_shape
            if full is None:  # set by `build`, before any weight is made
                raise RuntimeError(f"Layer '{self.name}' is quantized but was never built.")
            free = full[len(full) - free_count :]
            flat = inputs.reshape(*lead, quantized.spec.in_features)
            outputs = quantized.linear(self, flat, None, compute)
            outputs = outputs.reshape(*lead, *free)
        if self.bias is not None:
            outputs = outputs + self.bias
        return self.activation(outputs)

    def _check_quantized_input(
        self, inputs: torch.Tensor, plan: tuple, quantized: QuantizedWeight
    ) -> None:
        """What `torch.einsum` checks of the float call: the input's rank and
        the sizes of its contracted axes (the quantized product reads them
        flattened, so a transposed input would pass)."""
        permutation, count = plan
        explicit = len(self.spec.inputs)
        kernel_shape = quantized.spec.float_shape
        contracted = tuple(kernel_shape[axis] for axis in permutation[:count])
        rank_fits = inputs.dim() == explicit or (
            self.spec.ellipsis is not None and inputs.dim() >= explicit
        )
        if not rank_fits or tuple(inputs.shape[inputs.dim() - count :]) != contracted:
            raise RuntimeError(
                f"EinsumDense('{self.equation}') got an input of shape {tuple(inputs.shape)}: "
                f"its spec '{self.spec.inputs}' asks for rank {explicit}"
                f"{' or more' if self.spec.ellipsis is not None else ''}, ending in the "
                f"contracted axes {contracted}"
            )

    def call(self, inputs: torch.Tensor) -> torch.Tensor:
        if self._quantized is not None:
            return self._quantized_call(inputs)
        outputs = torch.einsum(self.equation, inputs, self.kernel)
        if self.bias is not None:
            outputs = outputs + self.bias
        return self.activation(outputs)

    def get_config(self) -> dict[str, Any]:
        output_shape = self.partial_output_shape
        return {
            **super().get_config(),
            "equation": self.equation,
            "output_shape": tuple(output_shape),  # Keras's: a tuple, an int's too
            "activation": activations.serialize(self.activation),
            "bias_axes": self.bias_axes,
            **kernel_bias_config(self),
            "activity_regularizer": regularizers.serialize(self._activity_regularizer),
        }


def _einsum_spec(layer: EinsumDense, mode: str) -> WeightSpec:
    kernel = layer._parameters["kernel"]
    if kernel is None:
        raise layer._missing_weight("kernel")
    kernel_shape = tuple(kernel.shape)
    plan = layer.spec.matmul_plan()
    if plan is None:  # only modes with a general contraction take it (float8)
        equation = layer.equation
        return WeightSpec(
            weight="kernel",
            layout="in_out",
            role="linear",
            in_features=0,
            out_features=0,
            float_shape=kernel_shape,
            contract=functools.partial(torch.einsum, equation),
        )
    permutation, reduced = plan
    sizes = [kernel_shape[i] for i in permutation]
    return WeightSpec(
        weight="kernel",
        layout="in_out",
        role="linear",
        in_features=math.prod(sizes[:reduced]),
        out_features=math.prod(sizes[reduced:]),
        float_shape=kernel_shape,
        permutation=tuple(permutation),
    )


register_layer_kind(EinsumDense, _einsum_spec, role="linear")
