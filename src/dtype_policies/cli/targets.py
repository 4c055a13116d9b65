"""What a command-line TARGET names: a model factory (`package.module:factory`)
or a checkpoint written by `dtype_policies.saving.save`."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import torch


class CLIError(Exception):
    """A problem with what the user asked for: printed as one line, exit code 1."""


def is_checkpoint(target: str) -> bool:
    """A `saving.save` file or directory, or a `save_pretrained` directory."""
    path = Path(target)
    return (
        path.suffix == ".safetensors"
        or (path / "model.safetensors").is_file()
        or ((path / "config.json").is_file() and any(path.glob("*.safetensors")))
    )


def _put_working_directory_on_path() -> None:
    """The console script's `sys.path` starts with its own `bin/` directory, not
    the working directory as `python -m` does; factories next to the user are
    found either way (as uvicorn and gunicorn do)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def load_callable(target: str, what: str = "TARGET") -> Any:
    """The callable `package.module:attribute` names (`what` names the
    argument in errors)."""
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise CLIError(f"{what} {target!r} is not 'package.module:callable'.")
    _put_working_directory_on_path()
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise CLIError(f"cannot import {module_name!r} from {what} {target!r}: {e}") from e
    missing = object()
    found: Any = module
    for part in attribute.split("."):
        found = getattr(found, part, missing)
        if found is missing:
            raise CLIError(f"{module_name!r} has no attribute {attribute!r} ({what} {target!r})")
    if not callable(found):
        raise CLIError(f"{target!r} is not callable (expected a function)")
    return found


def build_model(target: str) -> torch.nn.Module:
    """Calls the factory `package.module:callable` and returns its model (or
    returns the model `package.module:name` names)."""
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise CLIError(
            f"TARGET {target!r} is neither 'package.module:factory' nor a checkpoint "
            "(a .safetensors file or a directory written by dtype_policies.saving.save)."
        )
    factory = load_callable(target)
    if isinstance(factory, torch.nn.Module):  # callable too, but the model itself
        return factory
    try:
        model = factory()
    except Exception as e:
        raise CLIError(f"calling {target!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise CLIError(f"{target!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model
