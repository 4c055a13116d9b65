"""Rules that pick modules: a class (subclasses match), a class-name suffix
(`"Norm"` matches `LlamaRMSNorm`), or a callable `(path, module) -> bool`.
Used by `apply_policy(float32_modules=...)` and `distributed.fully_shard(units=...)`."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from dtype_policies._core.compose import original_class

ModuleRule = type[torch.nn.Module] | str | Callable[[str, torch.nn.Module], bool]


def matches_any(path: str, module: torch.nn.Module, rules: Iterable[ModuleRule]) -> bool:
    """Whether `module` (at `path`) is picked by any of `rules`; a policied
    module is judged by its original class."""
    cls = original_class(module)
    for rule in rules:
        if isinstance(rule, type):
            if issubclass(cls, rule):
                return True
        elif isinstance(rule, str):
            if cls.__name__.endswith(rule):
                return True
        elif rule(path, module):
            return True
    return False
