"""The registry of benchmark workloads: registering one is one line,
`register(key, title, build, ...)`, in its own module of
`dtype_policies.bench.workloads` (every module there is imported, so a new
file drops in).

A workload either builds its variants (`build() -> ({name: call}, notes)`;
the runner times them with `harness.measure_interleaved` and tables ratios
against `reference` and `baseline`), or times itself through the same
harness (`run(context) -> Section`, for workloads with their own table, such
as the real models' quality beside speed).

>>> w = register("demo_noop", "A no-op", lambda: ({"float32": lambda: None}, {}))
>>> w.reference, WORKLOADS["demo_noop"] is w
('float32', True)
>>> del WORKLOADS["demo_noop"]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Variants = dict[str, Callable[[], object]]


@dataclass
class RunContext:
    """What a self-timing workload gets from the runner."""

    quick: bool
    output: Path
    machine: dict[str, str]
    variants: str | None = None
    speed_only: bool = False
    charts: Path | None = None  # where the real models' charts go (default: `output`)
    skip: str | None = None  # real-model variants left out (fnmatch patterns)


@dataclass
class Section:
    """A self-timing workload's markdown, and what goes into latest.json."""

    markdown: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    build: Callable[[], tuple[Variants, dict[str, str]]] | None = None
    reference: str = "float32"
    baseline: str | None = None
    heavy: bool = False  # whole models: fewer repeats
    first_call: str | None = None  # an LLM kind whose first call is measured in a fresh process
    run: Callable[[RunContext], Section] | None = None


WORKLOADS: dict[str, Workload] = {}
"""Every registered workload, in registration order (the suite's table order)."""


def register(
    key: str,
    title: str,
    build: Callable[[], tuple[Variants, dict[str, str]]] | None = None,
    **options: Any,
) -> Workload:
    """Registers a workload under `key` (options: the fields of `Workload`)."""
    if key in WORKLOADS:
        raise ValueError(f"a workload {key!r} is already registered")
    if (build is None) == (options.get("run") is None):
        raise ValueError(f"workload {key!r}: give exactly one of `build` and `run`")
    workload = Workload(key, title, build, **options)
    WORKLOADS[key] = workload
    return workload
