"""The benchmark workloads: each module registers its own with
`registry.register(...)`; every module of this package is imported here (the
suite's own first, in table order, then any other, by name), so a new
workload is a new file."""

import importlib
import pkgutil

from dtype_policies.bench.registry import WORKLOADS, register

_FIRST = ("mlp", "small", "llm", "real_models")
_OTHERS = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _FIRST)
for _name in (*_FIRST, *_OTHERS):
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["WORKLOADS", "register"]
