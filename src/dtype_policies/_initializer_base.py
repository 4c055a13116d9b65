"""The base class of the initializers (`initializers.Initializer`), apart so
that the deterministic initializers of `_fixed_initializers` can build on it."""

from __future__ import annotations

from typing import Any

import torch

Shape = tuple[int, ...]


class Initializer:
    """Base class: `initializer(shape, dtype, device=None) -> tensor`; a
    subclass fills `sample(shape, out)`, drawn in float32 and cast to `dtype`.

    >>> class Arange(Initializer):
    ...     def sample(self, shape, out):
    ...         return out.copy_(torch.arange(out.numel()).reshape(shape))
    >>> Arange()((2, 2), torch.bfloat16)
    tensor([[0., 1.],
            [2., 3.]], dtype=torch.bfloat16)
    """

    def __call__(
        self, shape: Shape, dtype: torch.dtype = torch.float32, device: Any = None
    ) -> torch.Tensor:
        shape = tuple(shape)
        if not dtype.is_floating_point:
            raise ValueError(
                f"{type(self).__name__} makes floating values; it cannot initialize a "
                f"{dtype} weight. Use 'zeros', 'ones' or a constant."
            )
        values = self.sample(shape, torch.empty(shape, dtype=torch.float32, device=device))
        return values.to(dtype)

    def sample(self, shape: Shape, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Initializer:
        """The initializer a `get_config()` dict describes.

        >>> from dtype_policies.initializers import RandomNormal
        >>> RandomNormal.from_config({"mean": 0.0, "stddev": 2.0, "seed": 1}).stddev
        2.0
        """
        return cls(**config)
