"""Quantized matrix products: the fastest correct path for each shape and device."""

from __future__ import annotations

import sys

import torch

from dtype_policies._core.casting import exporting
from dtype_policies._core.tensor_identity import tensor_key as tensor_key


def prepare() -> None:
    """Builds and loads, now, this library's native kernels that the
    processor supports (`native.KERNELS`; cached after the first build), so
    that no product builds or loads one on its first call: a compiler tracing
    that call (`torch.compile`) cannot read files or load libraries. Called
    when a weight is planned for quantization and before a frozen compiled
    call; a kernel that cannot be built is warned about once and left out.
    Torch's int4 packing is probed now too (`int4_native.torch_packing_block`:
    a traced probe, with its random generator, broke the graph of a compiled
    int4 model into 35 frames)."""
    from dtype_policies import _native as native
    from dtype_policies._cpu import processor
    from dtype_policies.quantization.kernels import int4, int4_native

    cpu = processor()
    for name in native.KERNELS:
        native.available(name, cpu)
    int4.find_inductor_prims()
    int4_native.torch_packing_block()


def freezing_weights() -> bool:
    """Whether the graph being traced has its weights frozen (Inductor's
    `freezing`, as `compile_for_generation` sets it): what depends on weights
    alone is then computed once, at compile time, and the traced products may
    call the eager kernels on layouts computed in the graph."""
    if torch.compiler.is_compiling():
        # Dynamo imported it. Not looked up in `sys.modules` here: Dynamo
        # traces that lookup by walking the whole dictionary, which another
        # thread's import changes under it ("dictionary changed size")
        from torch._inductor import config as inductor_config

        return bool(inductor_config.freezing) and not exporting()
    config = sys.modules.get("torch._inductor.config")  # not imported: not frozen
    return bool(config is not None and config.freezing) and not exporting()
