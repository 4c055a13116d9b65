"""float8 (Keras's `float8` mode): quantize-dequantize training with delayed
(the default, as Keras) or dynamic scaling. The float weight stays a trained
parameter; six float32 buffers hold the delayed-scaling state:
`inputs_scale`, `kernel_scale`, `outputs_grad_scale` (scalars) and their
`*_amax_history` (the policy's length, default 1024).

Weight-only (`Float8QuantizationConfig(scaling="weight_only")`) rounds the
kernel to e4m3fn with a scale per output channel taken from the kernel itself
(per tensor for contractions without an output-channel axis); inputs and
output gradients are not quantized, and the buffers are not used.

Dynamic scaling (`Float8QuantizationConfig(scaling="dynamic")`) takes each
scale from the tensor being quantized, in every call (inputs and kernel in the
forward, the output gradient in the backward): `max|t| / format max`. It
needs no calibration and never reads or writes the six buffers (they stay,
so that checkpoints have one format).

Delayed scaling: in a training step (forwards in training mode, with
gradients enabled, and the backward pass that reaches them): inputs and
kernel are quantize-dequantized in float8_e4m3fn with the scales from before
the step, the output gradient in float8_e5m2 with its scale; gradients pass
straight through (an inf or NaN gradient stays one, so that loss scalers see
the overflow). Once the backward pass is over, each scale becomes
`max(history before the step) / format max` and each history is rolled once
with the largest absolute maximum of the module's calls in that pass (a
layer called twice counts both calls) as its newest entry (index 0); a
non-finite maximum leaves its history and scale as they were. A step that
`LossScaleOptimizer` skips undoes the updates made since the last optimizer
step, as Keras never applies them. Forwards in eval mode, or without
gradients, change nothing; a frozen layer in training mode still records its
step.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from dtype_policies._compat import compiling
from dtype_policies._core.call import leaf_weights
from dtype_policies._core.casting import (
    bfloat16_rounded,
    exporting,
    plus_bias,
    straight_through,
    tracing,
)
from dtype_policies._core.listeners import (
    add_step_skipped_listener,
    backward_owner,
    clear_backward_owner,
)
from dtype_policies._core.module_state import state_of
from dtype_policies._derivatives import (
    backward_running,
    derivative_free,
    functorch_active,
    transform_active,
)
from dtype_policies._modes import QuantizationMode, register_mode
from dtype_policies.policies.quantized import QuantizedFloat8DTypePolicy
from dtype_policies.quantization.kernels.float8 import float8_kernel, float8_linear
from dtype_policies.quantization.schemes.base import (
    QuantizedWeight,
    Scheme,
    WeightSpec,
    not_prepared,
)
from dtype_policies.quantizers.config import Float8QuantizationConfig
from dtype_policies.quantizers.math import (
    FLOAT8_E4M3_MAX,
    FLOAT8_E5M2_MAX,
    compute_float8_amax_history,
    compute_float8_channel_scale,
    compute_float8_dynamic_scale,
    compute_float8_scale,
    quantize_and_dequantize,
)

STATE_NAMES = (
    "inputs_scale",
    "inputs_amax_history",
    "kernel_scale",
    "kernel_amax_history",
    "outputs_grad_scale",
    "outputs_grad_amax_history",
)


class Float8Scheme(Scheme[Float8QuantizationConfig]):
    mode = "float8"
    keeps_float_weight = True
    general_contraction = True

    def buffer_names(self, spec: WeightSpec, config: Float8QuantizationConfig) -> tuple[str, ...]:
        return STATE_NAMES

    def quantize(
        self, weight: torch.Tensor, spec: WeightSpec, config: Float8QuantizationConfig
    ) -> dict[str, torch.Tensor]:
        state = {}
        for name in STATE_NAMES:
            if name.endswith("history"):
                value = torch.zeros(config.history_length, dtype=torch.float32)
            else:
                value = torch.ones((), dtype=torch.float32)
            state[name] = value.to(weight.device)
        return state

    def stored_shapes(self, spec: WeightSpec, config: Float8QuantizationConfig) -> dict:
        return {
            name: (((config.history_length,) if name.endswith("history") else ()), torch.float32)
            for name in STATE_NAMES
        }

    def dequantize(
        self, module: torch.nn.Module, qw: QuantizedWeight[Float8QuantizationConfig]
    ) -> torch.Tensor:
        spec = qw.spec
        # float8 keeps the float weight as a parameter (`keeps_float_weight`)
        weight = cast(torch.nn.Parameter, module._parameters[spec.weight])
        return spec.nk(spec.matrix(weight.detach().float()))

    def linear(self, module, qw, x2, bias, compute):
        return self.forward(module, qw, x2, bias, compute)

    def forward(self, module, qw, x, bias, compute):
        spec = qw.spec
        stored = module._buffers
        if qw.config.scaling != "weight_only" and any(
            stored.get(name) is None for name in STATE_NAMES
        ):  # its scales removed meanwhile (`remove()` in another thread)
            raise not_prepared(module)
        weight = module._parameters[spec.weight]
        records_step = (
            qw.config.scaling == "delayed" and module.training and torch.is_grad_enabled()
        )
        if not records_step and _without_graph(x, weight, bias):
            return self._inference(module, qw, x, weight, bias, compute)
        kernel, bias = leaf_weights(
            state_of(module).casts,
            module._parameters[spec.weight],
            bias,
            compute,
            spec.weight,
            spec.bias or "bias",
        )
        if x.dtype != compute and x.is_floating_point():
            x = x.to(compute)
        if spec.contract is not None:
            contract = spec.contract
        elif spec.layout == "in_out":

            def contract(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                matrix = spec.matrix(w)
                return F.linear(a, matrix.t())

        else:
            contract = F.linear
        if qw.config.scaling == "weight_only":
            y = contract(x, weight_only_kernel(spec, kernel))
        else:
            dynamic = qw.config.scaling == "dynamic"
            y = float8_contract(module, x, kernel, contract, module.training, dynamic)
        return plus_bias(y, bias).to(compute)

    def _inference(self, module, qw, x, weight, bias, compute):
        """The forward of a call without autograd: the kept kernel (see
        `kernels.float8`); the same values as the graph path."""
        spec = qw.spec
        if bias is not None:
            bias = leaf_weights(state_of(module).casts, bias, None, compute, "bias")[0]
        if x.dtype != compute and x.is_floating_point():
            x = x.to(compute)
        scaling = qw.config.scaling
        stored = None if scaling != "delayed" else module._buffers["kernel_scale"]
        kernel, product = float8_kernel(
            state_of(module).casts,
            f"{spec.weight}:float8",
            weight,
            stored,
            compute,
            None if spec.contract is not None else lambda k: spec.nk(spec.matrix(k)),
            (lambda k: weight_only_kernel(spec, k)) if scaling == "weight_only" else None,
        )
        contract = spec.contract or (lambda a, k: F.linear(a, spec.nk(spec.matrix(k))))
        input_scale = module._buffers["inputs_scale"] if scaling == "delayed" else None
        y = float8_linear(x, input_scale, kernel, product, contract, bias, scaling != "weight_only")
        return y.to(compute)


def _without_graph(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a float8 call runs eagerly where no derivative can be asked for
    (so no scale update can follow), on the kept kernel."""
    return not tracing() and derivative_free(x, weight, bias)


def weight_only_kernel(spec: WeightSpec, kernel: torch.Tensor) -> torch.Tensor:
    """`kernel` rounded to float8_e4m3fn with a scale per output channel (per
    tensor for contractions without one), in its own shape and dtype;
    gradients pass straight through."""
    if spec.contract is not None:
        return _qdq(kernel, compute_float8_dynamic_scale(kernel, FLOAT8_E4M3_MAX))
    w_nk = spec.nk(spec.matrix(kernel))
    scale = compute_float8_channel_scale(w_nk, FLOAT8_E4M3_MAX)
    return spec.from_nk(_qdq(w_nk, scale))


def _rounded_like_eager(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """`quantize_and_dequantize(x, scale, fmt, x.dtype)`. Compiled, with `x`
    in bfloat16, the roundings to bfloat16 around the float8 one are written
    out (`bfloat16_rounded`): Inductor keeps the intermediate of a fused cast
    pair in float32, so the input reached the float8 rounding unrounded and
    compiled float8 layers differed from eager ones by up to float8's own
    error (1-5% on a layer)."""
    if x.dtype is torch.bfloat16 and compiling() and not exporting():
        values = quantize_and_dequantize(bfloat16_rounded(x), scale, fmt, torch.float32)
        return bfloat16_rounded(values).to(torch.bfloat16)
    return quantize_and_dequantize(x, scale, fmt, x.dtype)


def _qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` quantize-dequantized in e4m3fn, the gradient straight through:
    plain ops when exporting (an exported program cannot hold a Python
    autograd function), else `_QDQForward`."""
    if exporting():
        return straight_through(x, quantize_and_dequantize(x, scale, torch.float8_e4m3fn, x.dtype))
    return _qdq_forward(x, scale)


_STATE_FORMATS = (
    ("inputs", FLOAT8_E4M3_MAX),
    ("kernel", FLOAT8_E4M3_MAX),
    ("outputs_grad", FLOAT8_E5M2_MAX),
)


class _CallMaxima:
    """One call's absolute maxima of its inputs and kernel, taken in the
    forward and handed to the module's step by the call's backward (a call
    no backward reaches counts for nothing), with the state tensors that
    forward read: the step advances those (under
    `torch.func.functional_call`, the ones substituted for the module's own,
    as torch's batch norm updates the running statistics it was given), and
    the parameters it read (those an optimizer of that state steps)."""

    __slots__ = ("maxima", "module", "parameters", "state")

    def __init__(
        self,
        module: torch.nn.Module,
        maxima: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        self.module = module
        self.maxima = maxima
        self.state = state
        self.parameters = tuple(p for p in module._parameters.values() if p is not None)


class _PendingStep:
    """The step of one (scale, history) pair in the running backward pass:
    the largest absolute maximum its calls have shown, the pair, the module
    and the parameters those calls read, the thread whose pass scheduled the
    commit, and the optimizer whose scaled loss the pass started from
    (`listeners.backward_owner`; None: no loss scaler's)."""

    __slots__ = (
        "fmt_max", "history", "maximum", "module", "owner", "parameters", "scale", "thread"
    )  # fmt: skip

    def __init__(
        self, call: _CallMaxima, name: str, thread: int, owner: weakref.ref | None
    ) -> None:
        self.maximum: torch.Tensor | None = None
        self.fmt_max = dict(_STATE_FORMATS)[name]
        self.scale = call.state[f"{name}_scale"]
        self.history = call.state[f"{name}_amax_history"]
        self.module = weakref.ref(call.module)
        self.parameters = tuple(weakref.ref(p) for p in call.parameters)
        self.thread = thread
        self.owner = owner


_lock = threading.Lock()
_pending: weakref.WeakKeyDictionary[torch.Tensor, _PendingStep] = weakref.WeakKeyDictionary()
"""Per (scale, history) pair a call read (keyed by the scale), its step
until the pass is over (`_commit`): each pair steps alone, so a call that
read a substituted pair and one that read the module's own each advance
their own."""


def _forward_outside_backward(key: torch.Tensor) -> None:
    """A training forward reading the pair whose scale is `key` while this
    thread runs no backward pass: whatever a pass of this thread left
    behind for it is stale. Such a pass
    raised (a failing hook, an interrupt), and torch drops the callbacks
    queued in it: the commit of `module`'s step (which would then never be
    scheduled again: its scales would stay) and the end of a loss scaler's
    mark (which would claim later passes)."""
    if backward_running():  # a recomputation inside a backward pass
        return
    clear_backward_owner()
    held = _pending.get(key)
    if held is not None and held.thread == threading.get_ident():
        with _lock:
            if _pending.get(key) is held:
                del _pending[key]


_undo: dict[int, tuple[weakref.ref, torch.Tensor, weakref.ref, weakref.ref | None, tuple]] = {}
"""Per state buffer (by id): the buffer, its value before the first commit
since the last step of an optimizer of its module (what a skipped step
restores), its module, the optimizer whose scaled loss's backward pass
recorded it (None: not a loss scaler's), and (weakly) the parameters the
calls that advanced it read. Changed only under `_lock`."""
_dead: list[tuple[int, weakref.ref]] = []
"""Records whose buffer died, dropped from `_undo` by the next holder of the
lock: a weakref callback runs inside any allocation, in any thread (within
an iteration over `_undo` too), so it only appends here."""


def _record(call: _CallMaxima, maxima: dict[str, torch.Tensor]) -> None:
    """Adds one call's maxima to the steps of the pairs it read; the first
    call of a backward pass to read a pair schedules that pair's commit for
    the end of the pass."""
    thread = threading.get_ident()
    owner = backward_owner()
    firsts = []
    with _lock:
        for name, amax in maxima.items():
            key = call.state[f"{name}_scale"]
            held_step = _pending.get(key)
            # another thread's held step: that thread's pass is running (its
            # commit takes this one's maxima too) or raised (its commit was
            # dropped): this pass commits at its end as well
            if held_step is not None and held_step.thread == thread:
                step = held_step
            else:
                step = _PendingStep(
                    call, name, thread, None if owner is None else weakref.ref(owner)
                )
                if held_step is not None:
                    step.maximum = held_step.maximum
                _pending[key] = step
                firsts.append(key)
            held = step.maximum
            step.maximum = amax if held is None else torch.maximum(held, amax)
    for key in firsts:
        _commit_after_backward(functools.partial(_commit, key))


def _commit_after_backward(commit: Any) -> None:
    """Runs `commit` when the running backward pass ends, not in the middle
    of it: activation checkpointing recomputes a layer's forward during the
    backward (after its output gradient's node ran), and that forward must
    read the scales the first one read. Outside a backward pass (or where
    torch has no such callback), at once."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(commit)
    except (RuntimeError, AttributeError):
        commit()


def _commit(key: torch.Tensor) -> None:
    """Writes the pending step of the pair whose scale is `key`: the scale
    from its history before the step, the history rolled with the step's
    maximum (a non-finite maximum changes neither)."""
    with _lock:
        _drop_dead()
        pending = _pending.pop(key, None)
        if pending is None or pending.maximum is None:
            return
        amax, scale, history = pending.maximum, pending.scale, pending.history
        if not bool(torch.isfinite(amax)):
            return
        fmt_max = pending.fmt_max
        with torch.no_grad():
            for tensor in (scale, history):
                record = _undo.get(id(tensor))
                if record is None or record[0]() is not tensor:  # none, or a dead tensor's
                    forget = functools.partial(_forget_dead, id(tensor))
                    old = tensor.detach().clone()
                    _undo[id(tensor)] = (
                        weakref.ref(tensor, forget), old, pending.module, pending.owner,
                        pending.parameters,
                    )  # fmt: skip
            scale.copy_(compute_float8_scale(history.max(), scale, fmt_max))
            history.copy_(compute_float8_amax_history(amax, history))  # |amax| is amax


def _steps_for(record: tuple, optimizer: Any, optimized: set[int], undo: bool = False) -> bool:
    """Whether a step of `optimizer` (of the parameters `optimized`, ids) is
    the step of `record`'s module: the optimizer holds one of its parameters;
    or none of them trains (a frozen float8 base under an adapter) and the
    record was made in the backward pass of this optimizer's scaled loss, or
    of no loss scaler's (then any optimizer's step makes it stand, and no
    loss scaler's skip undoes it: its own backward passes are marked)."""
    module = record[2]()
    if module is None:
        return True
    # the parameters the calls read (substituted ones under functional_call,
    # copies of its own in a meta-learning loop) and the module's own
    read = [p for p in (ref() for ref in record[4]) if p is not None]
    own = read + [p for p in module.parameters(recurse=False) if all(p is not q for q in read)]
    if any(id(p) in optimized for p in own):
        return True
    if any(p.requires_grad for p in own):
        return False
    owner = record[3]
    if owner is None:
        return not undo
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return owner() in (None, inner)


def _optimized(optimizer: Any) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _forget_dead(key: int, ref: weakref.ref) -> None:
    """A recorded tensor died: its record goes at the next `_drop_dead`."""
    _dead.append((key, ref))


def _drop_dead() -> None:
    """Drops the records of dead tensors (not another tensor's of the same
    id); the caller holds `_lock`."""
    while _dead:
        key, ref = _dead.pop()
        record = _undo.get(key)
        if record is not None and record[0] is ref:
            del _undo[key]


def _forget_undo(optimizer: Any, *_: Any) -> None:
    """`optimizer` stepped: the steps recorded so far for its modules stand."""
    if not _undo:
        return
    optimized = _optimized(optimizer)
    with _lock:
        _drop_dead()
        for key, record in list(_undo.items()):
            if _steps_for(record, optimizer, optimized):
                del _undo[key]


def _undo_since_last_step(optimizer: Any) -> None:
    """A loss scaler skipped a step of `optimizer`: its modules' state goes
    back to what it was before the backward passes since their last step;
    other models' (another optimizer's) stays."""
    optimized = _optimized(optimizer)
    with _lock:
        _drop_dead()
        restores = []
        for key, record in list(_undo.items()):
            if _steps_for(record, optimizer, optimized, undo=True):
                restores.append((record[0](), record[1]))
                del _undo[key]
                module = record[2]()
                if module is not None:
                    for state, step in list(_pending.items()):
                        if step.module() is module:
                            del _pending[state]
        with torch.no_grad():
            for tensor, old in restores:
                if tensor is not None:
                    tensor.copy_(old)


register_optimizer_step_post_hook(_forget_undo)
add_step_skipped_listener(_undo_since_last_step)


class _QDQForward(torch.autograd.Function):
    """Forward: quantize-dequantize in e4m3fn. Backward: straight through."""

    generate_vmap_rule = True  # per-sample gradients (`vmap(grad(...))`)

    @staticmethod
    def forward(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _rounded_like_eager(x, scale, torch.float8_e4m3fn)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:  # type: ignore[override]
        pass  # a separate setup_context: what torch.func transforms require

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _QDQGradient(torch.autograd.Function):
    """Forward: identity. Backward: quantize-dequantize the gradient in e5m2
    (with the stored scale, or with its own when `dynamic`), then commit the
    step's scale and history updates (delayed scaling) when the backward pass
    is over."""

    generate_vmap_rule = True  # under torch.func no state is updated: pure

    @staticmethod
    def forward(  # type: ignore[override]
        y: torch.Tensor,
        scale: torch.Tensor,
        step: _CallMaxima | None,
        dynamic: bool,
        anchor: torch.Tensor | None,
    ) -> torch.Tensor:
        # an alias that is no view: a view out of a custom Function may not be
        # modified in place, and models add into their products' outputs
        # (Falcon's `mlp_output += attention_output`)
        return y.detach()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:  # type: ignore[override]
        _, ctx.scale, ctx.step, ctx.dynamic, _ = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None, None]:
        if ctx.dynamic:
            scale = compute_float8_dynamic_scale(grad, FLOAT8_E5M2_MAX)
        else:
            # a graph of the backward (create_graph) keeps its own copy: the
            # commit at the end of this pass writes the buffer in place
            scale = ctx.scale.clone() if torch.is_grad_enabled() else ctx.scale
        qdq = _rounded_like_eager(grad, scale, torch.float8_e5m2)
        qdq = torch.where(torch.isfinite(grad), qdq, grad)  # an overflow stays visible
        if ctx.step is not None and grad.numel() > 0:
            step, ctx.step = ctx.step, None  # a second backward records nothing
            with torch.no_grad():
                maxima = {**step.maxima, "outputs_grad": grad.detach().abs().amax().float()}
            _record(step, maxima)
        return (qdq if ctx.needs_input_grad[0] else None), None, None, None, None


class _QDQForwardTangents(_QDQForward):
    """`_QDQForward` with its forward-mode derivative: straight through."""

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor | None, _scale: Any) -> torch.Tensor | None:
        return tangent


class _QDQGradientTangents(_QDQGradient):
    """`_QDQGradient` with its forward-mode derivative: the identity (only
    output gradients are quantized)."""

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor | None, *_: Any) -> torch.Tensor | None:
        return None if tangent is None else tangent.view_as(tangent)


def _qdq_forward(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """`_QDQForward`; with its `jvp` where forward mode or a `torch.func`
    transform runs (Dynamo cannot trace an autograd function that defines
    one: compiled graphs get the function without it)."""
    function = _QDQForwardTangents if transform_active() else _QDQForward
    return function.apply(x, scale)


def _qdq_gradient(y: torch.Tensor, scale: torch.Tensor | None, *args: Any) -> torch.Tensor:
    """`_QDQGradient`, with its `jvp` where one can be asked for (see `_qdq_forward`)."""
    function = _QDQGradientTangents if transform_active() else _QDQGradient
    return function.apply(y, scale, *args)


def float8_contract(
    module: torch.nn.Module,
    inputs: torch.Tensor,
    kernel: torch.Tensor,
    contract: Any,
    training: bool,
    dynamic: bool = False,
) -> torch.Tensor:
    """`contract(qdq(inputs), qdq(kernel))` with the output gradient
    quantize-dequantized. Delayed scaling: with the scales of `module`'s
    state, advanced when `training` and a backward runs (read, never advanced,
    under `torch.func` transforms: they forbid writing to captured tensors).
    `dynamic`: with scales from the tensors themselves, the state untouched."""
    state = module._buffers  # read directly: never through a policy's autocasting
    if exporting():  # the forward alone: no output-gradient rounding, no scale updates
        if dynamic:
            x_scale = compute_float8_dynamic_scale(inputs, FLOAT8_E4M3_MAX)
            k_scale = compute_float8_dynamic_scale(kernel, FLOAT8_E4M3_MAX)
        else:
            x_scale = cast(torch.Tensor, state["inputs_scale"])
            k_scale = cast(torch.Tensor, state["kernel_scale"])
        return contract(_qdq(inputs, x_scale), _qdq(kernel, k_scale))
    if dynamic:
        x = _qdq_forward(inputs, compute_float8_dynamic_scale(inputs, FLOAT8_E4M3_MAX))
        k = _qdq_forward(kernel, compute_float8_dynamic_scale(kernel, FLOAT8_E4M3_MAX))
        y = contract(x, k)
        return _qdq_gradient(y, state["outputs_grad_scale"], None, True, None)
    step = anchor = None
    functional = not tracing() and functorch_active()
    if training and torch.is_grad_enabled() and inputs.numel() > 0 and not functional:
        with torch.no_grad():
            maxima = {
                "inputs": inputs.detach().abs().amax().float(),
                "kernel": kernel.detach().abs().amax().float(),
            }
        read = {name: cast(torch.Tensor, state[name]) for name in STATE_NAMES}
        step = _CallMaxima(module, maxima, read)
        if not tracing():  # (a compiled forward: no stale state to look for)
            for name, _ in _STATE_FORMATS:
                _forward_outside_backward(read[f"{name}_scale"])
        if not (inputs.requires_grad or kernel.requires_grad):
            anchor = _ANCHOR  # a frozen call's backward still records its step
    x = _qdq_forward(inputs, state["inputs_scale"])
    k = _qdq_forward(kernel, state["kernel_scale"])
    y = contract(x, k)
    return _qdq_gradient(y, state["outputs_grad_scale"], step, False, anchor)


_ANCHOR = torch.zeros((), requires_grad=True)
"""An input that requires gradients, given to the output-gradient function of
a training call whose inputs and kernel do not, so that the backward pass
reaches it (its own gradient is never computed)."""

register_mode(
    QuantizationMode(
        name="float8",
        config_class=Float8QuantizationConfig,
        policy_class=QuantizedFloat8DTypePolicy,
        scheme=Float8Scheme(),
        module_buffers=STATE_NAMES,
        policy_for_config=lambda config, source: QuantizedFloat8DTypePolicy(
            "float8", source, config.history_length, config.scaling
        ),
    )
)
