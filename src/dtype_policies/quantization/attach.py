"""The one transactional way a weight gets quantized: `plan` computes
everything (and raises on any problem) without touching the module;
`commit` applies a plan and cannot fail. `Layer.quantize`, the model-level
`quantize()` and `apply_policy` with quantized policies all use these two.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.nn.utils import parametrize

from dtype_policies._core.compose import mixins_of, original_class, set_mixins
from dtype_policies._core.module_state import (
    ModuleState,
    ensure_state,
    pop_application,
    quantization_of,
    state_of,
)
from dtype_policies._core.policy_module import install
from dtype_policies._core.sharded import refuse_sharded
from dtype_policies._modes import QuantizationMode, mode_record, registered_modes
from dtype_policies.policies import DTypePolicy
from dtype_policies.quantization import kernels
from dtype_policies.quantization.adapters import guard_peft
from dtype_policies.quantization.kinds import ModuleKind, kind_of, kind_of_class, read_by_parent
from dtype_policies.quantization.modules import (
    FORWARDS,
    QUANTIZE_TOKEN,
    own_options,
)
from dtype_policies.quantization.schemes import (
    ActivationStatistics,
    QuantizedWeight,
    Scheme,
    WeightSpec,
)
from dtype_policies.quantization.schemes.base import check_finite, quantize_by_outputs
from dtype_policies.quantizers.config import QuantizationConfig


@dataclass
class Plan:
    """A quantization ready to be committed: nothing in it has touched the module."""

    module: torch.nn.Module
    path: str
    kind: ModuleKind
    scheme: Scheme
    spec: WeightSpec
    config: QuantizationConfig
    float_dtype: torch.dtype
    source_policy: DTypePolicy
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    # the planned expansion of a mixture-of-experts module this linear is one
    # expert's of (`quantization.experts`), attached by the first commit
    expansion: Any = None

    @property
    def mode(self) -> str:
        return self.scheme.mode


def is_quantized(module: torch.nn.Module) -> bool:
    return quantization_of(module) is not None


def _source_policy(module: torch.nn.Module, weight: torch.Tensor) -> DTypePolicy:
    """The float policy a module computes with now: its policy's float part,
    else the dtype of its weight."""
    state = getattr(state_of(module), "call", None)
    policy = state.policy if state is not None else None
    if policy is None:
        return DTypePolicy(str(weight.dtype).removeprefix("torch."))
    source = getattr(policy, "source_policy", None)
    return source if source is not None else policy


def _check_weight(module: torch.nn.Module, name: str, needs_values: bool) -> torch.nn.Parameter:
    weight = module._parameters.get(name)
    if not isinstance(weight, torch.nn.Parameter) or not weight.is_floating_point():
        raise NotImplementedError(f"'{name}' is not a floating parameter")
    if needs_values and weight.device.type == "meta":
        raise ValueError(f"its weight '{name}' is on the meta device (load real values first)")
    return weight


def _check_forward_replaceable(module: torch.nn.Module, kind: ModuleKind) -> None:
    """A quantized forward replaces the registered class's forward: a subclass
    with a forward of its own (extra computation around the product) would
    silently lose it, so it is refused (unless registered itself)."""
    for cls in original_class(module).__mro__:
        if kind_of_class(cls) is kind:
            return
        if "forward" in vars(cls):
            advice = (
                "quantize the table of a plain nn.Embedding instead"
                if kind.role == "embedding"
                else "register the class with register_linear_kind if its forward is the "
                "plain product"
            )
            raise NotImplementedError(
                f"its class {cls.__name__} defines its own forward(), which a quantized "
                f"forward would bypass ({advice})"
            )


@dataclass(frozen=True)
class Checked:
    """A module found able to take a quantization (what `check` returns)."""

    module: torch.nn.Module
    kind: ModuleKind
    record: QuantizationMode
    spec: WeightSpec
    weight: torch.nn.Parameter
    source: DTypePolicy

    @property
    def scheme(self) -> Scheme:
        return self.record.scheme


def check(
    module: torch.nn.Module,
    config: QuantizationConfig,
    *,
    path: str = "",
    type_check: bool = True,
    kind: ModuleKind | None = None,
    source: DTypePolicy | None = None,
    needs_values: bool = True,
    modules: Mapping[str, torch.nn.Module] | None = None,
) -> Checked:
    """Everything `plan` checks, without computing stored tensors.

    Raises `NotImplementedError` when the module cannot take this mode (the
    message says why) and `ValueError` for invalid states. `modules` (the
    model's modules by path, `path` among them) lets it refuse a module
    whose weight its parent reads directly (`kinds.read_by_parent`): the
    quantized product would never run, the parent computing with the
    dequantized weight instead.
    """
    mode = config.mode
    record = mode_record(mode)
    name = type(module).__name__
    # every route (quantize(), apply_policy, a layer's quantize() or policy) comes here
    refuse_sharded(module, f"quantizing {path or name!r}")
    kind = kind or kind_of(module)
    if kind is None:
        raise NotImplementedError(f"{name} does not support quantization")
    if not getattr(module, "built", True):
        raise ValueError(
            "Cannot quantize a layer that isn't yet built. "
            f"Layer '{getattr(module, 'name', path)}' (of type '{name}') is not built yet."
        )
    if quantization_of(module) is not None:
        raise _already_quantized(module, path or name, mode)
    if not kind.supports(mode):
        raise NotImplementedError(
            f"Invalid quantization mode. Expected one of {kind.modes}. "
            f"Received: quantization_mode={mode}"
        )
    if modules is not None and (read := read_by_parent(path, module, modules)) is not None:
        raise NotImplementedError(read)
    state = getattr(state_of(module), "call", None)
    if source is not None:
        record.check_compute_dtype(source.compute_dtype)
    elif state is not None:
        record.check_compute_dtype(state.policy.compute_dtype)
    if type_check and kind.exact:
        base = next(cls for cls in type(module).__mro__ if kind_of_class(cls) is kind)
        if type(module) is not base:
            raise NotImplementedError(
                f"Layer {name} does not have a `quantize` method implemented. Pass "
                f"`type_check=False` to quantize a subclass whose `call` is {base.__name__}'s."
            )
    if kind.forward is not None:
        _check_forward_replaceable(module, kind)
    if parametrize.is_parametrized(module):
        raise NotImplementedError("its weights are parametrized (torch.nn.utils.parametrize)")
    hooks = [type(hook).__name__ for hook in module._forward_pre_hooks.values()]
    if "WeightNorm" in hooks or "SpectralNorm" in hooks:
        raise NotImplementedError("its weight is recomputed by weight_norm/spectral_norm")
    scheme = record.scheme
    spec = kind.spec(module, mode)
    if spec.role not in scheme.roles:
        raise NotImplementedError(f"mode '{mode}' does not support {spec.role} weights")
    if spec.contract is not None and not scheme.general_contraction:
        able = [r.name for r in registered_modes() if r.scheme.general_contraction]
        raise NotImplementedError(
            f"{name} '{getattr(module, 'name', path)}': its contraction is not a matrix "
            f"product of the input's last axes, so mode '{mode}' is not supported for it "
            f"({', '.join(able) or 'no mode'} is)."
        )
    scheme.check_shapes(spec, config)
    _check_names_free(module, scheme.stored_shapes(spec, config))
    weight = _check_weight(module, spec.weight, needs_values=needs_values)
    if weight.numel() == 0:  # (the kernels and scales assume a row and a column)
        raise NotImplementedError(f"its weight is empty (shape {tuple(weight.shape)})")
    if needs_values:
        check_finite(weight, spec.weight)
    if source is None:
        source = _source_policy(module, weight)
    record.check_compute_dtype(source.compute_dtype)
    return Checked(module, kind, record, spec, weight, source)


def _check_names_free(module: torch.nn.Module, stored: Mapping[str, Any]) -> None:
    """Refuses a module that already has a parameter, buffer, submodule or
    attribute under a name the quantized tensors would take: storing them
    would overwrite it (a buffer) or hide it from `state_dict` (a parameter)."""
    for name in stored:
        if (
            name in module._parameters
            or name in module._buffers
            or name in module._modules
            or name in module.__dict__
            or hasattr(type(module), name)
        ):
            raise ValueError(
                f"The {type(module).__name__} already has an attribute '{name}', a name its "
                f"quantized tensors take ({', '.join(stored)}): "
                "rename it, or leave the module out (`filters=`). Nothing was changed."
            )


def shared_tensors(
    module: torch.nn.Module, spec: Any, config: QuantizationConfig, planned_weights: dict
) -> dict | None:
    """The stored tensors of an already planned module holding the same weight
    Parameter, stored the same way (tied weights), if any: `planned_weights`
    maps `id(weight)` to the first plan of that weight (`quantize()` and
    `apply_policy` both store a tied table once). The tensors are named
    after this module's weight (a layer's `embeddings` tied to a linear's
    `weight`: `embeddings_int8` is its `weight_int8`)."""
    weight = module._parameters.get(spec.weight)
    earlier = planned_weights.get(id(weight)) if weight is not None else None
    if earlier is None:
        return None
    renamed = _renamed(earlier.tensors, earlier.spec.weight, spec.weight)
    same = (
        earlier.config == config
        and earlier.spec.layout == spec.layout
        and earlier.spec.float_shape == spec.float_shape
        and not earlier.scheme.keeps_float_weight
        and {name: (tuple(t.shape), t.dtype) for name, t in renamed.items()}
        == earlier.scheme.stored_shapes(spec, config)
    )
    return renamed if same else None


def unshareable_ties(plans: list[Plan]) -> dict[int, str]:
    """The plans (by id) of weights that several plans store in tensors of
    their own (holders laying the weight out otherwise: a torch linear's
    (out, in) and a Keras kernel's (in, out)), each with the path of another
    holder: one stored copy cannot serve them, two would untie the weight.
    float8's plans keep the float weight and are left out."""
    holders: dict[int, list[Plan]] = {}
    for plan in plans:
        weight = plan.module._parameters.get(plan.spec.weight)
        if weight is not None and not plan.scheme.keeps_float_weight:
            holders.setdefault(id(weight), []).append(plan)
    found: dict[int, str] = {}
    for group in holders.values():
        stored = {id(plan): frozenset(id(t) for t in plan.tensors.values()) for plan in group}
        if len(set(stored.values())) > 1:
            for plan in group:
                other = next(p for p in group if stored[id(p)] != stored[id(plan)])
                found[id(plan)] = other.path or "(root)"
    return found


def _renamed(tensors: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    """`tensors` stored for the weight `old`, named as for the weight `new`."""
    return {
        new + name[len(old) :] if name.startswith(old) else name: t for name, t in tensors.items()
    }


def plan(
    module: torch.nn.Module,
    config: QuantizationConfig,
    *,
    path: str = "",
    type_check: bool = True,
    kind: ModuleKind | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    source: DTypePolicy | None = None,
    statistics: ActivationStatistics | None = None,
    modules: Mapping[str, torch.nn.Module] | None = None,
) -> Plan:
    """Plans quantizing `module` with `config`.

    Raises `NotImplementedError` when the module cannot take this mode (the
    message says why) and `ValueError` for invalid states. `tensors` reuses
    stored tensors already computed for the same weight (tied weights, or a
    checkpoint's). `source` is the float policy the module will compute with
    (default: the one it computes with now). A calibrated mode computes its
    tensors from `statistics` (what `quantization.calibration` gathered);
    without them, its scheme's `quantize` (which may refuse). `modules`: as
    `check`'s.
    """
    checked = check(
        module,
        config,
        path=path,
        type_check=type_check,
        kind=kind,
        source=source,
        needs_values=tensors is None,
        modules=modules,
    )
    scheme, spec, weight = checked.scheme, checked.spec, checked.weight
    if weight.device.type == "cpu":
        kernels.prepare()  # never on a first product a compiler may be tracing
    if tensors is None:
        with torch.no_grad(), torch.inference_mode(False):
            if checked.record.calibrated and statistics is not None:
                tensors = scheme.quantize_calibrated(weight, spec, config, statistics)
            else:
                tensors = quantize_by_outputs(scheme, weight, spec, config)
    return Plan(
        module, path, checked.kind, scheme, spec, config, weight.dtype, checked.source, tensors
    )


def _already_quantized(module: torch.nn.Module, label: str, mode: str) -> ValueError:
    state = cast(Any, state_of(module))  # quantized: its call state derived
    return ValueError(
        f"Layer '{getattr(module, 'name', label)}' is already quantized with "
        f"dtype_policy='{state.call.policy.name}'. Received: mode={mode}"
    )


_commit_lock = threading.RLock()


@contextlib.contextmanager
def committing(plans: Sequence[Plan]) -> Iterator[None]:
    """Holds the lock every commit of plans is made under, after checking that
    no module of `plans` was quantized since it was planned (another thread's
    `quantize()` of the same model): raises as `check` would, before anything
    is committed."""
    with _commit_lock:
        for plan in plans:
            if quantization_of(plan.module) is not None:
                raise _already_quantized(plan.module, plan.path or "(root)", plan.mode)
        yield


def commit(plan: Plan) -> QuantizedWeight:
    """Applies a plan (cannot fail, but for another thread having quantized
    its module since it was planned: see `committing`)."""
    with committing((plan,)):
        return _commit(plan)


def _commit(plan: Plan) -> QuantizedWeight:
    module, spec = plan.module, plan.spec
    if plan.expansion is not None:
        plan.expansion.attach()
    qw = QuantizedWeight(plan.scheme, spec, plan.config, plan.float_dtype)
    qw.path = plan.path
    if not plan.scheme.keeps_float_weight:
        del module._parameters[spec.weight]
    guard_peft()  # a peft tuner's base, maybe
    for name, tensor in plan.tensors.items():
        module._buffers[name] = tensor
    ensure_state(module).quantization = qw
    if plan.kind.forward is not None:
        set_mixins(module, (*mixins_of(module), FORWARDS[plan.kind.forward]))
        # Below any application: the module computes in its own dtype without one.
        install(module, QUANTIZE_TOKEN, own_options(plan.mode, plan.float_dtype), bottom=True)
    if plan.kind.after_commit is not None:
        plan.kind.after_commit(module, plan)
    return qw


def detach_float8(module: torch.nn.Module) -> None:
    """Undoes a float8 quantization (its float weight was kept)."""
    qw = quantization_of(module)
    for name in qw.stored_names:
        module._buffers.pop(name, None)
    cast(ModuleState, state_of(module)).quantization = None  # quantized: it has a state
    set_mixins(module, tuple(m for m in mixins_of(module) if m not in FORWARDS.values()))
    pop_application(module, QUANTIZE_TOKEN)
