"""Attention for one query per sequence (a decode step), written out for
Inductor, as a transformers attention implementation.

A decode step attends one query per head to the whole KV cache. torch's fused
SDPA kernel sets up blocks for many queries, and under `torch.compile`
transformers copies the key/value heads once per query head (`repeat_kv`)
before calling it: on SmolLM2-135M's compiled int8 step, attention took 16% of
the step. Written out as products and sums, Inductor fuses each of the two
into one loop over the cache (bfloat16 read, float32 arithmetic), and the
query heads sharing a key/value head (grouped-query attention) read it once.

The query, key and value are realized before the loops
(`_computed_once`): otherwise Inductor inlines what produces them into the
loops over the cache, so that the new key's rotary embedding (a cosine and
a sine per lane, through the cache update) was recomputed for every cached
position: on SmolLM2's compiled int8 step at 1056 cached positions, 54% of
the graph's time.

`compile_for_generation`'s decode step selects it (`NAME`, made selectable
behind transformers' `"sdpa"` by `register()`: `_attention_dispatch`), for
the compiled call only. The model's `_attn_implementation` stays `"sdpa"`,
with SDPA's masks (boolean or additive; `None` attends everywhere), so that
a model whose code branches on the name takes its `"sdpa"` path. Anything
but one query without dropout and position bias goes to transformers' SDPA
function unchanged.

>>> import torch
>>> from transformers.integrations.sdpa_attention import sdpa_attention_forward
>>> module = torch.nn.Module()
>>> module.num_key_value_groups, module.is_causal = 3, True
>>> query, key, value = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
>>> ours, _ = one_query_attention(module, query, key, value, None, scaling=0.3)
>>> theirs, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
>>> ours.shape, bool(torch.allclose(ours, theirs, atol=1e-5))
(torch.Size([2, 1, 6, 8]), True)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dtype_policies import _attention_dispatch
from dtype_policies._compat import compiling

NAME = "dtype_policies_one_query"

# Inductor's `inductor_force_stride_order` prim (set by `register`): under
# Inductor it realizes its input into a buffer (computed once, then read).
# Only traced: in eager mode the inputs are already tensors.
_force_stride_order: Any = None


def _computed_once(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, which a compiled graph computes into a buffer of its own
    before the loops that read it, instead of inlining its producer there."""
    if _force_stride_order is None or not compiling():
        return tensor
    return _force_stride_order(tensor, tensor.stride())


def _per_key_head(mask: torch.Tensor, key_heads: int, groups: int) -> torch.Tensor:
    """A (batch, heads or 1, 1, length) mask as (batch, key heads or 1, groups or 1, length)."""
    if mask.shape[1] == 1:
        return mask
    return mask.reshape(mask.shape[0], key_heads, groups, mask.shape[-1])


def one_query_attention(
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
    """transformers' attention interface: `query` (batch, heads, queries,
    width), `key` and `value` (batch, key heads, length, width), the mask
    additive (float) or boolean (True attends), broadcast over heads or one per
    head. Returns (batch, queries, heads, value width) in `query`'s dtype, and
    no weights."""
    batch, heads, queries, width = query.shape
    key_heads = key.shape[1]
    if (
        queries != 1
        or dropout
        or position_bias is not None
        or heads % key_heads
        or kwargs.get("output_attentions", False)
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
    groups = heads // key_heads
    scale = width**-0.5 if scaling is None else scaling
    grouped = _computed_once(query.float().contiguous()).reshape(batch, key_heads, groups, 1, width)
    key, value = _computed_once(key), _computed_once(value)
    scores = (grouped * key.float()[:, :, None]).sum(-1) * scale  # (b, key heads, groups, length)
    if attention_mask is not None:
        mask = _per_key_head(attention_mask, key_heads, groups)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    weights = torch.softmax(scores, dim=-1)
    out = (weights[..., None] * value.float()[:, :, None]).sum(-2)  # (b, key heads, groups, width)
    out = out.to(query.dtype).reshape(batch, heads, 1, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Makes `one_query_attention` selectable as `NAME` behind transformers'
    `"sdpa"`; returns `NAME`. Idempotent."""
    global _force_stride_order
    if _force_stride_order is None:
        # importing Inductor's prims registers the prim; a torch without
        # Inductor keeps the producers inlined
        with contextlib.suppress(ImportError):
            import torch._inductor.inductor_prims
        _force_stride_order = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    _attention_dispatch.register(NAME, one_query_attention)
    return NAME
