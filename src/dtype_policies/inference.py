"""A fast path for small batches of any policied or quantized model's
inference: `torch.compile` (Inductor, with frozen weights).

A forward over a few rows spends most of its time outside the matrix
products (Python, module calls, the policies' per-call bookkeeping);
compiled, it is one graph. `compile_for_inference(model)` returns a callable
that runs `model` that way under `torch.no_grad()` or
`torch.inference_mode()`:

* Inductor with weight freezing: the policies' casts of float weights, the
  float32 copies of rounded weights (CPUs without native half-precision
  products), oneDNN's prepacked layouts and the int4 kernel's packing are
  folded once into constants; the quantized products call the eager kernels
  (int4, weight-only int8) or their traced forms, or, with `autotune` (the
  default), Inductor's C++ GEMM template for the product where its timing at
  compile time beat the kernel's; this library's packed int8 and int4
  products of one input by several weights (an attention's query, key and
  value) run as one call on the concatenated weights
  (`quantization.kernels.siblings`, the same values);
* a transformers model's bfloat16 attention runs on this library's kernel
  on CPUs with AVX-512 bfloat16 (`quantization.kernels.attention`: torch's
  CPU flash kernel multiplies bfloat16 at float32 speed there), swapped in
  for `"sdpa"` during each compiled call only;
* the products follow the eager rules for this processor
  (`dtype_policies._cpu`): on a CPU without native bfloat16 a bfloat16 policy
  multiplies in float32 beyond one row, as eagerly;
* shapes: a new input shape compiles again, then Dynamo makes the changing
  sizes dynamic (one graph for every sequence length);
* staleness: the weights are read once. After changing weights, policies,
  quantization or the training mode, calls run eagerly (with a warning) until
  `compile_for_inference` is called again; calls with gradients enabled
  always run eagerly (a frozen graph has no backward);
* many models: each returned callable has Dynamo frames and compiled entries
  of its own, so any number of models (or the same one compiled again) in
  one process each count against Dynamo's `recompile_limit` alone; where
  Dynamo gives up on part of a call (that limit reached by one model's
  variants, a graph break it cannot resume from), that part runs eagerly
  with a warning naming the model and Dynamo's reason.

The model itself is unchanged; the returned callable holds it. Graphs
compiled with frozen weights keep those weights as constants in torch's
compiled code, which torch does not free within the process even after the
model and the callable are deleted (as plain `torch.compile` with freezing):
a service that compiles again after each reload grows by about the weights'
size each time.

Cost: the first call of each shape compiles (tens of seconds for a 6-layer
encoder on 2 cores), the graph's calls made from generated C++ from torch
2.13 (Inductor's C++ wrapper; `cpp_wrapper=False` for the Python one);
Inductor keeps compiled kernels in its cache
(`TORCHINDUCTOR_CACHE_DIR`) for the next process, keyed here on the CPU's
vector instructions (`_frozen.cpu_cache_tag`: torch's own key is not, and a
cache moved to another CPU gave wrong values). Measured gains and limits:
docs/speed.md.

>>> import torch
>>> from dtype_policies import apply_policy, compile_for_inference
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
>>> _ = apply_policy(model, "mixed_bfloat16")
>>> fast = compile_for_inference(model)  # nothing compiles before the first call
>>> fast.module is model
True
>>> out = fast(torch.randn(2, 8))  # gradients enabled: eager, the same values
>>> out.dtype, out.requires_grad
(torch.bfloat16, True)

Under `torch.inference_mode()`, `fast(x)` compiles at its first call (tests:
`tests/test_compile_for_inference.py`, slow).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from dtype_policies._frozen import FrozenCompiledCall, check_flags, resolved_cpp_wrapper
from dtype_policies.layers._unbuilt import refuse_unbuilt
from dtype_policies.quantization.kernels import attention


class CompiledInference:
    """`model`'s inference, compiled with frozen weights (see the module
    docstring). Call it as the model; `module` is the model. Calls with
    gradients enabled run the model eagerly, without compiling. A copy
    (pickle, `torch.save`, deepcopy) is a `CompiledInference` of the copied
    model with the same options, compiled at its first call (compiled graphs
    are not copied).

    >>> import torch
    >>> from dtype_policies import CompiledInference, compile_for_inference
    >>> model = torch.nn.Linear(4, 2)
    >>> fast = compile_for_inference(model)
    >>> isinstance(fast, CompiledInference), fast.module is model
    (True, True)
    >>> torch.equal(fast(torch.ones(1, 4)), model(torch.ones(1, 4)))  # grad enabled: eager
    True
    """

    def __init__(
        self,
        model: torch.nn.Module,
        freeze_weights: bool,
        fullgraph: bool,
        autotune: bool = True,
        cpp_wrapper: bool | None = None,
    ) -> None:
        self._call = FrozenCompiledCall(
            model,
            freeze_weights,
            name="compile_for_inference",
            dynamic=None,
            fullgraph=fullgraph,
            call_context=_call_context,
            autotune=autotune,
            cpp_wrapper=cpp_wrapper,
        )
        self._module = model

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __repr__(self) -> str:
        return f"CompiledInference({type(self._module).__name__})"


def _call_context(
    model: torch.nn.Module, kwargs: dict, continuing: bool
) -> AbstractContextManager[None]:
    """Each compiled call: a transformers model's bfloat16 attention on this
    library's kernel where the CPU has it (`kernels.attention.selected`)."""
    return attention.selected(model)


def compile_for_inference(
    model: torch.nn.Module,
    *,
    freeze_weights: bool = True,
    fullgraph: bool = False,
    autotune: bool = True,
    cpp_wrapper: bool | None = None,
) -> CompiledInference:
    """`model`'s inference, compiled by Inductor with frozen weights.

    Args:
        model: Any module, policied and/or quantized by this library or not.
        freeze_weights: Fold weight-only computations (casts, packing) into
            constants at compile time (default). Without it, the compiled
            call casts float weights on every call and follows every change;
            a model whose weights are inference tensors (built or loaded
            under `torch.inference_mode()`, whose writes torch does not
            record) or that holds sparse or nested tensors (which Dynamo
            cannot make constants of a graph) is compiled so, with a warning.
        fullgraph: Refuse graph breaks (as `torch.compile`'s option).
        autotune: Let Inductor time its C++ GEMM templates against ATen's
            kernels for each product shape and keep the faster (default): a
            longer first call per shape (docs/speed.md).
        cpp_wrapper: Call the graph's kernels and operators from generated
            C++, not Python: less overhead per kernel where calls are small
            and many (all-MiniLM-L6-v2 int8 at 1 x 32 tokens 1.06-1.2x faster
            on an AMX Xeon), its first compilation as long (docs/speed.md).
            `None` (default): the C++ wrapper from torch 2.13, the Python one
            before (torch 2.6's cannot compile a quantized model's graph).

    Returns:
        A `CompiledInference`, called as the model: compiled under
        `torch.no_grad()` or `torch.inference_mode()`, eager otherwise.

    Raises:
        TypeError: `model` is not a `torch.nn.Module`.
        ValueError: A layer of it is not built yet (a Keras-style layer
            before its first call, a torch lazy module): its weights would
            be created inside the compiled call, which freezes none of them.

    >>> compile_for_inference(lambda x: x)
    Traceback (most recent call last):
    ...
    TypeError: compile_for_inference needs a torch.nn.Module, got function
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"compile_for_inference needs a torch.nn.Module, got {type(model).__name__}"
        )
    refuse_unbuilt(
        model,
        "compile_for_inference",
        "inside the compiled call, and frozen weights need them before",
    )
    cpp_wrapper = resolved_cpp_wrapper(cpp_wrapper)
    check_flags(
        "compile_for_inference",
        freeze_weights=freeze_weights,
        fullgraph=fullgraph,
        autotune=autotune,
        cpp_wrapper=cpp_wrapper,
    )
    return CompiledInference(model, freeze_weights, fullgraph, autotune, cpp_wrapper)
