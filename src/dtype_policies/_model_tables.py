"""The token tables a model declares: transformers' `get_input_embeddings()`
and `get_output_embeddings()`, read so that a model without one says
nothing (transformers' base classes raise `NotImplementedError` for models
with no token table, such as Wav2Vec2 and CLIP)."""

from __future__ import annotations

import inspect

import torch


def declared_table(model: torch.nn.Module, getter_name: str) -> torch.nn.Module | None:
    """The module `model.<getter_name>()` returns (`"get_input_embeddings"`,
    `"get_output_embeddings"`), or `None` when it has no such method, its
    method raises, or it returns no module.

    >>> import torch
    >>> class Tokens(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = torch.nn.Embedding(10, 4)
    ...     def get_input_embeddings(self):
    ...         return self.embed
    ...     def get_output_embeddings(self):
    ...         raise NotImplementedError("no head")
    >>> model = Tokens()
    >>> declared_table(model, "get_input_embeddings") is model.embed
    True
    >>> declared_table(model, "get_output_embeddings") is None
    True
    """
    getter = getattr(model, getter_name, None)
    if not inspect.ismethod(getter):
        return None
    try:
        table = getter()
    except Exception:  # a model class without that table (transformers' base classes raise)
        return None
    return table if isinstance(table, torch.nn.Module) else None
