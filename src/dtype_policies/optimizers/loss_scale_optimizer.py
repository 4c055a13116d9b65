"""`LossScaleOptimizer`: Keras 3 dynamic loss scaling around any torch optimizer.

Under `mixed_float16`, small gradients underflow to zero in float16. Scaling
the loss by a large factor before `backward()` lifts them into float16's range;
`step()` divides them back down (in float32, the parameters' dtype), skips the
update when any of them overflowed, and adapts the factor as Keras does.
"""

from __future__ import annotations

import bisect
import functools
import importlib
import inspect
import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, NoReturn, cast, overload

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from dtype_policies._core.listeners import scaled_loss_backward, step_skipped
from dtype_policies.optimizers._checks import (
    check_kwargs,
    check_loss_scale_state,
    check_scale,
    to_float32,
)

# The second factor of a reciprocal too large for float32 (`_unscale_grads`)
_SPLIT = 2.0**64


@functools.cache
def _unscaling_runs_eagerly() -> None:
    """Makes `_unscale_grads` run eagerly in a compiled training step: it
    reads storage addresses and strides per gradient, which a trace would
    guard on (a recompile per parameter shape, up to Dynamo's recompile
    limit). Done when the first optimizer is made, not when the package is
    imported: `torch.compiler.disable` imports Dynamo (about a second)."""
    method = LossScaleOptimizer.__dict__["_unscale_grads"]
    LossScaleOptimizer._unscale_grads = torch.compiler.disable(method)  # type: ignore[method-assign]


class LossScaleOptimizer(torch.optim.Optimizer):
    """Dynamic loss scaling around a torch optimizer (Keras 3 semantics).

    Multiply the loss by the current scale with `scale_loss` before
    `backward()`, then call `step()`. `step()` divides all gradients by the
    scale in place and checks all of them for inf/NaN in one fused pass per
    (device, dtype) group, then:

    * all finite: runs the inner optimizer's step. After `dynamic_growth_steps`
      consecutive finite steps the scale doubles.
    * any inf/NaN: skips the update (parameters and inner optimizer state stay
      bit-identical, `iterations` does not advance) and halves the scale. The
      gradients are left as they are (unscaled, holding the inf/NaN), as with
      `torch.amp.GradScaler`; the next `zero_grad()` clears them.

    Like Keras, the scale has no lower bound. A loss that is inf or NaN for
    reasons unrelated to scaling (bad data, divergence) halves the scale at
    every step, and it reaches 0 after about 165 consecutive skipped steps
    (from the default 2**15); watch `dynamic_scale` or the loss. Until it
    is 0, finite gradients are unscaled and applied, as Keras's division
    does (also below 2**-126, where the scale's float32 reciprocal is inf). Unlike
    Keras (and as `torch.amp.GradScaler`), growth stops below float32's
    largest value: a scale grown to inf (gradients exactly 0 for thousands of
    steps) would skip every later step, inf halved being inf.

    The scale is a Python float holding a float32 value (Keras keeps a float32
    variable), so scaling costs no extra tensor and adapting it launches no
    kernel. Deciding whether to skip the inner step needs the overflow flag on
    the host: `step()` reads it once (one device sync per device holding
    gradients, none on CPU beyond reading a scalar), never once per parameter.
    The gradients are multiplied by the float32 reciprocal of the scale, which
    is exact for powers of two (every scale reachable from a power-of-two
    initial scale).

    Under `torch.distributed` (DDP, FSDP2), every rank must take the same
    decision, or the replicas drift apart: under FSDP2 each rank checks only
    its own shard of each gradient. So when a process group of more than one
    process is in use, the overflow flag is all-reduced (max) over it before
    `step()` reads it, still once: one small collective and one host sync per
    step. Sharded (DTensor) gradients are unscaled and checked through their
    local shards.

    The wrapper is a `torch.optim.Optimizer`: learning-rate schedulers attach to
    it, and `param_groups`, `state` and `defaults` are the inner optimizer's
    own objects. `state_dict()` holds the inner state plus the scale, the growth
    counter and `iterations`.

    Float8 scales and amax histories (from `float8_from_*` policies) are module
    buffers, not parameters: the inner optimizer never touches them, and a
    skipped step undoes what the backward passes since the last optimizer step
    wrote to them (Keras applies them with the step).

    Args:
        inner_optimizer: The `torch.optim.Optimizer` to wrap.
        initial_scale: The starting scale, a finite positive number (rounded
            to float32). Defaults to `2**15`.
        dynamic_growth_steps: How many consecutive finite steps double the
            scale, a positive int. Defaults to 2000.
        name: A name, for Keras parity. Defaults to `"loss_scale_optimizer"`.
        process_group: The ranks that agree on skipping a step: each
            `step()` all-reduces whether any of them found inf/NaN, so every
            rank of the group must call `step()` as often. Defaults to the
            default group whenever `torch.distributed` is initialized with
            more than one process (looked up at each `step()`). `False`: this
            rank alone, with no collective (an optimizer that only some ranks
            step, or a model each rank trains on its own).
        **kwargs: Only Keras's backward-compatibility arguments are accepted:
            `dynamic=True`, and Keras's base optimizer arguments
            (`weight_decay`, `clipnorm`, ...) at their default values.

    Example:

    >>> import torch
    >>> from dtype_policies.optimizers import LossScaleOptimizer
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> optimizer.dynamic_scale
    32768.0
    >>> loss = model(torch.ones(2, 4)).square().mean()
    >>> optimizer.scale_loss(loss).backward()
    >>> optimizer.step()
    >>> optimizer.zero_grad()
    >>> optimizer.iterations, optimizer.dynamic_scale
    (1, 32768.0)
    >>> model.weight.grad = torch.full((1, 4), float("inf"))  # an overflow
    >>> optimizer.step()  # skipped: no update, the scale is halved
    >>> optimizer.iterations, optimizer.dynamic_scale
    (1, 16384.0)
    """

    # Written in `__init__` (the first five straight into `__dict__`: the
    # optimizer's `param_groups`, `state` and `defaults` are the inner one's).
    _inner: torch.optim.Optimizer
    name: str
    _initial_scale: float
    _dynamic_growth_steps: int
    _process_group: Any
    _scale: float
    _step_counter: int
    _iterations: int

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        name: str | None = None,
        *,
        process_group: Any = None,
        **kwargs: Any,
    ) -> None:
        check_kwargs(kwargs)
        _unscaling_runs_eagerly()
        if isinstance(inner_optimizer, LossScaleOptimizer):
            raise ValueError(
                "`inner_optimizer` is already a LossScaleOptimizer; wrapping it again "
                "would scale the loss twice. Pass its `inner_optimizer` instead."
            )
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(
                "`inner_optimizer` must be a torch.optim.Optimizer. "
                f"Received: inner_optimizer={inner_optimizer!r} "
                f"(of type {type(inner_optimizer).__name__})"
            )
        if _needs_closure(inner_optimizer):
            raise TypeError(
                f"LossScaleOptimizer cannot wrap {type(inner_optimizer).__name__}: its step() "
                "needs a closure, which re-evaluates the loss several times per step, and "
                "the wrapper's step() takes none (each evaluation would need the scaled loss). "
                "Use it without loss scaling (bfloat16 needs none)."
            )
        scale = check_scale(initial_scale, "initial_scale")
        group_type = getattr(torch.distributed, "ProcessGroup", None)
        if not (
            process_group is None
            or process_group is False
            or (group_type is not None and isinstance(process_group, group_type))
        ):
            raise TypeError(
                "`process_group` must be None (the default group), False (this rank alone) "
                f"or a torch.distributed.ProcessGroup. Received: process_group={process_group!r}"
            )
        if not isinstance(dynamic_growth_steps, numbers.Integral) or isinstance(
            dynamic_growth_steps, bool
        ):
            raise TypeError(
                "`dynamic_growth_steps` must be a positive int. "
                f"Received: dynamic_growth_steps={dynamic_growth_steps!r} "
                f"(of type {type(dynamic_growth_steps).__name__})"
            )
        if dynamic_growth_steps < 1:
            raise ValueError(
                "`dynamic_growth_steps` must be a positive int. "
                f"Received: dynamic_growth_steps={dynamic_growth_steps!r}"
            )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"`name` must be a string. Received: name={name!r}")
        self.__dict__.update(
            _inner=inner_optimizer,
            name=name or "loss_scale_optimizer",
            _initial_scale=scale,
            _dynamic_growth_steps=int(dynamic_growth_steps),
            _process_group=process_group,
        )
        self._reset_runtime_state()
        self._scale = scale
        self._step_counter = 0
        self._iterations = 0
        self._set_up_hooks()

    def _set_up_hooks(self) -> None:
        """What `torch.optim.Optimizer.__init__` sets up (hooks, the patched
        step), minus the parameters: those stay the inner optimizer's. torch's
        set-up also writes a key into `defaults`, here the inner optimizer's
        own dict, which must stay as it was."""
        defaults = dict(self._inner.defaults)
        torch.optim.Optimizer.__setstate__(self, {})
        self._inner.defaults.clear()
        self._inner.defaults.update(defaults)

    def _reset_runtime_state(self) -> None:
        self._found_inf: list[torch.Tensor] | None = None  # set by `unscale_()`
        self._inv_scales: dict[torch.device, torch.Tensor] = {}
        self._last_step_skipped = False
        # scale_loss() called since the last step, in a plain object: under
        # torch.compile, Dynamo drops attribute writes on an optimizer (a
        # compiled forward-backward calling scale_loss() left the flag unset)
        self._since_step = _SinceStep()

    # ------------------------------------------------------------ delegation

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's `param_groups` (the same list object)."""
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter `state`."""
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's `defaults`."""
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group to the inner optimizer."""
        self._inner.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's `zero_grad`; also forgets an `unscale_()`
        done since the last step (its gradients are gone)."""
        self._found_inf = None
        self._inner.zero_grad(set_to_none=set_to_none)

    # ---------------------------------------------------------------- scaling

    @property
    def dynamic_scale(self) -> float:
        """The current loss scale."""
        return self._scale

    @property
    def initial_scale(self) -> float:
        """The scale this optimizer started with."""
        return self._initial_scale

    @property
    def dynamic_growth_steps(self) -> int:
        """How many consecutive finite steps double the scale."""
        return self._dynamic_growth_steps

    @property
    def learning_rate(self) -> float:
        """The inner optimizer's learning rate (its first parameter group's,
        as Keras's `learning_rate`); setting it sets every group's.

        >>> import torch
        >>> from dtype_policies.optimizers import LossScaleOptimizer
        >>> weight = torch.zeros(1, requires_grad=True)
        >>> optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=0.1))
        >>> optimizer.learning_rate = 0.5
        >>> optimizer.learning_rate, optimizer.inner_optimizer.param_groups[0]["lr"]
        (0.5, 0.5)
        """
        return self._inner.param_groups[0]["lr"]

    @learning_rate.setter
    def learning_rate(self, value: float | torch.Tensor) -> None:
        # A tensor learning rate is updated in place by torch's schedulers:
        # each group keeps a tensor of its own, written into where it has one.
        for group in self._inner.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(value)
            elif isinstance(value, torch.Tensor):
                group["lr"] = value.detach().clone()
            else:
                group["lr"] = value

    def get_config(self) -> dict[str, Any]:
        """Keras's four keys: `name`, `initial_scale`, `dynamic_growth_steps`
        and `inner_optimizer`, the inner optimizer's class (module and name)
        and `defaults` (a torch optimizer's hyperparameters; its parameters
        are not configuration).

        >>> import torch
        >>> from dtype_policies.optimizers import LossScaleOptimizer
        >>> params = [torch.zeros(1, requires_grad=True)]
        >>> optimizer = LossScaleOptimizer(torch.optim.SGD(params, lr=0.5), initial_scale=3.0)
        >>> config = optimizer.get_config()
        >>> sorted(config)
        ['dynamic_growth_steps', 'initial_scale', 'inner_optimizer', 'name']
        >>> config["inner_optimizer"]["class_name"]
        'torch.optim.sgd.SGD'
        >>> again = LossScaleOptimizer.from_config(config, params=params)
        >>> again.initial_scale, again.learning_rate
        (3.0, 0.5)
        """
        inner = type(self._inner)
        return {
            "name": self.name,
            "initial_scale": self._initial_scale,
            "dynamic_growth_steps": self._dynamic_growth_steps,
            "inner_optimizer": {
                "class_name": f"{inner.__module__}.{inner.__qualname__}",
                "config": {
                    key: _snapshot(value)
                    for key, value in _constructor_arguments(inner, self._inner.defaults).items()
                },
            },
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], params: Any = None) -> LossScaleOptimizer:
        """The optimizer `config` (from `get_config`) describes. Its
        `inner_optimizer` is a torch optimizer, or the description
        `get_config` writes, built on `params` (required then)."""
        if not isinstance(config, dict) or "inner_optimizer" not in config:
            raise ValueError(
                "from_config() expects a dict from get_config(), with an 'inner_optimizer'. "
                f"Received: {config!r}"
            )
        config = dict(config)
        inner = config.pop("inner_optimizer")
        if not isinstance(inner, torch.optim.Optimizer):
            inner = _inner_from_config(inner, params)
        return cls(inner, **config)

    @property
    def step_counter(self) -> int:
        """Consecutive finite steps since the scale last changed."""
        return self._step_counter

    @property
    def iterations(self) -> int:
        """How many updates were applied (skipped steps do not count)."""
        return self._iterations

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last `step()` was skipped because of inf/NaN gradients."""
        return self._last_step_skipped

    def scale_loss(self, loss: Any) -> Any:
        """Returns `loss * dynamic_scale`; call `backward()` on the result.

        The result keeps the loss's dtype. Compute the loss in float32 (cast
        float16 logits with `.float()`), so that the scaled loss does not
        overflow float16 itself.

        >>> import torch
        >>> from dtype_policies.optimizers import LossScaleOptimizer
        >>> optimizer = LossScaleOptimizer(
        ...     torch.optim.SGD([torch.zeros(1, requires_grad=True)]), initial_scale=8)
        >>> optimizer.scale_loss(torch.tensor(0.5))
        tensor(4.)
        """
        self._since_step.scaled = True
        scaled = loss * self._scale
        scaled_loss_backward(scaled, self._inner)
        return scaled

    def unscale_(self) -> None:
        """Divides the gradients by the scale now, in place, and records
        whether any is inf/NaN, so they can be inspected or clipped before
        `step()` (which then does not unscale again).

        Call it at most once between two `step()`s, after all `backward()`
        calls of the step (the whole accumulated gradient).

        >>> import torch
        >>> from dtype_policies.optimizers import LossScaleOptimizer
        >>> weight = torch.nn.Parameter(torch.zeros(3))
        >>> optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=1.0), initial_scale=4)
        >>> optimizer.scale_loss((weight - 3.0).square().sum() / 2).backward()
        >>> weight.grad
        tensor([-12., -12., -12.])
        >>> optimizer.unscale_()
        >>> weight.grad
        tensor([-3., -3., -3.])
        >>> _ = torch.nn.utils.clip_grad_norm_([weight], max_norm=1.0)
        >>> optimizer.step()
        >>> weight.detach()
        tensor([0.5774, 0.5774, 0.5774])
        """
        if self._found_inf is not None:
            raise RuntimeError(
                "unscale_() has already been called on this LossScaleOptimizer since the "
                "last step(); the gradients are already unscaled. Call it at most once "
                "per step, after all backward() calls."
            )
        self._found_inf = self._unscale_grads()

    def _unscale_grads(self) -> list[torch.Tensor]:
        """Unscales every gradient in place; returns one found-inf flag per device.

        A gradient that cannot be written in place (elements sharing memory,
        as an expanded one from `torch.autograd.grad`; a lazily conjugated
        complex one) is replaced by a copy first, before any is written: the
        fused unscale raised part-way otherwise, some gradients divided and
        not recorded as such, so that a retried step divided them again."""
        grads: list[torch.Tensor | None] = []  # (the grouping helper's type)
        spans: dict[int, _Spans] = {}  # by storage: the written
        for group in self._inner.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not grad.is_sparse and type(grad) is torch.Tensor and _not_writable(grad):
                    param.grad = grad = grad.resolve_conj().clone(
                        memory_format=torch.contiguous_format
                    )
                written = _written(grad)
                if written is None:
                    if grad.dtype is torch.float16:  # duplicates may overflow when summed
                        param.grad = grad = grad.coalesce()
                    grads.append(_real(grad._values()))
                    continue
                shared = _shared(written, spans)
                if shared == "same":  # one gradient of several parameters: unscaled once
                    continue
                if shared == "overlapping":  # their common elements would be divided twice
                    param.grad = grad = grad.clone()
                    written = _written(grad)
                    assert written is not None
                    _shared(written, spans)
                grads.append(_real(written))
        if not grads:
            return []
        if not self._since_step.scaled and not self.__dict__.get("_warned_unscaled", False):
            # as Keras's `apply(grads)`, gradients set by hand are taken as scaled
            self.__dict__["_warned_unscaled"] = True
            warnings.warn(
                "LossScaleOptimizer: scale_loss() was not called since the last step(): if "
                "backward() ran on the loss itself, its gradients are now divided by the loss "
                f"scale ({self._scale:g}) and the model barely trains. Call "
                "`optimizer.scale_loss(loss).backward()`. With Hugging Face's Trainer, which "
                "calls backward() itself, override its training_step to back-propagate the "
                "scaled loss and set max_grad_norm=0 (its clipping would see the scaled "
                "gradients), or leave loss scaling out: bfloat16 needs none.",
                UserWarning,
                stacklevel=4,
            )
        found_infs: dict[torch.device, torch.Tensor] = {}
        inv_scales = self._inv_scales
        inverse = to_float32(1.0 / self._scale) if self._scale else math.inf
        # Below 2**-126 the reciprocal overflows float32: the gradients are
        # multiplied by two finite factors instead (Keras divides by the scale)
        split = 0.0 < self._scale and not math.isfinite(inverse)
        if split:
            inverse = to_float32(1.0 / (self._scale * _SPLIT))
        for (device, _), ((device_grads,), _) in _group_tensors_by_device_and_dtype(
            [grads]
        ).items():
            found_inf = found_infs.get(device)
            if found_inf is None:
                found_inf = found_infs[device] = torch.zeros(1, dtype=torch.float32, device=device)
            inv_scale = inv_scales.get(device)
            if inv_scale is None:
                inv_scale = inv_scales[device] = torch.full(
                    (1,), inverse, dtype=torch.float32, device=device
                )
            # The fused op checks the gradients before multiplying them. Split,
            # 2**64 first: the scaled gradients are small, and dividing them
            # by 2**64 first would take their low bits into subnormals.
            factors = [inv_scale]
            if split:
                factors.insert(0, torch.full((1,), _SPLIT, device=device))
            elif not inverse <= 1.0:
                # A scale below 1 (or 0) multiplies: the unscaled gradients may
                # overflow, so they are checked again (multiplied by 1).
                factors.append(torch.ones(1, dtype=torch.float32, device=device))
            for factor in factors:
                torch._amp_foreach_non_finite_check_and_unscale_(
                    cast("list[torch.Tensor]", device_grads), found_inf, factor
                )
        return list(found_infs.values())

    # ------------------------------------------------------------------ step

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> NoReturn: ...  # (refused: see below)
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Unscales the gradients (unless `unscale_()` did), then applies the
        inner step if they are all finite, else skips it; adapts the scale."""
        if closure is not None:
            raise RuntimeError(
                "LossScaleOptimizer.step() does not take a closure: the closure's "
                "backward() would need the scaled loss and optimizers such as LBFGS "
                "re-evaluate it several times per step. Compute the loss, call "
                "`optimizer.scale_loss(loss).backward()`, then `optimizer.step()`."
            )
        if self._only_creates_state():
            self._inner.step()
            return None
        found_infs = self._found_inf
        if found_infs is None:
            # kept until the step is done: if the inner step raises, the
            # gradients are known to be unscaled already (a retry does not
            # divide them again)
            found_infs = self._found_inf = self._unscale_grads()
        if not found_infs and _sync_group(self._process_group) is None:
            # no gradient at all: the inner step (a no-op) runs, nothing counts
            self._inner.step()
            self._step_done(skipped=False)
            return None
        # across ranks a rank without gradients (an empty micro-batch) still
        # joins the agreement, or the others would wait for it
        finite = self._all_finite(found_infs)
        if not finite:
            self._step_counter = 0
            # (inf, which a checkpoint may hold, halves to float32's largest
            # power of two, as the powers of two it stands for)
            self._set_scale(min(self._scale, 2.0**128) / 2.0)
            step_skipped(self._inner)  # float8 scale updates of the skipped step are undone
            self._step_done(skipped=True)
            return None
        self._inner.step()
        self._step_done(skipped=False)
        self._iterations += 1
        if self._step_counter == self._dynamic_growth_steps - 1:
            self._step_counter = 0
            grown = to_float32(self._scale * 2.0)
            if math.isfinite(grown):  # as GradScaler: never inf, whence no step could recover
                self._set_scale(grown)
        else:
            self._step_counter += 1
        return None

    def _only_creates_state(self) -> bool:
        """Whether this step can change nothing: no loss scaled, no
        `unscale_()`, every learning rate 0 and every gradient 0. torch's
        distributed-checkpoint helpers (`get_optimizer_state_dict`, ...) call
        `step()` so to create an empty optimizer's state; that is no update:
        it counts neither as an iteration nor towards the scale's growth."""
        if self._since_step.scaled or self._found_inf is not None:
            return False
        groups = self._inner.param_groups
        if any(float(group.get("lr", 1.0)) != 0.0 for group in groups):
            return False
        grads = [p.grad for group in groups for p in group["params"] if p.grad is not None]
        return bool(grads) and not any(
            bool(_local(grad.coalesce()._values() if grad.is_sparse else grad).any())
            for grad in grads
        )

    def _step_done(self, skipped: bool) -> None:
        self._found_inf = None
        self._since_step.scaled = False
        self._last_step_skipped = skipped

    def _all_finite(self, found_infs: list[torch.Tensor]) -> bool:
        """Whether no rank found inf/NaN: the only host sync of a step."""
        group = _sync_group(self._process_group)
        if group is None:
            return not any(flag.item() for flag in found_infs)
        import torch.distributed as dist

        device = _collective_device(group, found_infs)
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for found_inf in found_infs:
            # Blocking to the CPU: an asynchronous copy there may be read unfinished.
            flag += found_inf.to(device, non_blocking=device.type != "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return not flag.item()

    def _set_scale(self, value: float) -> None:
        self._scale = to_float32(value)
        self._inv_scales = {}

    # ------------------------------------------------------------ state dict

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus a `"loss_scale"` entry with
        the scale, the growth counter, `iterations` and `dynamic_growth_steps`
        (restored by `load_state_dict`, as torch restores learning rates).

        A plain optimizer's `load_state_dict` ignores the extra entry, so a
        checkpoint stays loadable without the wrapper.

        >>> import torch
        >>> from dtype_policies.optimizers import LossScaleOptimizer
        >>> params = [torch.nn.Parameter(torch.zeros(2))]
        >>> LossScaleOptimizer(torch.optim.SGD(params, lr=0.1)).state_dict()["loss_scale"]
        {'scale': 32768.0, 'step_counter': 0, 'iterations': 0, 'dynamic_growth_steps': 2000}
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = dict(self._inner.state_dict())
        state_dict["loss_scale"] = {
            "scale": self._scale,
            "step_counter": self._step_counter,
            "iterations": self._iterations,
            "dynamic_growth_steps": self._dynamic_growth_steps,
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a `state_dict()`. A plain optimizer's state dict (without a
        `"loss_scale"` entry) loads into the inner optimizer and keeps the
        current scale, counter, `iterations` and `dynamic_growth_steps`."""
        if not isinstance(state_dict, dict):
            raise TypeError(
                "load_state_dict() expects a dict from state_dict(). "
                f"Received: {type(state_dict).__name__}"
            )
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if "param_groups" not in state_dict:
            scaler = {"scale", "_growth_tracker"} <= state_dict.keys()
            raise ValueError(
                "load_state_dict() expects an optimizer's state dict (from state_dict(), with "
                f"'state' and 'param_groups'). Received one with the keys {sorted(state_dict)}"
                + (
                    ": a torch.amp.GradScaler's; its scale maps to "
                    "LossScaleOptimizer(initial_scale=...)"
                    if scaler
                    else ""
                )
                + ". Nothing was changed."
            )
        state_dict = dict(state_dict)
        loss_scale = state_dict.pop("loss_scale", None)
        if loss_scale is not None:
            scale, step_counter, iterations, growth_steps = check_loss_scale_state(loss_scale)
        self._inner.load_state_dict(state_dict)
        if loss_scale is not None:
            self._set_scale(scale)
            self._step_counter = step_counter
            self._iterations = iterations
            self._dynamic_growth_steps = growth_steps
        # an `unscale_()` since the last step stands: the gradients stay unscaled
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ---------------------------------------------------------------- python

    def __getstate__(self) -> dict[str, Any]:  # pickle / copy.deepcopy
        # The process group is not kept: a copy uses the default one.
        return {
            key: self.__dict__[key]
            for key in (
                "_inner",
                "name",
                "_initial_scale",
                "_dynamic_growth_steps",
                "_scale",
                "_step_counter",
                "_iterations",
            )
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        _unscaling_runs_eagerly()  # a fresh process's first optimizer may be unpickled
        self.__dict__.update(state)
        self.__dict__.setdefault("_process_group", None)
        self._reset_runtime_state()
        self._set_up_hooks()

    def __repr__(self) -> str:
        inner = "\n    ".join(repr(self._inner).splitlines())
        return (
            f"LossScaleOptimizer(dynamic_scale={self._scale}, "
            f"dynamic_growth_steps={self._dynamic_growth_steps},\n    {inner})"
        )


def _inner_from_config(described: Any, params: Any) -> torch.optim.Optimizer:
    """The torch optimizer `{"class_name": "<module>.<name>", "config": {...}}`
    describes, on `params`."""
    if (
        not isinstance(described, dict)
        or not isinstance(described.get("class_name"), str)
        or not isinstance(described.get("config"), dict)
    ):
        raise ValueError(
            "'inner_optimizer' must be a torch optimizer or {'class_name': '<module>.<name>', "
            f"'config': {{...}}}} as get_config() writes it. Received: {described!r}"
        )
    if params is None:
        raise TypeError(
            "from_config() needs `params` to build the inner optimizer "
            f"{described['class_name']} (a torch optimizer holds its parameters)."
        )
    module_name, _, name = described["class_name"].rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        found = None
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise ValueError(
            f"'inner_optimizer' class_name {described['class_name']!r} names no "
            "torch.optim.Optimizer subclass."
        )
    return found(params, **{key: _snapshot(value) for key, value in described["config"].items()})


def _written(grad: torch.Tensor) -> torch.Tensor | None:
    """The dense tensor unscaling `grad` writes (a DTensor's local shard);
    `None` for a sparse gradient."""
    return None if grad.is_sparse else _local(grad)


def _real(grad: torch.Tensor) -> torch.Tensor:
    """`grad`, a complex one as its real view (the fused op writes through it)."""
    return torch.view_as_real(grad) if grad.is_complex() else grad


class _Spans:
    """The byte spans of one storage's tensors, disjoint, sorted by start."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.spans: list[tuple[int, int, torch.Tensor]] = []


def _shared(tensor: torch.Tensor, spans: dict[int, _Spans]) -> str:
    """Whether `tensor` is one already in `spans` (`"same"`), overlaps one
    (`"overlapping"`), or neither (`""`, and it is added): gradients set by
    hand may be one tensor for two parameters, or views of one buffer (a
    flat gradient buffer: thousands of views, each checked in log time)."""
    if tensor.numel() == 0:
        return ""
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    extent = 1 + sum((int(n) - 1) * abs(int(s)) for n, s in zip(tensor.shape, tensor.stride()))
    end = start + extent * size
    seen = spans.setdefault(tensor.untyped_storage().data_ptr(), _Spans())
    # the spans are disjoint, so their ends grow with their starts: only the
    # last one starting before `end` can reach past `start`
    index = bisect.bisect_left(seen.starts, end)
    if index:
        other_start, other_end, other = seen.spans[index - 1]
        if start < other_end:
            same = (
                start == other_start
                and tensor.shape == other.shape
                and tensor.stride() == other.stride()
                and tensor.dtype == other.dtype
            )
            return "same" if same else "overlapping"
    seen.starts.insert(index, start)
    seen.spans.insert(index, (start, end, tensor))
    return ""


class _SinceStep:
    """What happened since the last step (a plain object: see `_reset_runtime_state`)."""

    scaled = False


def _not_writable(grad: torch.Tensor) -> bool:
    """Whether an in-place unscale of `grad` would fail: a lazily conjugated
    tensor, or one whose elements may share memory (0: they do not)."""
    return grad.is_conj() or torch._debug_has_internal_overlap(grad) != 0


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's) shard on this rank, in place; else `grad`."""
    if type(grad) is not torch.Tensor and hasattr(grad, "to_local"):
        return grad.to_local()
    return grad


def _snapshot(value: Any) -> Any:
    """`value` with its tensors copied (a tensor learning rate, betas): a
    config must not share them with the optimizer it describes."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_snapshot(item) for item in value)
    return value


def _constructor_arguments(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of an optimizer's `defaults` its constructor takes (torch's
    AdamW keeps `decoupled_weight_decay` there, which `AdamW()` refuses)."""
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read: every entry
        return dict(defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {key: value for key, value in defaults.items() if key in parameters}


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` cannot be called without a closure (LBFGS)."""
    try:
        parameter = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: taken as optional
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _sync_group(process_group: Any) -> Any:
    """The group whose ranks must agree, or `None` when there is nothing to
    agree with (torch.distributed not initialized, or one process)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return None
    if process_group is False:  # this rank alone
        return None
    group = process_group if process_group is not None else distributed.group.WORLD
    return group if distributed.get_world_size(group) > 1 else None


def _collective_device(group: Any, found_infs: list[torch.Tensor]) -> torch.device:
    """Where the flag is all-reduced: with the gradients' flags if the group's
    backend serves their device (gloo the CPU, nccl CUDA), else where it does."""
    backend = str(torch.distributed.get_backend(group)).lower()
    device = found_infs[0].device if found_infs else torch.device("cpu")
    if device.type == "cpu":
        if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
            return device
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and "nccl" not in backend:
        return torch.device("cpu")
    return device
