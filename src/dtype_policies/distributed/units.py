"""`shard_plan`: which modules become FSDP2 units, and in which dtypes.

Rule: FSDP2 all-gathers a unit's parameters in one `param_dtype`. A unit may
cast them to a half dtype only if every module in it reads its parameters in
that very dtype; then the policy's own cast finds them cast already, and the
forward computes with exactly the values of a single-process run (rounding
to bfloat16 before or after the all-gather gives the same bits). Modules that
read their parameters otherwise (float32 islands, modules of a float32 block,
embedding tables, looked up in their own dtype) become units of their own,
all-gathered as stored (`param_dtype=None`); there the policy casts as it
does in one process. Quantized modules are refused (FSDP2 does not train
them).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from dtype_policies._core.compose import original_class
from dtype_policies._core.module_rules import ModuleRule, matches_any, module_rules
from dtype_policies._core.module_state import state_of
from dtype_policies.distributed.mixed_precision import quantized_error
from dtype_policies.quantization.attach import quantization_of
from dtype_policies.quantization.kinds import read_by_parent as read_by_parent_kind

UnitRule = ModuleRule


@dataclass
class ShardUnit:
    """One `torch.distributed.fsdp.fully_shard` call of a plan.

    Attributes:
        name: The module's torch name (dotted, `""` for the model itself).
        module: The module.
        param_dtype: The dtype its parameters are all-gathered and computed
            in; `None`: as stored (the policy casts them in the forward).
        reduce_dtype: The dtype its gradients are reduced in (`None`: their
            own, the parameters' dtype).
        reason: Why it is a unit: `"block"`, `"root"`, or `"reads <dtype>"`
            for a module split from its block because it reads its parameters
            in another dtype.

    >>> import torch
    >>> import dtype_policies
    >>> from dtype_policies.distributed import shard_plan
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    >>> _ = dtype_policies.apply_policy(model, "mixed_float16")
    >>> unit = shard_plan(model)[0]
    >>> unit.name, unit.param_dtype, unit.reduce_dtype, unit.module is model[0]
    ('0', torch.float16, torch.float32, True)
    """

    name: str
    module: torch.nn.Module = field(repr=False)
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reason: str


def _never_called(module: torch.nn.Module) -> bool:
    """Containers (`ModuleList`, `ModuleDict`, parameter lists) have no
    forward; peft's tuner models (`LoraModel`, ...) are passed by: their
    `PeftModel` calls the model they hold (its `base_model.model`) directly."""
    if original_class(module).forward is torch.nn.Module.forward:
        return True
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # loaded if a peft model exists
    tuner = getattr(tuners, "BaseTuner", None)
    return isinstance(tuner, type) and isinstance(module, tuner)


def _has_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _default_blocks(
    model: torch.nn.Module, folded: Mapping[int, str]
) -> list[tuple[str, torch.nn.Module]]:
    """Each direct child with parameters (not one the model reads itself);
    containers are looked into."""
    blocks = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            if not _has_parameters(child) or id(child) in folded:
                continue
            if _never_called(child):
                visit(f"{name}.", child)
            else:
                blocks.append((name, child))

    visit("", model)
    return blocks


def refuse_quantized(model: torch.nn.Module, where: str) -> None:
    """Raises naming the quantized modules of `model`, if it has any."""
    quantized = [
        f"'{name or '(model)'}' ({quantization_of(module).mode})"
        for name, module in model.named_modules()
        if quantization_of(module) is not None
    ]
    if quantized:
        shown = ", ".join(quantized[:3]) + (", ..." if len(quantized) > 3 else "")
        raise quantized_error(where, f"the model has quantized modules: {shown}")


def _read_dtypes(module: torch.nn.Module) -> set[torch.dtype | None]:
    """How the module reads its own floating parameters in a forward: `None`
    for as stored, else the dtype the policy casts them to."""
    state = getattr(state_of(module), "call", None)
    compute = getattr(state, "compute", None)
    casts = getattr(state, "autocast", False) and compute is not None
    names: frozenset[str] = getattr(state, "weight_names", frozenset())
    dtypes: set[torch.dtype | None] = set()
    for name, parameter in module._parameters.items():
        if parameter is None or not parameter.is_floating_point():
            continue
        if not casts or name not in names or compute == parameter.dtype:
            dtypes.add(None)
        else:
            dtypes.add(compute)
    return dtypes


def read_by_parents(
    model: torch.nn.Module, named: Iterable[UnitRule] | None = None
) -> dict[int, str]:
    """`{id(module): why}` for the modules whose parameters their parent
    reads itself, never calling their forward (`nn.MultiheadAttention`'s
    `out_proj`, and those `named` rules pick: a tied head read by
    `F.linear(h, self.wte.weight)`): FSDP2 gathers a unit's parameters
    around the unit's own forward, so such a module shares its parent's
    unit."""
    modules = {name.replace(".", "/"): module for name, module in model.named_modules()}
    rules = module_rules(named, "read_by_parent") if named is not None else ()
    found = {}
    for path, module in modules.items():
        why = read_by_parent_kind(path, module, modules)
        if why is None and path and matches_any(path.replace("/", "."), module, rules):
            why = "named in read_by_parent="
        if why is not None:
            found[id(module)] = why
    for rule in rules:
        if not any(
            path and matches_any(path.replace("/", "."), module, (rule,))
            for path, module in modules.items()
        ):
            warnings.warn(
                f"fully_shard(): the read_by_parent rule {rule!r} matches no module",
                stacklevel=5,
            )
    return found


def _requirement(
    module: torch.nn.Module, folded: Mapping[int, str]
) -> tuple[bool, torch.dtype | None]:
    """`(has own floating parameters, the one dtype they can be all-gathered
    in)`; the parameters of the children it reads itself (`folded`) count as
    its own."""
    dtypes = _read_dtypes(module)
    for child in module.children():
        if id(child) in folded:
            has_own, own = _requirement(child, folded)
            if has_own:
                dtypes.add(own)
    if not dtypes:
        return False, None
    return True, dtypes.pop() if len(dtypes) == 1 else None


def _stored_dtype(module: torch.nn.Module) -> torch.dtype | None:
    for parameter in module.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return None


def _block_dtype(module: torch.nn.Module, folded: Mapping[int, str]) -> torch.dtype | None:
    has_own, own = _requirement(module, folded)
    if has_own:
        return own
    state = getattr(state_of(module), "call", None)
    compute = getattr(state, "compute", None)
    if compute is None or compute == _stored_dtype(module):
        return None
    return compute


def _named_blocks(
    model: torch.nn.Module, rules: tuple[UnitRule, ...], folded: Mapping[int, str], stacklevel: int
) -> list[tuple[str, torch.nn.Module]]:
    """The modules `rules` pick as blocks; warns naming each rule that picks
    none (its modules would fall into the model's unit, gathered whole), and
    the picked modules whose parent reads them (they stay in its unit)."""
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if module is not model and _has_parameters(module) and not _never_called(module)
    ]
    for rule in rules:
        if not any(matches_any(name, module, (rule,)) for name, module in candidates):
            warnings.warn(
                f"shard_plan(): the units rule {rule!r} matches no module of the model "
                "with parameters and a forward of its own (e.g. "
                f"{_example_blocks(candidates)}); what it was meant to pick is sharded in the "
                "unit around it.",
                UserWarning,
                stacklevel=stacklevel,
            )
    picked = [(name, module) for name, module in candidates if matches_any(name, module, rules)]
    kept_in_parent = [
        f"'{name}' ({folded[id(module)]})" for name, module in picked if id(module) in folded
    ]
    if kept_in_parent:
        warnings.warn(
            f"shard_plan(): `units` picks {', '.join(kept_in_parent[:3])}"
            f"{' ...' if len(kept_in_parent) > 3 else ''}, whose parent never calls its "
            "forward, around which FSDP2 gathers a unit's parameters: it stays in its "
            "parent's unit.",
            UserWarning,
            stacklevel=stacklevel,
        )
    return [(name, module) for name, module in picked if id(module) not in folded]


def _example_blocks(candidates: list[tuple[str, torch.nn.Module]]) -> str:
    shown = [f"'{name}' ({original_class(module).__name__})" for name, module in candidates[:3]]
    return ", ".join(shown) or "none"


def shard_plan(
    model: torch.nn.Module,
    *,
    units: Iterable[UnitRule] | None = None,
    read_by_parent: Iterable[UnitRule] | None = None,
) -> list[ShardUnit]:
    """The FSDP2 units `fully_shard` makes of a policied model, innermost
    first (the order `fully_shard` must be called in), the model last.

    Blocks: each direct child of `model` with parameters (the items of a
    `ModuleList` or `ModuleDict`, which are never called themselves), or,
    with `units`, every module matching one of its rules (module classes,
    class-name suffixes, or callables `(name, module) -> bool`, with torch's
    dotted `name`). A block is all-gathered in its policy's compute dtype.
    Inside it, a module reading its parameters in another dtype (float32
    islands, modules of another policy, embedding tables) is a unit of its
    own, all-gathered as stored. A module whose parent reads its parameters
    without calling it (`nn.MultiheadAttention.out_proj`; any module
    `read_by_parent` rules pick, as `units` rules do: a torch module cannot
    tell that a parent reads a child's weight itself) is never a unit: its
    parameters count as its parent's. The model is the last unit, for the
    parameters no block holds. A parameter tied between modules that would
    fall in two units (a tied embedding and LM head) is held by the
    innermost unit enclosing both, gathered as stored, the blocks between
    dissolved into it. A `units` rule that matches no module (with
    parameters and a forward) warns, naming it. A model with quantized
    modules raises `ValueError` (FSDP2 does not train them).

    >>> import torch
    >>> import dtype_policies
    >>> from dtype_policies.distributed import shard_plan
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    >>> _ = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> [(u.name, u.param_dtype, u.reason) for u in shard_plan(model)]
    [('0', torch.bfloat16, 'block'), ('1', None, 'block'), ('', torch.bfloat16, 'root')]
    """
    return plan_units(model, units, stacklevel=4, read_by_parent=read_by_parent)


def plan_units(
    model: torch.nn.Module,
    units: Iterable[UnitRule] | None,
    stacklevel: int,
    read_by_parent: Iterable[UnitRule] | None = None,
) -> list[ShardUnit]:
    """`shard_plan`, its warnings attributed `stacklevel` frames up."""
    refuse_quantized(model, "shard_plan()")
    folded = read_by_parents(model, read_by_parent)
    if units is None:
        blocks = _default_blocks(model, folded)
    else:
        blocks = _named_blocks(model, module_rules(units, "units"), folded, stacklevel)
    # A parameter tied between modules that would fall in different units (a
    # tied embedding and LM head, which read it in different dtypes): the
    # innermost unit enclosing both holds it, gathered as stored (each
    # module's policy casts it in its forward, as in one process), and the
    # blocks in between are no units of their own.
    as_stored: dict[str, str] = {}
    dissolved: set[str] = set()
    for _ in range(2 * len(blocks) + 2):  # each round dissolves a block or forces a unit
        kept = [(name, block) for name, block in blocks if name not in dissolved]
        block_ids = {id(module) for _, module in kept}
        try:
            return _walk_units(model, kept, block_ids, folded, as_stored)
        except _TiedAcrossUnits as tie:
            # the blocks below the common unit holding either module
            between = {
                name
                for name, _ in kept
                if name != tie.common
                and _encloses(tie.common, name)
                and (_encloses(name, tie.first) or _encloses(name, tie.second))
            }
            if tie.common in as_stored and not between:
                raise ValueError(tie.message) from None
            dissolved |= between
            as_stored[tie.common] = tie.why
    raise ValueError("fully_shard(): the tied parameters could not be placed in one unit")


class _TiedAcrossUnits(Exception):
    def __init__(self, message: str, first: str, second: str, common: str, why: str) -> None:
        super().__init__(message)
        self.message, self.first, self.second = message, first, second
        self.common, self.why = common, why


def _walk_units(
    model: torch.nn.Module,
    blocks: list[tuple[str, torch.nn.Module]],
    block_ids: set[int],
    folded: Mapping[int, str],
    as_stored: dict[str, str],
) -> list[ShardUnit]:
    plan: list[tuple[int, ShardUnit]] = []  # (depth, unit)
    owner: dict[int, tuple[str, str]] = {}  # id(parameter) -> (unit name, parameter name)
    unit_names: set[str] = set()

    def add(name: str, module: torch.nn.Module, dtype: torch.dtype | None, reason: str):
        if name in as_stored:
            dtype, reason = None, as_stored[name]
        reduce = _stored_dtype(module) if dtype is not None else None
        unit = ShardUnit(name, module, dtype, reduce, reason)
        plan.append((name.count(".") + (1 if name else 0), unit))
        unit_names.add(name)
        return unit

    def walk(name: str, module: torch.nn.Module, unit: ShardUnit) -> None:
        has_own, own = _requirement(module, folded)
        split = module is not unit.module and id(module) not in folded
        if has_own and split and unit.param_dtype not in (None, own):
            unit = add(name, module, own, f"reads {dtype_name(own)}")
        for parameter_name, parameter in module._parameters.items():
            if parameter is None:
                continue
            full = f"{name}.{parameter_name}" if name else parameter_name
            previous = owner.setdefault(id(parameter), (unit.name, full))
            if previous[0] != unit.name:
                common = _common_unit(previous[0], unit.name, unit_names)
                raise _TiedAcrossUnits(
                    f"fully_shard(): the parameter '{full}' is tied to '{previous[1]}', which "
                    f"falls in another FSDP unit ('{previous[0] or '(model)'}' and "
                    f"'{unit.name or '(model)'}').",
                    previous[0],
                    unit.name,
                    common,
                    f"as stored: '{full}' is tied to '{previous[1]}'",
                )
        for child_name, child in module.named_children():
            child_full = f"{name}.{child_name}" if name else child_name
            if id(child) in block_ids:
                continue
            walk(child_full, child, unit)

    for name, block in blocks:
        walk(name, block, add(name, block, _block_dtype(block, folded), "block"))
    walk("", model, add("", model, _block_dtype(model, folded), "root"))
    plan.sort(key=lambda entry: -entry[0])  # stable: innermost first, the model last
    return [unit for _, unit in plan]


def _encloses(outer: str, inner: str) -> bool:
    """Whether the module path `outer` (dotted; `""` the model) holds `inner`."""
    return outer == "" or inner == outer or inner.startswith(f"{outer}.")


def _common_unit(first: str, second: str, unit_names: set[str]) -> str:
    """The innermost unit enclosing both units `first` and `second` (names
    are dotted module paths; the model, `""`, encloses every unit)."""

    def enclosing(name: str) -> list[str]:
        parts = name.split(".") if name else []
        return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]

    seconds = set(enclosing(second))
    return next((name for name in enclosing(first) if name in seconds and name in unit_names), "")


def dtype_name(dtype: torch.dtype | None) -> str:
    return "as stored" if dtype is None else str(dtype).removeprefix("torch.")


def describe_plan(plan: list[ShardUnit]) -> str:
    """One line per unit: name, param dtype, reduce dtype, reason.

    >>> import torch
    >>> import dtype_policies
    >>> from dtype_policies.distributed import describe_plan, shard_plan
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    >>> _ = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> print(describe_plan(shard_plan(model)))
    0: param bfloat16, reduce float32 (block)
    1: param as stored, reduce as stored (block)
    (model): param bfloat16, reduce float32 (root)
    """
    return "\n".join(
        f"{unit.name or '(model)'}: param {dtype_name(unit.param_dtype)}, "
        f"reduce {dtype_name(unit.reduce_dtype)} ({unit.reason})"
        for unit in plan
    )
