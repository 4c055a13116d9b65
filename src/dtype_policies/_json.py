"""JSON that every parser reads: no `NaN` or `Infinity` (Python's `json`
writes them by default; `jq` and `JSON.parse` refuse them)."""

from __future__ import annotations

import math
from typing import Any


def strict(value: Any) -> Any:
    """`value` with every non-finite float (a failed measurement's NaN) as
    None, through dicts, lists and tuples.

    >>> strict({"ms": float("nan"), "rows": [1.5, float("inf")]})
    {'ms': None, 'rows': [1.5, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value
