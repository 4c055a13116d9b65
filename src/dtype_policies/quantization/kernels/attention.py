"""Scaled dot-product attention on bfloat16 tensors with this library's kernel
(`_csrc/attention_bf16.cpp`) on CPUs with AVX-512 bfloat16 dot products and
no AMX, and torch's `F.scaled_dot_product_attention` everywhere else (with
AMX, torch's flash kernel multiplies on its bfloat16 tiles: 1.3-2.9x this
kernel, MiniLM's to Llama-3.2-1B's shapes, 2 threads, 2026-12-02).

torch's CPU flash kernel multiplies bfloat16 at float32 speed on these CPUs
(SmolLM2's prefill shape, 8 x 9 heads x 512 x 64, causal: 38.9 ms bfloat16
against 38.4 float32, 2 threads, Zen 4); this kernel's products are bfloat16
dot products, with the same roundings as torch's (scores, softmax and sums in
float32, the unnormalised probabilities in bfloat16 for the product with the
values), not the same bits: its sums run in another order than torch's kernel
(on AMX, 1 step of bfloat16 in some outputs; as accurate against a float64
reference). Inference only: no gradient, no dropout.

Hugging Face models reach it through transformers' attention interface:
`transformers_attention` is transformers' `"sdpa"` implementation on this
kernel, registered as `NAME` behind the name `"sdpa"` (`_attention_dispatch`:
the model's `_attn_implementation` is never renamed); `selected(model)`
selects it for the duration of a call (`compile_for_inference`'s compiled
calls, calibration), and `attend_on_kernel(model)` does so around each eager
call of a model (`apply_policy` installs it on a transformers model).
Anything the kernel does not take goes to transformers' own function
unchanged.

>>> import torch
>>> q = k = v = torch.randn(1, 2, 8, 16).bfloat16()
>>> out = scaled_dot_product_attention(q, k, v, is_causal=True)
>>> out.shape, out.dtype
(torch.Size([1, 2, 8, 16]), torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies import _attention_dispatch
from dtype_policies import _native as native
from dtype_policies._compat import compiling
from dtype_policies._derivatives import derivative_free

KERNEL = "attention_bf16"
NAME = "dtype_policies_sdpa"


def applies(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> bool:
    """Whether this library's kernel computes this call here: bfloat16 CPU
    tensors (B, H, L, D) with D a multiple of 16, key heads dividing the query
    heads (when they differ, with `enable_gqa`), no dropout, not both a mask
    and `is_causal`, no derivative wanted (`derivative_free`), and the kernel
    built for this CPU."""
    tensors = (query, key, value)
    if any(
        t.dtype is not torch.bfloat16 or t.device.type != "cpu" or t.dim() != 4 for t in tensors
    ):
        return False
    if not derivative_free(query, key, value, attn_mask):
        return False
    if dropout_p != 0.0 or (attn_mask is not None and is_causal):
        return False
    (batch, heads, _, depth), (key_batch, key_heads, length, key_depth) = query.shape, key.shape
    if value.shape != key.shape or key_batch != batch or key_depth != depth or length == 0:
        return False
    if depth % 16 or heads % key_heads or (heads != key_heads and not enable_gqa):
        return False
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, torch.bfloat16):
        return False
    return native.available(KERNEL)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention`'s values and signature, on this
    library's kernel where it `applies`, else on torch's."""
    if not applies(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    mask = attn_mask
    if mask is not None and mask.dtype is torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, -math.inf)
    elif mask is not None:
        mask = mask.float()
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return torch.ops.dtype_policies.attention_bf16(query, key, value, mask, scale, is_causal)


def transformers_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' `"sdpa"` attention function (`query` (batch, heads,
    queries, width), `key` and `value` (batch, key heads, length, width);
    returns (batch, queries, heads, width) and no weights), on this library's
    kernel where it applies, with transformers' rule for `is_causal`: many
    queries, no mask, and a causal module."""
    queries = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(queries > 1 and attention_mask is None and causal)
    grouped = query.shape[1] != key.shape[1]
    if (
        position_bias is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
        # transformers' quirk for a prompt on an empty static cache (keys cut to the queries)
        or (causal and key.shape[2] > queries)
        or not applies(query, key, value, attention_mask, dropout, causal, grouped)
    ):
        return _attention_dispatch.transformers_sdpa()(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            position_bias=position_bias,
            **kwargs,
        )
    out = scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        is_causal=causal,
        scale=scaling,
        enable_gqa=grouped,
    )
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def register() -> str:
    """Makes `transformers_attention` selectable as `NAME` behind
    transformers' `"sdpa"` (once); returns `NAME`."""
    _attention_dispatch.register(NAME, transformers_attention)
    return NAME


@contextlib.contextmanager
def selected(model: torch.nn.Module, config: Any = None) -> Iterator[None]:
    """Within the block, `model` (a transformers model on `"sdpa"`, one
    config) attends with `transformers_attention`, where this CPU has the
    kernel; otherwise (or for any other model) nothing changes. The model's
    own setting is back in force after the block. Another thread calling the
    model meanwhile attends the same way (the same values, up to rounding).
    `config`: the one a part of a model (a decoder layer) reads
    (its `_attention_dispatch.config_holder`'s), else the model's own."""
    if config is None:
        config = getattr(model, "config", None)
    if not (_attention_dispatch.selectable(model, config) and native.available(KERNEL)):
        yield
        return
    with _attention_dispatch.selecting(model, register(), config):
        yield


class _EagerCalls:
    """Forward hooks of one model: `selected` around each eager call (not
    while a compiler traces it: a traced call keeps the model's setting, and
    the compile helpers select the kernel outside their compiled calls)."""

    def __init__(self, holder: torch.nn.Module | None = None) -> None:
        self.swapped = threading.local()
        # the module holding the config the model's attention reads (found
        # at the first call of a copy); its config is read at each call
        self.holder = None if holder is None else weakref.ref(holder)

    # a copied or pickled model gets hooks of its own, with no call under way
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    def before(self, model: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if compiling():  # nothing for the traced graph to replay
            return
        holder = None if self.holder is None else self.holder()
        if holder is None:  # a copy's: its own model's
            holder = _attention_dispatch.config_holder(model)
            self.holder = None if holder is None else weakref.ref(holder)
        context = selected(model, None if holder is None else holder.config)
        context.__enter__()
        self.swapped.__dict__.setdefault("stack", []).append(context)

    def after(self, model: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if compiling():
            return
        stack = self.swapped.__dict__.get("stack")
        if stack:
            stack.pop().__exit__(None, None, None)


def attend_on_kernel(model: torch.nn.Module) -> list[Any]:
    """Makes each eager call of `model`, a transformers model on `"sdpa"` or
    a part of one (`apply_policy(llm.model.layers[1], ...)`), attend with
    `transformers_attention` (as `selected`), and every call on one dtype
    (`_attention_dispatch.promoted`); returns the hooks' handles
    (`handle.remove()` undoes it), none for any other model. The model's
    setting is restored after each call, also when it raises. A container
    that is never called itself (`llm.model.layers`, a `ModuleList`) has its
    called children hooked instead."""
    if isinstance(model, (torch.nn.ModuleList, torch.nn.ModuleDict)):
        return [handle for child in model.children() for handle in attend_on_kernel(child)]
    holder = _attention_dispatch.config_holder(model)
    implementation = getattr(getattr(holder, "config", None), "_attn_implementation", None)
    if implementation in ("eager", "sdpa"):
        # both promote mixed dtypes, whichever the model is switched to later
        # (`set_attn_implementation`)
        _attention_dispatch.promote_in_eager_attention(model)
        _attention_dispatch.transformers_sdpa()  # `dispatch` behind "sdpa"
    if implementation != "sdpa":
        return []
    calls = _EagerCalls(holder)
    return [
        model.register_forward_pre_hook(calls.before, with_kwargs=True),
        model.register_forward_hook(calls.after, with_kwargs=True, always_call=True),
    ]


def _attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """The operator's shape for compilers (it comes from the built library)."""
    batch, heads, queries, _ = query.shape  # the kernel's layout: (B, Lq, H, D) memory
    return query.new_empty((batch, queries, heads, value.shape[-1])).transpose(1, 2)


native.register_fakes(KERNEL, {"dtype_policies::attention_bf16": _attention_fake})
