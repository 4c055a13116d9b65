"""Rules that pick modules: a class (subclasses match), a class-name suffix
(`"Norm"` matches `LlamaRMSNorm`), or a callable `(path, module) -> bool`.
Used by `apply_policy(float32_modules=...)` and `distributed.fully_shard(units=...)`."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from dtype_policies._core.compose import original_class

ModuleRule = type[torch.nn.Module] | str | Callable[[str, torch.nn.Module], bool]


def module_rules(value: object, argument: str) -> tuple[ModuleRule, ...]:
    """`value` as a tuple of rules: one rule on its own (a class, a suffix, a
    callable) or an iterable of them. Raises TypeError naming `argument` for
    anything else, a module instance included (its `__call__` is not a rule).

    >>> module_rules("Norm", "float32_modules")
    ('Norm',)
    >>> module_rules([torch.nn.LayerNorm, "Norm"], "float32_modules")
    (<class 'torch.nn.modules.normalization.LayerNorm'>, 'Norm')
    """
    if _is_rule(value):
        return (value,)  # type: ignore[return-value]
    if isinstance(value, torch.nn.Module) or not isinstance(value, Iterable):
        raise TypeError(
            f"{argument} must be a module class, a class-name suffix, a callable "
            f"(path, module) -> bool, or an iterable of them. Received: {value!r}"
        )
    rules = tuple(value)
    for rule in rules:
        if not _is_rule(rule):
            instance = isinstance(rule, torch.nn.Module)
            raise TypeError(
                f"{argument} entries must be module classes, class-name suffixes or "
                f"callables (path, module) -> bool. Received: {rule!r}"
                + (" (a module instance: pass its class)" if instance else "")
            )
    return rules


def _is_rule(value: object) -> bool:
    if isinstance(value, type):
        return issubclass(value, torch.nn.Module)
    return isinstance(value, str) or (callable(value) and not isinstance(value, torch.nn.Module))


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
