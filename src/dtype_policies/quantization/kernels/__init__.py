"""Quantized matrix products: the fastest correct path for each shape and device."""

from __future__ import annotations

import sys

from dtype_policies._compat import compiling
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
    if compiling():
        return _inductor_freezing() and not exporting()
    config = sys.modules.get("torch._inductor.config")  # not imported: not frozen
    return bool(config is not None and config.freezing) and not exporting()


def _inductor_freezing() -> bool:
    """Inductor's `freezing` in this thread, while a compiler traces. Dynamo
    calls this function and takes its result as a constant of the graph
    (marked below, as `torch.compiler.assume_constant_result` marks one), as
    Inductor itself reads the setting once, when it compiles a graph: read
    in the traced code, it was a guard that ran Python (the config's
    `__getattr__`, a per-thread value since torch 2.13) in every call's
    cache lookup."""
    # Dynamo imported it. Not looked up in `sys.modules`: traced, that lookup
    # walks the whole dictionary, which another thread's import changes
    from torch._inductor import config as inductor_config

    return bool(inductor_config.freezing)


# marked without importing Dynamo (importing this package does not load it)
_inductor_freezing._dynamo_marked_constant = True  # type: ignore[attr-defined]
