"""What Dynamo keeps per compiled model, and what it runs eagerly: each model
compiled with frozen weights (`_frozen.FrozenCompiledCall`) gets Dynamo
frames of its own, and word of the frames Dynamo gives up on.

Dynamo keeps compiled code per *code object* and stops compiling a code
object after `torch._dynamo.config.recompile_limit` (8) entries, running it
eagerly from then on, silently. A frame every compiled model goes through
(`torch.compile` wraps a `functools.partial` in one shared function of its
own) would run the ninth model of a process eagerly. So:

* `own_step()`: the compiled call's outermost frame is a function with a code
  object of its own, called with the model's call as its first argument;
* `isolated()`: on torch versions that have it (`isolate_recompiles`), every
  frame compiled inside one model's call (a function Dynamo compiles as a
  frame of its own after a graph break) keeps its compiled entries apart
  from other models';
* `skip_guards_on_the_models_modules`: Dynamo's guards on the model's modules
  are dropped in that outermost frame only (its `ModelWatch` stands in for
  them), never in a frame shared by several modules, whose entries are told
  apart by them;
* `EagerFrames`: a call during which Dynamo gave up on a frame (the
  recompile limit, an unsupported construct outside a graph break) names
  the reasons, read from Dynamo's own counts.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

MODEL_CALL = "frozen_model_call"
"""The outermost compiled frame's argument holding the model's call (the root
of the sources of the guards on its modules)."""


def _step(frozen_model_call: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return frozen_model_call(*args, **kwargs)


_STEPS = itertools.count()


def own_step() -> types.FunctionType:
    """`_step` with a code object of its own: Dynamo's compiled entries and
    their recompile limit are per code object, so one per compiled model.
    Its name is its own too: Dynamo keys what it learns of a frame's shapes
    (automatic dynamic) by file, line and name, and a second model's first
    call, of another width, was compiled with that width symbolic.

    >>> first, second = own_step(), own_step()
    >>> first.__code__ is second.__code__, first.__code__.co_name == second.__code__.co_name
    (False, False)
    """
    name = f"_step_{next(_STEPS)}"
    code = _step.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):  # Python 3.11+
        options: dict[str, Any] = {"co_qualname": name}
        code = code.replace(**options)
    return types.FunctionType(code, _step.__globals__, name)


@functools.cache
def isolated() -> dict[str, Any]:
    """`torch.compile`'s option keeping the entries compiled in one call's
    frames apart (torch 2.13's `isolate_recompiles`), or nothing before it."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return {"isolate_recompiles": True}
    return {}


def _root(source: Any) -> Any:
    while getattr(source, "base", None) is not None:
        source = source.base
    return source


def skip_guards_on_the_models_modules(entries: Sequence[Any]) -> list[bool]:
    """A `guard_filter_fn` (torch >= 2.8) dropping the guards on modules
    reached from the outermost frame's `MODEL_CALL`, and keeping every other
    guard: a module's forward that Dynamo compiles as a frame of its own (after
    a graph break) is shared by all instances of its class, and only these
    guards keep one instance from running another's frozen weights."""
    return [
        not (
            entry.orig_guard.source.is_unspecialized_nn_module()
            and getattr(_root(entry.orig_guard.originating_source), "local_name", None)
            == MODEL_CALL
        )
        for entry in entries
    ]


@functools.cache
def _dynamo_counters() -> Any:
    # read at the first compiled call, so that importing the package does not import Dynamo
    from torch._dynamo.utils import counters

    return counters


class EagerFrames:
    """Dynamo's count of the frames it gave up on, read around a call: Dynamo
    counts each unsupported construct it met (`counters["unimplemented"]`),
    and moves those it handled by breaking the graph to another count, so
    what stays new after a call is a frame that ran eagerly.

    Reading it costs a few lookups per call while nothing compiles: the
    counts are copied only when Dynamo tried a frame, or counted an
    unsupported construct, since the last copy (a frame refused under
    `fullgraph=True` counts its reason without counting as tried).

    >>> frames = EagerFrames()
    >>> mark = frames.mark()
    >>> frames.given_up_since(mark)
    []
    """

    __slots__ = ("copy",)

    def __init__(self) -> None:
        self.copy: tuple[tuple[int, int], dict[str, int]] = ((-1, -1), {})

    @staticmethod
    def _state() -> tuple[int, int]:
        counters = _dynamo_counters()
        return counters["frames"]["total"], sum(counters["unimplemented"].values())

    def mark(self) -> tuple[tuple[int, int], dict[str, int]]:
        """Dynamo's counts now (the last copy, while nothing was counted since)."""
        state = self._state()
        if state != self.copy[0]:
            self.copy = (state, dict(_dynamo_counters()["unimplemented"]))
        return self.copy

    def given_up_since(self, mark: tuple[tuple[int, int], dict[str, int]]) -> list[str]:
        """The first line of each reason Dynamo gave up on a frame since `mark`."""
        if self._state() == mark[0]:
            return []
        before = mark[1]
        return [
            reason.strip().splitlines()[0]
            for reason, count in self.mark()[1].items()
            if count > before.get(reason, 0) and reason.strip()
        ]
