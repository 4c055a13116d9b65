"""`advise`: the policy map that meets an error budget, measured on this machine."""

from __future__ import annotations

import copy
import math
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from numbers import Real
from typing import Any, cast

import torch

from dtype_policies._core.module_state import quantization_of, state_of
from dtype_policies._core.products import FEW_ROWS, native_half_products
from dtype_policies._core.slots import own_parameters
from dtype_policies._cpu import processor
from dtype_policies._paths import named_module_paths, root_path_of
from dtype_policies.advisor.advice import Advice, ModuleAdvice
from dtype_policies.advisor.batches import as_batches
from dtype_policies.advisor.candidates import DEFAULT_CANDIDATES, Candidate, parse_candidates
from dtype_policies.advisor.errors import ErrorMeter, Metric
from dtype_policies.advisor.grouping import group_units
from dtype_policies.advisor.latency import time_variants
from dtype_policies.advisor.selection import (
    Option,
    ladder,
    predicted_errors,
    predicted_prefix,
    state_after,
    step_sequence,
)
from dtype_policies.advisor.sensitivity import group_error
from dtype_policies.advisor.units import Skipped, Unit, find_units, record
from dtype_policies.advisor.variants import (
    build_variant,
    group_bytes,
    model_bytes,
    shared_tensors,
    stored_bytes,
)
from dtype_policies.advisor.verify import Check, back_off, prepared
from dtype_policies.apply import apply_policy
from dtype_policies.policies import DTypePolicyMap
from dtype_policies.policies import get as get_policy
from dtype_policies.quantization.modules import computes_in_own_dtype

OBJECTIVES = ("latency", "memory")
LATENCY_MIN_GAIN = 0.05  # a cheaper rung must be 5% faster: timings here are noisy


def advise(
    model: torch.nn.Module,
    inputs: Any,
    max_error: float = 0.02,
    candidates: Iterable[Any] = DEFAULT_CANDIDATES,
    objective: str = "latency",
    metric: Metric | None = None,
    *,
    progress: bool = True,
    repeats: int = 7,
) -> Advice:
    """Chooses a precision per module: the fastest (or smallest) policy map
    whose end-to-end error on `inputs` is within `max_error`, measured here.

    1. The model as given (a deep copy in eval mode) gives the reference
       outputs; one pass records each module's inputs and calls, and which
       modules read the same input (they get one precision together, as do
       modules sharing a weight).
    2. For each group and candidate, copies of just those modules with the
       candidate applied are swapped into a float32 working copy: the
       end-to-end error is the group's sensitivity; each module's
       microseconds per call are timed at its recorded inputs; its stored
       bytes are counted.
    3. Groups move from float32 towards more aggressive candidates in the
       order of the most saving per unit of added squared error (see
       `dtype_policies.advisor.selection`), as far as the errors, added like
       independent noise, fit the budget.
    4. The map is applied to a fresh copy and its error measured; while it
       exceeds the budget, the last step is undone. Float32 everywhere (the
       model as given) ends it.
    5. The whole model is timed on the first batch as given and under the
       chosen map (`Advice.forward_micros`), and its bytes counted.

    Microseconds are the fastest of `repeats` interleaved samples (see
    `dtype_policies.advisor.latency`). The model is never changed (every
    measurement runs on copies).

    Args:
        model: A float32 model.
        inputs: A batch (a tensor, a tuple of positional arguments or a dict
            of keyword arguments) or an iterable of batches (a list, a
            generator, a DataLoader); all are kept and run in every
            measurement.
        max_error: The budget: the relative Frobenius error of all floating
            outputs against the model as given (see
            `dtype_policies.advisor.errors`), or of `metric`.
        candidates: In any order (each group's options are ranked by their
            measured cost and error): `"int4"` (int4/128), `"int4/64"`,
            `"int8"`, `"float8"` (quantized from mixed_bfloat16),
            `"mixed_bfloat16"`, `"bfloat16"`, or full policy names
            (`"int4/-1_from_mixed_bfloat16"`). float32 is always allowed.
        objective: `"latency"` (measured microseconds per forward) or
            `"memory"` (stored bytes).
        metric: `(outputs, reference_outputs) -> float`, an error (lower is
            better, 0 for identical outputs) replacing the relative error;
            averaged over batches.
        progress: Print progress on stderr.
        repeats: Interleaved timing rounds per module.

    Returns:
        An `Advice`: `policy_map`, the measured `error`, `table()`,
        `to_json()`, `save(path)`, `apply(model)`.

    Raises:
        ValueError: `max_error` not > 0 or not finite, an unknown candidate
            or objective, empty inputs, a model that fails on the inputs, or
            one that already computes by policies (`apply_policy` in force).
        TypeError: `model` not a module, `max_error` or `repeats` not a
            number, inputs of the wrong type, `metric` not callable.

    Example:

    >>> import torch
    >>> import dtype_policies
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(
    ...     torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)
    ... )
    >>> advice = dtype_policies.advise(
    ...     model, torch.randn(32, 64), max_error=0.02, objective="memory", progress=False
    ... )
    >>> advice.error <= 0.02
    True
    >>> {key: policy.name for key, policy in advice.policy_map.items()}
    {'0': 'int8_from_mixed_bfloat16', '2': 'int8_from_mixed_bfloat16'}
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"advise() expects a torch.nn.Module. Received: {type(model).__name__}")
    if isinstance(max_error, bool) or not isinstance(max_error, Real):
        raise TypeError(
            "advise(): `max_error` must be a finite number > 0 (the relative error allowed, "
            f"e.g. 0.02). Received: max_error={max_error!r} (of type {type(max_error).__name__})"
        )
    if not math.isfinite(max_error) or max_error <= 0:
        raise ValueError(
            "advise(): `max_error` must be a finite number > 0 (the relative error allowed, "
            f"e.g. 0.02). Received: max_error={max_error!r}"
        )
    if objective not in OBJECTIVES:
        raise ValueError(
            f"advise(): `objective` must be one of {OBJECTIVES}. Received: {objective!r}"
        )
    if metric is not None and not callable(metric):
        raise TypeError(
            f"advise(): `metric` must be a callable (outputs, reference) -> float. "
            f"Received: {metric!r}"
        )
    if not isinstance(repeats, int) or isinstance(repeats, bool):
        raise TypeError(
            f"advise(): `repeats` must be a positive int. Received: {repeats!r} "
            f"(of type {type(repeats).__name__})"
        )
    if repeats < 1:
        raise ValueError(f"advise(): `repeats` must be a positive int. Received: {repeats!r}")
    policied = _policied_modules(model)
    if policied:
        shown = ", ".join(policied[:3]) + (
            f" and {len(policied) - 3} more" if len(policied) > 3 else ""
        )
        raise ValueError(
            f"advise(): the model already computes by dtype policies ({shown}); the advisor "
            "measures every candidate against the float32 model, and applies its advice "
            "over nothing else. Pass the float32 model (PolicyHandle.remove() first, or a "
            "fresh copy)."
        )
    meta = next((n for n, t in _named_tensors(model) if t.device.type == "meta"), None)
    if meta is not None:
        raise ValueError(
            f"advise(): the model's '{meta}' is on the meta device; the advisor measures "
            "errors and times on real weights (load them first)."
        )
    choices = parse_candidates(candidates)
    batches = as_batches(inputs)
    max_error = float(max_error)
    say = _printer(progress)
    started = time.perf_counter()

    # 1. Reference outputs and the recorded pass, on a copy in eval mode.
    work = copy.deepcopy(model).eval()
    units, skipped = find_units(work)
    try:
        first, shared = record(work, units, batches[0])
        with torch.inference_mode():
            references = [first, *(batch(work) for batch in batches[1:])]
    except Exception as e:
        raise ValueError(
            f"advise(): calling the model on the inputs failed: {type(e).__name__}: {e}"
        ) from e
    meter = ErrorMeter(batches, references, metric)
    called = _called_or_tied(units)
    groups = group_units(called, shared)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        float32 = apply_policy(work, "float32")  # every module casts, as under the map
    baseline = meter(work)

    # 2. Sensitivity, latency and bytes per group and candidate.
    originals = dict(named_module_paths(model, root_path_of(model)))
    say(
        f"dtype_policies.advise: {len(called)} modules in {len(groups)} groups, "
        f"{len(choices) - 1} candidates, {len(batches)} batch(es)"
    )
    # Latency: half the timing rounds now, half in a second pass after every
    # group, keeping the faster: a busy spell of the machine rarely covers both.
    second_pass = repeats // 2 if objective == "latency" else 0
    first_pass = repeats - second_pass
    measurements = []
    for index, group in enumerate(groups):
        measurements.append(_measure_group(group, choices, originals, work, meter, first_pass))
        say(
            f"dtype_policies.advise: measured {index + 1}/{len(groups)} "
            f"{group[0].path or '(root)'}{f' (+{len(group) - 1})' if len(group) > 1 else ''} "
            f"[{time.perf_counter() - started:.1f} s]"
        )
    if second_pass:
        for index, (group, measure) in enumerate(zip(groups, measurements)):
            _retime(group, measure, choices, originals, second_pass)
            say(f"dtype_policies.advise: timed again {index + 1}/{len(groups)}")
    measured_at = time.perf_counter()
    if objective == "latency":
        for group, measure in zip(groups, measurements):
            for candidate in choices:
                reason = _emulated_half_products(candidate, group)
                if reason is not None:
                    measure.unavailable.setdefault(candidate.rank, reason)

    # 3. The sequence of steps and the predicted prefix.
    options = [_options(group, m, choices, objective) for group, m in zip(groups, measurements)]
    min_gain = LATENCY_MIN_GAIN if objective == "latency" else 0.0
    ladders = [ladder(group_options, min_gain) for group_options in options]
    steps = step_sequence(ladders)
    predictions = predicted_errors(ladders, steps)
    start = predicted_prefix(predictions, max_error)

    # 4. Verify, back off.
    def policy_map_after(k: int) -> DTypePolicyMap:
        entries = {}
        for group, option in zip(groups, state_after(ladders, steps, k)):
            if option.rank:
                for unit in group:
                    entries[map_key(unit.path)] = choices[option.rank].policy
        return DTypePolicyMap("float32", entries)

    def report(check: Check) -> None:
        say(
            f"dtype_policies.advise: {check.steps}/{len(steps)} steps: "
            f"error {check.error:.4g} (budget {max_error:g})"
        )

    verified: dict[int, torch.nn.Module] = {}
    recorded = {unit.path: unit.args for unit in called}

    def evaluate(k: int) -> float:
        verified.clear()
        verified[k] = prepared(model, policy_map_after(k), recorded)
        return meter(verified[k])

    taken, error, checks = back_off(start, max_error, evaluate, report)
    if error > max_error:
        warnings.warn(
            f"advise(): even float32 everywhere measures an error of {error:.4g} > "
            f"max_error={max_error:g} (is the model deterministic, and float32?).",
            UserWarning,
            stacklevel=2,
        )
    chosen_map, chosen_model = policy_map_after(taken), verified[taken]
    common = _with_common_default(chosen_map, units, skipped) if objective == "latency" else None
    if common is not None:
        # The code between the units (attention, activations, sums) computes by
        # the map's default: float32 as measured, or the units' common policy,
        # kept when it runs, is within the budget and is faster.
        say(f"dtype_policies.advise: the same choice with {common.default_policy.name} by default")
        try:
            common_model = prepared(model, common, recorded)
            common_error = meter(common_model)
        except Exception as failure:  # the model's own code refused that default
            reason = str(failure).splitlines()[0] if str(failure) else ""
            say(
                f"dtype_policies.advise: not with {common.default_policy.name} by default "
                f"({type(failure).__name__}: {reason})"
            )
            common_error = math.inf
        if common_error <= max_error:
            pair = {"map": chosen_model, "default": common_model}
            seconds = time_variants(pair, batches[0].args, batches[0].kwargs, repeats)
            if seconds["default"] < seconds["map"]:
                chosen_map, chosen_model, error = common, common_model, common_error
    verified_at = time.perf_counter()

    # 5. The whole model, as given and under the chosen map.
    float32.remove()
    say("dtype_policies.advise: timing the whole model, float32 and chosen")
    whole = {"float32": work, "chosen": chosen_model}
    forward = time_variants(whole, batches[0].args, batches[0].kwargs, repeats)
    finished = time.perf_counter()
    state = state_after(ladders, steps, taken)
    rows = _rows(originals, units, skipped, groups, measurements, state, choices)
    return Advice(
        policy_map=chosen_map,
        error=error,
        max_error=max_error,
        predicted_error=predictions[taken],
        objective=objective,
        candidates=[(c.label, c.policy.name) for c in choices],
        modules=rows,
        groups=[[unit.path for unit in group] for group in groups],
        checks=[(check.steps, check.error) for check in checks],
        steps_taken=taken,
        steps_total=len(steps),
        seconds={
            "measure": measured_at - started,
            "verify": verified_at - measured_at,
            "total": finished - started,
        },
        baseline_error=baseline,
        forward_micros={name: value * 1e6 for name, value in forward.items()},
        model_bytes={name: model_bytes(m) for name, m in whole.items()},
        cpu=processor().describe(),
        calibration_inputs=recorded,
    )


class _GroupMeasure:
    """Per candidate rank: the group's error, and per member µs and bytes (or
    why the group cannot take it)."""

    def __init__(self) -> None:
        self.errors: dict[int, float] = {0: 0.0}
        self.micros: dict[str, dict[int, float]] = {}
        self.bytes: dict[str, dict[int, int]] = {}
        self.unavailable: dict[int, str] = {}
        self.shared: dict[str, str] = {}  # member -> the earlier member it shares tensors with


def _measure_group(
    group: list[Unit],
    choices: list[Candidate],
    originals: dict[str, torch.nn.Module],
    work: torch.nn.Module,
    meter: ErrorMeter,
    repeats: int,
) -> _GroupMeasure:
    result = _GroupMeasure()
    variants: dict[int, dict[str, torch.nn.Module]] = {}
    for candidate in choices:
        built = {}
        for unit in group:
            variant = build_variant(originals[unit.path], candidate, unit.args, unit.router)
            if isinstance(variant, str):
                result.unavailable[candidate.rank] = f"{unit.path or '(root)'}: {variant}"
                break
            built[unit.path] = variant
        else:
            variants[candidate.rank] = built
    if 0 not in variants:
        raise RuntimeError(f"advise(): cannot apply float32 to {result.unavailable.get(0)}")
    for unit in group:
        per_rank = {rank: built[unit.path] for rank, built in variants.items()}
        if unit.calls == 0:  # a holder of the group's weight the model never calls
            seconds = dict.fromkeys(per_rank, 0.0)
        else:
            try:
                seconds = time_variants(per_rank, unit.args, unit.kwargs, repeats)
            except Exception:
                seconds = _time_each(per_rank, unit, repeats, result)
        result.micros[unit.path] = {rank: s * 1e6 for rank, s in seconds.items()}
        result.bytes[unit.path] = {rank: stored_bytes(v) for rank, v in per_rank.items()}
    members = {unit.path: originals[unit.path] for unit in group}
    result.shared = shared_tensors(members)
    if result.shared:  # tied weights: each tensor counted once, as the map stores them
        inputs = {unit.path: unit.args for unit in group}
        routers = {unit.path for unit in group if unit.router}
        for rank in variants:
            try:
                counted = group_bytes(members, choices[rank], inputs, routers)
            except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
                if rank == 0:
                    raise
                result.unavailable.setdefault(rank, f"{choices[rank].label}: {e}")
                continue
            for path, size in counted.items():
                result.bytes[path][rank] = size
    for rank, built in variants.items():
        if rank == 0 or rank in result.unavailable:
            continue
        try:
            result.errors[rank] = group_error(work, built, meter)
        except Exception as e:
            result.unavailable[rank] = f"{choices[rank].label}: the model failed: {e}"
    return result


def _retime(
    group: list[Unit],
    measure: _GroupMeasure,
    choices: list[Candidate],
    originals: dict[str, torch.nn.Module],
    repeats: int,
) -> None:
    """Times each member's variants again (built afresh), keeping for each
    the faster of the two passes."""
    for unit in group:
        if unit.calls == 0:
            continue
        micros = measure.micros[unit.path]
        per_rank = {
            rank: build_variant(originals[unit.path], choices[rank], unit.args, unit.router)
            for rank in micros
        }
        try:
            # (the ranks built in the first pass: modules again, not reasons)
            built = cast("dict[int, torch.nn.Module]", per_rank)
            seconds = time_variants(built, unit.args, unit.kwargs, repeats)
        except Exception:
            continue  # the first pass found which variants fail; keep its times
        for rank, value in seconds.items():
            micros[rank] = min(micros[rank], value * 1e6)


def _time_each(per_rank, unit, repeats, result) -> dict[int, float]:
    """Times variants one by one, marking those whose call fails."""
    seconds = {}
    for rank, variant in per_rank.items():
        try:
            seconds[rank] = time_variants({rank: variant}, unit.args, unit.kwargs, repeats)[rank]
        except Exception as e:
            if rank == 0:
                raise
            result.unavailable.setdefault(rank, f"{unit.path}: calling it failed: {e}")
    return seconds


def _emulated_half_products(candidate: Candidate, group: list[Unit]) -> str | None:
    """Why a half-precision float candidate cannot be faster for this group
    on this CPU, or `None`: without native products of its dtype, beyond
    `FEW_ROWS` rows its linear products run in float32 (`_core.products`)."""
    policy = candidate.policy
    dtype = policy.torch_compute_dtype if policy.quantization_mode is None else None
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    cpu = processor()
    if native_half_products(dtype, cpu):
        return None
    for unit in group:
        x = next((a for a in unit.args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        if x is not None and x.device.type == "cpu" and x.numel() > FEW_ROWS * x.shape[-1]:
            name = policy.compute_dtype
            return (
                f"not for speed: this CPU ({cpu.name}) has no native {name} products, so "
                f"beyond {FEW_ROWS} row{'s' if FEW_ROWS > 1 else ''} {candidate.label} "
                "multiplies in float32, as fast "
                "as float32 at best"
            )
    return None


def _options(
    group: list[Unit], measure: _GroupMeasure, choices: list[Candidate], objective: str
) -> list[Option]:
    options = []
    for candidate in choices:
        rank = candidate.rank
        if rank in measure.unavailable or rank not in measure.errors:
            continue
        if objective == "latency":
            cost = sum(measure.micros[u.path][rank] * u.calls for u in group)
        else:
            cost = sum(measure.bytes[u.path][rank] for u in group)
        options.append(Option(rank, measure.errors[rank], float(cost)))
    return options


def _rows(originals, units, skipped, groups, measurements, state, choices) -> list[ModuleAdvice]:
    by_path: dict[str, ModuleAdvice] = {}
    for index, (group, measure, option) in enumerate(zip(groups, measurements, state)):
        chosen = choices[option.rank]
        for unit in group:
            by_path[unit.path] = ModuleAdvice(
                path=unit.path,
                class_name=unit.class_name,
                group=index,
                calls=unit.calls,
                choice=chosen.label,
                policy=chosen.policy.name,
                errors={
                    c.label: (None if c.rank in measure.unavailable else measure.errors.get(c.rank))
                    for c in choices
                    if c.rank
                },
                micros={
                    c.label: measure.micros[unit.path].get(c.rank)
                    for c in choices
                    if c.rank not in measure.unavailable
                },
                bytes={
                    c.label: measure.bytes[unit.path].get(c.rank)
                    for c in choices
                    if c.rank not in measure.unavailable
                },
                note="; ".join(
                    [
                        *(
                            [f"shares tensors with '{measure.shared[unit.path]}' (counted there)"]
                            if unit.path in measure.shared
                            else []
                        ),
                        *(
                            f"no {choices[rank].label} ({reason})"
                            for rank, reason in sorted(measure.unavailable.items())
                        ),
                    ]
                ),
            )
    for unit in units:
        if unit.calls == 0 and unit.path not in by_path:  # not in a group
            by_path[unit.path] = ModuleAdvice(
                unit.path,
                unit.class_name,
                None,
                0,
                "float32",
                "float32",
                note="not called on the given inputs",
            )
    for item in skipped:
        by_path[item.path] = ModuleAdvice(
            item.path, item.class_name, None, 0, item.policy, item.policy, note=item.reason
        )
    return [by_path[path] for path in originals if path in by_path]


def _called_or_tied(units: list[Unit]) -> list[Unit]:
    """The units called in the recorded pass, and the others holding one of
    their weights (a table tied to called modules that the model never calls
    through this one, T5's and BART's `shared`): a weight takes one policy in
    every module holding it, so they join the called holders' group."""
    called = {id(p) for unit in units if unit.calls > 0 for p in own_parameters(unit.module)}
    return [
        unit
        for unit in units
        if unit.calls > 0 or any(id(p) in called for p in own_parameters(unit.module))
    ]


def _with_common_default(
    policy_map: DTypePolicyMap, units: list[Unit], skipped: list[Skipped]
) -> DTypePolicyMap | None:
    """The same per-unit choice written with the float policy more than half
    the units took as the map's default (the others, float32 ones included,
    by entries, and the skipped modules with weights by entries of the
    policies they keep); `None` when no float policy has a majority."""
    entries = policy_map.policy_map
    counts = Counter(policy for policy in entries.values() if policy.quantization_mode is None)
    if not counts or 2 * counts.most_common(1)[0][1] <= len(units):
        return None
    default = counts.most_common(1)[0][0]
    others = {key: policy for key, policy in entries.items() if policy != default}
    for key in map(map_key, (unit.path for unit in units)):
        if key not in entries:  # left at the map's default: kept so by an entry
            others[key] = policy_map.default_policy
    for item in skipped:  # left as they are, whatever the default
        others.setdefault(map_key(item.path), get_policy(item.policy))
    return DTypePolicyMap(default, others)


def map_key(path: str) -> str:
    """The policy map key of a module path: the path itself, escaped when it
    holds regex characters (so it can only ever match that path)."""
    return path if re.escape(path) == path else re.escape(path)


def _printer(enabled: bool) -> Callable[[str], None]:
    def say(message: str) -> None:
        if enabled:
            print(message, file=sys.stderr, flush=True)

    return say


def _policied_modules(model: torch.nn.Module) -> list[str]:
    """`'path' (policy)` of each module that computes by a policy other than
    float32 (modules quantized by `quantize()` alone, on their float32 weights,
    are measured as they are)."""
    found = []
    for name, module in model.named_modules():
        call = getattr(state_of(module), "call", None)
        if call is None or call.policy.name == "float32":
            continue
        if quantization_of(module) is not None and computes_in_own_dtype(module):
            continue
        found.append(f"'{name or '(model)'}' ({call.policy.name})")
    return found


def _named_tensors(model: torch.nn.Module) -> Any:
    yield from model.named_parameters()
    yield from model.named_buffers()
