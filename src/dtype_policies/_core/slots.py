"""A module's own tensors and children, read and written in their slots.

torch keeps them in `module._parameters`, `module._buffers` and
`module._modules`. Going through attributes instead (`getattr`,
`register_buffer`, `setattr`) would run the hooks a policy or a quantization
installs on a module (weights read in the compute dtype, state re-derived on
registration); the saving and advisor tools need the tensors as stored, and
changes that leave that state alone. Keys are dotted paths from `root`
(`"encoder.0.weight"`), as in `state_dict`.
"""

from __future__ import annotations

import torch


def _owner_and_name(root: torch.nn.Module, key: str) -> tuple[torch.nn.Module, str]:
    owner, _, name = key.rpartition(".")
    return root.get_submodule(owner), name


def own_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters registered on `module` itself (not its children), as stored."""
    return [p for p in module._parameters.values() if p is not None]


def stored_parameter(root: torch.nn.Module, key: str) -> torch.nn.Parameter | None:
    """The parameter at `key` as stored (`None` if that slot is empty or absent)."""
    owner, name = _owner_and_name(root, key)
    return owner._parameters.get(name)


def replace_parameter(
    root: torch.nn.Module, key: str, parameter: torch.nn.Parameter | None
) -> bool:
    """Puts `parameter` in the parameter slot at `key`, if there is one; returns
    whether there was."""
    owner, name = _owner_and_name(root, key)
    if name not in owner._parameters:
        return False
    owner._parameters[name] = parameter
    return True


def stored_buffer(root: torch.nn.Module, key: str) -> torch.Tensor | None:
    """The buffer at `key` as stored (`None` if that slot is empty or absent;
    `AttributeError` if the module owning it does not exist)."""
    owner, name = _owner_and_name(root, key)
    return owner._buffers.get(name)


def replace_buffer(root: torch.nn.Module, key: str, tensor: torch.Tensor) -> None:
    """Puts `tensor` in the buffer slot at `key`, which keeps its persistence."""
    owner, name = _owner_and_name(root, key)
    owner._buffers[name] = tensor


def non_persistent_buffer_names(module: torch.nn.Module) -> list[str]:
    """The names of `module`'s own non-persistent buffers that hold a tensor, sorted."""
    return sorted(
        name for name in module._non_persistent_buffers_set if module._buffers.get(name) is not None
    )


def swap_child(
    parent: torch.nn.Module, name: str, child: torch.nn.Module | None
) -> torch.nn.Module | None:
    """Puts `child` in `parent`'s child slot `name`; returns the module it held."""
    previous = parent._modules[name]
    parent._modules[name] = child
    return previous
