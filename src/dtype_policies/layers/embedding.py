"""`Embedding`: integer ids to dense vectors."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies import constraints, initializers, regularizers
from dtype_policies.layers.dense import _check_positive_int
from dtype_policies.quantization.embedding import EmbeddingQuantization
from dtype_policies.quantization.layer_support import QuantizableLayer


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

    _supported_quantization_modes = ("int8", "int4")

    def _quantization_for(self, mode: str, config: Any) -> EmbeddingQuantization:
        return EmbeddingQuantization(mode, "embeddings", self.input_dim, self.output_dim, config)

    def _float_weight(self, quantization: EmbeddingQuantization) -> torch.Tensor:
        return self._parameters["embeddings"]

    def call(self, inputs: torch.Tensor) -> torch.Tensor:
        quantization = self._quantization
        if quantization is not None:
            return quantization.lookup(self, inputs, self._compute_torch_dtype)
        outputs = F.embedding(self._ids(inputs), self.embeddings)
        return outputs.to(self._compute_torch_dtype)

    def compute_mask(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """`inputs != 0` when `mask_zero=True`, else `None`."""
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
        }
