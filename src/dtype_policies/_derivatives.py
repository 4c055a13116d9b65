"""Whether anything may ask for a derivative of what a call computes: the one
rule that decides whether an operator without derivatives may compute it.

This library's native kernels (the AVX2 bfloat16 product, the int8 and int4
products, bfloat16 attention), oneDNN's prepacked products and torch's
quantized products have no derivative formula, no forward-mode formula and
no batching rule. They run only where `derivative_free` holds; elsewhere a
call takes plain ops (or a straight-through autograd function) with the same
values. Three things can ask for derivatives, and each is seen here:

* reverse mode: gradients enabled and a tensor that requires them;
* forward mode (`torch.autograd.forward_ad`): a dual level entered, whether
  gradients are enabled or not (`no_grad` does not stop tangents);
* a `torch.func` transform (`grad`, `vjp`, `jvp`, `jacfwd`, `hessian`,
  `vmap`): its wrapped tensors set no `requires_grad`, and its forward mode
  and batching see only what the ops they run define.

>>> import torch
>>> derivative_free(torch.ones(2))
True
>>> derivative_free(torch.ones(2, requires_grad=True))
False
>>> torch.func.vmap(lambda x: torch.tensor(derivative_free(x)))(torch.ones(3)).tolist()
[False, False, False]
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad

# asked before the stack probe, which Dynamo on older torch (2.6) cannot
# trace; this thread's (another thread compiling hides none of its transforms)
from dtype_policies._compat import compiling as _is_compiling

try:
    from torch._C._functorch import peek_interpreter_stack as _functorch_interpreter
except ImportError:  # pragma: no cover - older torch

    def _functorch_interpreter() -> object | None:  # type: ignore[misc]
        return None


_grad_enabled = torch.is_grad_enabled


def functorch_active() -> bool:
    """Whether a `torch.func` transform runs (its interpreter stack is not
    empty). Under `torch.compile`, never: Dynamo handles the transforms it
    traces itself and sees no interpreter here."""
    return not _is_compiling() and _functorch_interpreter() is not None


def backward_running() -> bool:
    """Whether autograd's engine runs a backward pass in this thread: a
    module called now is activation checkpointing's replay of a forward (or
    a hook's call). Under `torch.compile`, never."""
    return not _is_compiling() and torch._C._current_graph_task_id() != -1


def transform_active() -> bool:
    """Whether forward mode or a `torch.func` transform may ask for
    derivatives (or batch) whatever this call computes."""
    # read on every product: written out rather than calling the two above
    if _forward_ad._current_level >= 0:
        return True
    return not _is_compiling() and _functorch_interpreter() is not None


def derivative_free(*tensors: torch.Tensor | None) -> bool:
    """Whether nothing can ask for a derivative of a computation on `tensors`
    (`None`s skipped): no reverse-mode graph is recorded for any of them and
    no forward mode or `torch.func` transform is active. Only then may an
    operator without derivatives compute it."""
    if _grad_enabled():
        for tensor in tensors:
            if tensor is not None and tensor.requires_grad:
                return False
    if _forward_ad._current_level >= 0:
        return False
    return _is_compiling() or _functorch_interpreter() is None
