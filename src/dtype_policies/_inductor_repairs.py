"""Repairs of Inductor miscompilations met by this library's compiled calls,
active only inside them (`repaired()`; every other compile is untouched).

Inductor's CPU code generator (torch 2.13) fuses the outer loops of
consecutive kernels and keeps a buffer used only inside them in a
"local buffer" sized for one iteration of the fused outer loops
(`OuterLoopFusedSchedulerNode`). When those outer loops are tiled (their
step is more than 1: a transposing 2-D tile, chosen for a tensor laid out
column-first), one local buffer serves the whole tile and every row but the
tile's last reads the last row's values. Met here: a Qwen2 decoder whose
embedding and head are int4, compiled by `compile_for_inference` with frozen
weights, gave logits with a relative error of 1.06 at every position but the
last (an RMSNorm fused with the residual sum before it). The repair refuses
that fusion when an outer loop is tiled; Inductor then generates the kernels
unfused, as it does whenever its own check refuses one.

Before torch 2.9, Inductor also lowered a division by a constant on CPU to a
product with its reciprocal (pytorch#157959): `x / 127` then differs from
eager's by one unit in the last place for some `x`, and llama.cpp's Q8_0
rounding of activations (`kernels.epilogues.round_activation_blocks`) moved
about 4% of its values by a step (torch 2.6, 64 x 576 normal inputs). The
repair divides on CPU, as torch 2.9 and later do themselves.

>>> with repaired():
...     active()
True
>>> active()
False
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "dtype_policies_repairs", default=False
)
_installed = False


def active() -> bool:
    """Whether the repairs apply here."""
    return _ACTIVE.get()


@contextlib.contextmanager
def repaired() -> Iterator[None]:
    """Inside, Inductor compiles with the repairs above."""
    _install()
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _tiled_outer_loops(proxies: list[Any], depth: int) -> bool:
    for proxy in proxies:
        loops = getattr(getattr(proxy, "loop_nest", None), "loops", None) or []
        if any(getattr(level, "steps", 1) != 1 for level in loops[:depth]):
            return True
    return False


def _install() -> None:
    """Installs the repairs once (each a no-op where this torch lacks what it
    wraps)."""
    global _installed
    if _installed:
        return
    _installed = True
    _install_outer_loop_check()
    _install_exact_division()


def _install_exact_division() -> None:
    """Wraps Inductor's lowering of float division so that a constant divisor
    on CPU is divided by, not multiplied by its reciprocal (what torch 2.9 and
    later do; there the wrapper changes nothing)."""
    try:
        from torch._inductor import lowering
        from torch._inductor.virtualized import ops
    except ImportError:  # pragma: no cover - a torch without Inductor
        return
    needed = ("div_prim", "get_constant_value", "is_boolean_type", "is_integer_type")
    if not all(hasattr(lowering, name) for name in (*needed, "make_pointwise")):
        return  # pragma: no cover - another torch's lowering
    original, constant_value, boolean, integer = (getattr(lowering, name) for name in needed)

    def divide(*args: Any) -> Any:
        return ops.truediv(*args)

    def on_cpu(a: Any) -> bool:
        device = getattr(a, "get_device", None)
        return getattr(device() if device is not None else None, "type", None) == "cpu"

    def div_prim(a: Any, b: Any) -> Any:
        if (
            active()
            and not all(boolean(x) or integer(x) for x in (a, b))
            and constant_value(b) is not None
            and on_cpu(a)
        ):
            return lowering.make_pointwise(divide)(a, b)
        return original(a, b)

    lowering.div_prim = div_prim  # the module's `div` lowering looks it up by name


def _install_outer_loop_check() -> None:
    """Wraps the outer-loop fusion's check (a no-op where this torch has no
    such check)."""
    try:
        from torch._inductor.codegen.cpp import OuterLoopFusedSchedulerNode
    except ImportError:  # pragma: no cover - a torch without it
        return
    original = getattr(OuterLoopFusedSchedulerNode, "check_outer_fusion_loop_level_attr", None)
    if original is None:  # pragma: no cover
        return

    def check(self: Any, cpp_kernel_proxy_list: list[Any], outer_loop_fusion_depth: int) -> bool:
        if active() and _tiled_outer_loops(cpp_kernel_proxy_list, outer_loop_fusion_depth):
            return False
        return original(self, cpp_kernel_proxy_list, outer_loop_fusion_depth)

    setattr(OuterLoopFusedSchedulerNode, "check_outer_fusion_loop_level_attr", check)  # noqa: B010
