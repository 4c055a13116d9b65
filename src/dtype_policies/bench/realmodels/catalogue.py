"""Every variant of the real-model tables, ours then the peers', and the
selection of a run's variants from the command line's names."""

from __future__ import annotations

import fnmatch

from dtype_policies.bench.realmodels.peers import PEERS
from dtype_policies.bench.realmodels.variants import OURS, Variant


def all_variants() -> list[Variant]:
    """Ours, then the peers."""
    return [*OURS, *PEERS]


def select(names: str | None, model: str, skip: str | None = None) -> list[Variant]:
    """The variants applying to `model`, all or those named in a comma-separated
    list, less those matching a comma-separated list of `skip` patterns
    (`fnmatch`: `"gptq/*,awq/*"`); float32, the reference, is always included."""
    available = [v for v in all_variants() if model in v.models]
    if skip:
        patterns = [p.strip() for p in skip.split(",") if p.strip()]
        available = [
            v
            for v in available
            if v.name == "float32" or not any(fnmatch.fnmatchcase(v.name, p) for p in patterns)
        ]
    if not names:
        return available
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    by_name = {v.name: v for v in available}
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise ValueError(f"unknown variants {unknown} for {model}; choose from {list(by_name)}")
    return [by_name["float32"]] + [by_name[n] for n in wanted if n != "float32"]
