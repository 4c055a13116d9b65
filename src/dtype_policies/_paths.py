"""Module paths: `/`-joined module names from a root (the Keras `layer.path` form)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def join(parent: str, child: str) -> str:
    return f"{parent}/{child}" if parent and child else parent or child


def named_module_paths(
    root: torch.nn.Module, root_path: str = ""
) -> Iterator[tuple[str, torch.nn.Module]]:
    """Yields `(path, module)` for `root` and every submodule, depth first.

    `root` itself has the path `root_path`; a submodule's path is its torch
    dotted name with `/` separators, prefixed by `root_path`. A module reachable
    by several routes is listed once, under its first path (as torch does).
    """
    for dotted, module in root.named_modules():
        yield join(root_path, dotted.replace(".", "/")), module


def root_path_of(module: torch.nn.Module) -> str:
    """The path a model's root has: a named layer's path (or name), else `""`."""
    if not hasattr(module, "built"):  # not one of this library's layers
        return ""
    path, name = getattr(module, "path", None), getattr(module, "name", None)
    return path if isinstance(path, str) else name if isinstance(name, str) else ""
