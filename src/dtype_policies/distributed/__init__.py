"""Dtype policies beyond one process: FSDP2 and DDP.

* `fully_shard(model, policy_or_map)`: FSDP2 (`torch.distributed.fsdp`)
  with one `MixedPrecisionPolicy` per unit, derived from the policies.
* `shard_plan(model)`: the units and dtypes `fully_shard` would use.
* `to_mixed_precision_policy(policy)`: one policy as a `MixedPrecisionPolicy`.

DDP needs nothing from here: `DistributedDataParallel` over an `apply_policy`
model reduces the float32 gradients of the float32 parameters. Under both,
`optimizers.LossScaleOptimizer` agrees with all ranks on skipping a step, and
`saving.save` of a sharded model writes full tensors from rank 0.
See docs/distributed.md.

>>> from dtype_policies import distributed
>>> fsdp_policy = distributed.to_mixed_precision_policy("mixed_bfloat16")
>>> fsdp_policy.param_dtype, fsdp_policy.reduce_dtype
(torch.bfloat16, torch.float32)
"""

from dtype_policies.distributed.agreement import PolicyMismatchError
from dtype_policies.distributed.fsdp import fully_shard
from dtype_policies.distributed.mixed_precision import to_mixed_precision_policy
from dtype_policies.distributed.units import ShardUnit, describe_plan, shard_plan

__all__ = [
    "PolicyMismatchError",
    "ShardUnit",
    "describe_plan",
    "fully_shard",
    "shard_plan",
    "to_mixed_precision_policy",
]
