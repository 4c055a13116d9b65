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
    """Wraps the outer-loop fusion's check once (a no-op where this torch has
    no such check)."""
    global _installed
    if _installed:
        return
    _installed = True
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
