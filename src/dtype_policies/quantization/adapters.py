"""The adapters of parameter-efficient fine-tuning, which quantization leaves
in floating point.

A PEFT tuner layer (`peft`'s `BaseTunerLayer`: LoRA, AdaLoRA, LoHa, ...)
wraps a base module and holds its trainable adapters in the containers it
names in `adapter_layer_names` (LoRA: `lora_A`, `lora_B` and their embedding
forms). The base is what quantization is for (QLoRA: a quantized base, float
adapters trained on it); an adapter quantized would no longer train (its
parameters become integer buffers: an optimizer made before steps tensors the
model no longer reads), so `quantize()` skips adapters, reported as
`"adapter"`, whatever the filters. Read by duck typing: nothing here imports
`peft`.

>>> import torch
>>> class Tuned(torch.nn.Module):  # the shape of a LoRA layer
...     adapter_layer_names = ("lora_A", "lora_B")
...     def __init__(self):
...         super().__init__()
...         self.base_layer = torch.nn.Linear(8, 8)
...         self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(8, 2)})
...         self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 8)})
>>> tuned = Tuned()
>>> found = adapter_modules(tuned.modules())
>>> id(tuned.lora_A["default"]) in found, id(tuned.base_layer) in found
(True, False)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adapter_modules(modules: Iterable[torch.nn.Module]) -> set[int]:
    """The ids of every module inside an adapter container of a tuner layer
    among `modules` (a model's modules)."""
    found: set[int] = set()
    for module in modules:
        names = getattr(type(module), "adapter_layer_names", None)
        if not isinstance(names, tuple):
            continue
        for name in names:
            container = module._modules.get(name)
            if isinstance(container, torch.nn.Module):
                found.update(id(inner) for inner in container.modules())
    return found
