"""Sensitivity: the end-to-end error of the model when only one group of
units changes precision, measured by swapping copies of just those modules
into the advisor's working model (and always putting the originals back)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dtype_policies._core.slots import swap_child
from dtype_policies._paths import root_path_of
from dtype_policies.advisor.errors import ErrorMeter


@contextlib.contextmanager
def swapped(
    model: torch.nn.Module, replacements: dict[str, torch.nn.Module]
) -> Iterator[torch.nn.Module]:
    """Within the block, the modules at these paths (the advisor's: under the
    root's own path, a layer's name) are the replacements; yields the model
    to call (the replacement itself when the root is one)."""
    root = root_path_of(model)
    target = replacements.get(root, model)
    restore = []
    try:
        for path, replacement in replacements.items():
            if path == root:
                continue
            path = path[len(root) + 1 :] if root else path
            parent_path, _, name = path.rpartition("/")
            parent = target.get_submodule(parent_path.replace("/", ".")) if parent_path else target
            restore.append((parent, name, swap_child(parent, name, replacement)))
        yield target
    finally:
        for parent, name, original in reversed(restore):
            swap_child(parent, name, original)


def group_error(
    model: torch.nn.Module, replacements: dict[str, torch.nn.Module], meter: ErrorMeter
) -> float:
    """The error of `model` with these modules replaced."""
    with swapped(model, replacements) as target:
        return meter(target)
