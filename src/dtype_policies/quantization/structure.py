"""Finding the blocks a calibrated quantization walks one at a time, when
the config gives no `quantization_layer_structure`.

The blocks are the longest run of sibling modules of one class (at least
two, each with parameters) held in a `torch.nn.ModuleList` or a sequential
container (`torch.nn.Sequential`, this library's `layers.Sequential`), the
outermost on a tie: the decoder layers of a Hugging Face model
(`model.model.layers`), the encoder layers of a BERT, the repeated blocks of
a Keras-style stack. Everything before the first block (embeddings, the
rotary tables) runs as part of the model's forward when its inputs are
captured.

A found structure is used only if the model really chains it: on one
calibration batch, each block runs once, in order, and each block's first
input equals the previous block's first output (`blocks_chain`). Otherwise
(or when nothing repeats) the whole model is one block.

>>> import torch
>>> model = torch.nn.Sequential(
...     torch.nn.Linear(4, 8), *[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
...                              for _ in range(3)], torch.nn.Linear(8, 2))
>>> [path for path, _ in find_blocks(model)]
['1', '2', '3']
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)


class _LastBlockDone(Exception):
    """Stops the model's forward once the last block has run."""


_Hook = Callable[..., Any]


def in_this_thread(hook: _Hook) -> _Hook:
    """`hook`, acting only in the thread that made it: a calibration's hooks
    see its own runs of the model, and calls of the same model from other
    threads meanwhile (a server) pass through them unobserved (they had
    added their inputs to the statistics and got the calibration's private
    exceptions)."""
    thread = threading.get_ident()

    def only_in_its_thread(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread:
            return hook(*args, **kwargs)
        return None

    return only_in_its_thread


def _is_container(module: torch.nn.Module) -> bool:
    return isinstance(module, _CONTAINERS) or getattr(module, "_is_container", False)


def _has_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _longest_run(children: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    best: list[tuple[str, torch.nn.Module]] = []
    run: list[tuple[str, torch.nn.Module]] = []
    for name, child in children:
        if run and type(child) is type(run[-1][1]) and _has_parameters(child):
            run.append((name, child))
        else:
            run = [(name, child)] if _has_parameters(child) else []
        if len(run) > len(best):
            best = list(run)
    return best


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """`(dotted path, module)` of the model's repeated blocks (see the module
    docstring), or `[]` if nothing repeats."""
    best: list[tuple[str, torch.nn.Module]] = []
    best_depth = 0
    for path, module in model.named_modules():
        if not _is_container(module):
            continue
        run = _longest_run(list(module.named_children()))
        depth = path.count(".") + (1 if path else 0)
        if len(run) >= 2 and (
            len(run) > len(best) or (len(run) == len(best) and depth < best_depth)
        ):
            prefix = f"{path}." if path else ""
            best = [(prefix + name, child) for name, child in run]
            best_depth = depth
    return best


def first_input(args: tuple, kwargs: dict) -> Any:
    """A block's first input: its first positional argument, else its first
    keyword argument holding a tensor."""
    if args:
        return args[0]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def first_output(output: Any) -> Any:
    """A block's first output (a tensor, or the first item of a tuple, list or `ModelOutput`)."""
    if isinstance(output, (tuple, list)):
        return output[0]
    if isinstance(output, torch.Tensor):
        return output
    return output[0]


def blocks_chain(
    blocks: list[torch.nn.Module],
    run_model: Callable[[], Any],
    after_block: Callable[[], None] = lambda: None,
) -> tuple[bool, str]:
    """Whether running the model (`run_model()`) calls each block once, in
    order, each on the previous block's first output and on the first block's
    other arguments (calibration feeds every block those: a block handed a
    second tensor by the one before it, a residual stream, or an attention
    bias the first block computes, would be calibrated on the first block's);
    and if not, why. `after_block()` is called as each block returns.

    Each block's input is compared with the previous block's output as it
    arrives, so that only one block's output is held, not the model's. The
    run stops at the first module called after the last block (what follows
    the blocks, an LM head, need not run), which must not be a block again
    (a model looping over its blocks)."""
    order: list[int] = []
    previous: list[Any] = [None]
    unchained: list[int] = []  # the first block whose input is not the previous output
    first_others: list[Any] = []  # the first block's other arguments
    differing: list[str] = []  # which of them a later block got otherwise
    block_ids = {id(block) for block in blocks}
    after_last: list[Any] = []  # the global hook that stops the run after the last block

    def stop(module: torch.nn.Module, args: tuple) -> None:
        if id(module) not in block_ids:
            raise _LastBlockDone

    def again(index: int):
        def pre_hook(module: torch.nn.Module, args: tuple) -> None:
            if after_last:  # a block called after the last one
                order.append(index)
                raise _LastBlockDone

        return pre_hook

    def record(index: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            current = first_input(args, kwargs)
            others = _other_inputs(module, args, kwargs)
            if not order:
                first_others.append(others)
            elif not unchained and not _same_tensor(previous[0], current):
                unchained.append(index)
            elif not unchained:
                name = _first_difference(first_others[0], others)
                if name is not None:
                    unchained.append(index)
                    differing.append(name)
            order.append(index)
            previous[0] = first_output(output)
            after_block()
            if index == len(blocks) - 1 and not after_last:
                after_last.append(register_module_forward_pre_hook(in_this_thread(stop)))

        return hook

    handles = []
    try:
        for index, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(in_this_thread(again(index))))
            handles.append(
                block.register_forward_hook(in_this_thread(record(index)), with_kwargs=True)
            )
        run_model()
    except _LastBlockDone:
        pass
    finally:
        for handle in (*handles, *after_last):
            handle.remove()
        previous.clear()
        first_others.clear()
    if order != list(range(len(blocks))):
        return False, f"the blocks ran in the order {order[:8]}{'...' if len(order) > 8 else ''}"
    if unchained and differing:
        return False, (
            f"block {unchained[0]} takes another {differing[0]} than block 0, and calibration "
            "gives every block the first block's other arguments"
        )
    if unchained:
        index = unchained[0]
        return False, f"block {index} does not take block {index - 1}'s output as its input"
    return True, ""


def _other_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A block's arguments besides its first input, by name (positional ones
    by the name its `forward` gives them)."""
    if args:
        try:
            names = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            names = []
        others = {
            (f"'{names[i]}'" if i < len(names) else f"argument {i}"): value
            for i, value in enumerate(args)
            if i > 0
        }
        return {**others, **{f"'{k}'": v for k, v in kwargs.items()}}
    first = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    return {f"'{k}'": v for k, v in kwargs.items() if k != first}


def _first_difference(first: dict[str, Any], other: dict[str, Any]) -> str | None:
    """The name of the first argument that differs, or `None`."""
    for name in [*first, *(key for key in other if key not in first)]:  # in call order
        if not _same_value(first.get(name), other.get(name)):
            return name
    return None


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _same_tensor(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # objects without a plain equality: the same object only
        return False


def _same_tensor(previous: Any, current: Any) -> bool:
    """Equal tensors, NaN equal to NaN (a NaN in the hidden states is
    calibration's to report, not a sign that the blocks do not chain)."""
    return (
        isinstance(previous, torch.Tensor)
        and isinstance(current, torch.Tensor)
        and previous.shape == current.shape
        and (
            torch.equal(previous, current)
            or (
                previous.dtype == current.dtype
                and previous.is_floating_point()
                and bool(torch.allclose(previous, current, rtol=0, atol=0, equal_nan=True))
            )
        )
    )
