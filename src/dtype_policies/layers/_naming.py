"""Default layer names: `dense`, `dense_1`, ... unique in the process."""

from __future__ import annotations

import re
import threading

_name_counts: dict[str, int] = {}
_name_lock = threading.Lock()


def to_snake_case(name: str) -> str:
    """`"MultiHeadAttention"` -> `"multi_head_attention"`."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def auto_name(class_name: str) -> str:
    """A process-unique default layer name: `dense`, `dense_1`, `dense_2`, ..."""
    base = to_snake_case(class_name)
    with _name_lock:
        count = _name_counts.get(base, 0)
        _name_counts[base] = count + 1
    return base if count == 0 else f"{base}_{count}"
