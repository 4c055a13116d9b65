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
import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Iterable, Sequence
from types import ModuleType
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
_TUNERS_UTILS = "peft.tuners.tuners_utils"
_OTHER_UTILS = "peft.utils.other"


def guard_peft() -> None:
    """Extends, once peft is imported, the two places where peft meets a
    module this library quantized: its merges (`guard_merges`) and its
    trained copies (`modules_to_save`: `guard_trained_copies`).

    Called whenever a weight is quantized (`attach`); with peft not loaded
    yet, as soon as peft loads its tuners."""
    tuners_utils = sys.modules.get(_TUNERS_UTILS)
    if tuners_utils is None:
        _GuardWhenPeftLoads.wait()
        return
    guard_merges(tuners_utils)
    guard_trained_copies(sys.modules.get(_OTHER_UTILS))


def guard_trained_copies(other_utils: ModuleType | None) -> None:
    """peft trains a copy of each module named in `modules_to_save` (a
    sequence classifier's head, with `task_type="SEQ_CLS"`), made when it
    wraps the model: a copy of a module whose weight this library stores as
    integers trains its float parameters alone (a bias), its weight frozen.
    peft's wrapper is extended, once, to warn, naming the module (a warning,
    not an error: peft has wrapped other modules by then)."""
    wrapper = getattr(other_utils, "ModulesToSaveWrapper", None)
    update = getattr(wrapper, "update", None)
    if update is None or getattr(update, _GUARDED, False):
        return

    @functools.wraps(update)
    def _update(self: Any, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        result = update(self, adapter_name, *args, **kwargs)
        copies = getattr(self, "modules_to_save", {})
        copy = copies[adapter_name] if adapter_name in copies else None  # noqa: SIM401 (a ModuleDict has no get)
        frozen = [] if copy is None else _integer_quantized(copy)
        if frozen:
            names = ", ".join(f"'{name}' ({mode})" for name, mode in frozen)
            warnings.warn(
                f"peft trains a copy of a module (`modules_to_save`) that holds integer-"
                f"quantized weights: {names}. Those weights are frozen, so only the copy's "
                "float parameters (biases, norms) will train. Keep the module out of "
                "`quantize()` (`filters=`); quantizing after `get_peft_model` leaves the "
                "copies it made then in floating point, not those a later adapter makes.",
                UserWarning,
                stacklevel=2,
            )
        return result

    setattr(_update, _GUARDED, True)
    setattr(wrapper, "update", _update)  # noqa: B010


def _integer_quantized(module: torch.nn.Module) -> list[tuple[str, str]]:
    """`(path, mode)` of each module under `module` (itself included) whose
    weight this library stores as integers."""
    found = []
    for name, child in module.named_modules():
        quantized = quantization_of(child)
        if quantized is not None and not quantized.scheme.keeps_float_weight:
            found.append((quantized.path or name or type(child).__name__, quantized.mode))
    return found


def guard_merges(tuners_utils: ModuleType) -> None:
    """peft merges a model's adapters tuner by tuner (`merge_and_unload()`,
    `merge_adapter()`) through `.data`, which moves no version counter.
    Before merging anything it checks the model can be merged
    (`BaseTuner._check_merge_allowed`, where it refuses GPTQ models of its
    own); that check is extended, once, so that:

    * a model holding a tuner on a base whose weight this library stores
      quantized is refused (its write would raise `TypeError` after the
      tuners before it were merged, and unloaded, already): nothing merges;
    * every tuner's base drops its kept casts (a float8 base keeps its float
      weight, and would go on computing from the cast of the unmerged one),
      and tuners are watched, so that a later `unmerge_adapter()` is seen."""
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


class _GuardWhenPeftLoads(importlib.abc.MetaPathFinder):
    """An import hook, waiting in `sys.meta_path` from the first quantized
    weight of a process that has not imported peft: when peft's tuners module
    loads, it lets the other finders find the module, and runs
    `guard_peft` once the module has executed. It finds nothing
    itself, and leaves `sys.meta_path` when the module has loaded."""

    _lock = threading.Lock()
    _waiting: _GuardWhenPeftLoads | None = None

    @classmethod
    def wait(cls) -> None:
        with cls._lock:
            if cls._waiting is None:
                cls._waiting = cls()
                sys.meta_path.insert(0, cls._waiting)

    @classmethod
    def stop(cls) -> None:
        with cls._lock:
            if cls._waiting in sys.meta_path:
                sys.meta_path.remove(cls._waiting)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TUNERS_UTILS:
            return None
        for finder in [f for f in sys.meta_path if f is not self]:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _GuardAfterExec(spec.loader)
        return spec


class _GuardAfterExec(importlib.abc.Loader):
    """peft's own loader, which runs `guard_peft` after executing
    the module (everything else is the loader's)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _GuardWhenPeftLoads.stop()
        guard_peft()

    def __getattr__(self, name: str) -> Any:
        if name == "_loader" or name.startswith("__"):  # copies and pickles start empty
            raise AttributeError(name)
        return getattr(self._loader, name)


def merges_seen(tuner: torch.nn.Module) -> None:
    """Drops the kept casts of a watched `tuner`'s base if its merged
    adapters changed (`merge_and_unload()` replaces the tuner by its base
    right after merging: no call of the tuner sees it)."""
    watch = _watch_of(tuner)
    if watch is not None:
        watch(tuner, ())
