"""Keras's deterministic initializers that fill a weight with a fixed
matrix: `Identity` and `STFT` (the kernels of a short-time Fourier transform)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtype_policies._initializer_base import Initializer, Shape


class Identity(Initializer):
    """`gain` times the identity matrix (rank 2 only; a non-square shape gets
    ones on its main diagonal), in any dtype.

    >>> Identity(gain=2.0)((2, 3))
    tensor([[2., 0., 0.],
            [0., 2., 0.]])
    """

    def __init__(self, gain: float = 1.0) -> None:
        self.gain = gain

    def __call__(self, shape: Shape, dtype: torch.dtype = torch.float32, device: Any = None):
        shape = tuple(shape)
        if len(shape) != 2:
            raise ValueError(
                "Identity matrix initializer can only be used for 2D matrices. "
                f"Received: shape={shape} of rank {len(shape)}."
            )
        return (self.gain * torch.eye(*shape, device=device)).to(dtype)

    def get_config(self) -> dict[str, Any]:
        return {"gain": self.gain}


def _symmetric_or_periodic(
    make: Callable[..., torch.Tensor],
) -> Callable[[int, bool], torch.Tensor]:
    return lambda length, periodic: make(length, sym=not periodic, dtype=torch.float64)


# The windows of `scipy.signal.get_window` that need no parameter and that
# torch computes (Keras reads any scipy window by name; this library has no scipy).
_WINDOWS: dict[str, Callable[[int, bool], torch.Tensor]] = {
    "hann": _symmetric_or_periodic(torch.signal.windows.hann),
    "hamming": _symmetric_or_periodic(torch.signal.windows.hamming),
    "blackman": _symmetric_or_periodic(torch.signal.windows.blackman),
    "bartlett": _symmetric_or_periodic(torch.signal.windows.bartlett),
    "cosine": _symmetric_or_periodic(torch.signal.windows.cosine),
    "nuttall": _symmetric_or_periodic(torch.signal.windows.nuttall),
    "boxcar": lambda length, periodic: torch.ones(length, dtype=torch.float64),
}


class STFT(Initializer):
    """The real (`side="real"`) or imaginary (`"imag"`) part of the short-time
    Fourier transform's kernels, for a weight of shape
    `(frame_length, 1, fft_length // 2 + 1)` (Keras's `STFTSpectrogram`),
    multiplied by `window` (a name: hann, hamming, blackman, bartlett,
    cosine, nuttall or boxcar, symmetric unless `periodic`; the values
    themselves; or `None`) and divided by its L2 (`scaling="density"`) or L1
    (`"spectrum"`) norm.

    >>> STFT(window=None)((4, 1, 3))[:, 0, :]
    tensor([[ 1.0000e+00,  1.0000e+00,  1.0000e+00],
            [ 1.0000e+00, -4.3711e-08, -1.0000e+00],
            [ 1.0000e+00, -1.0000e+00,  1.0000e+00],
            [ 1.0000e+00,  1.1925e-08, -1.0000e+00]])
    """

    def __init__(
        self,
        side: str = "real",
        window: str | Sequence[float] | None = "hann",
        scaling: str | None = "density",
        periodic: bool = False,
    ) -> None:
        if side not in ("real", "imag"):
            raise ValueError(f"side should be 'real' or 'imag', not {side}")
        if isinstance(window, str) and window not in _WINDOWS:
            raise ValueError(
                f"Unknown window {window!r}: expected one of {sorted(_WINDOWS)}, the "
                "window's values, or None."
            )
        if scaling is not None and scaling not in ("density", "spectrum"):
            raise ValueError(
                "Scaling is invalid, it must be `None`, 'density' or 'spectrum'. "
                f"Received scaling={scaling}"
            )
        self.side, self.window, self.scaling, self.periodic = side, window, scaling, periodic

    def __call__(self, shape: Shape, dtype: torch.dtype = torch.float32, device: Any = None):
        frame_length, _, fft_length = tuple(shape)
        time = torch.arange(frame_length, dtype=dtype, device=device).reshape(-1, 1, 1)
        freq = torch.arange(fft_length, dtype=dtype, device=device).reshape(1, 1, -1)
        freq = freq / ((fft_length - 1) * 2)
        args = -2 * time * freq * torch.arccos(torch.tensor(-1.0, dtype=dtype, device=device))
        kernel = torch.cos(args) if self.side == "real" else torch.sin(args)
        if self.window is None:
            return kernel
        window = self._window(frame_length).to(dtype=dtype, device=device)
        if self.scaling == "density":
            kernel = kernel * window / window.square().sum().sqrt()
        elif self.scaling == "spectrum":
            kernel = kernel * window / window.abs().sum()
        else:
            kernel = kernel * window
        return kernel

    def _window(self, frame_length: int) -> torch.Tensor:
        if isinstance(self.window, str):
            window = _WINDOWS[self.window](frame_length, self.periodic)
        else:
            window = torch.as_tensor(self.window, dtype=torch.float64)
        if window.ndim != 1 or window.shape[-1] != frame_length:
            raise ValueError(
                "The shape of `window` must be equal to [frame_length]."
                f"Received: window shape={tuple(window.shape)}"
            )
        return window.reshape(frame_length, 1, 1)

    def get_config(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "window": self.window,
            "periodic": self.periodic,
            "scaling": self.scaling,
        }


__all__ = ["STFT", "Identity"]
