"""Differences between the supported torch versions (2.6 to current), in one place."""

from __future__ import annotations

import torch

_MAJOR, _MINOR = (int(p) for p in torch.__version__.split(".")[:2])
TORCH_VERSION: tuple[int, int] = (_MAJOR, _MINOR)

# Strict `torch.export` before torch 2.13 (the oldest version measured
# without it) also runs module calls as plain Python on fake tensors, with
# `torch.compiler.is_compiling()` false (measured on 2.6).
STRICT_EXPORT_RUNS_EAGER_ON_FAKE_TENSORS = TORCH_VERSION < (2, 13)
