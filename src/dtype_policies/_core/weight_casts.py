"""Compute-dtype copies of weights, and which of them may be kept between calls.

Two kinds of cast, two lifetimes, both fixed by construction:

* A cast made with gradients enabled (a training call) is never kept by the
  module. It lives in the autocast scope of the call that made it (so a weight
  read twice in one forward is cast once, and its gradient accumulates through
  one node) and goes with that call; nothing of it survives into the next
  step. Whatever happens to a weight between two training calls (an optimizer
  step, fused or not, a write through `p.data`), the next call reads it.
* A cast made without gradients (`no_grad`, `inference_mode`) is graph-free and
  may be kept in the module's `WeightCasts` for the next such call, which is
  what makes repeated inference fast. It is reused only while its weight is the
  same object, on the same storage, at the same address, with the same
  version counter (`tensor_identity.contents_key`), so every write that
  torch tracks is seen, `p.data = ...` included. All of a module's kept casts are dropped
  whenever the module reads a weight with gradients enabled (it runs in a
  training call) and whenever it switches mode (`train()`, `eval()`).

Never kept: casts of inference tensors (no version counter), of tensor
subclasses and functorch-wrapped tensors, anything under `torch.compile`
or `torch.jit.trace` (the compiler deduplicates casts itself), and anything
while forward mode or a `torch.func` transform is active.

What a kept cast cannot see is stated once, in docs/apply_policy.md
("What a kept cast cannot see"); `clear_cast_caches(model)` covers it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtype_policies._core.casting import cast_tensor, functorch_wrapped, tracing
from dtype_policies._core.products import LinearProduct, linear_product, traced_product
from dtype_policies._core.scope import AutocastScope, current_scope
from dtype_policies._core.tensor_identity import contents_key, tensor_key
from dtype_policies._cpu import processor
from dtype_policies._derivatives import transform_active

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_grad_enabled = torch.is_grad_enabled


class WeightCasts:
    """A module's store of kept graph-free casts.

    `entries` maps a weight name to `(weight, key, cast)`; `pair` holds a
    linear leaf's `(weight, bias, key, weight cast, bias cast, product)`,
    checked in one step. Entries are immutable tuples replaced whole, so
    concurrent readers see the old entry or the new one; each key holds the
    store's `generation` read before its value was made, and `clear` moves
    it on, so an entry another thread made before a clear and stored after
    it is never used. Copies, pickles and deep copies of a module start with
    an empty store.
    """

    __slots__ = ("enabled", "entries", "generation", "pair")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.entries: dict[str, tuple] = {}
        self.pair: tuple | None = None
        self.generation = 0

    def clear(self) -> None:
        self.generation += 1
        if self.entries:
            self.entries = {}
        self.pair = None

    def __deepcopy__(self, memo: dict) -> WeightCasts:
        return WeightCasts(self.enabled)

    def __reduce__(self) -> tuple:
        return (WeightCasts, (self.enabled,))

    def __repr__(self) -> str:
        return f"WeightCasts(enabled={self.enabled}, kept={sorted(self.entries)})"


def can_keep(weight: torch.Tensor) -> bool:
    """Whether a cast of `weight` may be kept across calls at all."""
    return (
        type(weight) in _PLAIN_TYPES
        and not weight.is_inference()
        and not tracing()
        and not functorch_wrapped(weight)
    )


def _uses_store(store: WeightCasts | None) -> bool:
    """Whether this read may use `store`'s kept casts: a store that keeps
    casts, no tracing, gradients disabled and no forward mode or `torch.func`
    transform (a kept cast holds no tangent, and the products kept with it
    have no derivatives). A read with gradients enabled empties the store
    instead (its module runs in a training call)."""
    if store is None or not store.enabled or tracing():
        return False
    if _grad_enabled():
        if store.pair is not None or store.entries:
            store.clear()
        return False
    return not transform_active()


def keep_derived(
    store: WeightCasts | None,
    name: str,
    tensors: tuple[torch.Tensor, ...],
    extra: tuple,
    make: Callable[[], Any],
) -> Any:
    """`make()`, a graph-free value computed from `tensors` (a quantized
    kernel of a float weight, say), kept in `store` under `name` by the rules
    of kept casts: reused only while every one of `tensors` is the same
    object with the same `contents_key`, and `extra` is equal; never kept by
    a call with gradients enabled (which empties the store), and dropped with
    the casts (`train()`, `eval()`, `clear_cast_caches`)."""
    if not _uses_store(store) or not all(can_keep(t) for t in tensors):
        return make()
    assert store is not None
    key = (*tensor_key(*tensors), *extra, store.generation)
    entry = store.entries.get(name)
    if entry is not None and entry[1] == key:
        return entry[2]
    value = make()
    store.entries[name] = (tensors[0], key, value)
    return value


def _make_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A graph-free cast to keep (made outside inference mode, so that it can
    be used outside it later)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            return cast_tensor(weight, dtype)
    return cast_tensor(weight, dtype)


def _call_cast(
    weight: torch.Tensor, dtype: torch.dtype, scope: AutocastScope | None
) -> torch.Tensor:
    """`weight` in `dtype` for this call only (once per `scope` when given)."""
    return scope.cast(weight) if scope is not None else cast_tensor(weight, dtype)


def cast_weight(
    store: WeightCasts | None,
    name: str,
    weight: torch.Tensor,
    dtype: torch.dtype,
    scope: AutocastScope | None = None,
) -> torch.Tensor:
    """`weight` in `dtype`: a kept graph-free cast when still valid, else cast
    now (once per `scope` when one is given; kept when allowed)."""
    if weight.dtype == dtype:
        if store is not None and (store.entries or store.pair is not None):
            _uses_store(store)  # a training call's read empties it (float8's kernel)
        return weight
    if not _uses_store(store):
        return _call_cast(weight, dtype, scope)
    assert store is not None  # _uses_store says so
    entry = store.entries.get(name)
    key = (*contents_key(weight), dtype, store.generation)  # before the cast reads the values
    if entry is not None and entry[0] is weight and entry[1] == key:
        return entry[2]
    if not can_keep(weight):
        return _call_cast(weight, dtype, scope)
    cast = _make_cast(weight, dtype)
    store.entries[name] = (weight, key, cast)
    return cast


def cast_pair(
    store: WeightCasts | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    pack: bool = False,
    transposed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, LinearProduct | None]:
    """A linear leaf's weight and bias in `dtype`: the rules of `cast_weight`,
    with one check for both (the per-call cost that matters for small layers).

    With `pack`, the weight of an `(out, in)` linear (`(in, out)` with
    `transposed`) also gets the product path this processor runs it by
    (`products.linear_product`: e.g. oneDNN's prepacked layout, or float32
    products where half-precision ones are emulated), kept with the cast.
    Returns `(weight, bias, product)`; `product` is `None` for a plain product.
    """
    if tracing():  # plain ops, by the eager path's rule for this processor
        weight_cast = cast_tensor(weight, dtype)
        bias_cast = None if bias is None else cast_tensor(bias, dtype)
        if not pack:
            return weight_cast, bias_cast, None
        product = traced_product(weight_cast.t() if transposed else weight_cast)
        return weight_cast, bias_cast, product
    if not _uses_store(store):
        scope = current_scope()
        if scope is not None and scope.dtype is dtype:
            weight_cast, bias_cast = scope.cast(weight), None if bias is None else scope.cast(bias)
        else:
            weight_cast = cast_tensor(weight, dtype)
            bias_cast = None if bias is None else cast_tensor(bias, dtype)
        return weight_cast, bias_cast, _product(weight_cast, pack, transposed, kept=False)
    assert store is not None  # _uses_store says so
    if store.entries:  # read by attribute too: a copy written in this call reaches them
        scope = current_scope()
        if scope is not None:
            scope.settle(weight)
            if bias is not None:
                scope.settle(bias)
    entry = store.pair
    if (
        entry is not None
        and entry[0] is weight
        and entry[1] is bias
        and entry[2] == (*_pair_key(weight, bias, dtype), store.generation)
        and (entry[5] is None or pack)
    ):
        return entry[3], entry[4], entry[5]
    if can_keep(weight) and (bias is None or (can_keep(bias) and bias.dtype == weight.dtype)):
        # before the casts read the values
        key = (*_pair_key(weight, bias, dtype), store.generation)
        weight_cast = _make_cast(weight, dtype)
        bias_cast = None if bias is None else _make_cast(bias, dtype)
        product = _product(weight_cast, pack, transposed, kept=True)
        if product is not None and product.kind == "onednn_prepacked":
            weight_cast = product.weight  # the packed layout replaces the cast
        store.pair = (weight, bias, key, weight_cast, bias_cast, product)
        return weight_cast, bias_cast, product
    weight_cast = cast_tensor(weight, dtype)
    bias_cast = None if bias is None else cast_tensor(bias, dtype)
    return weight_cast, bias_cast, _product(weight_cast, pack, transposed, kept=False)


def _product(
    weight_cast: torch.Tensor, pack: bool, transposed: bool, kept: bool
) -> LinearProduct | None:
    if not pack:
        return None
    return linear_product(weight_cast.t() if transposed else weight_cast, kept=kept)


def _pair_key(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> tuple:
    # The processor is part of the key: its product path was chosen for it.
    if bias is None:
        return (*contents_key(weight), dtype, processor())
    return (*contents_key(weight), *contents_key(bias), dtype, processor())
