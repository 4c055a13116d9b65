"""Calibration: planning a calibrated mode's quantization block by block.

A calibrated mode (its record says `calibrated=True`; GPTQ needs each
weight's input Hessian, AWQ its per-channel activation statistics) computes
its stored tensors from the activations each weight sees on calibration data.
`plan_calibrated` gathers them and plans, without changing the model:

1. the inputs of the first block are captured by running the model on the
   config's calibration batches (`config.calibration_batches(model)`) up to
   that block;
2. for each block in turn, every target weight in it gets its scheme's
   statistics (`Scheme.new_statistics`), fed with the weight's input rows
   while the block runs on the captured inputs; each target is then planned
   from them (`Scheme.quantize_calibrated`);
3. the block's outputs, computed with its planned (quantized) weights, or its
   float weights if the scheme says so, are the next block's inputs, so that
   memory holds one block's activations for the calibration set at a time
   (written over the block's inputs call by call); no compute-dtype casts are
   kept between calls while calibrating, and the C heap's freed pages go
   back to the system as blocks finish (`_memory.FreedMemoryLimit`: glibc
   keeps freed temporaries otherwise, up to the size of the model here).

The model is only ever run (in eval mode, without gradients, with its
weights read, or swapped for the planned ones inside `functional_call`); its
hooks and modes are restored on the way out, whatever happens. A
mixture-of-experts block's experts planned as one linear per expert
(`quantization.experts`, `expansions`) compute with those linears while
calibrating, so that each expert's statistics are those of the tokens routed
to it (an expert no calibration token chose gets its scheme's statistics of
no rows: GPTQ's Hessian is then the identity, round to nearest on its grid);
the linears, outside the module tree until attached, get their planned
weights in place of their views for the next block's inputs, and their views
back after. Nothing is
committed here: `quantize()` commits every plan at the end, so a failure or a
`KeyboardInterrupt` part-way leaves the model bit-for-bit unchanged.

Blocks come from `config.quantization_layer_structure`: a sequence of
submodules or their paths, in the order the model runs them, or Keras's dict
`{"pre_block_layers": [...], "sequential_blocks": [...]}` (the pre-block
layers, checked to exist, run as part of the model's forward); `None` finds
the model's repeated blocks (`quantization.structure`: the decoder layers of
a Hugging Face model), else makes the whole model one block. Blocks are
checked to chain on the first batch: found ones that do not fall back to the
whole model (with a warning); given ones that do not are refused (a
ValueError saying why), since each block is fed the previous one's output:
a block receives the previous block's first output as its first input (its
first positional argument, else its first tensor keyword) and the first
block's other arguments unchanged.

Progress (block i of n, elapsed, remaining) goes to standard error when it
is a terminal, or as `progress` says (`quantization.progress`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from dtype_policies._core.module_state import casts_not_kept, state_of
from dtype_policies._memory import FreedMemoryLimit, release_freed_memory
from dtype_policies._paths import join, named_module_paths, root_path_of
from dtype_policies.quantization.attach import Checked, Plan, is_quantized, plan
from dtype_policies.quantization.experts import ExpertsExpansion
from dtype_policies.quantization.kernels import attention
from dtype_policies.quantization.progress import CalibrationProgress
from dtype_policies.quantization.schemes.base import (
    ActivationStatistics,
    QuantizedWeight,
    non_finite_values,
)
from dtype_policies.quantization.structure import (
    blocks_chain,
    find_blocks,
    first_input,
    in_this_thread,
)
from dtype_policies.quantizers.calibration_data import position_limits
from dtype_policies.quantizers.config import CalibratedQuantizationConfig, QuantizationConfig

Call = tuple[tuple, dict]


@dataclass
class CalibrationResult:
    """Plans for the targets inside the blocks, and the paths outside them."""

    plans: list[Plan] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)


class _Captured(Exception):
    """Stops the model's forward once the first block's inputs are captured."""


class _Observed(Exception):
    """Stops a block's forward once its targets have seen their inputs."""


def plan_calibrated(
    model: torch.nn.Module,
    targets: Sequence[tuple[str, Checked]],
    config: CalibratedQuantizationConfig,
    progress: bool | None = None,
    expansions: Sequence[ExpertsExpansion] = (),
) -> CalibrationResult:
    """Plans the calibrated quantization of `targets` (checked modules of
    `model`, with their paths, the linears of planned `expansions`
    included) from `config`'s calibration data; `progress` as
    `CalibrationProgress`'s `enabled`."""
    structure = getattr(config, "quantization_layer_structure", None)
    found = structure is None
    repeated = [module for _, module in find_blocks(model)] if found else []
    blocks = _blocks(model, structure) if not found else _blocks(model, repeated or None)
    result, members = _assign(blocks, targets)
    if found and not any(members) and not _holds_quantized(repeated):
        # nothing to calibrate inside the repeated blocks, and never was: the model is the block
        blocks = [("", model)]
        result, members = _assign(blocks, targets)
    if not any(members):
        return result
    with _calibrating(model), contextlib.ExitStack() as stack:
        for expansion in expansions:
            stack.enter_context(expansion.computing())
            for linears in expansion.lists.values():  # outside the model's tree
                stack.enter_context(casts_not_kept(linears))
        batches = config.calibration_batches(model)
        limit = FreedMemoryLimit(FREED_PER_CALL)
        chained, why = (
            blocks_chain(
                [b for _, b in blocks],
                lambda: _run(model, batches[0]),
                FreedMemoryLimit(FREED_PER_BLOCK_IN_ONE_RUN),
            )
            if len(blocks) > 1
            else (True, "")
        )
        release_freed_memory()
        if not chained:
            if not found:
                raise ValueError(
                    f"The blocks of `quantization_layer_structure` ({blocks[0][0]}, ...) do not "
                    f"run one after the other ({why}), and calibration feeds each block the "
                    "previous block's output: pass the blocks in the order the model runs "
                    "them, each taking the previous one's output, or None to find them."
                )
            enclosing = _enclosing_block(model, blocks)
            warnings.warn(
                f"quantize(): the model's repeated blocks ({blocks[0][0]}, ...) do not run "
                f"one after the other ({why}); calibrating "
                f"{repr(enclosing[0]) if enclosing[0] else 'the whole model'} as one block. "
                "Pass `quantization_layer_structure` to calibrate block by block.",
                UserWarning,
                stacklevel=3,
            )
            blocks = [enclosing]
            result, members = _assign(blocks, targets)
        last = max(i for i, group in enumerate(members) if group)
        report = CalibrationProgress(config.mode, last + 1, enabled=progress)
        try:
            calls = _first_block_calls(model, blocks[0][1], batches)
            if blocks[0][1] is not model:
                _check_first_inputs_finite(blocks[0][0], calls)
            for index, (_, block) in enumerate(blocks[: last + 1]):
                plans = _plan_block(block, calls, members[index], config, limit)
                result.plans += plans
                release_freed_memory()  # the block's statistics
                if index < last:
                    calls = _next_calls(block, calls, plans, limit)
                    release_freed_memory()  # the planned weights swapped in
                report.block_done(index)
        except BaseException as error:
            report.interrupted(error)
            raise
        report.finish()
    return result


def _enclosing_block(
    model: torch.nn.Module, blocks: list[tuple[str, Any]]
) -> tuple[str, torch.nn.Module]:
    """`(path, module)` of the smallest callable module holding every block
    (the stack that runs them: an encoder-decoder's encoder, which the whole
    model could not be run as, lacking decoder inputs); the model at most."""
    parents: dict[int, torch.nn.Module] = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(id(child), parent)

    def ancestors(module: torch.nn.Module) -> list[torch.nn.Module]:
        chain = []
        while id(module) in parents:
            module = parents[id(module)]
            chain.append(module)
        return chain

    holding = [{id(m) for m in ancestors(block)} for _, block in blocks[1:]]
    common = next(
        (m for m in ancestors(blocks[0][1]) if all(id(m) in ids for ids in holding)), model
    )
    while isinstance(common, (torch.nn.ModuleList, torch.nn.ModuleDict)) and common is not model:
        common = parents.get(id(common), model)
    if common is model:
        return "", model
    path = next(p for p, m in named_module_paths(model, root_path_of(model)) if m is common)
    return path, common


def _holds_quantized(blocks: list[torch.nn.Module]) -> bool:
    """Whether a module inside `blocks` is quantized already (by an earlier
    call: the blocks stay the structure, so that what lies outside them is
    still skipped, not calibrated as part of a whole-model block)."""
    return any(is_quantized(module) for block in blocks for module in block.modules())


def _assign(
    blocks: list[tuple[str, torch.nn.Module]], targets: Sequence[tuple[str, Checked]]
) -> tuple[CalibrationResult, list[list[tuple[str, Checked]]]]:
    """The targets of each block, and those outside every block."""
    result = CalibrationResult()
    members: list[list[tuple[str, Checked]]] = [[] for _ in blocks]
    for path, checked in targets:
        index = next((i for i, b in enumerate(blocks) if _inside(path, b[0])), None)
        if index is None:
            result.outside.append(path)
        else:
            members[index].append((path, checked))
    return result, members


def _run(model: torch.nn.Module, batch: Any) -> Any:
    args, kwargs = _as_call(batch)
    try:
        return model(*args, **kwargs)
    except IndexError as error:  # an embedding lookup past its table
        raise _model_refused_windows(model, batch, error) from error


def _model_refused_windows(model: torch.nn.Module, batch: Any, error: Exception) -> ValueError:
    """The error of a model whose first run on the calibration windows
    failed on an index: most likely windows longer than its positions."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    length = f"{ids.shape[-1]} tokens" if isinstance(ids, torch.Tensor) else "its windows"
    limits = position_limits(model)
    named = f" (its config: {limits})" if limits else ""
    return ValueError(
        f"The model failed on the calibration windows of {length} with "
        f"{type(error).__name__}: {error}. A model with a table of positions takes at "
        f"most that many tokens{named}: lower `sequence_length`."
    )


def _plan_block(
    block: torch.nn.Module,
    calls: list[Call],
    group: list[tuple[str, Checked]],
    config: QuantizationConfig,
    limit: FreedMemoryLimit,
) -> list[Plan]:
    plans = []
    for members, statistics in _statistics_passes(group, config):
        with _observing(block, members, statistics):
            for args, kwargs in calls:
                with contextlib.suppress(_Observed):  # the rest feeds no statistics
                    block(*args, **kwargs)
                limit()
        release_freed_memory()  # the forward's temporaries, before the statistics are solved
        for path, checked in members:
            try:
                gathered = statistics[id(checked.module)]
                if hasattr(gathered, "check_finite"):
                    gathered.check_finite()
                module_plan = plan(
                    checked.module,
                    config,
                    path=path,
                    type_check=False,
                    kind=checked.kind,
                    source=checked.source,
                    statistics=statistics.pop(id(checked.module)),  # freed once planned
                )
            except Exception as e:
                raise type(e)(f"quantize(): module '{path or '(root)'}': {e}") from e
            plans.append(module_plan)
    return plans


FREED_PER_BLOCK_IN_ONE_RUN = 64 * 2**20
"""Freed memory the C heap may keep while the whole model runs once (the
check that the blocks chain): measured on SmolLM2-135M (8 windows of 512
tokens, mixed_bfloat16), glibc kept 590-690 MB of the blocks' freed
temporaries by the last block, more than the calibration's own peak above
the model; released as each block returns, 290-320 MB."""

FREED_PER_CALL = 256 * 2**20
"""Freed memory the C heap may keep between a block's calls on the
calibration batches: a bound, rarely reached (each block's end releases it
all), since returning pages each call costs their faults on the next one
(SmolLM2-135M: released at 64 MB, calibration took 92-95 s against 75 s)."""

STATISTICS_PER_PASS = 512 * 2**20
"""Bytes of statistics one pass over the calibration set gathers: a block
whose weights need more (a mixture-of-experts block: one `K x K` Hessian per
expert and weight, 1.4 GB for 64 experts at width 2048) runs its calls again
for each further share of its weights, with the same statistics as one pass."""


def _statistics_passes(
    group: list[tuple[str, Checked]], config: QuantizationConfig
) -> Iterator[tuple[list[tuple[str, Checked]], dict[int, ActivationStatistics]]]:
    """The block's weights in consecutive shares of at most about
    `STATISTICS_PER_PASS` bytes of statistics, each with its new statistics
    (made when its pass comes, not before)."""
    members: list[tuple[str, Checked]] = []
    statistics: dict[int, ActivationStatistics] = {}
    size = 0
    for path, checked in group:
        new = checked.scheme.new_statistics(checked.spec, config)
        # any statistics object: the tensors it holds
        size += sum(v.nbytes for v in vars(new).values() if isinstance(v, torch.Tensor))
        members.append((path, checked))
        statistics[id(checked.module)] = new
        if size >= STATISTICS_PER_PASS:
            yield members, statistics
            members, statistics, size = [], {}, 0
    if members:
        yield members, statistics


def _next_calls(
    block: torch.nn.Module, calls: list[Call], plans: list[Plan], limit: FreedMemoryLimit
) -> list[Call]:
    """The next block's calls: this block's first output in place of the first
    argument. `calls` is overwritten call by call, so that the block's inputs
    and outputs for the whole calibration set are never held at once."""
    swapped = {}
    planned_outside: list[Plan] = []  # experts' linears, not in the tree until attached
    if plans and plans[0].scheme.calibrated_on_quantized_outputs:
        names = {id(module): name for name, module in block.named_modules()}
        for module_plan in plans:
            prefix = names.get(id(module_plan.module))
            if prefix is None:
                planned_outside.append(module_plan)
                continue
            key = f"{prefix}.{module_plan.spec.weight}" if prefix else module_plan.spec.weight
            swapped[key] = _dequantized(module_plan)
    with _planned_weights(planned_outside):
        return _run_calls(block, calls, swapped, limit)


@contextlib.contextmanager
def _planned_weights(plans: list[Plan]) -> Iterator[None]:
    """The planned modules' weights in place of their own (parameters of
    modules outside the model's tree: an expansion's linears), restored after."""
    originals = []
    try:
        for module_plan in plans:
            name = module_plan.spec.weight
            parameter = module_plan.module._parameters[name]
            originals.append((module_plan.module, name, parameter))
            module_plan.module._parameters[name] = torch.nn.Parameter(
                _dequantized(module_plan), requires_grad=False
            )
        yield
    finally:
        for module, name, parameter in reversed(originals):
            module._parameters[name] = parameter


def _run_calls(
    block: torch.nn.Module, calls: list[Call], swapped: dict, limit: FreedMemoryLimit
) -> list[Call]:
    for index, (args, kwargs) in enumerate(calls):
        out = functional_call(block, swapped, args, kwargs) if swapped else block(*args, **kwargs)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(first, torch.Tensor):
            first = first[0]  # a ModelOutput
        del out
        if args:
            calls[index] = ((first, *args[1:]), kwargs)
        else:  # the block took its input by keyword
            name = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
            calls[index] = ((), {**kwargs, name: first})
        del args, kwargs
        limit()
    return calls


def _dequantized(module_plan: Plan) -> torch.Tensor:
    """The float weight the planned tensors stand for, in the parameter's
    shape, and in the dtype the module's calls read it in: a linear computing
    in a narrower dtype (`mixed_bfloat16`) would cast the parameter's dtype to
    it in every call, so it gets the cast once (the same rounding; half the
    memory, which for a mixture-of-experts block's experts is most of it)."""
    holder = torch.nn.Module()
    holder._buffers.update(module_plan.tensors)
    qw = QuantizedWeight(module_plan.scheme, module_plan.spec, module_plan.config)
    weight = module_plan.spec.from_nk(module_plan.scheme.dequantize(holder, qw))
    return weight.to(module_plan.float_dtype).to(_read_dtype(module_plan))


def _read_dtype(module_plan: Plan) -> torch.dtype:
    state = state_of(module_plan.module)
    call = None if state is None else state.call
    dtype = module_plan.float_dtype
    if (
        call is None
        or call.compute is None
        or module_plan.spec.weight not in call.weight_names
        or not (call.autocast or call.casts_own_weights)
        or call.compute.itemsize >= dtype.itemsize
    ):
        return dtype
    return call.compute


def _first_block_calls(
    model: torch.nn.Module, first: torch.nn.Module, batches: list[Any]
) -> list[Call]:
    """The arguments the first block is called with, one per calibration batch."""
    if first is model:
        return [_as_call(batch) for batch in batches]
    calls: list[Call] = []

    def capture(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append((args, kwargs))
        raise _Captured

    handle = first.register_forward_pre_hook(in_this_thread(capture), with_kwargs=True)
    try:
        for batch in batches:
            args, kwargs = _as_call(batch)
            try:
                model(*args, **kwargs)
            except _Captured:
                continue
            except IndexError as error:
                raise _model_refused_windows(model, batch, error) from error
            raise ValueError(
                f"The model's forward never reached the first block of the quantization "
                f"structure ({type(first).__name__}): check `quantization_layer_structure`."
            )
    finally:
        handle.remove()
    return calls


def _check_first_inputs_finite(path: str, calls: list[Call]) -> None:
    """The first block's main input (its first positional argument, or
    `hidden_states`) is finite: else what runs before the block (an
    embedding table holding NaN) would be blamed on the block's first weight."""
    for args, kwargs in calls:
        value = args[0] if args else kwargs.get("hidden_states")
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            found = non_finite_values(value)
            if found is not None:
                raise ValueError(
                    f"quantize(): the inputs of the first block '{path}' hold {found}: the "
                    "model computes them before any block (its embeddings; check their "
                    "weights, and the calibration data)"
                )


def _as_call(batch: Any) -> Call:
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


SINK_ROW_WEIGHT = 32.0
"""How much more the first position's rows count in the statistics of an
attention's input projections (see `_observing`)."""


def _is_attention(module: torch.nn.Module) -> bool:
    return "Attention" in type(module).__name__


def _attention_parents(
    block: torch.nn.Module, group: list[tuple[str, Checked]]
) -> dict[int, torch.nn.Module]:
    """The attention module (`*Attention*` by class name) each target is a
    direct child of, by the target's id."""
    targets = {id(checked.module) for _, checked in group}
    return {
        id(child): module
        for module in block.modules()
        if _is_attention(module)
        for child in module.children()
        if id(child) in targets
    }


MASSIVE_ROW_CAP = 100.0
"""At most how many times the energy (squared norm) of a batch's typical
row one input row counts in the statistics of a weight other than an
attention's input projections (see `_capped_row_weights`)."""


def _sink_weights(inputs: torch.Tensor) -> torch.Tensor:
    """Row weights of `(B, T, K)` inputs: `SINK_ROW_WEIGHT` at position 0 of each sequence."""
    weights = torch.ones(inputs.shape[0], inputs.shape[1])
    weights[:, 0] = SINK_ROW_WEIGHT
    return weights.reshape(-1)


def _capped_row_weights(rows: torch.Tensor) -> torch.Tensor | None:
    """Row weights of `(M, K)` rows under which no row's weighted energy
    exceeds `MASSIVE_ROW_CAP` times the median energy of the rows that are
    not zero; `None` (all ones) when no row exceeds it.

    >>> rows = torch.ones(5, 4)
    >>> rows[0] *= 1000.0  # 10**6 times the others' energy
    >>> _capped_row_weights(rows)
    tensor([1.0000e-04, 1.0000e+00, 1.0000e+00, 1.0000e+00, 1.0000e+00])
    >>> _capped_row_weights(torch.ones(5, 4)) is None
    True
    """
    energy = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).square()
    nonzero = energy[energy > 0]
    if nonzero.numel() == 0:
        return None
    bound = MASSIVE_ROW_CAP * float(nonzero.median())
    if not float(energy.max()) > bound:
        return None
    return (bound / energy).clamp_(max=1.0)


@contextlib.contextmanager
def _observing(
    block: torch.nn.Module,
    group: list[tuple[str, Checked]],
    statistics: dict[int, ActivationStatistics],
) -> Iterator[None]:
    """Feeds each target's input rows to its statistics while the block runs.

    The projections an attention module computes from its own input (queries,
    keys, values) get the rows of each sequence's first position weighted
    `SINK_ROW_WEIGHT` times: whatever token comes first becomes the attention
    sink, which most later tokens attend to, so its keys and values count in
    the outputs of every position, not only its own. Unweighted, GPTQ shifts
    rounding error onto those rows (1 in 512 of the data): measured on
    SmolLM2-135M, GPTQ on the value projections alone took perplexity from
    24.9 to 28.0 (round to nearest: 25.6); weighted, 24.7.

    Every other weight's rows count at most `MASSIVE_ROW_CAP` times the
    batch's median row energy (`_capped_row_weights`). The massive
    activations of a few tokens (the sink's, in a decoder's MLP down
    projection: up to 3 x 10^5 times the median row's energy in SmolLM2-135M,
    99.9% of `XᵀX`'s trace in some layers) otherwise make a weight's
    statistics nearly rank one, and GPTQ then fits those rows alone: capped,
    SmolLM2-135M's gptq/4/128 went from perplexity 27.83 to 27.01 and KL
    from 0.161 to 0.148 (docs/quantization.md).

    The first call runs the whole block and records the order in which the
    targets are called. When each target was called exactly once, later
    calls stop (`_Observed`) as soon as they have called the targets once
    each in that same order: what the block computes after its last target
    (a decoder layer's down projection and residual) feeds nothing here,
    and it is a quarter of a decoder layer's products. Any other pattern (a
    target called twice, or only by some inputs, as a mixture's experts
    are) runs every call to the end.
    """
    last: list[Any] = [None, None, None]  # modules fed the same input share rows and weights
    parents = _attention_parents(block, group)
    attention_inputs: dict[int, Any] = {}
    called: list[int] = []  # the targets called so far in this call, by id
    order: list[list[int]] = []  # the first call's order, when it allows stopping early
    first_call = [True]

    def enter_block(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if called and first_call[0]:
            _record_order(called, group, order)
            first_call[0] = False
        called.clear()

    def enter_attention(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        attention_inputs[id(module)] = first_input(args, kwargs)

    def observe(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = first_input(args, kwargs)
        label, spec = next((name, c.spec) for name, c in group if c.module is module)
        if inputs.numel() % spec.in_features:
            raise ValueError(
                f"Calibration: the module {label!r} takes {spec.in_features} input features; "
                f"the calibration data reached it with inputs of shape {tuple(inputs.shape)}. "
                "Pass data of the model's input shape. Nothing was changed."
            )
        if last[0] is inputs and last[1].shape[1] == spec.in_features:
            rows, weights = last[1], last[2]
        else:
            rows = inputs.detach().reshape(-1, spec.in_features)
            if not rows.is_floating_point():
                rows = rows.float()
            parent = parents.get(id(module))
            weights = None
            if parent is not None and inputs.dim() == 3:
                entered = attention_inputs.get(id(parent))
                if entered is inputs or (
                    isinstance(entered, torch.Tensor)
                    and entered.shape == inputs.shape
                    and torch.equal(entered.to(inputs.dtype), inputs)
                ):
                    weights = _sink_weights(inputs)
            if weights is None:
                weights = _capped_row_weights(rows)
            last[:] = [inputs, rows, weights]
        if weights is None:
            statistics[id(module)].update(rows)
        else:
            statistics[id(module)].update(rows, row_weights=weights)
        called.append(id(module))
        if order and called == order[0]:
            raise _Observed

    handles = [block.register_forward_pre_hook(in_this_thread(enter_block), with_kwargs=True)]
    try:
        for module in {id(p): p for p in parents.values()}.values():
            handles.append(
                module.register_forward_pre_hook(in_this_thread(enter_attention), with_kwargs=True)
            )
        for _, checked in group:
            handles.append(
                checked.module.register_forward_pre_hook(in_this_thread(observe), with_kwargs=True)
            )
        yield
    finally:
        for handle in handles:
            handle.remove()


def _record_order(called: list[int], group: list[tuple[str, Checked]], order: list) -> None:
    """`order` gets `called` when it holds every target of `group` once."""
    targets = [id(checked.module) for _, checked in group]
    if len(called) == len(targets) and sorted(called) == sorted(targets):
        order.append(list(called))


_lock = threading.Lock()
_being_calibrated: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


@contextlib.contextmanager
def _calibrating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode, no gradients and no kept casts while calibrating (each block
    runs a few times on the whole set: kept casts of every weight would be a
    second copy of the model), a transformers model's bfloat16 attention on
    this library's kernel (`kernels.attention.selected`); every module's mode
    restored."""
    with _lock:
        if model in _being_calibrated:
            raise RuntimeError(
                f"The {type(model).__name__} is being calibrated by another quantize() call "
                "(another thread): calibrate one model once at a time; its forward hooks "
                "would see each other's runs."
            )
        _being_calibrated.add(model)
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        with torch.no_grad(), casts_not_kept(model), attention.selected(model):
            yield
    finally:
        for module, training in modes:
            module.training = training
        with _lock:
            _being_calibrated.discard(model)


def _blocks(model: torch.nn.Module, structure: Any) -> list[tuple[str, Any]]:
    """`(path, module)` of each block of `structure`, in order (none: the whole model)."""
    if structure is None:
        return [("", model)]
    if isinstance(structure, dict) and "sequential_blocks" not in structure:
        raise ValueError(
            "A `quantization_layer_structure` dict needs the key 'sequential_blocks'. "
            f"Received keys: {sorted(structure)}"
        )
    root = root_path_of(model)
    named = list(named_module_paths(model, root))
    paths = {id(module): path for path, module in named}
    by_path = dict(named)

    def resolve(entry: Any, where: str, kind: str) -> tuple[str, torch.nn.Module]:
        if isinstance(entry, str):
            wanted = entry.replace(".", "/")
            module = by_path.get(wanted)
            if module is None:
                module = by_path.get(join(root, wanted))
            if module is None:
                raise ValueError(f"No module at '{entry}' in the model ({where}).")
            entry = module
        if not isinstance(entry, torch.nn.Module) or id(entry) not in paths:
            raise ValueError(
                f"Every {kind} of the quantization structure must be a module of the model "
                f"(or its path). Received: {entry!r}"
            )
        return paths[id(entry)], entry

    if isinstance(structure, dict):
        for layer in structure.get("pre_block_layers", None) or ():
            resolve(layer, "quantization structure's pre_block_layers", "pre-block layer")
        structure = structure["sequential_blocks"]
    blocks = [resolve(block, "quantization structure", "block") for block in structure]
    if not blocks:
        raise ValueError("The quantization structure has no sequential blocks.")
    return blocks


def _inside(path: str, block_path: str) -> bool:
    return block_path == "" or path == block_path or path.startswith(block_path + "/")
