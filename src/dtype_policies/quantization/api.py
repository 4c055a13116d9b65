"""`quantize(model, mode, config, filters)`: quantize every module that can be,
all or nothing."""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, cast

import torch
from torch.nn.utils import parametrize

from dtype_policies._core.checkpoints import guard_loading
from dtype_policies._core.compose import original_class
from dtype_policies._core.listeners import model_changed
from dtype_policies._core.module_state import quantization_of, state_of
from dtype_policies._core.policy_module import ModuleOptions, refresh, top_options
from dtype_policies._core.sharded import refuse_replicated, refuse_sharded
from dtype_policies._memory import release_freed_memory
from dtype_policies._model_tables import declared_table
from dtype_policies._modes import mode_record
from dtype_policies._paths import named_module_paths, root_path_of
from dtype_policies.policies import DTypePolicy
from dtype_policies.quantization.adapters import adapter_modules
from dtype_policies.quantization.attach import (
    Plan,
    check,
    commit,
    committing,
    plan,
    shared_tensors,
    unshareable_ties,
)
from dtype_policies.quantization.calibration import plan_calibrated
from dtype_policies.quantization.experts import ExpertsExpansion, expert_routers, experts_layout
from dtype_policies.quantization.kinds import is_weight_matrix, kind_of, owns_matrix
from dtype_policies.quantization.modules import QUANTIZE_TOKEN, computes_in_own_dtype
from dtype_policies.quantization.report import (
    ADAPTER_DETAIL,
    ROUTER_DETAIL,
    SKIP_ADAPTER,
    SKIP_ALREADY_QUANTIZED,
    SKIP_FILTERED,
    SKIP_NO_MATRIX,
    SKIP_NO_SUPPORT,
    SKIP_NOT_IN_MODE,
    SKIP_NOT_READY,
    SKIP_OUTSIDE_STRUCTURE,
    SKIP_ROUTER,
    QuantizationReport,
    shared_float_detail,
    shared_layout_detail,
)
from dtype_policies.quantizers.config import validate_and_resolve_config

Filters = str | list | tuple | Callable[[str, torch.nn.Module], bool] | None


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"Invalid regex in `filters`: {pattern!r} ({e}).") from None


class _Filter:
    """`quantize()`'s `filters`, in Keras's forms and this library's: a regex
    (or a list of them, any matching) searched in the module's path and, for
    this library's layers, in the layer's name (Keras matches names); or a
    callable `(module) -> bool` (Keras's) or `(path, module) -> bool`. It
    remembers which patterns matched a quantizable module, so that a filter
    matching none can be named in a warning."""

    def __init__(self, filters: Filters) -> None:
        self.filters = filters
        self.patterns: list[tuple[str, re.Pattern]] = []
        self.call: Callable[[str, torch.nn.Module], bool] | None = None
        if filters is None:
            return
        if isinstance(filters, str):
            self.patterns = [(filters, _compile(filters))]
        elif isinstance(filters, (list, tuple)):
            if not all(isinstance(item, str) for item in filters):
                raise ValueError(f"A `filters` list must hold regex strings. Received: {filters!r}")
            self.patterns = [(item, _compile(item)) for item in filters]
        elif callable(filters):
            self.call = _two_argument_form(filters)
        else:
            raise ValueError(
                "The `filters` argument must be a regex string, a list of regex strings, or a "
                f"callable (module) -> bool or (path, module) -> bool. Received: {type(filters)}"
            )
        self.matched: set[str] = set()
        self.called = False

    def __call__(self, path: str, module: torch.nn.Module, quantizable: bool = True) -> bool:
        if self.filters is None:
            return True
        if self.call is not None:
            keep = bool(self.call(path, module))
            self.called = self.called or (keep and quantizable)
            return keep
        names = [path]
        name = getattr(module, "name", None)
        if hasattr(module, "built") and isinstance(name, str):
            names.append(name)
        hits = [text for text, pattern in self.patterns if any(pattern.search(n) for n in names)]
        if quantizable:
            self.matched.update(hits)
        return bool(hits)

    def unmatched(self) -> list[Any]:
        """The patterns (or the callable) that selected no quantizable module."""
        if self.filters is None:
            return []
        if self.call is not None:
            return [] if self.called else [self.filters]
        return [text for text, _ in self.patterns if text not in self.matched]


def _two_argument_form(function: Callable) -> Callable[[str, torch.nn.Module], bool]:
    """`(path, module) -> bool` for a filter taking `(path, module)` or Keras's `(module)`."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return function
    try:
        signature.bind(None, None)
        return function
    except TypeError:
        pass
    try:
        signature.bind(None)
    except TypeError:
        raise TypeError(
            "A `filters` callable must take (module) (Keras's form) or (path, module). "
            f"Received: {function!r} with signature {signature}"
        ) from None
    return lambda path, module: function(module)


def _own_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """`module`'s parameters, those its parametrizations hold for it
    (`weight_norm`'s `original0`, `original1`) included."""
    own = [p for p in module._parameters.values() if p is not None]
    if parametrize.is_parametrized(module):
        lists: Any = module.parametrizations  # a ModuleDict (typed as nn.Module's attributes)
        own += [p for held in lists.values() for p in held.parameters()]
    return own


def _parametrized_matrix(module: torch.nn.Module) -> bool:
    """Whether a weight of 2 or more dimensions of `module` is parametrized
    (`weight_norm`'s: its parameters then sit in `module.parametrizations`)."""
    if not parametrize.is_parametrized(module):
        return False
    lists: Any = module.parametrizations  # a ModuleDict (typed as nn.Module's attributes)
    return any(is_weight_matrix(p) for held in lists.values() for p in held.parameters())


def _unique_elements(parameters: Any, seen: set[int]) -> int:
    """Elements of `parameters` not in `seen` (by identity), adding them to it."""
    total = 0
    for parameter in parameters:
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel() if not torch.nn.parameter.is_lazy(parameter) else 0
    return total


def _not_ready(module: torch.nn.Module) -> str | None:
    """Why a torch module has no weights to quantize yet (a lazy module), if so."""
    if any(torch.nn.parameter.is_lazy(p) for p in module._parameters.values() if p is not None):
        return f"{SKIP_NOT_READY}: a lazy module, call the model once first"
    return None


def _calibrates(config: Any) -> bool:
    """Whether a calibrated mode's `config` carries calibration data."""
    return getattr(config, "dataset", None) is not None


_quantizing_lock = threading.Lock()
_being_quantized: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
"""The modules of the models `quantize()` calls are quantizing, each with its caller's thread."""


@contextlib.contextmanager
def _alone(model: Any) -> Iterator[None]:
    """Refuses a `quantize()` of a model sharing a module with one another
    thread is quantizing: each plans from the float weights the other
    replaces (the loser failed with a bare `KeyError`)."""
    if not isinstance(model, torch.nn.Module):
        yield
        return
    modules = list(model.modules())
    with _quantizing_lock:
        busy = next((m for m in modules if m in _being_quantized), None)
        if busy is not None:
            what = "" if busy is model else f"'s {type(busy).__name__} module"
            caller = (
                "the quantize() call this one runs inside (a filter or callback of it)"
                if _being_quantized.get(busy) == threading.get_ident()
                else "another quantize() call (another thread)"
            )
            raise RuntimeError(
                f"quantize(): the {type(model).__name__}{what} is being quantized by {caller}: "
                "quantize one model once at a time. Nothing was changed."
            )
        _being_quantized.update(dict.fromkeys(modules, threading.get_ident()))
    try:
        yield
    finally:
        with _quantizing_lock:
            for module in modules:
                _being_quantized.pop(module, None)


def _one_at_a_time(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def quantize(model: Any, *args: Any, **kwargs: Any) -> Any:
        with _alone(model):
            return function(model, *args, **kwargs)

    return quantize


@_one_at_a_time
def quantize(
    model: torch.nn.Module,
    mode: str | None = None,
    config: Any = None,
    filters: Filters = None,
    *,
    type_check: bool = True,
    verbose: bool = False,
    progress: bool | None = None,
    **kwargs: Any,
) -> QuantizationReport:
    """Quantizes every module of `model` that supports `mode`, in place: all of
    them or, if any raises, none (the error names the module's path).

    Supported: this library's `Dense`, `EinsumDense` (int8, int4, float8) and
    `Embedding` (int8, int4); `torch.nn.Linear`, transformers' `Conv1D` and any
    class registered with `register_linear_kind` (int8, int4, float8); and
    `torch.nn.Embedding` (int8, int4): every registered mode whose scheme
    quantizes the module's kind of weight. Skipped and reported, with one
    summary warning: modules that hold weight matrices but cannot be quantized
    (with the share of the model's parameters they leave in floating point),
    weights that a parent module reads directly (`nn.MultiheadAttention.out_proj`,
    the linears of `nn.TransformerEncoderLayer`), parametrized weights, lazy
    modules not initialized yet. A weight shared by several modules (an
    embedding tied to an LM head) is quantized once and its stored tensors are
    shared. A calibrated mode (its config holds calibration data) runs the
    model on it block by block first (`dtype_policies.quantization.calibration`);
    nothing changes until every module is planned.

    A module's policy becomes `"<mode>_from_<its float policy>"`; under
    `apply_policy(model, "mixed_bfloat16")` that is e.g.
    `int8_from_mixed_bfloat16`, which computes in bfloat16. One exception:
    the model's linear output head (transformers' `get_output_embeddings()`),
    when its product rounds its inputs to int8 (the default int8, W4A8, the
    int8 table of a tied head under int4) and the policy applied to it would
    hand out 16-bit logits, becomes `"<mode>_from_float32"`: the same integer
    product, with logits in float32 (bfloat16 logits changed SmolLM2-135M's
    most likely token at 0.5% of positions). The application's handle and a
    later `apply_policy` treat it as any other module.

    Args:
        model: Any module (built, for this library's layers: an unbuilt layer
            raises `ValueError`, as in Keras).
        mode: A registered mode such as `"int8"`, `"int4"` or `"float8"`
            (optional when `config` is given).
        config: A quantization config (`Int8QuantizationConfig(activation_quantizer=None)`
            for weight-only int8, `Int4QuantizationConfig(block_size=-1)` for
            per-channel int4, ...).
        filters: Which modules to quantize (Keras's forms): a regex searched
            in each module's path and in the names of this library's layers,
            a list of them (any matches), or a callable `(module) -> bool`
            (or `(path, module) -> bool`). A filter that selects no
            quantizable module is named in a warning.
        type_check: Refuse subclasses of this library's layers (whose `call`
            may not dispatch to the quantized product) unless `False`.
        verbose: Print the report.
        progress: A calibrated mode's progress (block i of n, elapsed,
            remaining) on standard error: `None` shows it when standard error
            is a terminal, `False` never, `True` always.
        **kwargs: None accepted: an unknown keyword raises `ValueError` (as Keras).

    Returns:
        A `QuantizationReport` of the quantized and skipped modules.

    >>> import torch
    >>> import dtype_policies
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
    ...                             torch.nn.Linear(64, 8))
    >>> report = dtype_policies.quantize(model, "int8", filters=r"^0$")
    >>> report.quantized, report.skipped
    ([('0', 'int8', 'int8_from_float32')], [('1', 'no weight matrix'), ('2', 'filtered out')])
    >>> model[0].weight_int8.dtype, model(torch.randn(2, 64)).dtype
    (torch.int8, torch.float32)
    """
    if kwargs:
        raise ValueError(
            f"Unrecognized keyword arguments passed to quantize(): {kwargs}. Accepted: "
            "mode, config, filters, type_check, verbose, progress."
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"quantize() expects a torch.nn.Module. Received: {type(model).__name__}")
    refuse_sharded(model, "quantize()")
    refuse_replicated(model, "quantize()")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"quantize(): progress must be True, False or None. Received: {progress!r}")
    config_given = config is not None
    config = validate_and_resolve_config(mode, config)
    mode = config.mode
    calibrated = mode_record(mode).calibrated
    keep = _Filter(filters)
    report = QuantizationReport(mode)
    report.total_parameters = _unique_elements(model.parameters(), set())
    unsupported_seen: set[int] = set()
    modules = dict(named_module_paths(model, root_path_of(model)))
    plans = []
    checked = []
    to_plan: list[tuple[str, torch.nn.Module, Any, Any, Any]] = []
    quantizable: list[str] = []
    planned_weights: dict[int, Any] = {}
    # weights that stay float: one module holding each, and the kind of reason
    # (out of the mode's scope, filtered out, for want of support)
    left_float: dict[int, tuple[str, str]] = {}

    def leave_float(label: str, module: torch.nn.Module, reason: str = SKIP_NO_SUPPORT) -> None:
        for parameter in _own_parameters(module):
            left_float.setdefault(id(parameter), (label, reason))

    def unsupported(label: str, module: torch.nn.Module, why: str) -> None:
        report.skipped.append((label, f"{SKIP_NO_SUPPORT}: {why}"))
        report.unsupported_parameters += _unique_elements(_own_parameters(module), unsupported_seen)
        leave_float(label, module)

    def stores_no_float_copy(path: str, scheme: Any, weight: torch.Tensor | None) -> bool:
        # A shared weight is stored quantized in all its modules or in none: a
        # module that keeps it float keeps the whole float table, and another's
        # quantized copy would only add to it (a tied LM head beside an embedding
        # it cannot take); float8 keeps its float weight and adds no copy.
        return scheme.keeps_float_weight or _not_kept_float_elsewhere(
            path, weight, left_float, report
        )

    tied = _tied_embeddings(modules.values(), config.tied_embeddings_config().mode)
    expansions: list[ExpertsExpansion] = []
    routers = expert_routers(modules.values())
    adapters = adapter_modules(modules.values())
    for path, module in _with_expert_linears(modules, expansions):
        label = path or "(root)"
        kind = kind_of(module)
        if id(module) in routers:
            report.skipped.append((label, f"{SKIP_ROUTER}: {ROUTER_DETAIL}"))
            leave_float(label, module, SKIP_NOT_IN_MODE)
            continue
        if id(module) in adapters:
            if owns_matrix(module):
                report.skipped.append((label, f"{SKIP_ADAPTER}: {ADAPTER_DETAIL}"))
            leave_float(label, module, SKIP_NOT_IN_MODE)
            continue
        if kind is None:
            if isinstance(module, parametrize.ParametrizationList):
                continue  # the parametrized module holding it is reported, with why
            if not (owns_matrix(module) or _parametrized_matrix(module)):
                if _own_parameters(module):
                    report.skipped.append((label, SKIP_NO_MATRIX))
            elif keep(path, module, False):
                unsupported(
                    label, module, f"{original_class(module).__name__}, not a quantizable kind"
                )
            else:
                report.skipped.append((label, SKIP_FILTERED))
                leave_float(label, module, SKIP_FILTERED)
            continue
        quantizable.append(label)
        existing = quantization_of(module)
        if existing is not None:
            report.skipped.append((label, SKIP_ALREADY_QUANTIZED))
            if existing.mode != mode:
                report.other_modes.append(existing.mode)
            elif config_given and existing.config != config:
                report.other_configs.append(f"{label} ({existing.config})")
            elif calibrated and _calibrates(config) and not _calibrates(existing.config):
                # equal configs (data is no part of equality), one without data
                report.other_configs.append(f"{label} (rounded to nearest, without data)")
            continue
        if not keep(path, module):
            report.skipped.append((label, SKIP_FILTERED))
            leave_float(label, module, SKIP_FILTERED)
            continue
        not_ready = _not_ready(module)
        if not_ready is not None:
            report.skipped.append((label, not_ready))
            leave_float(label, module)
            continue
        module_config = config.tied_embeddings_config() if id(module) in tied else config
        if not kind.supports(module_config.mode):  # the mode's scope, as Keras's
            modes = ", ".join(kind.modes)
            report.skipped.append((label, f"{SKIP_NOT_IN_MODE}: {kind.role} weights take {modes}"))
            leave_float(label, module, SKIP_NOT_IN_MODE)
            continue
        try:
            # every weight (its values too) before any is quantized: a NaN in
            # the last layer fails at once, not after minutes of planning the others
            found = check(
                module,
                module_config,
                path=path,
                type_check=type_check,
                kind=kind,
                modules=modules,
            )
        except NotImplementedError as e:
            unsupported(label, module, str(e))
            continue
        except Exception as e:
            raise type(e)(f"quantize(): module '{label}': {e}") from e
        if calibrated and module_config is config:
            checked.append((path, found))
        else:
            to_plan.append((path, module, module_config, kind, found))
    for path, module, module_config, kind, found in to_plan:
        label = path or "(root)"
        try:
            shared = shared_tensors(module, found.spec, module_config, planned_weights)
            module_plan = plan(
                module, module_config, path=path, type_check=type_check, kind=kind, tensors=shared
            )
        except NotImplementedError as e:
            unsupported(label, module, str(e))
            continue
        except Exception as e:
            raise type(e)(f"quantize(): module '{label}': {e}") from e
        weight = module._parameters[module_plan.spec.weight]
        planned_weights.setdefault(id(weight), module_plan)
        plans.append(module_plan)
    unshareable = unshareable_ties(plans)
    for module_plan in plans:
        if id(module_plan) in unshareable:
            label = module_plan.path or "(root)"
            detail = shared_layout_detail(unshareable[id(module_plan)])
            unsupported(label, module_plan.module, detail)
    plans = [
        p
        for p in plans
        if id(p) not in unshareable
        and stores_no_float_copy(p.path, p.scheme, p.module._parameters[p.spec.weight])
    ]
    checked = [(path, f) for path, f in checked if stores_no_float_copy(path, f.scheme, f.weight)]
    _refuse_shared_calibrated_weights(checked, mode)
    if checked:
        calibration = plan_calibrated(model, checked, config, progress, expansions)
        plans += calibration.plans
        outside = [(path or "(root)", SKIP_OUTSIDE_STRUCTURE) for path in calibration.outside]
        report.skipped += outside
        report.outside_linears = _outside_linears(model, modules, calibration.outside)
    ExpertsExpansion.claim_all(plans, expansions)
    head = _output_head(model)
    with committing(plans):
        for module_plan in plans:  # nothing above changed the model
            commit(module_plan)
            if module_plan.module is head:
                _logits_in_float32(module_plan)
            label = module_plan.path or "(root)"
            state = cast(Any, state_of(module_plan.module))  # committed: its call state derived
            report.quantized.append((label, module_plan.mode, state.call.policy.name))
    if plans:
        guard_loading(model)
        model_changed(model)
        release_freed_memory()  # the float weights and the planning's temporaries
    for unmatched in keep.unmatched():
        warnings.warn(
            f"quantize(): the filter {unmatched!r} matched no quantizable module (strings are "
            "searched in module paths such as 'encoder/layers/0/linear1' and in layer names; "
            f"quantizable modules here: {_examples(quantizable)}).",
            UserWarning,
            stacklevel=2,
        )
    message = report.summary_warning()
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=2)
    if verbose:
        print(report.render())
    return report


def _refuse_shared_calibrated_weights(checked: list, mode: str) -> None:
    """GPTQ and AWQ fit each weight to its own module's inputs: one weight
    shared by two modules has no single fit (it was calibrated twice and
    stored untied, or failed inside torch's `functional_call`)."""
    owners: dict[int, str] = {}
    for path, found in checked:
        other = owners.setdefault(id(found.weight), path or "(root)")
        if other != (path or "(root)"):
            raise ValueError(
                f"quantize(): modules '{other}' and '{path or '(root)'}' share one weight, and "
                f"{mode.upper()} fits each weight to the inputs of its own module. Quantize "
                "shared weights with round to nearest (quantize(model, 'int4') quantizes a "
                "shared weight once), or give each module a weight of its own."
            )


def _with_expert_linears(modules: dict[str, torch.nn.Module], expansions: list) -> Any:
    """`modules`' items, each transformers experts module (3-D weights)
    followed by the linears of its planned expansion (`quantization.experts`)
    in its place; the expansions are added to `expansions` (calibrated modes
    run them while calibrating, so that each linear's statistics come from its
    own calls)."""
    for path, module in modules.items():
        layout = experts_layout(module)
        if layout is None:
            yield path, module
            continue
        expansion = ExpertsExpansion(module, layout)
        expansions.append(expansion)
        yield from expansion.linears(under=path)


def _not_kept_float_elsewhere(
    path: str,
    weight: torch.Tensor | None,
    left_float: dict[int, tuple[str, str]],
    report: QuantizationReport,
) -> bool:
    """Whether no module keeps `weight` float; if one does, the module at
    `path` is reported skipped, for the holder's kind of reason (out of the
    mode's scope, filtered out, for want of support)."""
    found = left_float.get(id(weight))
    if found is None:
        return True
    holder, reason = found
    report.skipped.append((path or "(root)", f"{reason}: {shared_float_detail(holder)}"))
    return False


def _outside_linears(
    model: torch.nn.Module, modules: dict[str, torch.nn.Module], outside: list[str]
) -> list[str]:
    """The linear modules of `outside` other than the model's output head
    (`get_output_embeddings()`, which Keras's calibrated modes leave float)."""
    head = _output_head(model)
    linears = []
    for path in outside:
        module = modules.get(path)
        if module is None:  # one expert's linear of a mixture expanded for planning only
            linears.append(path)
            continue
        kind = kind_of(module)
        if kind is not None and kind.role == "linear" and module is not head:
            linears.append(path or "(root)")
    return linears


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module computing the model's outputs over its vocabulary
    (transformers' `get_output_embeddings()`), if the model says (a model
    whose method raises, or that has none, says nothing)."""
    return declared_table(model, "get_output_embeddings")


def _logits_in_float32(module_plan: Plan) -> None:
    """Makes the policy applications on a just-quantized linear output head
    whose product rounds its inputs to integers compute in float32 where they
    hand out 16-bit outputs: the same product, with float32 logits. Each
    entry stays its application's own (its handle's `remove()` takes it off,
    saving writes it as any other); a head computing in its own dtype (no
    application above `quantize()`'s own) is left as it is."""
    module = module_plan.module
    if top_options(module) is None or module_plan.kind.role != "linear":
        return  # this library's layers carry their own policies; tables are looked up
    if computes_in_own_dtype(module) or not module_plan.config.rounds_inputs:
        return
    state = state_of(module)
    assert state is not None
    changed = False
    for at, (token, options) in enumerate(state.applications):
        if token is QUANTIZE_TOKEN or not isinstance(options, ModuleOptions):
            continue
        if (options.outputs or options.policy.compute_dtype) in ("bfloat16", "float16"):
            float32 = replace(
                options,
                policy=DTypePolicy("float32"),
                island=False,
                half_inputs_ok=False,
                outputs=None,
            )
            state.applications[at] = (token, float32)
            changed = True
    if changed:
        refresh(module)


def _examples(paths: list[str], count: int = 3) -> str:
    text = ", ".join(repr(path) for path in paths[:count]) or "none"
    return text + (", ..." if len(paths) > count else "")


def _tied_embeddings(modules: Any, mode: str) -> set[int]:
    """The ids of modules whose weight is shared by an embedding table and a
    linear (a tied LM head), both quantizable in `mode` (the mode of the
    config's `tied_embeddings_config()`, which `quantize()` gives them)."""
    roles: dict[int, set[str]] = {}
    holders: dict[int, list[int]] = {}
    for module in modules:
        kind = kind_of(module)
        if kind is None or not kind.supports(mode):
            continue
        try:
            spec = kind.spec(module, mode)
        except Exception:  # the planning pass reports why, module by module
            continue
        weight = module._parameters.get(spec.weight)
        if weight is None:
            continue
        roles.setdefault(id(weight), set()).add(spec.role)
        holders.setdefault(id(weight), []).append(id(module))
    return {
        holder
        for weight, kinds in roles.items()
        if {"embedding", "linear"} <= kinds
        for holder in holders[weight]
    }
