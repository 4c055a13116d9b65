"""Weight initializers by their Keras names, with Keras's fan conventions.

A kernel of shape `(in, out)` has `fan_in = in`, `fan_out = out`; higher-rank
kernels multiply both by the product of the leading (receptive-field) axes.

>>> import torch
>>> from dtype_policies import initializers
>>> initializers.get("ones")((2, 3), torch.bfloat16)
tensor([[1., 1., 1.],
        [1., 1., 1.]], dtype=torch.bfloat16)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dtype_policies import _registry
from dtype_policies._fixed_initializers import STFT, Identity
from dtype_policies._initializer_base import Initializer, Shape


def compute_fans(shape: Shape) -> tuple[int, int]:
    """`(fan_in, fan_out)` of a weight shape, as Keras computes them.

    >>> compute_fans((3, 3, 16, 32))  # a 3x3 convolution kernel
    (144, 288)
    """
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive_field = math.prod(shape[:-2])
    return shape[-2] * receptive_field, shape[-1] * receptive_field


class Constant(Initializer):
    """Every entry `value`.

    >>> Constant(0.5)((3,))
    tensor([0.5000, 0.5000, 0.5000])
    """

    def __init__(self, value: float = 0.0) -> None:
        self.value = value

    def __call__(self, shape: Shape, dtype: torch.dtype = torch.float32, device: Any = None):
        return torch.full(tuple(shape), self.value, dtype=dtype, device=device)

    def get_config(self) -> dict[str, Any]:
        return {"value": self.value}


class Zeros(Constant):
    """Every entry 0, in any dtype (integer ones too).

    >>> Zeros()((2,), torch.int64)
    tensor([0, 0])
    """

    def __init__(self) -> None:
        super().__init__(0)

    def get_config(self) -> dict[str, Any]:
        return {}


class Ones(Constant):
    """Every entry 1, in any dtype (integer ones too).

    >>> Ones()((2,), torch.int64)
    tensor([1, 1])
    """

    def __init__(self) -> None:
        super().__init__(1)

    def get_config(self) -> dict[str, Any]:
        return {}


class RandomInitializer(Initializer):
    """An initializer that draws random values: with an integer `seed`, every
    call draws the same values (Keras's seeded initializers; torch's generator,
    so not Keras's numbers), else torch's global generator.

    >>> draw = RandomNormal(seed=7)
    >>> torch.equal(draw((4, 4)), draw((4, 4)))
    True
    """

    def __init__(self, seed: int | None = None) -> None:
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(
                f"{type(self).__name__}: `seed` must be an integer or None. Received: seed={seed!r}"
            )
        self.seed = seed

    def generator(self, out: torch.Tensor) -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator(device=out.device).manual_seed(self.seed)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


class RandomNormal(RandomInitializer):
    """Normal values of `mean` and `stddev`.

    >>> values = RandomNormal(mean=1.0, stddev=0.05, seed=0)((100, 100))
    >>> round(values.mean().item(), 2), round(values.std().item(), 2)
    (1.0, 0.05)
    """

    def __init__(self, mean: float = 0.0, stddev: float = 0.05, seed: int | None = None) -> None:
        super().__init__(seed)
        self.mean, self.stddev = mean, stddev

    def sample(self, shape, out):
        return out.normal_(self.mean, self.stddev, generator=self.generator(out))

    def get_config(self):
        return {**super().get_config(), "mean": self.mean, "stddev": self.stddev}


class RandomUniform(RandomInitializer):
    """Uniform values in `[minval, maxval)`.

    >>> values = RandomUniform(minval=2.0, maxval=3.0, seed=0)((1000,))
    >>> bool(values.min() >= 2.0 and values.max() < 3.0)
    True
    """

    def __init__(
        self, minval: float = -0.05, maxval: float = 0.05, seed: int | None = None
    ) -> None:
        super().__init__(seed)
        self.minval, self.maxval = minval, maxval

    def sample(self, shape, out):
        return out.uniform_(self.minval, self.maxval, generator=self.generator(out))

    def get_config(self):
        return {**super().get_config(), "minval": self.minval, "maxval": self.maxval}


class TruncatedNormal(RandomInitializer):
    """Normal values re-drawn beyond two standard deviations.

    >>> values = TruncatedNormal(stddev=1.0, seed=0)((10000,))
    >>> bool(values.abs().max() <= 2.0)
    True
    """

    def __init__(self, mean: float = 0.0, stddev: float = 0.05, seed: int | None = None) -> None:
        super().__init__(seed)
        self.mean, self.stddev = mean, stddev

    def sample(self, shape, out):
        low, high = self.mean - 2 * self.stddev, self.mean + 2 * self.stddev
        return torch.nn.init.trunc_normal_(
            out, self.mean, self.stddev, low, high, generator=self.generator(out)
        )

    def get_config(self):
        return {**super().get_config(), "mean": self.mean, "stddev": self.stddev}


class VarianceScaling(RandomInitializer):
    """Values with variance `scale / n`, `n` the fan given by `mode`; the fans
    are the products of `input_axes` and `output_axes` of the shape when both
    are given (Keras 3.15's option for einsum kernels), else `compute_fans`.

    >>> uniform = VarianceScaling(scale=3.0, mode="fan_in", distribution="uniform", seed=0)
    >>> bool(uniform((100, 10)).abs().max() <= (3 * 3.0 / 100) ** 0.5)
    True
    """

    # Standard deviation of a unit normal truncated to [-2, 2].
    _TRUNCATION_STDDEV = 0.87962566103423978

    def __init__(
        self,
        scale: float = 1.0,
        mode: str = "fan_in",
        distribution: str = "truncated_normal",
        seed: int | None = None,
        input_axes: list[int] | None = None,
        output_axes: list[int] | None = None,
    ) -> None:
        super().__init__(seed)
        if mode not in ("fan_in", "fan_out", "fan_avg"):
            raise ValueError(f"Invalid `mode` {mode!r}: expected fan_in, fan_out or fan_avg.")
        if distribution not in ("truncated_normal", "untruncated_normal", "uniform"):
            raise ValueError(
                f"Invalid `distribution` {distribution!r}: expected truncated_normal, "
                "untruncated_normal or uniform."
            )
        if scale <= 0:
            raise ValueError(f"`scale` must be positive. Received: scale={scale}")
        self.scale, self.mode, self.distribution = scale, mode, distribution
        self.input_axes = None if input_axes is None else list(input_axes)
        self.output_axes = None if output_axes is None else list(output_axes)

    def fans(self, shape: Shape) -> tuple[int, int]:
        if self.input_axes is None or self.output_axes is None:
            return compute_fans(shape)
        try:
            return (
                math.prod(shape[axis] for axis in self.input_axes),
                math.prod(shape[axis] for axis in self.output_axes),
            )
        except IndexError:
            raise ValueError(
                f"{type(self).__name__}: input_axes={self.input_axes} and "
                f"output_axes={self.output_axes} do not fit a weight of shape {shape}."
            ) from None

    def sample(self, shape, out):
        fan_in, fan_out = self.fans(shape)
        n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[self.mode]
        variance = self.scale / max(1.0, n)
        generator = self.generator(out)
        if self.distribution == "uniform":
            limit = math.sqrt(3.0 * variance)
            return out.uniform_(-limit, limit, generator=generator)
        if self.distribution == "untruncated_normal":
            return out.normal_(0.0, math.sqrt(variance), generator=generator)
        stddev = math.sqrt(variance) / self._TRUNCATION_STDDEV
        return torch.nn.init.trunc_normal_(
            out, 0.0, stddev, -2 * stddev, 2 * stddev, generator=generator
        )

    def axes_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "input_axes": self.input_axes,
            "output_axes": self.output_axes,
        }

    def get_config(self):
        return {
            **self.axes_config(),
            "scale": self.scale,
            "mode": self.mode,
            "distribution": self.distribution,
        }


class _NamedVarianceScaling(VarianceScaling):
    """A variance scaling with fixed `scale`, `mode` and `distribution`."""

    fixed: tuple[float, str, str]

    def __init__(
        self,
        seed: int | None = None,
        input_axes: list[int] | None = None,
        output_axes: list[int] | None = None,
    ) -> None:
        super().__init__(*self.fixed, seed, input_axes, output_axes)

    def get_config(self):
        return self.axes_config()


class GlorotUniform(_NamedVarianceScaling):
    """Uniform in `±sqrt(6 / (fan_in + fan_out))` (Keras's default kernel initializer).

    >>> bool(GlorotUniform(seed=0)((64, 32)).abs().max() <= (6 / 96) ** 0.5)
    True
    """

    fixed = (1.0, "fan_avg", "uniform")


class GlorotNormal(_NamedVarianceScaling):
    """Truncated normal of variance `2 / (fan_in + fan_out)`.

    >>> round(GlorotNormal(seed=0)((500, 500)).var().item(), 3)
    0.002
    """

    fixed = (1.0, "fan_avg", "truncated_normal")


class HeNormal(_NamedVarianceScaling):
    """Truncated normal of variance `2 / fan_in`.

    >>> round(HeNormal(seed=0)((200, 500)).var().item(), 3)
    0.01
    """

    fixed = (2.0, "fan_in", "truncated_normal")


class HeUniform(_NamedVarianceScaling):
    """Uniform in `±sqrt(6 / fan_in)`.

    >>> bool(HeUniform(seed=0)((24, 8)).abs().max() <= 0.5)
    True
    """

    fixed = (2.0, "fan_in", "uniform")


class LecunNormal(_NamedVarianceScaling):
    """Truncated normal of variance `1 / fan_in`.

    >>> round(LecunNormal(seed=0)((100, 1000)).var().item(), 3)
    0.01
    """

    fixed = (1.0, "fan_in", "truncated_normal")


class LecunUniform(_NamedVarianceScaling):
    """Uniform in `±sqrt(3 / fan_in)`.

    >>> bool(LecunUniform(seed=0)((12, 8)).abs().max() <= 0.5)
    True
    """

    fixed = (1.0, "fan_in", "uniform")


class Orthogonal(RandomInitializer):
    """A random orthogonal matrix times `gain` (higher ranks: flattened to
    `(-1, last axis)`).

    >>> q = Orthogonal(seed=0)((4, 4))
    >>> torch.allclose(q @ q.T, torch.eye(4), atol=1e-5)
    True
    """

    def __init__(self, gain: float = 1.0, seed: int | None = None) -> None:
        super().__init__(seed)
        self.gain = gain

    def sample(self, shape, out):
        if len(shape) < 2:
            raise ValueError(f"Orthogonal needs a weight of rank >= 2. Received shape {shape}")
        flat = out.reshape(-1, shape[-1])
        torch.nn.init.orthogonal_(flat, self.gain, generator=self.generator(out))
        return flat.reshape(shape)

    def get_config(self):
        return {**super().get_config(), "gain": self.gain}


# Keras's lowercase spellings and compatibility names of the classes
# (`keras.initializers.glorot_uniform` is `GlorotUniform`).
constant, zeros, ones, identity, stft = Constant, Zeros, Ones, Identity, STFT
random_normal, random_uniform, truncated_normal = RandomNormal, RandomUniform, TruncatedNormal
variance_scaling, orthogonal = VarianceScaling, Orthogonal
glorot_uniform, glorot_normal, he_normal, he_uniform = (
    GlorotUniform,
    GlorotNormal,
    HeNormal,
    HeUniform,
)
lecun_normal, lecun_uniform = LecunNormal, LecunUniform
IdentityInitializer, OrthogonalInitializer, STFTInitializer = Identity, Orthogonal, STFT

INITIALIZERS: dict[str, type[Initializer]] = {
    "zeros": Zeros,
    "zero": Zeros,
    "ones": Ones,
    "one": Ones,
    "constant": Constant,
    "identity": Identity,
    "stft": STFT,
    "random_normal": RandomNormal,
    "normal": RandomNormal,
    "random_uniform": RandomUniform,
    "uniform": RandomUniform,
    "truncated_normal": TruncatedNormal,
    "variance_scaling": VarianceScaling,
    "glorot_uniform": GlorotUniform,
    "glorot_normal": GlorotNormal,
    "he_normal": HeNormal,
    "he_uniform": HeUniform,
    "lecun_normal": LecunNormal,
    "lecun_uniform": LecunUniform,
    "orthogonal": Orthogonal,
    "IdentityInitializer": Identity,
    "OrthogonalInitializer": Orthogonal,
    "STFTInitializer": STFT,
}


def get(identifier: Any) -> Any:
    """An initializer from a name, a config dict, a class, a callable or a
    number (a constant); `None` stays `None`.

    >>> type(get("he_normal")).__name__
    'HeNormal'
    >>> get({"class_name": "RandomNormal", "config": {"stddev": 1.0}}).stddev
    1.0
    """
    if isinstance(identifier, (int, float)) and not isinstance(identifier, bool):
        return Constant(identifier)
    return _registry.resolve(identifier, INITIALIZERS, "initializer")


def serialize(initializer: Any) -> Any:
    """The Keras dict of an initializer, as `keras.initializers.serialize`
    writes it (`get` and `deserialize` read it back).

    >>> serialize(Constant(2.0))
    {'module': 'keras.initializers', 'class_name': 'Constant', 'config': {'value': 2.0}, \
'registered_name': None}
    """
    return _registry.serialize(initializer, INITIALIZERS, "keras.initializers")


def deserialize(config: Any, custom_objects: dict[str, Any] | None = None) -> Any:
    """The initializer a name or a Keras serialized dict describes (Keras's
    `keras.initializers.deserialize`), looked up in `custom_objects` first.

    >>> deserialize({"module": "keras.initializers", "class_name": "Identity",
    ...              "config": {"gain": 3.0}, "registered_name": None})((2, 2))
    tensor([[3., 0.],
            [0., 3.]])
    """
    return _registry.resolve(config, INITIALIZERS, "initializer", custom_objects=custom_objects)


__all__ = [
    "STFT",
    "Constant",
    "GlorotNormal",
    "GlorotUniform",
    "HeNormal",
    "HeUniform",
    "Identity",
    "IdentityInitializer",
    "Initializer",
    "LecunNormal",
    "LecunUniform",
    "Ones",
    "Orthogonal",
    "OrthogonalInitializer",
    "RandomInitializer",
    "RandomNormal",
    "RandomUniform",
    "STFTInitializer",
    "TruncatedNormal",
    "VarianceScaling",
    "Zeros",
    "compute_fans",
    "constant",
    "deserialize",
    "get",
    "glorot_normal",
    "glorot_uniform",
    "he_normal",
    "he_uniform",
    "identity",
    "lecun_normal",
    "lecun_uniform",
    "ones",
    "orthogonal",
    "random_normal",
    "random_uniform",
    "serialize",
    "stft",
    "truncated_normal",
    "variance_scaling",
    "zeros",
]
