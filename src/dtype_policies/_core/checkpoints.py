"""Checks a checkpoint against a whole module tree before any of it loads.

`load_state_dict` visits a module, then its children: a module of ours that
refused a checkpoint in its own turn would leave its earlier siblings loaded.
The root of a load (any policied module or `Layer`) checks its whole subtree
first, so a checkpoint that cannot load changes nothing:

* quantized weights (`<w>_int8`, `<w>_int4`: the data suffix of every
  registered mode), or a mode's own buffers (float8's `kernel_scale`, ...),
  for a module that is not quantized raise `ValueError` naming the keys
  (never int8 values cast into float weights, nor float8's weights loaded
  before torch refuses its scales);
* a quantized module checks its own keys (`QuantizedWeight.check_checkpoint`:
  another mode, or the same mode stored with another layout);
* a module with a `_dp_check_checkpoint(state_dict, prefix)` method checks
  its own (a mixture-of-experts block expanded into one linear per expert:
  the fused tensors it splits on loading).

* every tensor of the checkpoint that a module of the tree loads as torch
  does (its class's `_load_from_state_dict` is torch's or marked
  `loads_as_torch`, no foreign load pre-hook) has the shape of the parameter
  or buffer it goes into: torch refuses another shape only after copying the
  tensors before it.

Every problem found is listed in one `CheckpointError`. Missing and
unexpected keys are torch's to report: a module cannot tell whether the load
is strict (torch passes `strict=True` to every module and applies the real
`strict` at the end).

The root of a model `quantize()` or a loader changed need not be policied
itself: `guard_loading` gives it the same whole-tree check (a load pre-hook).

torch calls every module's `_load_from_state_dict` in one `load_state_dict`,
so `check_before_loading` checks a subtree once per call: a module whose
enclosing module already checked it, in the same call (torch's `missing_keys`
list, one per call) with the same tensors, is not checked again. A module
that a pre-hook above it handed other tensors is checked again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from dtype_policies._core.module_state import quantization_of
from dtype_policies._modes import module_buffer_modes, quantized_suffixes, stored_suffixes

_Function = TypeVar("_Function", bound=Callable[..., Any])


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that does not fit the target module.

    >>> import pathlib, tempfile, torch
    >>> from dtype_policies import saving
    >>> path = saving.save(torch.nn.Linear(4, 2), pathlib.Path(tempfile.mkdtemp()) / "m")
    >>> try:
    ...     saving.load(torch.nn.Linear(4, 3), path)
    ... except saving.CheckpointError as e:
    ...     print(type(e).__mro__[1].__name__)
    ValueError
    """


@dataclass
class _CheckedSubtree:
    """One `check_checkpoint` run inside a `load_state_dict` call."""

    load_call: list  # torch's `missing_keys` of the call: one list per call
    prefix: str
    entries: dict[str, int]  # key -> id of the value checked (alive through the call)

    def covers(self, load_call: list, state_dict: dict, prefix: str) -> bool:
        entries = self.entries
        return (
            load_call is self.load_call
            and prefix.startswith(self.prefix)
            and all(entries.get(key) == id(value) for key, value in state_dict.items())
        )


class _CheckedInThread(threading.local):
    def __init__(self) -> None:
        # the latest checks (a few: nested loads), newest last
        self.subtrees: list[_CheckedSubtree] = []


_checked = _CheckedInThread()
_KEPT_CHECKS = 16


def check_before_loading(
    module: torch.nn.Module, state_dict: dict, prefix: str, args: tuple, kwargs: dict
) -> None:
    """`check_checkpoint` from a `_load_from_state_dict(state_dict, prefix,
    *args, **kwargs)`, unless an enclosing module checked this subtree with
    these tensors earlier in the same `load_state_dict` call."""
    load_call = args[2] if len(args) > 2 else kwargs.get("missing_keys")
    if not isinstance(load_call, list):  # called by other code: check every time
        check_checkpoint(module, state_dict, prefix)
        return
    subtrees = _checked.subtrees
    if any(checked.covers(load_call, state_dict, prefix) for checked in reversed(subtrees)):
        return
    check_checkpoint(module, state_dict, prefix)
    entries = {key: id(value) for key, value in state_dict.items()}
    subtrees.append(_CheckedSubtree(load_call, prefix, entries))
    del subtrees[:-_KEPT_CHECKS]


def check_checkpoint(root: torch.nn.Module, state_dict: dict, prefix: str) -> None:
    """Raises `CheckpointError` (a `ValueError`) listing every way `state_dict`
    cannot load into the tree at `root` (loaded under `prefix`); reads only,
    changes nothing."""
    suffixes = quantized_suffixes()
    problems: list[str] = []
    refused: list[str] = []
    for name, module in root.named_modules(prefix=prefix[:-1]):
        module_prefix = f"{name}." if name else ""
        own_check = getattr(module, "_dp_check_checkpoint", None)
        if own_check is not None:
            _collect(problems, own_check, state_dict, module_prefix)
        quantized = quantization_of(module)
        if quantized is not None:
            _collect(problems, quantized.check_checkpoint, module, state_dict, module_prefix)
        else:
            refused += [
                module_prefix + weight + suffix
                for weight in module._parameters
                for suffix in suffixes
                if module_prefix + weight + suffix in state_dict
            ]
            refused += foreign_module_buffers(module, state_dict, module_prefix)
        if _loads_as_torch(module):
            own = () if quantized is None else quantized.stored_names
            problems += _shape_mismatches(module, state_dict, module_prefix, frozenset(own))
    if refused:
        paths = sorted({key.rsplit(".", 1)[0] if "." in key else "(root)" for key in refused})
        unbuilt = [path for path in paths if _unbuilt_layer(root, _relative(path, prefix))]
        advice = (
            f"The layer(s) {unbuilt} are not built yet (no weights to load into): build "
            "them first (`layer.build(input_shape)`; a layer made by from_config of a "
            "quantized layer takes its quantized weights once built)"
            if unbuilt
            else "Quantize the model the same way (quantize() with the same mode and config) "
            "before loading"
        )
        problems.insert(
            0,
            f"The checkpoint holds quantized state {refused}, but the module(s) {paths} "
            f"are not quantized. {advice}; nothing was loaded.",
        )
    if len(problems) == 1:
        raise CheckpointError(problems[0])
    if problems:
        raise CheckpointError(
            "The checkpoint does not fit the module; nothing was loaded:\n  "
            + "\n  ".join(problems)
        )


def _unbuilt_layer(root: torch.nn.Module, path: str) -> bool:
    """Whether the module at `path` is a layer not built yet (Keras's `built`)."""
    try:
        return getattr(root.get_submodule(path), "built", True) is False
    except AttributeError:
        return False


def _relative(path: str, prefix: str) -> str:
    """The submodule path (torch's dotted) of a key's module `path` (the
    checkpoint's, under `prefix`; "(root)" for the root)."""
    if path == "(root)" or path == prefix[:-1]:
        return ""
    return path[len(prefix) :] if prefix and path.startswith(prefix) else path


def _collect(problems: list[str], check: Callable[..., None], *args: Any) -> None:
    try:
        check(*args)
    except ValueError as e:
        problems.append(str(e))


def loads_as_torch(function: _Function) -> _Function:
    """Marks a `_load_from_state_dict` of this library's classes that loads
    the module's own tensors as torch does (it checks, or adapts a quantized
    weight that `check_checkpoint` checks through its `QuantizedWeight`)."""
    function._dp_loads_as_torch = True  # type: ignore[attr-defined]
    return function


def _loads_as_torch(module: torch.nn.Module) -> bool:
    """Whether `module` loads its own tensors by torch's rules: every
    `_load_from_state_dict` of its classes is torch's or marked, and no
    load pre-hook but this library's may rename or reshape what it reads."""
    for cls in type(module).__mro__:
        function = vars(cls).get("_load_from_state_dict")
        if function is None:
            continue
        if not (
            getattr(function, "__module__", "").startswith("torch.nn.")
            or getattr(function, "_dp_loads_as_torch", False)
        ):
            return False
    return all(
        getattr(hook, "hook", hook) is _check_before_loading
        for hook in module._load_state_dict_pre_hooks.values()
    )


def _shape_mismatches(
    module: torch.nn.Module, state_dict: dict, prefix: str, left: frozenset[str]
) -> list[str]:
    """The module's own parameters and persistent buffers (but those named in
    `left`) whose checkpoint tensor torch would refuse: another shape (a 0-d
    tensor takes a 1-d one, as in torch), or not a tensor."""
    persistent = [
        (name, buffer)
        for name, buffer in module._buffers.items()
        if name not in module._non_persistent_buffers_set
    ]
    found = []
    for name, tensor in [*module._parameters.items(), *persistent]:
        key = prefix + name
        if tensor is None or name in left or key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            found.append(
                f"'{key}': the checkpoint holds a {type(value).__name__}, the module a tensor "
                f"of shape {tuple(tensor.shape)}"
            )
        elif not (
            torch.nn.parameter.is_lazy(tensor)
            or tuple(value.shape) == tuple(tensor.shape)
            or (tensor.dim() == 0 and value.dim() == 1)
        ):
            found.append(
                f"'{key}': shape {tuple(value.shape)} in the checkpoint, "
                f"{tuple(tensor.shape)} in the module"
            )
    return found


def foreign_module_buffers(
    module: torch.nn.Module, state_dict: dict, prefix: str, expected: frozenset[str] = frozenset()
) -> list[str]:
    """The keys of `state_dict` under `prefix` that are a mode's own buffers
    (float8's `kernel_scale`, ...) which `module` neither holds nor `expected`.
    A name that is also a weight's stored tensor (int8's `kernel_scale` of a
    `kernel`) is left to the weight's checks."""
    parameters = [name for name, _ in module.named_parameters(recurse=False)]
    own = set(parameters) | {name for name, _ in module.named_buffers(recurse=False)}
    own |= {weight + suffix for weight in parameters for suffix in stored_suffixes()}
    return [
        prefix + name
        for name in module_buffer_modes()
        if prefix + name in state_dict and name not in own and name not in expected
    ]


def guard_loading(root: torch.nn.Module) -> None:
    """Makes `root` check its whole subtree (`check_checkpoint`) before any
    of a `load_state_dict` into it loads, once (a pre-hook, kept by copies)."""
    for hook in root._load_state_dict_pre_hooks.values():
        if getattr(hook, "hook", hook) is _check_before_loading:
            return
    root.register_load_state_dict_pre_hook(_check_before_loading)


def _check_before_loading(
    module: torch.nn.Module, state_dict: dict, prefix: str, *args: object
) -> None:
    check_before_loading(module, state_dict, prefix, args, {})
