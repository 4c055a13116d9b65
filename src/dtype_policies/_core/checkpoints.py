"""Checks a checkpoint against a whole module tree before any of it loads.

`load_state_dict` visits a module, then its children: a module of ours that
refused a checkpoint in its own turn would leave its earlier siblings loaded.
The root of a load (any policied module or `Layer`) checks its whole subtree
first, so a checkpoint that cannot load changes nothing:

* quantized weights (`<w>_int8`, `<w>_int4`: the data suffix of every
  registered mode) for a module that is not quantized raise `ValueError`
  naming the keys (never int8 values cast into float weights);
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
from dtype_policies._modes import quantized_suffixes


def check_checkpoint(root: torch.nn.Module, state_dict: dict, prefix: str) -> None:
    """Raises `ValueError` if `state_dict` cannot load into the tree at `root`
    (loaded under `prefix`); reads only, changes nothing."""
    suffixes = quantized_suffixes()
    if not any(key.endswith(suffixes) for key in state_dict) and not any(
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
    if refused:
        paths = sorted({key.rsplit(".", 1)[0] if "." in key else "(root)" for key in refused})
        raise ValueError(
            f"The checkpoint holds quantized weights {refused}, but the module(s) {paths} "
            "are not quantized. Quantize the model the same way (quantize() with the same "
            "mode and config) before loading; nothing was loaded."
        )


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
