"""Compute-dtype copies of weights kept between calls, correct by construction.

A cast is kept across calls only when it carries no autograd graph (grad
mode is off, or the weight does not require grad) and the weight is a plain
tensor whose writes torch tracks. It is reused only while the weight is the
same object, at the same address, with the same version counter: every
write through torch (in-place ops, `copy_`, `load_state_dict`, optimizer
steps, `nn.init`, `p.data = ...`, `.to()`) changes one of these. Casts that
are graph nodes are made afresh in every call (once per call), so two threads
never share one, and training never reads a cast made under `no_grad`.

Not seen: writes that bypass torch's version counter (in-place ops on
`p.data`, writes through a NumPy view) between two no-grad calls; call
`dtype_policies.clear_cast_caches(model)` after such a write.
"""

from __future__ import annotations

import torch

from dtype_policies._core.casting import cast_tensor
from dtype_policies._core.scope import AutocastScope

try:
    from torch._C._functorch import is_functorch_wrapped_tensor as _is_functorch_wrapped
except ImportError:  # pragma: no cover - older torch

    def _is_functorch_wrapped(tensor: torch.Tensor) -> bool:
        return False


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


class WeightCasts:
    """A module's store of kept casts, by weight name.

    Entries are immutable tuples `(weight, version, address, dtype, cast)`
    replaced whole, so concurrent readers see either the old or the new entry.
    Copies, pickles and deep copies of a module start with an empty store.
    """

    __slots__ = ("enabled", "entries")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.entries: dict[str, tuple] = {}

    def clear(self) -> None:
        self.entries.clear()

    def __deepcopy__(self, memo: dict) -> WeightCasts:
        return WeightCasts(self.enabled)

    def __reduce__(self) -> tuple:
        return (WeightCasts, (self.enabled,))

    def __repr__(self) -> str:
        return f"WeightCasts(enabled={self.enabled}, kept={sorted(self.entries)})"


def can_keep(weight: torch.Tensor) -> bool:
    """Whether a cast of `weight` may be kept across calls (see the module docs)."""
    return (
        not (weight.requires_grad and torch.is_grad_enabled())
        and type(weight) in _PLAIN_TYPES
        and not weight.is_inference()
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not _is_functorch_wrapped(weight)
    )


def _plain_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cast that is a normal tensor without a graph, also inside inference mode
    (so that it can be used later outside it)."""
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
    """`weight` in `dtype`: kept from an earlier call when allowed and still
    valid, else cast now (once per `scope` when one is given)."""
    if weight.dtype == dtype:
        return weight
    if store is None or not store.enabled or not can_keep(weight):
        return scope.cast(weight) if scope is not None else cast_tensor(weight, dtype)
    entry = store.entries.get(name)
    version, address = weight._version, weight.data_ptr()
    if (
        entry is not None
        and entry[0] is weight
        and entry[1] == version
        and entry[2] == address
        and entry[3] is dtype
    ):
        return entry[4]
    cast = _plain_cast(weight, dtype)
    store.entries[name] = (weight, version, address, dtype, cast)
    return cast


def clear_cast_caches(model: torch.nn.Module) -> None:
    """Drops the compute-dtype casts kept by `model` and its submodules.

    Needed only after writes that torch's version counter does not see
    (in-place ops on `p.data`, writes through a NumPy view) when the model is
    used under `no_grad`/`inference_mode` next.

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
