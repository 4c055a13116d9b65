"""The call core for any torch module: `PolicyModule`, the mixin put in front
of a module's class, and what its policy applications hold.

Each application (an `apply_policy` handle, or `quantize()` on a plain module)
pushes `(token, ModuleOptions)` on the module's application stack (in its
`ModuleState`, see `module_state`); the top entry decides the module's
`CallState`. When the last application is taken off, the module gets its own
class back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from dtype_policies._core import sharded
from dtype_policies._core.call import read_weight, run_call
from dtype_policies._core.casting import HALF_DTYPES, cast_tensor, tracing
from dtype_policies._core.checkpoints import check_before_loading, loads_as_torch
from dtype_policies._core.compose import ModuleMixin, mixins_of, original_class, set_mixins
from dtype_policies._core.module_state import (
    STATE_KEY,
    drop_state_if_empty,
    push_application,
    state_of,
)
from dtype_policies._core.products import linear_product, traced_product
from dtype_policies._core.state import CallState, derive_call_state
from dtype_policies._core.weight_casts import WeightCasts, cast_pair
from dtype_policies.policies import DTypePolicy, QuantizedDTypePolicy, policy_for_config


@dataclass(frozen=True)
class ModuleOptions:
    """How one application treats one module.

    Attributes:
        policy: The module's float (or quantized) policy.
        island: Compute in float32 and hand outputs back in the caller's dtype.
        half_inputs_ok: (islands) its CPU kernel takes half inputs directly.
        norm: A normalization layer: its own parameters and buffers are never
            cast (running statistics stay float32 and keep updating); its
            outputs are in the compute dtype.
        gather: Its weights are looked up, not multiplied (embeddings).
        cast_buffers: Read persistent floating buffers in the compute dtype too.
        weight_cache: Keep graph-free casts between calls (see `weight_casts`).
        outputs: The name of the dtype its floating outputs are handed back
            in (`None`: its compute dtype): the enclosing module's compute
            dtype, where the module computes in a narrower one, so that the
            code around it computes as its own policy says (a
            parametrization's list: only inside a call, see
            `CallState.outputs_in_calls`).
    """

    policy: DTypePolicy
    island: bool = False
    half_inputs_ok: bool = False
    norm: bool = False
    gather: bool = False
    cast_buffers: bool = True
    weight_cache: bool = True
    outputs: str | None = None


class PolicyModule(ModuleMixin):
    """The mixin that runs a torch module's calls by its policy."""

    _dp_order = 0
    _dp_per_class = ("__call__",)  # see compose._own_copy

    @property
    def dtype_policy(self) -> DTypePolicy:
        """The policy this module computes by (quantized when it is)."""
        state = self.__dict__.get(STATE_KEY)
        if state is None or state.call is None:  # built by the module's own code (a slice)
            raise AttributeError(
                f"This {original_class(self).__name__} has no dtype policy of its own (built "
                "by its class's own code, as a slice of a Sequential is): its submodules keep "
                "theirs. Give it one with apply_policy()."
            )
        return state.call.policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, PolicyModule):
            # a bound method taken before the policy was removed (torch.compile
            # keeps the module's `__call__`): the module's class is its own again
            return type(self).__call__(self, *args, **kwargs)
        state = self.__dict__.get(STATE_KEY)
        call = None if state is None else state.call
        if call is None:  # built by the module's own code (a slice of a Sequential)
            return super().__call__(*args, **kwargs)
        if call.casts_own_weights and "forward" in self.__dict__:
            call = call.in_a_scope()  # an instance's forward bypasses the leaf forward
        return run_call(call, super().__call__, args, kwargs, self)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        modules = d.get("_modules")  # children: the most frequent lookup in a forward
        child = None if modules is None else modules.get(name)
        if child is not None:
            return child
        state = d.get(STATE_KEY)
        call = None if state is None else state.call
        if call is not None and name in call.weight_names:
            is_buffer = name in call.buffer_names
            value = (d["_buffers"] if is_buffer else d["_parameters"]).get(name)
            if value is not None:
                if sharded.as_is(d, value):  # FSDP2 reading its sharded parameter
                    return value
                # (`call` is not None only when `state` is not None)
                return read_weight(state.casts, name, value, is_buffer)  # type: ignore[union-attr]
        return super().__getattr__(name)

    _is_fsdp_managed_module = sharded.fsdp_managed

    def train(self, mode: bool = True) -> Any:
        state = self.__dict__.get(STATE_KEY)
        if state is not None:  # a switch of mode drops kept casts (see weight_casts)
            state.casts.clear()
        return super().train(mode)

    @loads_as_torch
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        check_before_loading(self, state_dict, prefix, args, kwargs)  # the whole subtree, once
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # `.to()`, `.half()`, ... may change weight dtypes: re-derive the state.
        result = super()._apply(fn, *args, **kwargs)
        if is_policied(self):
            refresh(self)
        return result

    def register_parameter(self, name: str, param: Any) -> None:
        # A weight registered after the policy (`spectral_norm` moves `weight`
        # to `weight_orig`) is read like the others: re-derive the state.
        super().register_parameter(name, param)
        if is_policied(self):
            refresh(self)

    def register_buffer(self, name: str, tensor: Any, persistent: bool = True) -> None:
        super().register_buffer(name, tensor, persistent)
        if is_policied(self):
            refresh(self)

    def _refresh_policy_state(self) -> None:
        """Re-derives the call state after a change of the application stack
        (`module_state.push_application` / `pop_application`)."""
        if self.__dict__[STATE_KEY].applications:
            refresh(self)
        else:
            release(self)


class FastLinearForward(ModuleMixin):
    """The forward of an exact `nn.Linear` under a policy: it reads its weights
    in the compute dtype itself (a leaf needs no autocast scope), which keeps
    the call cost of small layers low."""

    _dp_order = 10

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear_leaf(self, input, transposed=False)


class FastTransposedLinearForward(ModuleMixin):
    """The forward of transformers' exact `Conv1D` (GPT-2's linear layer, its
    weight stored `(in, out)`) under a policy: as `FastLinearForward`, with
    the same product paths, the weight read as its transpose."""

    _dp_order = 10

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_leaf(self, x, transposed=True)


def linear_leaf(module: torch.nn.Module, input: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A policied linear leaf's call: `input @ weight.T + bias` (`input @
    weight + bias` for a `transposed` one), its weights read in the compute
    dtype here and multiplied by the path this CPU runs them by."""
    d = module.__dict__
    state = d.get(STATE_KEY)
    call = None if state is None else state.call
    parameters = d["_parameters"]
    weight, bias = parameters.get("weight"), parameters.get("bias")
    store = None if state is None else state.casts
    if weight is None:
        # Not a registered parameter: a tensor that a hook or parametrization
        # computes in every call (`spectral_norm`, `weight_norm`). Cast per call.
        weight, store = module.weight, None
    if "bias" not in parameters:  # the same, of the bias (None: a layer without one)
        bias, store = module.bias, None
    inputs_dtype = None if call is None else call.inputs
    if inputs_dtype is not None and input.dtype is not inputs_dtype and input.is_floating_point():
        input = cast_tensor(input, inputs_dtype)  # cast by the call, then by a user's pre-hook
    if call is not None and call.autocast and weight.dtype is not call.compute:
        weight, bias, product = cast_pair(
            store, weight, bias, call.compute, pack=True, transposed=transposed
        )
        if product is not None:  # the path this CPU runs it by (`_core.products`)
            return product(input, bias)
        return half_linear(input, weight.t() if transposed else weight, bias)
    if call is not None and call.compute in HALF_DTYPES:
        # Weights already in the compute dtype (sharded or half-precision
        # parameters) take the same product path as cast ones; a bias
        # left in another dtype is cast per call.
        if bias is not None and call.autocast and bias.dtype is not call.compute:
            bias = bias.to(call.compute)
        rows_out = weight.t() if transposed else weight
        product = traced_product(rows_out) if tracing() else linear_product(rows_out, kept=False)
        if product is not None:
            return product(input, bias)
        return half_linear(input, rows_out, bias)
    if transposed:  # transformers' own product
        flat = input.reshape(-1, input.shape[-1])
        out = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
        return out.view(*input.shape[:-1], out.shape[-1])
    return F.linear(input, weight, bias)


def half_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear` in a compute dtype, a 3-D or wider input folded to 2-D first.

    Both half-precision branches of `FastLinearForward` end here, so a layer
    gives the same bits whether its weight was cast in the call or arrived in
    the compute dtype (FSDP2's gathered parameters). Unfolded, torch runs a
    strided 3-D input (the last position of a sequence; attention's
    transposed output) as a batched product: it copies the whole weight when
    the weight does not require grad, and adds the bias after rounding the
    product, where the folded `addmm` rounds once (the bits differ where
    oneDNN runs bfloat16 on AMX)."""
    if input.dim() <= 2:
        return F.linear(input, weight, bias)
    out = F.linear(input.reshape(-1, input.shape[-1]), weight, bias)
    return out.view(*input.shape[:-1], out.shape[-1])


FAST_LINEARS = (torch.nn.Linear, torch.nn.modules.linear.NonDynamicallyQuantizableLinear)
TRANSPOSED_LINEARS = frozenset({"transformers.pytorch_utils.Conv1D"})
"""Exact classes (by module and name, so that nothing here imports them) of
linear layers whose weight is stored `(in, out)`."""


LEAF_FORWARDS = (FastLinearForward, FastTransposedLinearForward)
"""The forwards `fast_forward_of` gives."""


def fast_forward_of(cls: type) -> type[ModuleMixin] | None:
    """The leaf forward an unquantized module of exactly class `cls` gets
    under a policy (`None`: its own forward, inside an autocast scope)."""
    if cls in FAST_LINEARS:
        return FastLinearForward
    if f"{cls.__module__}.{cls.__qualname__}" in TRANSPOSED_LINEARS:
        return FastTransposedLinearForward
    return None


class DenseTransformerEncoder(ModuleMixin):
    """An `nn.TransformerEncoder` whose layers compute in a half dtype: its
    nested-tensor path (eval mode with a padding mask) runs torch's fused
    encoder layer on nested tensors, which refuses the layers' float32 norm
    weights beside half activations ("expected scalar type Float but found
    BFloat16"); the dense path takes them. So `use_nested_tensor` reads False
    then; the module's own value is kept and is read again when its layers
    compute in float32, or once the policy is removed."""

    _dp_order = 10

    @property
    def use_nested_tensor(self) -> bool:
        own = bool(self.__dict__.get("use_nested_tensor", False))
        layers = self.__dict__["_modules"].get("layers")
        return own and not any(
            (state := layer.__dict__.get(STATE_KEY)) is not None
            and state.call is not None
            and state.call.compute in HALF_DTYPES
            for layer in (layers or ())
        )

    @use_nested_tensor.setter
    def use_nested_tensor(self, value: bool) -> None:
        self.__dict__["use_nested_tensor"] = value


CLASS_MIXINS: dict[type[torch.nn.Module], type[ModuleMixin]] = {
    torch.nn.TransformerEncoder: DenseTransformerEncoder,
}
"""Mixins that a policied module of a class (or a subclass) also gets."""


def install(
    module: torch.nn.Module, token: object, options: ModuleOptions, bottom: bool = False
) -> None:
    """Pushes an application on the module's stack (at the bottom with
    `bottom`, for permanent entries such as `quantize()`'s); the module
    computes by the top entry from now on. `module_state.pop_application`
    takes it off again."""
    set_mixins(module, (*mixins_of(module), PolicyModule))  # it re-derives itself
    push_application(module, token, options, bottom)


def top_options(module: torch.nn.Module) -> ModuleOptions | None:
    """The options in force on a torch module (`None` when it has none)."""
    state = state_of(module)
    top = None if state is None else state.top
    return top if isinstance(top, ModuleOptions) else None


def refresh(module: torch.nn.Module) -> None:
    """Re-derives the module's call state from the top of its stack."""
    state = module.__dict__[STATE_KEY]
    options = state.top
    state.call = module_call_state(module, options)
    keep = sharded.keeps_casts(module, options.weight_cache)
    if state.casts.enabled != keep:
        state.casts = WeightCasts(keep)
    else:
        state.casts.clear()
    mixins = set(mixins_of(module)) - set(LEAF_FORWARDS)
    mixins.add(PolicyModule)
    cls = original_class(module)
    fast = fast_forward_of(cls)
    if state.quantization is None and fast is not None:
        mixins.add(fast)
    mixins.update(mixin for base, mixin in CLASS_MIXINS.items() if issubclass(cls, base))
    set_mixins(module, tuple(mixins))


def release(module: torch.nn.Module) -> None:
    """Gives a module without applications its own class back (and drops its
    state unless something else is left in it)."""
    state = module.__dict__[STATE_KEY]
    state.call = None
    state.casts = WeightCasts()
    own = (PolicyModule, *LEAF_FORWARDS, *CLASS_MIXINS.values())
    set_mixins(module, tuple(m for m in mixins_of(module) if m not in own))
    drop_state_if_empty(module)


def module_call_state(module: torch.nn.Module, options: ModuleOptions) -> CallState:
    """The `CallState` of a torch module under `options` (quantized modules
    compute by the quantized policy of their mode on the options' policy)."""
    policy = options.policy
    quantization = module.__dict__[STATE_KEY].quantization
    stored: frozenset[str] = frozenset()
    if quantization is not None:
        source = getattr(policy, "source_name", policy.name)
        policy = policy_for_config(quantization.config, source)
        stored = quantization.stored_names
    elif policy.quantization_mode is not None:  # a module that cannot be quantized
        policy = cast(QuantizedDTypePolicy, policy).source_policy
    parameters = {
        name: p for name, p in module._parameters.items() if p is not None and name not in stored
    }
    buffers = {
        name: b for name, b in module._buffers.items() if b is not None and name not in stored
    }
    weight_names: set[str] = set()
    buffer_names: set[str] = set()
    if not options.norm:
        # Gather modules read their tables in their own dtype (their calls
        # disable casting), but a parent reading a table gets it cast.
        weight_names.update(n for n, p in parameters.items() if p.is_floating_point())
    if options.cast_buffers and not (options.norm or options.gather or options.island):
        # A non-persistent buffer is no model state but a constant of the module's own
        # code (rotary frequencies, which transformers multiplies in float32 on purpose:
        # rounded to bfloat16, logits drifted from position 500 on): it keeps its dtype,
        # as transformers' `from_pretrained(dtype=...)` leaves it.
        constants = module._non_persistent_buffers_set
        buffer_names.update(
            n for n, b in buffers.items() if b.is_floating_point() and n not in constants
        )
        weight_names |= buffer_names
    stored_dtype = None
    if options.norm:
        dtypes = {
            t.dtype for t in (*parameters.values(), *buffers.values()) if t.is_floating_point()
        }
        if len(dtypes) == 1:
            stored_dtype = dtypes.pop()
    gather_dtype = None
    if options.gather:
        weight = parameters.get("weight")
        gather_dtype = weight.dtype if weight is not None else None
        if quantization is not None:
            gather_dtype = torch.float32
    has_weights = next(module.parameters(), None) is not None or (
        next(module.buffers(), None) is not None
    )
    return derive_call_state(
        policy,
        autocast=not options.gather,
        has_weights=has_weights,
        weight_names=frozenset(weight_names),
        buffer_names=frozenset(buffer_names),
        island=options.island,
        half_inputs_ok=options.half_inputs_ok,
        gather_dtype=gather_dtype,
        output_compute=options.norm,
        norm_dtype=stored_dtype,
        hand_back=None if options.outputs is None else getattr(torch, options.outputs),
        hand_back_in_calls=isinstance(module, parametrize.ParametrizationList),
        casts_own_weights=quantization is not None
        or fast_forward_of(original_class(module)) is not None,
    )


def is_policied(module: torch.nn.Module) -> bool:
    """Whether the torch module is prepared by `apply_policy` or `quantize()`
    (never true of a `Layer`, whose policy is its own)."""
    return top_options(module) is not None
