"""The activation functions of Keras 3 in torch (Keras's names, arguments
and defaults); `activations` looks them up by name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor) -> torch.Tensor:
    """The identity (Keras's default: no activation).

    >>> linear(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-1.,  0.,  2.])
    """
    return x


def relu(
    x: torch.Tensor,
    negative_slope: float = 0.0,
    max_value: float | None = None,
    threshold: float = 0.0,
) -> torch.Tensor:
    """`max(x, 0)`; with Keras's options: `x` only above `threshold` (else 0),
    capped at `max_value`, and `negative_slope * (x - threshold)` below it.

    >>> relu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([0., 0., 2.])
    >>> relu(torch.tensor([-10.0, -5.0, 0.0, 5.0, 10.0]), negative_slope=0.5, max_value=5.0)
    tensor([-5.0000, -2.5000,  0.0000,  5.0000,  5.0000])
    """
    if negative_slope != 0.0 and max_value is None and threshold == 0:
        return F.leaky_relu(x, negative_slope)
    below = F.relu(threshold - x) if negative_slope != 0.0 else None
    capped = max_value is not None
    if threshold != 0:
        x = torch.where(x > threshold, x, torch.zeros_like(x))
    elif max_value == 6:
        x, capped = F.relu6(x), False
    else:
        x = F.relu(x)
    if capped:
        x = x.clamp(0, max_value)
    if below is not None:
        x = x - negative_slope * below
    return x


def relu6(x: torch.Tensor) -> torch.Tensor:
    """`min(max(x, 0), 6)`.

    >>> relu6(torch.tensor([-1.0, 3.0, 8.0]))
    tensor([0., 3., 6.])
    """
    return F.relu6(x)


def leaky_relu(x: torch.Tensor, negative_slope: float = 0.2) -> torch.Tensor:
    """`x` above 0, `negative_slope * x` below (Keras's default slope 0.2).

    >>> leaky_relu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.2000,  0.0000,  2.0000])
    """
    return F.leaky_relu(x, negative_slope)


def elu(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """`x` above 0, `alpha * (exp(x) - 1)` below.

    >>> elu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.6321,  0.0000,  2.0000])
    """
    return F.elu(x, alpha)


def selu(x: torch.Tensor) -> torch.Tensor:
    """The scaled ELU of self-normalizing networks.

    >>> selu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-1.1113,  0.0000,  2.1014])
    """
    return F.selu(x)


def gelu(x: torch.Tensor, approximate: bool = False) -> torch.Tensor:
    """The Gaussian error linear unit; `approximate=True`: its tanh approximation.

    >>> gelu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.1587,  0.0000,  1.9545])
    """
    return F.gelu(x, approximate="tanh" if approximate else "none")


def silu(x: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(x)` (Keras's `swish` too: the same function).

    >>> silu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.2689,  0.0000,  1.7616])
    """
    return F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`1 / (1 + exp(-x))`.

    >>> sigmoid(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([0.2689, 0.5000, 0.8808])
    """
    return torch.sigmoid(x)


def hard_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The piecewise-linear sigmoid: `clip(x / 6 + 0.5, 0, 1)`.

    >>> hard_sigmoid(torch.tensor([-4.0, 0.0, 1.5]))
    tensor([0.0000, 0.5000, 0.7500])
    """
    return F.hardsigmoid(x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """The hyperbolic tangent.

    >>> tanh(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.7616,  0.0000,  0.9640])
    """
    return torch.tanh(x)


def _over_axes(
    function: Callable[..., torch.Tensor], x: torch.Tensor, axis: int | tuple[int, ...] | None
) -> torch.Tensor:
    """`function(x, dim=-1)` over several axes at once (all of them for `None`),
    as Keras's softmax takes them."""
    if isinstance(axis, int):
        return function(x, dim=axis)
    axes = range(x.ndim) if axis is None else [a % x.ndim for a in axis]
    kept = [a for a in range(x.ndim) if a not in axes]
    moved = x.permute(*kept, *axes)
    flat = function(moved.reshape(*moved.shape[: len(kept)], -1), dim=-1)
    return flat.reshape(moved.shape).permute(*torch.argsort(torch.tensor([*kept, *axes])).tolist())


def softmax(x: torch.Tensor, axis: int | tuple[int, ...] | None = -1) -> torch.Tensor:
    """Exponentials normalized to sum to 1 along `axis` (a tuple of axes, or
    `None` for all, normalizes over them together).

    >>> softmax(torch.tensor([0.0, 0.0, 0.0, 0.0]))
    tensor([0.2500, 0.2500, 0.2500, 0.2500])
    >>> softmax(torch.zeros(2, 2), axis=None)
    tensor([[0.2500, 0.2500],
            [0.2500, 0.2500]])
    """
    return _over_axes(torch.softmax, x, axis)


def log_softmax(x: torch.Tensor, axis: int | tuple[int, ...] | None = -1) -> torch.Tensor:
    """The logarithm of `softmax`, computed stably.

    >>> log_softmax(torch.tensor([0.0, 0.0]))
    tensor([-0.6931, -0.6931])
    """
    return _over_axes(torch.log_softmax, x, axis)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """`log(1 + exp(x))`.

    >>> softplus(torch.tensor([0.0, 20.0]))
    tensor([ 0.6931, 20.0000])
    """
    return F.softplus(x)


def softsign(x: torch.Tensor) -> torch.Tensor:
    """`x / (1 + |x|)`.

    >>> softsign(torch.tensor([-1.0, 0.0, 3.0]))
    tensor([-0.5000,  0.0000,  0.7500])
    """
    return F.softsign(x)


def exponential(x: torch.Tensor) -> torch.Tensor:
    """`exp(x)`.

    >>> exponential(torch.tensor([0.0, 1.0]))
    tensor([1.0000, 2.7183])
    """
    return torch.exp(x)


def mish(x: torch.Tensor) -> torch.Tensor:
    """`x * tanh(softplus(x))`.

    >>> mish(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.3034,  0.0000,  1.9440])
    """
    return F.mish(x)


def celu(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """`x` above 0, `alpha * (exp(x / alpha) - 1)` below.

    >>> celu(torch.tensor([-1.0, 0.0, 2.0]), alpha=0.5)
    tensor([-0.4323,  0.0000,  2.0000])
    """
    return F.celu(x, alpha=alpha)


def glu(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """`a * sigmoid(b)`, `a` and `b` the two halves of `x` along `axis`.

    >>> glu(torch.tensor([1.0, 2.0, 0.0, 100.0]))
    tensor([0.5000, 2.0000])
    """
    return F.glu(x, dim=axis)


def hard_silu(x: torch.Tensor) -> torch.Tensor:
    """`x * hard_sigmoid(x)` (Keras's `hard_swish` too: the same function).

    >>> hard_silu(torch.tensor([-4.0, 0.0, 1.0, 4.0]))
    tensor([-0.0000, 0.0000, 0.6667, 4.0000])
    """
    return F.hardswish(x)


def hard_tanh(x: torch.Tensor) -> torch.Tensor:
    """`x` clipped to `[-1, 1]`.

    >>> hard_tanh(torch.tensor([-2.0, 0.5, 3.0]))
    tensor([-1.0000,  0.5000,  1.0000])
    """
    return F.hardtanh(x, min_val=-1.0, max_val=1.0)


def hard_shrink(x: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """`x` where `|x| > threshold`, else 0.

    >>> hard_shrink(torch.tensor([-1.0, 0.3, 2.0]))
    tensor([-1.,  0.,  2.])
    """
    return F.hardshrink(x, lambd=threshold)


def soft_shrink(x: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """`x` moved `threshold` towards 0, and 0 where `|x| <= threshold`.

    >>> soft_shrink(torch.tensor([-1.0, 0.3, 2.0]))
    tensor([-0.5000,  0.0000,  1.5000])
    """
    return F.softshrink(x, lambd=threshold)


def tanh_shrink(x: torch.Tensor) -> torch.Tensor:
    """`x - tanh(x)`.

    >>> tanh_shrink(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.2384,  0.0000,  1.0360])
    """
    return F.tanhshrink(x)


def threshold(x: torch.Tensor, threshold: float, default_value: float) -> torch.Tensor:
    """`x` where `x > threshold`, else `default_value`.

    >>> threshold(torch.tensor([-1.0, 0.5, 2.0]), 0.5, -7.0)
    tensor([-7., -7.,  2.])
    """
    return F.threshold(x, threshold, default_value)


def log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`log(sigmoid(x))`, computed stably.

    >>> log_sigmoid(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-1.3133, -0.6931, -0.1269])
    """
    return F.logsigmoid(x)


def sparse_plus(x: torch.Tensor) -> torch.Tensor:
    """0 below -1, `x` above 1, `(x + 1)**2 / 4` between.

    >>> sparse_plus(torch.tensor([-2.0, 0.0, 0.5, 3.0]))
    tensor([0.0000, 0.2500, 0.5625, 3.0000])
    """
    return torch.where(x <= -1, torch.zeros_like(x), torch.where(x < 1, 0.25 * (x + 1) ** 2, x))


def sparse_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """0 below -1, 1 above 1, `(x + 1) / 2` between.

    >>> sparse_sigmoid(torch.tensor([-2.0, 0.0, 0.5, 3.0]))
    tensor([0.0000, 0.5000, 0.7500, 1.0000])
    """
    return torch.where(
        x <= -1, torch.zeros_like(x), torch.where(x >= 1, torch.ones_like(x), 0.5 * (x + 1))
    )


def squareplus(x: torch.Tensor, b: float = 4) -> torch.Tensor:
    """`(x + sqrt(x**2 + b)) / 2`, a smooth ReLU.

    >>> squareplus(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([0.6180, 1.0000, 2.4142])
    """
    return (x + torch.sqrt(x**2 + b)) / 2


def sparsemax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """The Euclidean projection of `x` onto the probability simplex along
    `axis` (Martins et al., 2016): like softmax it sums to 1, but small
    entries become exactly 0.

    Keras 3.15 computes its threshold from the sum of the running sums over
    the support rather than the running sum at its end, so its outputs agree
    with this one only where a single entry is nonzero (and do not sum to 1
    elsewhere); this follows the definition Keras documents.

    >>> sparsemax(torch.tensor([0.0, 1.0, 3.0]))
    tensor([0., 0., 1.])
    >>> sparsemax(torch.tensor([0.5, 1.0, 0.0]))
    tensor([0.2500, 0.7500, 0.0000])
    """
    ordered = torch.sort(x, dim=axis, descending=True).values
    cumulative = torch.cumsum(ordered, dim=axis)
    ranks_shape = [1] * x.ndim
    ranks_shape[axis] = -1
    ranks = torch.arange(1, x.shape[axis] + 1, device=x.device, dtype=x.dtype).view(ranks_shape)
    support = ordered - (cumulative - 1) / ranks > 0  # a prefix of the sorted entries
    size = support.sum(dim=axis, keepdim=True)
    kept_sum = torch.where(support, ordered, torch.zeros_like(ordered)).sum(dim=axis, keepdim=True)
    return torch.clamp(x - (kept_sum - 1) / size, min=0.0)
