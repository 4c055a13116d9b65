"""Living with FSDP2 (`torch.distributed.fsdp.fully_shard`).

FSDP2 marks each module it manages with `_is_fsdp_managed_module = True`,
keeps the module's parameters as sharded DTensors between calls, and around
each forward registers one plain `Parameter` per weight that it refills by an
all-gather. Two things follow for a policied module:

* FSDP2 reads its sharded parameters with `getattr(module, name)`, the first
  time inside the root module's call (its lazy init runs in a forward
  pre-hook). Such reads must get the parameter itself, never a compute-dtype
  cast: `as_is` says so.
* FSDP2 refills the same unsharded `Parameter` in every step while keeping its
  version counter, and may get the same address back from the allocator: a
  kept cast (keyed by identity, version and address) could serve last step's
  weights. So a managed module keeps no casts (each call casts anew); the
  marker's setter, `fsdp_managed`, turns them off the moment FSDP2 sets it.
"""

from __future__ import annotations

from typing import Any

import torch

from dtype_policies._core.module_state import STATE_KEY

FSDP_MANAGED = "_is_fsdp_managed_module"

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _get(module: torch.nn.Module) -> bool:
    try:
        return module.__dict__[FSDP_MANAGED]
    except KeyError:
        raise AttributeError(FSDP_MANAGED) from None


def _set(module: torch.nn.Module, value: Any) -> None:
    d = module.__dict__
    d[FSDP_MANAGED] = value
    state = d.get(STATE_KEY)
    if value and state is not None:
        state.casts.enabled = False
        state.casts.clear()


def _delete(module: torch.nn.Module) -> None:
    module.__dict__.pop(FSDP_MANAGED, None)


fsdp_managed = property(_get, _set, _delete, "Set by FSDP on the modules it manages.")
"""The `_is_fsdp_managed_module` attribute of policied modules."""


def refuse_sharded(module: torch.nn.Module, action: str) -> None:
    """Raises `ValueError` when FSDP2 manages any module of `module`'s tree:
    its units gather each weight in the dtype its policy had when it was
    sharded, and quantization replaces weights FSDP2 holds the shards of,
    so neither may change under it (`action` names the call refused)."""
    managed = [
        name or "(model)"
        for name, submodule in module.named_modules()
        if submodule.__dict__.get(FSDP_MANAGED, False)
    ]
    if managed:
        shown = ", ".join(repr(name) for name in managed[:3])
        more = f" and {len(managed) - 3} more" if len(managed) > 3 else ""
        raise ValueError(
            f"{action}: the model is sharded by FSDP2 ({shown}{more} managed), and its units "
            "gather each weight in the dtype its policy had when it was sharded: policies and "
            "quantization cannot change under it. Change them before "
            "dtype_policies.distributed.fully_shard, or save the model (saving.save on every "
            "rank), load it into a fresh model, change them there, and shard it again. "
            "Nothing was changed."
        )


DATA_PARALLEL_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
"""The wrappers that replicate a model on every rank (their `module` is the model)."""


def refuse_replicated(
    module: torch.nn.Module,
    action: str,
    remedy: str = "Quantize the module before wrapping it: quantize(module, ...), then wrap it",
) -> None:
    """Raises `ValueError` when a `DistributedDataParallel` (or
    `DataParallel`) wrapper is in `module`'s tree and `action` quantizes: the
    wrapper holds the float weights quantization replaces (its gradient
    buckets would wait for them, and the ranks drift apart)."""
    for name, submodule in module.named_modules():
        if isinstance(submodule, DATA_PARALLEL_WRAPPERS):
            raise ValueError(
                f"{action}: {name or 'the model'!r} is a {type(submodule).__name__}, which "
                "keeps the float weights quantization replaces (its gradient reduction would "
                f"wait for them, and the ranks drift apart). {remedy}. Nothing was changed."
            )


def keeps_casts(module: torch.nn.Module, weight_cache: bool) -> bool:
    """Whether the module may keep casts between calls."""
    return weight_cache and not module.__dict__.get(FSDP_MANAGED, False)


def as_is(d: dict[str, Any], value: torch.Tensor) -> bool:
    """Whether a weight read from a module with `__dict__` `d` is FSDP's
    sharded parameter (a DTensor outside the module's forward)."""
    return type(value) not in _PLAIN_TYPES and bool(d.get(FSDP_MANAGED, False))


def is_sharded_tensor(tensor: torch.Tensor) -> bool:
    """A DTensor (FSDP2's sharded parameters): `full_tensor()` gathers it; it
    has no storage of its own to read."""
    return type(tensor) is not torch.Tensor and hasattr(tensor, "full_tensor")


def class_under_fsdp(cls: type) -> type:
    """The class FSDP2's wrapper class `FSDP<cls>` (made by `fully_shard`) stands
    for; any other class itself."""
    index = getattr(cls, "_orig_cls_mro_index", None)
    if isinstance(index, int) and len(cls.__mro__) > index:
        return cls.__mro__[index]
    return cls
