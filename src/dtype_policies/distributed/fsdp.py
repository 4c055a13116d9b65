"""`fully_shard`: FSDP2 over a model computing by dtype policies."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, cast

import torch

from dtype_policies._core.sharded import DATA_PARALLEL_WRAPPERS
from dtype_policies.apply.apply import Float32Rule, tentative_application
from dtype_policies.distributed.agreement import (
    REFUSED,
    PolicyMismatchError,
    check_ranks_agree,
    describe_policies,
)
from dtype_policies.distributed.mixed_precision import mixed_precision_policy, quantized_error
from dtype_policies.distributed.support import fsdp_refusal, sharding_device_type
from dtype_policies.distributed.units import UnitRule, plan_units, refuse_quantized
from dtype_policies.layers._unbuilt import refuse_unbuilt
from dtype_policies.policies import DTypePolicy, DTypePolicyMap
from dtype_policies.policies import get as get_policy


def _is_fsdp_module(module: torch.nn.Module) -> bool:
    return any(cls.__name__ == "FSDPModule" for cls in type(module).__mro__)


def _refuse_before_planning(model: Any, policy_or_map: Any, float32_modules: Any) -> None:
    """What is refused before any policy is applied."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"fully_shard() expects a torch.nn.Module. Received: {type(model).__name__}"
        )
    sharded = [name or "(model)" for name, m in model.named_modules() if _is_fsdp_module(m)]
    if sharded:
        raise ValueError(
            f"fully_shard(): the model is sharded already ({', '.join(sharded[:3])}). Apply "
            "dtype_policies.distributed.fully_shard to the unsharded model."
        )
    replicated = [
        name or "(model)"
        for name, m in model.named_modules()
        if isinstance(m, DATA_PARALLEL_WRAPPERS)
    ]
    if replicated:  # both would reduce the gradients, each its own way
        raise ValueError(
            f"fully_shard(): {', '.join(replicated[:3])} is a data-parallel wrapper "
            "(DistributedDataParallel or DataParallel): shard the model it wraps instead of "
            "wrapping it, fully_shard(ddp.module, ...). Nothing was changed."
        )
    refuse_unbuilt(
        model,
        "fully_shard()",
        "after the sharding, and would stay whole on every rank with their gradients never "
        "reduced (the ranks drift apart)",
    )
    scalars = [name for name, parameter in model.named_parameters() if parameter.dim() == 0]
    if scalars:  # torch's fully_shard refuses them part-way through the units
        raise ValueError(
            f"fully_shard(): FSDP2 shards every parameter along its first dimension, and "
            f"{', '.join(repr(name) for name in scalars[:3])} "
            f"{'is a scalar' if len(scalars) == 1 else 'are scalars'}: make each a 1-D tensor "
            "of one element (torch.nn.Parameter(value.reshape(1))). Nothing was changed."
        )
    if policy_or_map is None and float32_modules is not None:
        raise ValueError(
            "fully_shard(): float32_modules is an option of the policy's application, and "
            "policy_or_map=None applies none (it keeps the policies applied before, their "
            f"float32 modules included). Received: float32_modules={float32_modules!r}. Pass "
            "the policy with it, or apply_policy(model, policy, float32_modules=...) first."
        )


def _refuse_quantized_policies(policy_or_map: Any) -> None:
    """Raises if the policy, or any entry of the map, is quantized."""
    policy = get_policy(policy_or_map)
    entries: dict[str, DTypePolicy]
    if policy.is_map:
        policy_map = cast(DTypePolicyMap, policy)
        entries = {"the default": policy_map.default_policy, **policy_map.policy_map}
    else:
        entries = {"": policy}
    for key, entry in entries.items():
        if entry.quantization_mode is not None:
            where = f" (map entry {key!r})" if key else ""
            raise quantized_error("fully_shard()", f"'{entry.name}'{where} is a quantized policy")


def fully_shard(
    model: torch.nn.Module,
    policy_or_map: Any,
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int = True,
    units: Iterable[UnitRule] | None = None,
    float32_modules: Iterable[Float32Rule] | None = None,
    read_by_parent: Iterable[UnitRule] | None = None,
) -> torch.nn.Module:
    """Shards `model` with FSDP2, each unit in the dtypes its policy says.

    First the policy is applied (`apply_policy(model, policy_or_map,
    float32_modules=...)`; `None` keeps the policies already applied, as
    `saving.load` leaves them). Then `torch.distributed.fsdp.fully_shard` is
    called for each unit of `shard_plan(model, units=units)`, innermost first
    and the model last, with a `MixedPrecisionPolicy` per unit:

    * a block (by default each direct child with parameters, the items of a
      `ModuleList` included) all-gathers its parameters in its policy's
      compute dtype and reduce-scatters its gradients in their own dtype
      (the policy's variable dtype): `mixed_bfloat16` gives
      `param_dtype=bfloat16, reduce_dtype=float32`, a `float32` block
      `param_dtype=None`;
    * float32 islands (normalization layers), modules whose policy computes
      in another dtype than their block's, embedding tables (looked up in
      their own dtype) are units of their own, all-gathered as stored;
    * `cast_forward_inputs=False` everywhere: each module's policy casts its
      inputs (FSDP2 would cast them per unit only).

    The sharded parameters stay in the variable dtype (float32 DTensors, what
    the optimizer steps), and every module computes with the same values as
    a single-process `apply_policy` run.

    Call it on every rank, after `torch.distributed.init_process_group`, on
    a model that is not sharded yet, then build the optimizer on
    `model.parameters()`. The ranks check that they agree on every module's
    policy and every unit (one all-gather of a digest) before any shard.

    Args:
        model: The model (not yet sharded). Its parameters should be on the
            mesh's device type (CPU for gloo).
        policy_or_map: A policy, a policy name, a torch dtype, a
            `DTypePolicyMap`, or `None` to keep the applied policies.
        mesh: The `DeviceMesh` to shard over (default: FSDP2's, all ranks).
        reshard_after_forward: FSDP2's option, for every unit.
        units: The blocks: module classes, class-name suffixes, or callables
            `(name, module) -> bool` (`name` is torch's dotted name).
            Default: each direct child with parameters.
        float32_modules: As for `apply_policy`; only with a policy (with
            `None`, the policies applied before keep their own).
        read_by_parent: Modules whose parent reads their parameters itself,
            never calling them (rules as `units`): a tied head read as
            `F.linear(h, self.wte.weight)`, a norm's weight passed to
            `F.layer_norm` by its block. They share their parent's unit;
            as units of their own they would stay sharded when read (torch:
            "got mixed torch.Tensor and DTensor"). `nn.MultiheadAttention`'s
            `out_proj` and the modules `quantize()` reports as "weight read
            by its parent" are found without it.

    Returns:
        `model`, sharded (an `FSDPModule`).

    A group of one process, as `torchrun --nproc-per-node 1` would start:

    >>> import os, tempfile, torch
    >>> import torch.distributed as dist
    >>> from dtype_policies import DTypePolicyMap
    >>> from dtype_policies.distributed import fully_shard
    >>> init = tempfile.NamedTemporaryFile(delete=False).name
    >>> dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    >>> model = fully_shard(model, DTypePolicyMap("mixed_bfloat16", {"1": "float32"}))
    >>> type(model[0].weight).__name__, model[0].weight.dtype
    ('DTensor', torch.float32)
    >>> model(torch.ones(1, 4)).dtype  # the last layer computes in float32
    torch.float32
    >>> dist.destroy_process_group(); os.remove(init)

    Raises:
        PolicyMismatchError: (a `ValueError`) The ranks apply different
            policies or units; raised on every rank, naming the modules.
        ValueError: The model is sharded already; `float32_modules` without
            a policy; or a policy of the map, or
            a module of the model, is quantized (FSDP2 does not train
            quantized models; shard the float model, quantize afterwards).
        TypeError: `model` is not a module, or a bad policy or `units` entry.
        RuntimeError: No process group and no `mesh`; or this torch's FSDP2
            cannot run on the mesh's device (FSDP2 on CPU needs torch>=2.7:
            `distributed.support.fsdp_refusal` says why).

    When it raises before the first shard, the model is as it was, the
    policies applied before the call (and their handles) included.
    """
    try:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
    except ImportError as e:  # pragma: no cover - torch without distributed
        raise ImportError(
            f"dtype_policies.distributed.fully_shard() needs torch.distributed.fsdp: {e}"
        ) from None
    # What one rank refuses, every rank must hear of: each rank's checks run
    # to the agreement's exchange, which then raises on every rank (any error:
    # a `units` rule of the user's may raise anything).
    problem: Exception | None = None
    with contextlib.ExitStack() as applied:  # an error leaves the policies as they were
        try:
            _refuse_before_planning(model, policy_or_map, float32_modules)
            if policy_or_map is not None:
                _refuse_quantized_policies(policy_or_map)
            refuse_quantized(model, "fully_shard()")
            if policy_or_map is not None:
                applied.enter_context(
                    tentative_application(model, policy_or_map, float32_modules=float32_modules)
                )
            plan = plan_units(model, units, stacklevel=4, read_by_parent=read_by_parent)
            description = describe_policies(model, plan)
        except Exception as error:
            problem = error
            description = {REFUSED: f"{type(error).__name__}: {error}"}
        # ranks resharding differently would wait for each other in backward
        description["(option) reshard_after_forward"] = repr(reshard_after_forward)
        if mesh is None and not torch.distributed.is_initialized():
            if problem is not None:
                raise problem
            raise RuntimeError(
                "fully_shard(): no process group (call torch.distributed.init_process_group "
                "first) and no `mesh` given."
            )
        try:
            check_ranks_agree(description, mesh)
        except PolicyMismatchError:
            if problem is not None:
                raise problem from None  # this rank's own error, as in one process
            raise
        if problem is not None:
            raise problem
        refusal = fsdp_refusal(sharding_device_type(mesh))
        if refusal is not None:
            raise RuntimeError(f"fully_shard(): {refusal}")
        # torch refusing the first unit (its options) leaves the policies as they were
        _shard(torch_fully_shard, plan[0], mesh, reshard_after_forward)
    for unit in plan[1:]:
        _shard(torch_fully_shard, unit, mesh, reshard_after_forward)
    return model


def _shard(torch_fully_shard: Any, unit: Any, mesh: Any, reshard_after_forward: Any) -> None:
    torch_fully_shard(
        unit.module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mixed_precision_policy(unit.param_dtype, unit.reduce_dtype, False),
    )
