"""Compute-dtype copies of weights kept between calls, correct by construction.

A kept cast is reused only while its weight is the same object, at the same
address, with the same version counter: every write through torch (in-place
ops, `copy_`, `load_state_dict`, optimizer steps, `nn.init`, `p.data = ...`,
`.to()`) changes one of these, so the next call casts afresh. Casts that carry
an autograd graph (grad mode, trainable weight) are kept for the thread that
made them only, so a thread evaluating under `no_grad` and a thread training
never hand each other a cast, and training never reads a graph-free one.

Never kept: casts of inference tensors (no version counter), of tensor
subclasses and functorch-wrapped tensors, and anything under `torch.compile`
or `torch.jit.trace` (the compiler deduplicates casts itself).

Not seen: writes that bypass torch's version counter (in-place ops on
`p.data`, writes through a NumPy view); after one, call
`dtype_policies.clear_cast_caches(model)`.
"""

from __future__ import annotations

import threading

import torch

from dtype_policies._core.casting import cast_tensor, functorch_wrapped, tracing
from dtype_policies._core.products import LinearProduct, linear_product
from dtype_policies._core.scope import AutocastScope
from dtype_policies._cpu import processor

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_get_ident = threading.get_ident


class WeightCasts:
    """A module's store of kept casts.

    `entries` maps a weight name to `(weight, key, cast)`; `pair` holds a
    linear leaf's `(weight, bias, key, weight cast, bias cast, product)`,
    checked in one step. Entries are immutable tuples replaced whole, so concurrent readers
    see the old entry or the new one. Copies, pickles and deep copies of a
    module start with an empty store.
    """

    __slots__ = ("enabled", "entries", "pair")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.entries: dict[str, tuple] = {}
        self.pair: tuple | None = None

    def clear(self) -> None:
        self.entries.clear()
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


def _owner(*tensors: torch.Tensor | None) -> int:
    """0 for a cast without an autograd graph, else the calling thread."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _get_ident()
    return 0


def _make_cast(weight: torch.Tensor, dtype: torch.dtype, owner: int) -> torch.Tensor:
    """A cast to keep: with its graph for an owning thread, else a normal
    tensor without one (also inside inference mode, so it can be used
    outside it later)."""
    if owner:
        return cast_tensor(weight, dtype)
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            return cast_tensor(weight, dtype)
    with torch.no_grad():
        return cast_tensor(weight, dtype)


def cast_weight(
    store: WeightCasts | None,
    name: str,
    weight: torch.Tensor,
    dtype: torch.dtype,
    scope: AutocastScope | None = None,
) -> torch.Tensor:
    """`weight` in `dtype`: kept from an earlier call when still valid, else
    cast now (once per `scope` when one is given, and kept when allowed)."""
    if weight.dtype == dtype:
        return weight
    if store is None or not store.enabled or tracing():
        return scope.cast(weight) if scope is not None else cast_tensor(weight, dtype)
    owner = _owner(weight)
    entry = store.entries.get(name)
    if (
        entry is not None
        and entry[0] is weight
        and entry[1] == (weight._version, weight.data_ptr(), dtype, owner)
    ):
        return entry[2]
    if not can_keep(weight):
        return scope.cast(weight) if scope is not None else cast_tensor(weight, dtype)
    cast = _make_cast(weight, dtype, owner)
    store.entries[name] = (weight, (weight._version, weight.data_ptr(), dtype, owner), cast)
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
    if tracing():  # the compiler chooses the product
        return cast_tensor(weight, dtype), None if bias is None else cast_tensor(bias, dtype), None
    if store is None or not store.enabled:
        return _uncached(weight, bias, dtype, pack, transposed)
    owner = _owner(weight, bias)
    entry = store.pair
    if (
        entry is not None
        and entry[0] is weight
        and entry[1] is bias
        and entry[2] == _pair_key(weight, bias, dtype, owner)
        and (entry[5] is None or pack)
    ):
        return entry[3], entry[4], entry[5]
    if can_keep(weight) and (bias is None or (can_keep(bias) and bias.dtype == weight.dtype)):
        weight_cast = _make_cast(weight, dtype, owner)
        bias_cast = None if bias is None else _make_cast(bias, dtype, owner)
        product = _product(weight_cast, pack, transposed, kept=not owner)
        if product is not None and product.kind == "onednn_prepacked":
            weight_cast = product.weight  # the packed layout replaces the cast
        key = _pair_key(weight, bias, dtype, owner)
        store.pair = (weight, bias, key, weight_cast, bias_cast, product)
        return weight_cast, bias_cast, product
    return _uncached(weight, bias, dtype, pack, transposed)


def _uncached(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    pack: bool,
    transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, LinearProduct | None]:
    """Casts made for this call only, with the same product path as kept ones
    (so that a module computes the same values with or without its store)."""
    weight_cast = cast_tensor(weight, dtype)
    product = _product(weight_cast, pack, transposed, kept=False)
    return weight_cast, None if bias is None else cast_tensor(bias, dtype), product


def _product(
    weight_cast: torch.Tensor, pack: bool, transposed: bool, kept: bool
) -> LinearProduct | None:
    if not pack:
        return None
    return linear_product(weight_cast.t() if transposed else weight_cast, kept=kept)


def _pair_key(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, owner: int
) -> tuple:
    # The processor is part of the key: its product path was chosen for it.
    if bias is None:
        return (weight._version, weight.data_ptr(), dtype, owner, processor())
    return (
        weight._version,
        weight.data_ptr(),
        bias._version,
        bias.data_ptr(),
        dtype,
        owner,
        processor(),
    )


def clear_cast_caches(model: torch.nn.Module) -> None:
    """Drops the compute-dtype casts kept by `model` and its submodules.

    Needed only after writes that torch's version counter does not see
    (in-place ops on `p.data`, writes through a NumPy view).

    >>> import torch
    >>> import dtype_policies
    >>> model = torch.nn.Linear(4, 4)
    >>> _ = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> with torch.no_grad():
    ...     _ = model(torch.ones(1, 4))
    ...     _ = model.weight.data.zero_()  # invisible to torch's version counter
    ...     dtype_policies.clear_cast_caches(model)
    ...     bool((model(torch.ones(1, 4)) == model.bias.bfloat16()).all())
    True
    """
    for module in model.modules():
        casts = module.__dict__.get("_dp_casts")
        if casts is not None:
            casts.clear()
