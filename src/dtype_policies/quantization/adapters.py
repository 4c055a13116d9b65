"""The adapters of parameter-efficient fine-tuning, which quantization leaves
in floating point.

A PEFT tuner layer (`peft`'s `BaseTunerLayer`: LoRA, AdaLoRA, LoHa, ...)
wraps a base module and holds its trainable adapters in the containers it
names in `adapter_layer_names` (LoRA: `lora_A`, `lora_B` and their embedding
forms). The base is what quantization is for (QLoRA: a quantized base, float
adapters trained on it); an adapter quantized would no longer train (its
parameters become integer buffers: an optimizer made before steps tensors the
model no longer reads), so `quantize()` skips adapters, reported as
`"adapter"`, whatever the filters. A tuner's merges write its base's weight
through `.data`, unseen by torch's version counters: a tuner under an
application watches them (`watch_merges`). Read by duck typing: nothing here
imports `peft`.

>>> import torch
>>> class Tuned(torch.nn.Module):  # the shape of a LoRA layer
...     adapter_layer_names = ("lora_A", "lora_B")
...     def __init__(self):
...         super().__init__()
...         self.base_layer = torch.nn.Linear(8, 8)
...         self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(8, 2)})
...         self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 8)})
>>> tuned = Tuned()
>>> found = adapter_modules(tuned.modules())
>>> id(tuned.lora_A["default"]) in found, id(tuned.base_layer) in found
(True, False)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from typing import Any

import torch

from dtype_policies._core.module_state import clear_cast_caches, quantization_of


def adapter_modules(modules: Iterable[torch.nn.Module]) -> set[int]:
    """The ids of every module inside an adapter container of a tuner layer
    among `modules` (a model's modules)."""
    found: set[int] = set()
    for module in modules:
        names = getattr(type(module), "adapter_layer_names", None)
        if not isinstance(names, tuple):
            continue
        for name in names:
            container = module._modules.get(name)
            if isinstance(container, torch.nn.Module):
                found.update(id(inner) for inner in container.modules())
    return found


def _merged_state(tuner: torch.nn.Module) -> tuple | None:
    """The adapters merged into `tuner`'s base and, when some are, their
    weights' identities (an adapter re-merged with new weights, no call
    between, wrote the base again)."""
    merged = getattr(tuner, "merged_adapters", None)
    if not isinstance(merged, list):
        return None
    if not merged:
        return ()
    weights = []
    for name in getattr(type(tuner), "adapter_layer_names", ()):
        container = tuner._modules.get(name)
        if isinstance(container, torch.nn.Module):
            weights += [(p.data_ptr(), p._version) for p in container.parameters()]
    return (tuple(merged), tuple(weights))


class _MergeWatch:
    """A tuner layer's forward pre-hook: drops its base's kept casts when the
    adapters merged into the base changed since the last call."""

    def __init__(self, merged: tuple | None) -> None:
        self.seen = merged

    def __call__(self, tuner: torch.nn.Module, args: Any) -> None:
        merged = _merged_state(tuner)
        if merged is None or merged == self.seen:
            return
        self.seen = merged
        base = tuner._modules.get("base_layer")
        clear_cast_caches(base if isinstance(base, torch.nn.Module) else tuner)


def _watch_of(tuner: torch.nn.Module) -> _MergeWatch | None:
    return next((h for h in tuner._forward_pre_hooks.values() if isinstance(h, _MergeWatch)), None)


def watch_merges(module: torch.nn.Module) -> None:
    """peft's tuner layers merge adapters into their base's weight through
    `.data` (`merge_adapter()`, `merge_and_unload()`, `unmerge_adapter()`),
    which moves no version counter: a kept cast of the base would be
    reused. A tuner under an application checks, before each call, whether
    its merged adapters changed, and drops its base's kept casts if so."""
    for tuner in module.modules():
        merged = getattr(tuner, "merged_adapters", None)
        if isinstance(merged, list) and _watch_of(tuner) is None:
            tuner.register_forward_pre_hook(_MergeWatch(_merged_state(tuner)))


_GUARDED = "_dtype_policies_guards_merges"


def guard_peft_merges() -> None:
    """peft merges a model's adapters tuner by tuner (`merge_and_unload()`,
    `merge_adapter()`) through `.data`, which moves no version counter.
    Before merging anything it checks the model can be merged
    (`BaseTuner._check_merge_allowed`, where it refuses GPTQ models of its
    own); if peft is imported, that check is extended, once, so that:

    * a model holding a tuner on a base whose weight this library stores
      quantized is refused (its write would raise `TypeError` after the
      tuners before it were merged, and unloaded, already): nothing merges;
    * every tuner's base drops its kept casts (a float8 base keeps its float
      weight, and would go on computing from the cast of the unmerged one),
      and tuners are watched, so that a later `unmerge_adapter()` is seen.

    Called whenever a weight is quantized (`attach`)."""
    tuners_utils = sys.modules.get("peft.tuners.tuners_utils")
    base_tuner = getattr(tuners_utils, "BaseTuner", None)
    check = getattr(base_tuner, "_check_merge_allowed", None)
    if check is None or getattr(check, _GUARDED, False):
        return

    @functools.wraps(check)
    def _check_merge_allowed(self: Any) -> None:
        check(self)
        bases = []
        for name, tuner in self.model.named_modules():
            get_base = getattr(tuner, "get_base_layer", None)
            if getattr(type(tuner), "adapter_layer_names", None) is None or get_base is None:
                continue
            base = get_base()
            bases.append(base)
            quantized = quantization_of(base)
            if quantized is not None and not quantized.scheme.keeps_float_weight:
                raise TypeError(
                    f"Cannot merge adapters into this model: the base of its tuner layer "
                    f"'{name}' is {quantized.mode}-quantized (its weight is integer storage, "
                    "which a merge cannot write). Nothing was merged. Merge into the float "
                    "model, then quantize; or keep the adapters, which compute on the "
                    "quantized base."
                )
        for base in bases:  # the merge writes next, through `.data`
            clear_cast_caches(base)
        watch_merges(self.model)

    setattr(_check_merge_allowed, _GUARDED, True)
    setattr(base_tuner, "_check_merge_allowed", _check_merge_allowed)  # noqa: B010


def merges_seen(tuner: torch.nn.Module) -> None:
    """Drops the kept casts of a watched `tuner`'s base if its merged
    adapters changed (`merge_and_unload()` replaces the tuner by its base
    right after merging: no call of the tuner sees it)."""
    watch = _watch_of(tuner)
    if watch is not None:
        watch(tuner, ())
