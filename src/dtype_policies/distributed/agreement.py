"""Checking that every rank shards the same policies.

Ranks that apply different policies to their copies of a model would reduce
gradients computed in different dtypes, silently. `check_ranks_agree`
all-gathers one fixed-size digest of each rank's policies and units (one
collective); only when the digests differ are the descriptions themselves
gathered, to name the differing modules.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from dtype_policies.distributed.units import ShardUnit, dtype_name
from dtype_policies.quantizers.config import serialize_config

_DIGEST_WORDS = 4  # sha256 as int64 words


class PolicyMismatchError(ValueError):
    """The ranks of a process group apply different policies to one model.

    >>> from dtype_policies.distributed import PolicyMismatchError
    >>> issubclass(PolicyMismatchError, ValueError)
    True
    """


def describe_policies(model: torch.nn.Module, plan: list[ShardUnit]) -> dict[str, str]:
    """`{what: how}` for each module's policy (its quantization config
    included), each parameter's shape, and each unit of `plan`:
    what the ranks must agree on.

    >>> import torch
    >>> import dtype_policies
    >>> from dtype_policies.distributed import shard_plan
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    >>> _ = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> describe_policies(model, shard_plan(model))["module '0'"]
    'mixed_bfloat16'
    """
    description = {}
    for name, module in model.named_modules():
        policy = getattr(module, "dtype_policy", None)
        how = "no policy" if policy is None else policy.name
        config = getattr(policy, "quantization_config", None)
        if config is not None:
            how += f" {json.dumps(serialize_config(config), sort_keys=True, default=str)}"
        description[f"module '{name or '(model)'}'"] = how
    for name, parameter in model.named_parameters():  # else gloo aborts mid-collective
        description[f"parameter '{name}'"] = f"shape {tuple(parameter.shape)}"
    for unit in plan:
        description[f"unit '{unit.name or '(model)'}'"] = (
            f"param {dtype_name(unit.param_dtype)}, reduce {dtype_name(unit.reduce_dtype)}"
        )
    return description


def _digest(description: dict[str, str]) -> torch.Tensor:
    text = json.dumps(sorted(description.items()))
    data = bytearray(hashlib.sha256(text.encode()).digest())
    return torch.frombuffer(data, dtype=torch.int64).clone()


def _groups(mesh: Any) -> list[Any]:
    """The process groups the ranks of `mesh` (default: all ranks) form."""
    if mesh is None:
        return [torch.distributed.group.WORLD]
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


def _device(group: Any, mesh: Any) -> torch.device:
    """Where the group's collectives take tensors."""
    if mesh is not None:
        device_type = mesh.device_type
    elif torch.distributed.get_backend(group) == "gloo":
        device_type = "cpu"
    else:
        accelerator = torch.accelerator.current_accelerator()
        device_type = "cpu" if accelerator is None else accelerator.type
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())


REFUSED = "(refused)"
"""The key of a rank's description that holds the error it refused with."""


def mismatch_message(descriptions: list[dict[str, str]], ranks: list[int]) -> str:
    """The error naming what differs between the ranks' descriptions.

    >>> message = mismatch_message(
    ...     [{"module '0'": "float32"}, {"module '0'": "mixed_bfloat16"}], [0, 1]
    ... )
    >>> message[message.index("module"):message.index(". Apply")]
    "module '0': rank 0 float32, rank 1 mixed_bfloat16"
    """
    refusals = [
        f"rank {rank} refused it: {description[REFUSED]}"
        for rank, description in zip(ranks, descriptions)
        if REFUSED in description
    ]
    if refusals:
        return f"fully_shard(): {'; '.join(refusals)}. Nothing was changed on any rank."
    keys = sorted({key for description in descriptions for key in description})
    differing = []
    for key in keys:
        seen = [description.get(key, "absent") for description in descriptions]
        if len(set(seen)) > 1:
            per_rank = ", ".join(f"rank {rank} {how}" for rank, how in zip(ranks, seen))
            differing.append(f"{key}: {per_rank}")
    shown = "; ".join(differing[:5]) + (
        f"; and {len(differing) - 5} more" if len(differing) > 5 else ""
    )
    if any(line.startswith("parameter") for line in differing):
        return (
            f"fully_shard(): the ranks hold different models: {shown}. Build the same model "
            "on every rank (the same configuration, then the same seed or saving.load)."
        )
    if all(line.startswith("(option)") for line in differing):
        return (
            f"fully_shard(): the ranks pass different options: {shown}. Ranks sharding "
            "differently would wait for each other's collectives: pass the same options on "
            "every rank."
        )
    return (
        "fully_shard(): the ranks apply different policies, which would reduce gradients "
        f"computed in different dtypes. {shown}. Apply the same policies on every rank (the "
        "same DTypePolicyMap and float32_modules, or saving.load of one checkpoint)."
    )


def check_ranks_agree(description: dict[str, str], mesh: Any = None) -> None:
    """Raises `PolicyMismatchError` on every rank when the ranks of `mesh`
    (default: all ranks) hold different descriptions. One all-gather of a
    digest per mesh dimension; nothing for a group of one."""
    dist = torch.distributed
    for group in _groups(mesh):
        world = dist.get_world_size(group)
        if world == 1:
            continue
        mine = _digest(description).to(_device(group, mesh))
        gathered = mine.new_empty(world * _DIGEST_WORDS)
        # torch 2.13 deprecates all_gather_into_tensor for all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, mine, group=group)
        if bool((gathered.view(world, _DIGEST_WORDS) == mine).all()):
            continue
        descriptions: list[Any] = [None] * world
        dist.all_gather_object(descriptions, description, group=group)
        ranks = dist.get_process_group_ranks(group)
        raise PolicyMismatchError(mismatch_message(descriptions, ranks))
