"""Calls compiled by Inductor with frozen weights, guarded by a watch of the
model instead of Dynamo's guards on its modules (`compile_for_generation`,
`compile_for_inference`).

With weight freezing, what depends on weights alone (the policies' casts,
oneDNN's prepacked layouts, the int4 kernel's packing) is computed once, at
compile time, into constants of the graph; Dynamo's guards never look at the
values of those weights. `ModelWatch` records, per call, what such a graph
depends on besides its inputs, cheaply enough to read on every call; when it
changed, the call runs eagerly (with a warning) until compiled again.
"""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from dtype_policies._core.module_state import state_of


def _step(call: Any, *args: Any, **kwargs: Any) -> Any:
    return call(*args, **kwargs)


class ModelWatch:
    """What a graph compiled with frozen weights depends on besides its
    inputs, read back cheaply on every call: each parameter and buffer slot
    (the tensor in it, its address and version), each child slot, and each
    module's training flag and this library's call state and quantization
    (replaced whenever a policy or a quantization changes)."""

    __slots__ = ("modules", "tensors")

    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors: list[tuple[dict, str, torch.Tensor, int, int]] = []
        self.modules: list[tuple[torch.nn.Module, bool, Any, Any, tuple]] = []
        for module in model.modules():
            for slots in (module._parameters, module._buffers):
                for name, tensor in slots.items():
                    if tensor is not None:
                        self.tensors.append(
                            (slots, name, tensor, tensor.data_ptr(), _version(tensor))
                        )
            state = state_of(module)
            call, quantization = (None, None) if state is None else (state.call, state.quantization)
            children = tuple(module._modules.values())
            self.modules.append((module, module.training, call, quantization, children))

    def unchanged(self) -> bool:
        for slots, name, tensor, address, version in self.tensors:
            if (
                slots.get(name) is not tensor
                or tensor.data_ptr() != address
                or _version(tensor) != version
            ):
                return False
        for module, training, call, quantization, children in self.modules:
            state = state_of(module)
            if (
                module.training != training
                or (None if state is None else state.call) is not call
                or (None if state is None else state.quantization) is not quantization
                or tuple(module._modules.values()) != children
            ):
                return False
        return True


def _version(tensor: torch.Tensor) -> int:
    return -1 if tensor.is_inference() else tensor._version


AUTOTUNE_OPTIONS: dict[str, Any] = {
    "max_autotune": True,
    "max_autotune_gemm_backends": "ATEN,CPP,TRITON",
}
"""Inductor's settings for `autotune=True`. On CPU its C++ templates (weight
prepacked at freezing, micro-kernels per shape, int4 and weight-only int8
included) beat ATen's kernels at a few rows: SmolLM2-135M decodes 1.12x
(int4/32) to 1.63x (mixed_bfloat16) faster, int4's output kept in float32
rather than rounded to bfloat16; its first compilation takes up to 1.5x
longer (docs/speed.md).
ATen's kernel is always among the choices, so a shape never gets slower than
ATen's by more than the timing's noise."""


# Dynamo's guards on the model's modules cost milliseconds per call
# (SmolLM2-135M: 8.5 ms of 57 at 1 thread, measured): with frozen weights,
# `ModelWatch` stands in for them (torch >= 2.8 lets them be dropped).
_SKIP_MODULE_GUARDS = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)


class FrozenCompiledCall:
    """`model`'s call, compiled (Inductor, with weight freezing on: Dynamo
    reads the setting while tracing, so it must hold during the call, not
    only in the backend).

    Frozen weights are constants of the graph, and Dynamo's guards do not see
    their values: each instance compiles its own copy of the call's code (so
    its graphs are its own, never an earlier compilation's), and a call after
    any parameter, buffer, policy, quantization or training mode changed runs
    eagerly, with a warning naming `name`, until it is compiled again
    (`ModelWatch`, read on every call in place of Dynamo's guards on the
    model's modules). Calls with gradients enabled run eagerly: a frozen graph
    has no backward (compiled: under `torch.no_grad()`, `torch.inference_mode()`).
    `before_call(kwargs)` runs before each compiled call. With `autotune`,
    Inductor times its own C++ GEMM templates against ATen's kernels for each
    product shape and keeps the faster (`AUTOTUNE_OPTIONS`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        freeze_weights: bool = True,
        *,
        name: str = "compile_for_generation",
        dynamic: bool | None = False,
        fullgraph: bool = True,
        before_call: Callable[[dict], None] | None = None,
        autotune: bool = True,
    ) -> None:
        fresh = types.FunctionType(_step.__code__.replace(), _step.__globals__, "_step")
        options: Any = {}
        if freeze_weights and _SKIP_MODULE_GUARDS is not None:
            options["guard_filter_fn"] = _SKIP_MODULE_GUARDS
        self.compiled = torch.compile(
            functools.partial(fresh, model.__call__),
            fullgraph=fullgraph,
            dynamic=dynamic,
            options=options or None,
        )
        self.eager = model.__call__
        self.model_ref = weakref.ref(model)
        self.freeze_weights = freeze_weights
        self.name = name
        self.before_call = before_call
        self.inductor_options: dict[str, Any] = {"freezing": freeze_weights}
        if autotune:
            self.inductor_options.update(AUTOTUNE_OPTIONS)
        self.watch: ModelWatch | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._inductor import config

        model = self.model_ref()
        if self.freeze_weights and model is not None:
            if torch.is_grad_enabled():  # a frozen graph has no backward
                return self.eager(*args, **kwargs)
            if self.watch is None:
                self.watch = ModelWatch(model)
            elif not self.watch.unchanged():
                warnings.warn(
                    f"{self.name}: the model's weights, policies or mode changed after it "
                    "was compiled with frozen weights; running eagerly. Call "
                    f"{self.name}(model) again to compile the new model.",
                    stacklevel=2,
                )
                return self.eager(*args, **kwargs)
        if self.before_call is not None:
            self.before_call(kwargs)
        with config.patch(self.inductor_options):
            return self.compiled(*args, **kwargs)
