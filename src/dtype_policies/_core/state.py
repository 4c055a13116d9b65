"""`CallState`: everything a policied module's call needs, derived once from
its policy and the module's facts by `derive_call_state` (for `Layer`s and
for the modules `apply_policy` prepares alike)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dtype_policies._dtypes import is_float_dtype, to_torch_dtype
from dtype_policies.policies import DTypePolicy


@dataclass(frozen=True, eq=False)
class CallState:
    """The frozen per-module call state.

    Attributes:
        policy: The resolved policy (never a map), quantized when the module is.
        compute: The compute dtype, `None` when it is not floating.
        inputs: Floating call arguments are cast to this (`None`: no cast).
        outputs: Floating outputs are cast to this (`None`: as they come).
        outputs_in_calls: `outputs` holds only inside another module's call
            (a parametrization's weight, read by its module in the module's
            compute dtype); read outside any call, the outputs come as they
            are (the weight in its variable dtype, as a parameter reads then).
        island: A float32 island: outputs go back in the caller's dtype.
        half_inputs_ok: (islands) the module's CPU kernel takes half inputs
            with float32 weights and computes in float32 itself.
        autocast: Whether weights are read in the compute dtype in the call.
        has_weights: Whether the module or any submodule has tensors; a call
            of a module without any needs no autocast scope.
        casts_own_weights: The module's forward reads its weights in the
            compute dtype itself (a leaf fast path): no scope is opened.
        weight_names: Parameters and buffers read in the compute dtype.
        buffer_names: Those of `weight_names` that are buffers.
        warn_cpu_float16: Whether to warn about float16 compute on CPU.
        convert_arrays: Whether array arguments (NumPy, ...) become tensors
            even when nothing is cast (Keras layers do this).
        leaf_fast_path: Derived: a call needs nothing but its floating
            tensor arguments cast to `inputs`.
    """

    policy: DTypePolicy
    compute: torch.dtype | None
    inputs: torch.dtype | None
    outputs: torch.dtype | None
    outputs_in_calls: bool
    island: bool
    half_inputs_ok: bool
    autocast: bool
    has_weights: bool
    casts_own_weights: bool
    weight_names: frozenset[str]
    buffer_names: frozenset[str]
    warn_cpu_float16: bool
    convert_arrays: bool = False
    leaf_fast_path: bool = False

    def in_a_scope(self) -> CallState:
        """This state with the weights cast by a scope around the call, not by
        the class's leaf forward: for a module whose instance has a `forward`
        of its own (accelerate's hooks, a wrapped forward), which bypasses it."""
        if not self.casts_own_weights:
            return self
        return replace(self, casts_own_weights=False, leaf_fast_path=False)


def compute_dtype_of(policy: DTypePolicy) -> torch.dtype | None:
    """The policy's compute dtype as a torch dtype, `None` if not floating."""
    name = policy.compute_dtype
    return to_torch_dtype(name) if is_float_dtype(name) else None


def derive_call_state(
    policy: DTypePolicy,
    *,
    has_weights: bool,
    weight_names: frozenset[str] = frozenset(),
    buffer_names: frozenset[str] = frozenset(),
    autocast: bool = True,
    cast_inputs: bool = True,
    island: bool = False,
    half_inputs_ok: bool = False,
    gather_dtype: torch.dtype | None = None,
    output_compute: bool = False,
    casts_own_weights: bool = False,
    convert_arrays: bool = False,
    norm_dtype: torch.dtype | None = None,
    hand_back: torch.dtype | None = None,
    hand_back_in_calls: bool = False,
) -> CallState:
    """The call state of a module under `policy` (see `CallState`).

    `gather_dtype`: the module looks rows up in a table of this dtype
    (embeddings): its floating arguments (`per_sample_weights`) are cast to the
    table's dtype and its outputs to the compute dtype. `output_compute`:
    outputs are cast to the compute dtype (normalization layers, whose float32
    weights would otherwise promote them). `norm_dtype`: (normalization
    layers, which never cast their own tensors) the dtype their parameters and
    running statistics are stored in; when a conversion of the model
    (`.double()`, `.half()`, `.to(dtype)`) left it other than float32 and the
    compute dtype, no kernel combines the two: the layer computes in it.
    `hand_back`: floating outputs are cast to this dtype (the enclosing
    module's, wider than the compute dtype); with `hand_back_in_calls`, only
    inside another module's call (see `CallState.outputs_in_calls`).
    """
    compute = compute_dtype_of(policy)
    inputs = outputs = None
    if compute is not None and cast_inputs:
        inputs = compute
        if gather_dtype is not None:
            inputs, outputs = gather_dtype, compute
        elif output_compute and not island:
            outputs = compute
    if (
        compute is not None
        and norm_dtype is not None
        and norm_dtype not in (torch.float32, compute)
    ):
        compute, half_inputs_ok = norm_dtype, False
        inputs = compute if inputs is not None else None
    if hand_back is not None and compute is not None and hand_back != compute:
        outputs = hand_back
    return CallState(
        policy=policy,
        compute=compute,
        inputs=inputs,
        outputs=outputs,
        outputs_in_calls=hand_back_in_calls and outputs is hand_back,
        island=island and compute is not None,
        half_inputs_ok=half_inputs_ok,
        autocast=autocast and compute is not None,
        has_weights=has_weights,
        casts_own_weights=casts_own_weights,
        weight_names=weight_names if compute is not None else frozenset(),
        buffer_names=buffer_names if compute is not None else frozenset(),
        warn_cpu_float16=compute is torch.float16,
        convert_arrays=convert_arrays,
        leaf_fast_path=(
            casts_own_weights
            and inputs is not None
            and outputs is None
            and not (island and compute is not None)
            and compute is not torch.float16
        ),
    )
