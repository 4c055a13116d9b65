"""`MultiHeadAttention` built from `EinsumDense` sublayers."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies import regularizers as regularizers_lib
from dtype_policies.layers._weight_arguments import kernel_bias_config, set_kernel_bias_arguments
from dtype_policies.layers.core import Dropout
from dtype_policies.layers.dense import _check_positive_int
from dtype_policies.layers.einsum_dense import EinsumDense
from dtype_policies.layers.layer import Layer

_MASK_VALUE = -1e9


def _check_key_fits_value(value_shape: tuple, key_shape: tuple) -> None:
    if value_shape[1:-1] != key_shape[1:-1]:
        raise ValueError(
            "All dimensions of `value` and `key`, except the last one, must be equal. "
            f"Received: value_shape={value_shape} and key_shape={key_shape}"
        )


def _output_shape(value: Any) -> tuple[int, ...] | None:
    """Keras's `output_shape`: None (the query's features), an int or a
    sequence of ints, kept as a tuple."""
    if value is None:
        return None
    shape = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        shape = tuple(shape)
    except TypeError:
        shape = None
    if not shape or not all(
        isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in shape
    ):
        raise ValueError(
            f"Invalid `output_shape`: {value!r}. When specified, the `output_shape` should be "
            "of type tuple, list, or int, of positive sizes."
        )
    return shape


class MultiHeadAttention(Layer):
    """Multi-head attention over inputs of shape `(batch, sequence, features)`.

    Its sublayers `query`, `key`, `value`, `attention_output` and, with
    `use_gate=True`, `gate` (paths `<name>/query`, ...) receive this layer's
    own policy, so a
    `DTypePolicyMap` given as `dtype` sets each of them by its path. The
    softmax runs in float32 and its result is cast back to the compute dtype.

    Args:
        num_heads: Number of attention heads.
        key_dim: Size of each head for query and key.
        value_dim: Size of each head for value (default `key_dim`).
        dropout: Dropout rate on the attention probabilities.
        use_bias: Whether the projections have biases.
        output_shape: The output's shape besides batch and sequence: an int
            or a tuple (default: the query's features), as Keras's.
        attention_axes: Only `None` (attend over the sequence axis) is supported.
        sliding_window: None (full attention) or a positive int: each query
            attends only to keys within `sliding_window - 1` positions of its
            own, on either side (with `use_causal_mask=True`: the causal
            sliding window of Mistral), as Keras's.
        flash_attention: Accepted for Keras's configs; torch's fused
            attention is used whenever no scores are returned.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: For the projections (as Keras's: the activity
            regularizer too, on each projection's output).
        use_gate: Gated attention (Keras's `use_gate`, arXiv:2505.06708): a
            sigmoid projection of the query (sublayer `gate`) multiplies the
            attended values of each head before the output projection.
        seed: Seed of the attention dropout.

    Call arguments: `query`, `value`, `key=None` (defaults to `value`),
    `attention_mask=None` (bool, `(batch, target, source)`, True = attend),
    `return_attention_scores=False`, `training=None`, `use_causal_mask=False`.

    >>> import torch
    >>> from dtype_policies.layers import MultiHeadAttention
    >>> mha = MultiHeadAttention(num_heads=2, key_dim=4, name="mha", dtype="mixed_bfloat16")
    >>> x = torch.randn(3, 5, 8)
    >>> y, scores = mha(x, x, return_attention_scores=True)
    >>> tuple(y.shape), y.dtype, tuple(scores.shape)
    ((3, 5, 8), torch.bfloat16, (3, 2, 5, 5))
    >>> mha.query.path
    'mha/query'
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: int | tuple[int, ...] | None = None,
        attention_axes: Any = None,
        sliding_window: int | None = None,
        flash_attention: bool | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        activity_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        use_gate: bool = False,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        # Keras's: the projections' activity regularizer, not the layer's own
        super().__init__(**kwargs)
        self._projection_activity_regularizer = regularizers_lib.get(activity_regularizer)
        self.num_heads = _check_positive_int("num_heads", num_heads)
        self.key_dim = _check_positive_int("key_dim", key_dim)
        self.value_dim = _check_positive_int("value_dim", value_dim or key_dim)
        if attention_axes not in (None, -2, 1, (1,), [1], (-2,), [-2]):
            raise ValueError(
                "Only attention over the sequence axis of (batch, sequence, features) "
                f"inputs is supported (attention_axes=None). Received: {attention_axes!r}"
            )
        self._attention_axes = (
            None
            if attention_axes is None
            else (attention_axes,)
            if isinstance(attention_axes, int)
            else tuple(attention_axes)
        )
        if sliding_window is not None and (
            not isinstance(sliding_window, int)
            or isinstance(sliding_window, bool)
            or sliding_window <= 0
        ):
            raise ValueError(
                "`sliding_window` must be `None` or a positive integer. "
                f"Received: sliding_window={sliding_window!r}"
            )
        self.sliding_window = sliding_window
        self.flash_attention = flash_attention
        self.dropout = float(dropout)
        self.use_bias = bool(use_bias)
        self._output_shape = _output_shape(output_shape)
        set_kernel_bias_arguments(
            self,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
        )
        self.seed = seed
        self.use_gate = bool(use_gate)
        self.dropout_layer = Dropout(self.dropout, seed=seed, dtype=self.dtype_policy)

    def _projection(
        self, name: str, equation: str, output_shape: Any, bias_axes: str, activation: Any = None
    ):
        return EinsumDense(
            equation,
            output_shape=output_shape,
            activation=activation,
            bias_axes=bias_axes if self.use_bias else None,
            kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer,
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            activity_regularizer=self._projection_activity_regularizer,
            dtype=self.dtype_policy,
            name=name,
        )

    def compute_output_shape(
        self, query_shape: tuple, value_shape: tuple, key_shape: tuple | None = None
    ) -> tuple:
        """The output shape for these inputs, as Keras's.

        >>> MultiHeadAttention(2, 4).compute_output_shape((None, 5, 8), (None, 7, 6))
        (None, 5, 8)
        """
        query_shape, value_shape = tuple(query_shape), tuple(value_shape)
        key_shape = value_shape if key_shape is None else tuple(key_shape)
        _check_key_fits_value(value_shape, key_shape)
        return (*query_shape[:-1], *(self._output_shape or query_shape[-1:]))

    def build(self, query_shape: tuple, value_shape: tuple, key_shape: tuple | None = None) -> None:
        key_shape = value_shape if key_shape is None else key_shape
        for label, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if shape is None or len(shape) != 3:
                raise ValueError(
                    f"MultiHeadAttention expects {label} of shape (batch, sequence, features). "
                    f"Received: {label}_shape={shape}"
                )
        _check_key_fits_value(tuple(value_shape), tuple(key_shape))
        heads, key_dim, value_dim = self.num_heads, self.key_dim, self.value_dim
        self.query = self._projection("query", "abc,cde->abde", (None, heads, key_dim), "de")
        self.key = self._projection("key", "abc,cde->abde", (None, heads, key_dim), "de")
        self.value = self._projection("value", "abc,cde->abde", (None, heads, value_dim), "de")
        if self.use_gate:
            self.gate = self._projection(
                "gate", "abc,cde->abde", (None, heads, value_dim), "de", activation="sigmoid"
            )
        output_dims = self._output_shape or (query_shape[-1],)
        letters = "efghij"[: len(output_dims)]
        self.attention_output = self._projection(
            "attention_output", f"abcd,cd{letters}->ab{letters}", (None, *output_dims), letters
        )
        self.query.build(query_shape)
        self.key.build(key_shape)
        self.value.build(value_shape)
        if self.use_gate:
            self.gate.build(query_shape)
        self.attention_output.build((*query_shape[:2], heads, value_dim))

    def _mask(
        self,
        attention_mask: torch.Tensor | None,
        use_causal_mask: bool,
        target: int,
        source: int,
        device: torch.device,
    ) -> torch.Tensor | None:
        mask = None
        if attention_mask is not None:
            mask = attention_mask.bool()
            if mask.dim() == 3:
                mask = mask[:, None]  # broadcast over heads
        if use_causal_mask:
            causal = torch.ones(target, source, dtype=torch.bool, device=device).tril()
            mask = causal if mask is None else mask & causal
        if self.sliding_window is not None:
            rows = torch.arange(target, device=device)[:, None]
            band = (rows - torch.arange(source, device=device)).abs() < self.sliding_window
            mask = band if mask is None else mask & band
        return mask

    def call(
        self,
        query: torch.Tensor,
        value: torch.Tensor,
        key: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_attention_scores: bool = False,
        training: bool | None = None,
        use_causal_mask: bool = False,
    ) -> Any:
        key = value if key is None else key
        # torch's fused attention reads a value shorter or longer than the key
        # without a word
        _check_key_fits_value(tuple(value.shape), tuple(key.shape))
        if training is None:
            training = self.training
        # (batch, heads, sequence, head_dim), all in this layer's compute dtype
        # (the projections may compute in other dtypes under a policy map).
        compute = self._compute_torch_dtype
        q = self.query(query).transpose(1, 2).to(compute)
        k = self.key(key).transpose(1, 2).to(compute)
        v = self.value(value).transpose(1, 2).to(compute)
        mask = self._mask(attention_mask, use_causal_mask, q.shape[2], k.shape[2], q.device)
        if return_attention_scores or (training and self.dropout and self.seed is not None):
            scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.key_dim))
            scores = scores.float()
            if mask is not None:
                scores = scores.masked_fill(~mask, _MASK_VALUE)
            probabilities = torch.softmax(scores, dim=-1)
            if mask is not None:  # a query no key is left to: all zeros, as Keras's
                probabilities = probabilities.masked_fill(~mask, 0.0)
            probabilities = probabilities.to(q.dtype)
            attended = torch.matmul(self.dropout_layer(probabilities, training=training), v)
        else:
            # The fused CPU/GPU kernel accumulates its softmax in float32.
            probabilities = None
            attended = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if training else 0.0
            )
        attended = attended.transpose(1, 2)  # (batch, sequence, heads, head_dim)
        if self.use_gate:
            attended = attended * self.gate(query).to(attended.dtype)
        outputs = self.attention_output(attended)
        if return_attention_scores:
            return outputs, probabilities
        return outputs

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "dropout": self.dropout,
            "use_bias": self.use_bias,
            "output_shape": self._output_shape,
            # Keras's: as given, the sequence axis once built
            "attention_axes": (1,) if self.built else self._attention_axes,
            "sliding_window": self.sliding_window,
            **kernel_bias_config(self),
            "seed": self.seed,
            "use_gate": self.use_gate,
            "activity_regularizer": regularizers_lib.serialize(
                self._projection_activity_regularizer
            ),
        }
