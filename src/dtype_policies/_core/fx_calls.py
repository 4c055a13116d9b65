"""Policied modules under `torch.fx.symbolic_trace`: each one is a leaf of
the graph (a `call_module` node), so that the traced program runs the module
itself, by its policy, where a symbolic trace could not record its casts,
its autocast scope or its quantized products on `fx.Proxy` values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from dtype_policies._core.module_state import STATE_KEY


def fx_proxy(args: tuple, kwargs: dict[str, Any]) -> torch.fx.Proxy | None:
    """The first `torch.fx.Proxy` among a call's arguments (not nested), or `None`."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.fx.Proxy):
            return value
    return None


def record_module_call(
    proxy: torch.fx.Proxy, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
) -> torch.fx.Proxy:
    """The `call_module` node of the policied module whose bound `__call__`
    is `call`. Raises `TypeError` when the traced root is policied itself:
    `symbolic_trace` runs the root's `forward` directly, so its policy (casts
    of its inputs, the compute dtype of its own ops) would be left out."""
    tracer = cast(torch.fx.Tracer, proxy.tracer)  # a symbolic_trace tracer
    root = getattr(tracer, "root", None)
    root_state = None if root is None else root.__dict__.get(STATE_KEY)
    if root_state is not None and root_state.call is not None:
        raise TypeError(
            f"torch.fx.symbolic_trace cannot record the dtype policy of the traced root "
            f"module ({type(root).__name__}, policy '{root_state.call.policy.name}'): it runs "
            "the root's forward without its call. Trace the program with "
            "torch.export.export(model, args) (plain ATen ops with the eager values), or "
            "trace a module that holds the policied model (its policied modules become "
            "call_module nodes)."
        )
    module = call.__self__  # type: ignore[attr-defined]
    return tracer.create_proxy("call_module", tracer.path_of_module(module), args, kwargs)
