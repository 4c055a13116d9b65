"""Optimizers for mixed precision training: Keras 3 dynamic loss scaling.

>>> import torch
>>> from dtype_policies.optimizers import LossScaleOptimizer, maybe_wrap
>>> params = [torch.nn.Parameter(torch.zeros(2))]
>>> optimizer = maybe_wrap(torch.optim.SGD(params, lr=0.1), "mixed_float16")
>>> isinstance(optimizer, LossScaleOptimizer), optimizer.dynamic_scale
(True, 32768.0)
"""

from dtype_policies.optimizers.loss_scale_optimizer import LossScaleOptimizer
from dtype_policies.optimizers.maybe_wrap import maybe_wrap

__all__ = ["LossScaleOptimizer", "maybe_wrap"]
