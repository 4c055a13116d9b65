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

The root of a model `quantize()` or a loader changed need not be policied
itself: `guard_loading` gives it the same whole-tree check (a load pre-hook).
"""

from __future__ import annotations

import torch

from dtype_policies._core.module_state import quantization_of
from dtype_policies._modes import module_buffer_modes, quantized_suffixes, stored_suffixes


def check_checkpoint(root: torch.nn.Module, state_dict: dict, prefix: str) -> None:
    """Raises `ValueError` if `state_dict` cannot load into the tree at `root`
    (loaded under `prefix`); reads only, changes nothing."""
    suffixes = quantized_suffixes()
    buffer_modes = module_buffer_modes()
    if not any(_quantized_key(key, suffixes, buffer_modes) for key in state_dict) and not any(
        quantization_of(module) is not None for module in root.modules()
    ):
        return
    refused: list[str] = []
    for name, module in root.named_modules(prefix=prefix[:-1]):
        module_prefix = f"{name}." if name else ""
        own_check = getattr(module, "_dp_check_checkpoint", None)
        if own_check is not None:
            own_check(state_dict, module_prefix)
        quantized = quantization_of(module)
        if quantized is not None:
            quantized.check_checkpoint(module, state_dict, module_prefix)
            continue
        refused += [
            module_prefix + weight + suffix
            for weight in module._parameters
            for suffix in suffixes
            if module_prefix + weight + suffix in state_dict
        ]
        refused += foreign_module_buffers(module, state_dict, module_prefix)
    if refused:
        paths = sorted({key.rsplit(".", 1)[0] if "." in key else "(root)" for key in refused})
        raise ValueError(
            f"The checkpoint holds quantized state {refused}, but the module(s) {paths} "
            "are not quantized. Quantize the model the same way (quantize() with the same "
            "mode and config) before loading; nothing was loaded."
        )


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


def _quantized_key(key: str, suffixes: tuple[str, ...], buffer_modes: dict[str, str]) -> bool:
    return key.endswith(suffixes) or key.rsplit(".", 1)[-1] in buffer_modes


def guard_loading(root: torch.nn.Module) -> None:
    """Makes `root` check its whole subtree (`check_checkpoint`) before any
    of a `load_state_dict` into it loads, once (a pre-hook, kept by copies)."""
    for hook in root._load_state_dict_pre_hooks.values():
        if getattr(hook, "hook", hook) is _check_before_loading:
            return
    root.register_load_state_dict_pre_hook(_check_before_loading)


def _check_before_loading(
    module: torch.nn.Module, state_dict: dict, prefix: str, *_: object
) -> None:
    check_checkpoint(module, state_dict, prefix)
