"""`Embedding`: integer ids to dense vectors."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies import constraints, initializers, regularizers
from dtype_policies.layers._quantizable import QuantizableLayer, register_layer_kind
from dtype_policies.layers.dense import _check_positive_int
from dtype_policies.quantization.schemes import WeightSpec


class Embedding(QuantizableLayer):
    """Maps integer ids in `[0, input_dim)` to vectors of size `output_dim`.

    Ids are never cast to a float dtype (the layer does not autocast); the
    looked-up rows are cast to the compute dtype, so under `mixed_bfloat16` the
    table stays float32 and the output is bfloat16.

    Args:
        input_dim: Vocabulary size.
        output_dim: Embedding size.
        embeddings_initializer: Defaults to uniform in [-0.05, 0.05].
        embeddings_regularizer, embeddings_constraint: Optional.
        mask_zero: Whether id 0 is padding; `compute_mask(ids)` then gives
            `ids != 0`.

    >>> import torch
    >>> from dtype_policies.layers import Embedding
    >>> layer = Embedding(10, 4, dtype="mixed_bfloat16")
    >>> layer(torch.tensor([[1, 2, 3]])).dtype, layer.embeddings.dtype
    (torch.bfloat16, torch.float32)
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        embeddings_initializer: Any = "uniform",
        embeddings_regularizer: Any = None,
        embeddings_constraint: Any = None,
        mask_zero: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs["autocast"] = False
        super().__init__(**kwargs)
        self.input_dim = _check_positive_int("input_dim", input_dim)
        self.output_dim = _check_positive_int("output_dim", output_dim)
        self.embeddings_initializer = initializers.get(embeddings_initializer)
        self.embeddings_regularizer = regularizers.get(embeddings_regularizer)
        self.embeddings_constraint = constraints.get(embeddings_constraint)
        self.mask_zero = bool(mask_zero)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        """The output shape for `input_shape`, as Keras's.

        >>> Embedding(10, 4).compute_output_shape((None, 7))
        (None, 7, 4)
        """
        return (*tuple(input_shape), self.output_dim)

    def build(self, input_shape: Any = None) -> None:
        self.embeddings = self.add_weight(
            shape=(self.input_dim, self.output_dim),
            initializer=self.embeddings_initializer,
            regularizer=self.embeddings_regularizer,
            constraint=self.embeddings_constraint,
            name="embeddings",
        )

    @staticmethod
    def _ids(inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dtype not in (torch.int32, torch.int64):
            return inputs.long()
        return inputs

    def call(self, inputs: torch.Tensor) -> torch.Tensor:
        compute = self._call_state.compute
        quantized = self._quantized
        if quantized is not None:
            if compute is None:
                raise self._no_float_compute()
            return quantized.lookup(self, inputs, compute)
        # the float table's rows, cast after the gather; a parametrized table
        # (torch's property on the layer) as `call` reads it
        table = self._parameters.get("embeddings")
        outputs = F.embedding(self._ids(inputs), self.embeddings if table is None else table)
        return outputs if compute is None else outputs.to(compute)

    def compute_mask(self, inputs: torch.Tensor, mask: Any = None) -> torch.Tensor | None:
        """`inputs != 0` when `mask_zero=True`, else `None` (an incoming
        `mask` is not used, as in Keras)."""
        return inputs != 0 if self.mask_zero else None

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        return {
            **config,
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "embeddings_initializer": initializers.serialize(self.embeddings_initializer),
            "embeddings_regularizer": regularizers.serialize(self.embeddings_regularizer),
            "embeddings_constraint": constraints.serialize(self.embeddings_constraint),
            "mask_zero": self.mask_zero,
            "activity_regularizer": regularizers.serialize(self._activity_regularizer),
        }


def _embedding_spec(layer: Embedding, mode: str) -> WeightSpec:
    return WeightSpec(
        weight="embeddings",
        layout="out_in",
        role="embedding",
        in_features=layer.output_dim,
        out_features=layer.input_dim,
        float_shape=(layer.input_dim, layer.output_dim),
    )


register_layer_kind(Embedding, _embedding_spec, role="embedding")
