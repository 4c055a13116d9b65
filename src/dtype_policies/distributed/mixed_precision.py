"""`to_mixed_precision_policy`: a dtype policy as FSDP2's `MixedPrecisionPolicy`."""

from __future__ import annotations

from typing import Any

import torch

from dtype_policies._dtypes import is_float_dtype, to_torch_dtype
from dtype_policies.policies import get as get_policy


def mixed_precision_policy(
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    cast_forward_inputs: bool,
) -> Any:
    """FSDP2's `MixedPrecisionPolicy` (imported on first use: loading
    `torch.distributed.fsdp` takes about a second), with `reduce_dtype` `None`
    where it is `param_dtype` (the gradients' own dtype, reduced as they are):
    torch 2.6 sets it so itself, later versions keep what they are given."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=None if reduce_dtype == param_dtype else reduce_dtype,
        output_dtype=None,
        cast_forward_inputs=cast_forward_inputs,
    )


def quantized_error(where: str, what: str) -> ValueError:
    """The error for quantized policies and modules: FSDP2 cannot train them."""
    return ValueError(
        f"{where}: {what}. FSDP2 training of quantized models is not supported: their "
        "quantized weights are buffers that FSDP2 neither shards nor reduces, and int8/int4 "
        "weights get no gradient. Train under the float source policy (e.g. "
        "'mixed_bfloat16') and quantize afterwards; for quantized inference, load the "
        "quantized model whole on every rank, without sharding (docs/distributed.md)."
    )


def to_mixed_precision_policy(policy: Any, *, cast_forward_inputs: bool = True) -> Any:
    """FSDP2's `MixedPrecisionPolicy` for a dtype policy.

    Parameters are all-gathered (and the forward and backward computed) in the
    policy's compute dtype, and gradients are reduced in its variable dtype, in
    which the sharded parameters stay: `"mixed_bfloat16"` gives
    `param_dtype=torch.bfloat16, reduce_dtype=torch.float32`; a policy
    that computes in its variable dtype (`"float16"`) gives
    `reduce_dtype=None` (the gradients are reduced in the dtype they are
    computed in), on every torch version. `output_dtype` is left unset.
    Quantized policies raise `ValueError`: FSDP2 does not train quantized
    models.

    Use it with `torch.distributed.fsdp.fully_shard(module, mp_policy=...)`
    when sharding by hand; `dtype_policies.distributed.fully_shard` derives
    one per unit itself (with `cast_forward_inputs=False`: the policies cast
    each module's inputs).

    Args:
        policy: A policy, a policy name or a torch dtype (not a
            `DTypePolicyMap`: take the entry of one path, `policy_map[path]`).
        cast_forward_inputs: FSDP2's option: cast floating forward inputs to
            the compute dtype at the unit's boundary.

    >>> from dtype_policies.distributed import to_mixed_precision_policy
    >>> mp = to_mixed_precision_policy("mixed_bfloat16")
    >>> mp.param_dtype, mp.reduce_dtype, mp.output_dtype
    (torch.bfloat16, torch.float32, None)
    """
    try:
        policy = get_policy(policy)
    except (TypeError, ValueError) as e:
        raise type(e)(f"to_mixed_precision_policy(): invalid policy {policy!r}: {e}") from None
    if policy.is_map:
        raise TypeError(
            "to_mixed_precision_policy() takes one policy, not a DTypePolicyMap: pass the "
            "entry of a path (`policy_map[path]`), or use "
            "dtype_policies.distributed.fully_shard(model, policy_map)."
        )
    if policy.quantization_mode is not None:
        raise quantized_error(
            "to_mixed_precision_policy()", f"'{policy.name}' is a quantized policy"
        )
    compute, variable = policy.compute_dtype, policy.variable_dtype
    if not (is_float_dtype(compute) and is_float_dtype(variable)):
        raise ValueError(
            f"to_mixed_precision_policy(): the policy '{policy.name}' computes in {compute} "
            f"with {variable} variables; FSDP2 casts floating parameters only."
        )
    return mixed_precision_policy(
        to_torch_dtype(compute), to_torch_dtype(variable), cast_forward_inputs
    )
