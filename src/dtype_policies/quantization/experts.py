"""Mixture-of-experts blocks, quantized expert by expert.

transformers 5 keeps a mixture-of-experts block's experts in one module whose
weights are 3-D tensors, `(experts, out, in)` (or `(experts, in, out)` when
transposed): `gate_up_proj` (or `up_proj`) and `down_proj`, with optional
biases, run by whichever experts implementation the config selects
(`@use_experts_implementation`, whose flags say how: gated, transposed,
biased, a norm after each expert). No quantized product takes a 3-D weight,
so quantizing such a block first *expands* it: each 3-D weight becomes an
`nn.ModuleList` of one `nn.Linear` per expert under the same name
(`experts.gate_up_proj.0.weight`), each quantized like any linear (the same
schemes, kernels and stored tensors), and the block computes with them:
for each expert some token chose, its tokens through its linears, weighted
by the router and summed per token, as the batched implementation does.

An expansion is planned without touching the block (its linears hold views
of the 3-D weights) and attached when the first of its quantizations is
committed; `describe` records expanded blocks in the manifest, and loading
expands them again before the saved tensors go in.

>>> import torch
>>> from dtype_policies.quantization.experts import ExpertsExpansion
>>> class Experts(torch.nn.Module):  # transformers' layout and flags
...     def __init__(self):
...         super().__init__()
...         self.num_experts, self.has_gate, self.has_bias = 4, True, False
...         self.is_transposed, self.has_post_expert_norm = False, False
...         self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 2 * 6, 8))
...         self.down_proj = torch.nn.Parameter(torch.randn(4, 8, 6))
...         self.act_fn = torch.nn.SiLU()
...     def _apply_gate(self, gate_up):
...         gate, up = gate_up.chunk(2, dim=-1)
...         return self.act_fn(gate) * up
>>> experts = Experts()
>>> expansion = ExpertsExpansion.of(experts)
>>> [path for path, _ in expansion.linears()][:3]
['gate_up_proj/0', 'gate_up_proj/1', 'gate_up_proj/2']
>>> expansion.attach()
>>> experts.gate_up_proj[1].weight.shape, experts(torch.randn(3, 8),
...     torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.rand(3, 2)).shape
(torch.Size([12, 8]), torch.Size([3, 8]))
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

from dtype_policies._compat import compiling
from dtype_policies._core.compose import ModuleMixin, mixins_of, original_class, set_mixins
from dtype_policies._core.module_state import ensure_state, quantization_of, state_of
from dtype_policies._core.policy_module import install
from dtype_policies._derivatives import derivative_free

_FLAGS = ("num_experts", "has_gate", "has_bias", "is_transposed")
_WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertsLayout:
    """How a transformers experts module stores its experts."""

    num_experts: int
    weights: tuple[str, ...]  # ("gate_up_proj", "down_proj") or ("up_proj", "down_proj")
    transposed: bool
    biased: bool


def experts_layout(module: torch.nn.Module) -> ExpertsLayout | None:
    """The layout of a transformers 5 experts module (its class decorated with
    `@use_experts_implementation`, its 3-D weights not expanded yet), or
    `None` for any other module."""
    if not all(hasattr(module, flag) for flag in _FLAGS):
        return None
    if isinstance(module._modules.get("down_proj"), torch.nn.ModuleList):
        return None  # expanded already
    count = module.num_experts
    first = "gate_up_proj" if module.has_gate else "up_proj"
    weights = (first, "down_proj")
    names = set(weights)
    if module.has_bias:
        names |= {f"{weight}_bias" for weight in weights}
    own = {name for name, p in module._parameters.items() if p is not None}
    if not isinstance(count, int) or own != names or (module.has_gate and not _has_gate(module)):
        return None
    for weight in weights:
        parameter = module._parameters[weight]
        if parameter is None or parameter.dim() != 3 or parameter.shape[0] != count:
            return None
        bias = module._parameters.get(f"{weight}_bias")
        if bias is not None and (bias.dim() != 2 or bias.shape[0] != count):
            return None
    return ExpertsLayout(count, weights, bool(module.is_transposed), bool(module.has_bias))


def _has_gate(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "_apply_gate", None))


def expanded(module: torch.nn.Module) -> bool:
    """Whether `module` is an experts module computing with one linear per expert."""
    return ExpertLinearsForward in mixins_of(module)


def expert_routers(modules: Any) -> set[int]:
    """The ids of the gates of mixture-of-experts blocks, which engines keep
    in floating point (llama.cpp's `ffn_gate_inp`): they are small, and their
    rounding would change which experts run. `modules` are the candidate
    blocks (a model's modules).

    A block is a module with a collection of experts among its children
    (`_experts_count`: transformers' experts modules, fused or expanded;
    3-D weights with one slice per expert; or a container of two or more
    children of one structure, Switch Transformers' and NLLB-MoE's lists of
    experts). Its gates are those of its other children that hold a single
    weight matrix: the router, whose matrix has one row per expert (the
    block is a block only if it has one), and a gate of one row (a scalar
    per token, as Qwen-MoE's `shared_expert_gate`). A child of several
    matrices (a shared expert's MLP) computes, and is quantized."""
    found: set[int] = set()
    for block in modules:
        counts = []
        others = []
        for child in block._modules.values():
            if child is None:
                continue
            count = _experts_count(child)
            if count is None:
                others.append(child)
            else:
                counts.append(count)
        if not counts:
            continue
        single = [m for m in map(_single_matrix, others) if m is not None]
        routers = [(holder, rows) for holder, rows in single if rows in counts]
        if not routers:
            continue
        found.update(id(holder) for holder, rows in single if rows in counts or rows == 1)
    return found


def _experts_count(module: torch.nn.Module) -> int | None:
    """How many experts `module` holds, if it is a collection of experts: a
    transformers experts module (fused or expanded), a module whose weights
    are 3-D with one slice per expert (`num_experts` of them: JetMoe's
    `ParallelExperts`), or a container of two or more children with
    parameters, all of one structure (the same classes at the same paths),
    each an MLP (two or more weight matrices), and no parameters of its own;
    an `nn.Sequential` runs its children one after another and holds none."""
    if expanded(module) or experts_layout(module) is not None:
        return int(cast(int, module.num_experts))
    own = [p for p in module._parameters.values() if p is not None]
    count = getattr(module, "num_experts", None)
    if isinstance(count, int) and own and all(p.dim() == 3 and p.shape[0] == count for p in own):
        return count
    if own or isinstance(module, torch.nn.Sequential):
        return None
    children = [
        child for child in module._modules.values() if child is not None and _weight_matrices(child)
    ]
    if len(children) < 2 or len(_weight_matrices(children[0])) < 2:
        return None
    structure = _structure(children[0])
    return len(children) if all(_structure(c) == structure for c in children[1:]) else None


def _structure(module: torch.nn.Module) -> tuple:
    return tuple((name, original_class(m)) for name, m in module.named_modules())


def _weight_matrices(module: torch.nn.Module) -> list[tuple[torch.nn.Module, tuple[int, ...]]]:
    """`(holder, shape)` of each weight matrix under `module`, a quantized
    weight included (by its float shape)."""
    found = []
    for holder in module.modules():
        quantized = quantization_of(holder)
        skip = None if quantized is None else quantized.weight_name
        if quantized is not None:
            found.append((holder, tuple(quantized.spec.float_shape)))
        for name, parameter in holder._parameters.items():
            if parameter is not None and parameter.dim() >= 2 and name != skip:
                found.append((holder, tuple(parameter.shape)))
    return found


def _single_matrix(module: torch.nn.Module) -> tuple[torch.nn.Module, int] | None:
    """`(holder, rows)` if the only weight matrix under `module` is a 2-D
    one of `holder` with `rows` rows; `None` otherwise."""
    matrices = _weight_matrices(module)
    if len(matrices) != 1 or len(matrices[0][1]) != 2:
        return None
    holder, shape = matrices[0]
    return holder, shape[0]


class ExpertsExpansion:
    """One experts module's 3-D weights as one `nn.Linear` per expert,
    planned (the linears hold views of the weights; the module is untouched)
    until `attach` puts them in the module."""

    def __init__(self, module: torch.nn.Module, layout: ExpertsLayout) -> None:
        self.module = module
        self.layout = layout
        self.lists: dict[str, torch.nn.ModuleList] = {}
        self.attached = False
        self.planned: set[int] = set()  # the ids of linears with a quantization planned
        self.parameter_names = list(module._parameters)  # their order, for `detach`
        self.dropping: set[int] = set()  # of those whose float weight the quantization drops
        with torch.no_grad():  # views, not steps of a graph
            for name in layout.weights:
                weight = cast(torch.nn.Parameter, module._parameters[name])
                bias = module._parameters.get(f"{name}_bias")
                self.lists[name] = torch.nn.ModuleList(
                    _linear(
                        weight[e].t() if layout.transposed else weight[e],
                        None if bias is None else bias[e],
                        weight.requires_grad,
                    )
                    for e in range(layout.num_experts)
                )
        # the linears compute by the module's policy applications
        state = state_of(module)
        for token, entry in state.applications if state is not None else ():
            for linear in self.all_linears():
                install(linear, token, entry)

    @classmethod
    def of(cls, module: torch.nn.Module) -> ExpertsExpansion:
        """The expansion of an experts module (`ValueError` for any other)."""
        layout = experts_layout(module)
        if layout is None:
            raise ValueError(
                f"{type(module).__name__} is not a transformers experts module with 3-D "
                "weights (a class decorated with @use_experts_implementation)"
            )
        return cls(module, layout)

    def all_linears(self) -> list[torch.nn.Linear]:
        return [linear for linears in self.lists.values() for linear in linears]  # type: ignore[misc]

    def linears(self, under: str = "", separator: str = "/") -> list[tuple[str, torch.nn.Module]]:
        """`(path, linear)` for each linear, its path under the module's path
        `under` (`"gate_up_proj/3"` below the module itself)."""
        start = f"{under}{separator}" if under else ""
        return [
            (f"{start}{name}{separator}{index}", linear)
            for name, linears in self.lists.items()
            for index, linear in enumerate(linears)
        ]

    def claim(self, plan: Any) -> None:
        """Makes `plan` (an `attach.Plan` of one of the linears) attach this
        expansion when it is committed."""
        plan.expansion = self
        self.planned.add(id(plan.module))
        if not plan.scheme.keeps_float_weight:
            self.dropping.add(id(plan.module))

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """While planned (before `attach`), the module computes with its
        linears (`ExpertLinearsForward`'s values, on the linears' views of its
        weights), so that each linear's own calls can be observed (the
        statistics of calibrated modes); its forward is restored after."""
        module = self.module
        if self.attached:
            yield
            return
        lists = self.lists

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            index, weights = _routing(args, kwargs)
            return _experts(module, hidden_states, index, weights, lists)

        module.forward = forward  # an instance attribute, in front of the class's
        try:
            yield
        finally:
            del module.forward

    @staticmethod
    def claim_all(plans: list, expansions: list[ExpertsExpansion]) -> None:
        """Makes each plan of one of the `expansions`' linears attach its
        expansion when committed (`claim`)."""
        owner = {id(linear): e for e in expansions for linear in e.all_linears()}
        for plan in plans:
            expansion = owner.get(id(plan.module))
            if expansion is not None:
                expansion.claim(plan)

    def attach(self) -> None:
        """Puts the linears in the module in place of its 3-D weights (once;
        cannot fail). Biases, and the weights of linears that keep them in
        floating point (no quantization planned, or float8's), become
        contiguous tensors of their own, so that the 3-D tensors' memory goes
        once the quantized linears drop their views."""
        if self.attached:
            return
        self.attached = True
        module = self.module
        for linear in self.all_linears():
            # every parameter is a view of the module's (biases stay)
            kept = ("bias",) if id(linear) in self.dropping else ("weight", "bias")
            for name in kept:
                parameter = linear._parameters.get(name)
                if parameter is not None:
                    linear._parameters[name] = torch.nn.Parameter(
                        parameter.detach().clone(memory_format=torch.contiguous_format),
                        parameter.requires_grad,
                    )
        for name, linears in self.lists.items():
            del module._parameters[name]
            module._parameters.pop(f"{name}_bias", None)
            module._modules[name] = linears
        ensure_state(module)
        set_mixins(module, (*mixins_of(module), ExpertLinearsForward))
        _register(module)

    def detachable(self) -> bool:
        """Whether `detach` can put the 3-D weights back: attached, its lists
        still in the module, and every linear's weight a float parameter
        (none quantized, or float8 undone)."""
        return (
            self.attached
            and all(
                self.module._modules.get(name) is linears for name, linears in self.lists.items()
            )
            and all(
                quantization_of(linear) is None
                and isinstance(linear._parameters.get("weight"), torch.nn.Parameter)
                for linear in self.all_linears()
            )
        )

    def detach(self) -> None:
        """Undoes `attach` (once `detachable`; cannot fail): the module's 3-D
        weights (and biases), in their order, stacked from its linears' weights
        as they are now (trained, say), and the module's own forward."""
        module = self.module
        parameters = {}
        with torch.no_grad():
            for name, linears in self.lists.items():
                weights: list[torch.Tensor] = [
                    cast(torch.nn.Linear, linear).weight for linear in linears
                ]
                stacked = torch.stack([w.t() if self.layout.transposed else w for w in weights])
                parameters[name] = torch.nn.Parameter(stacked, weights[0].requires_grad)
                if self.layout.biased:
                    biases: list[torch.Tensor] = [
                        cast(torch.nn.Linear, linear).bias for linear in linears
                    ]
                    parameters[f"{name}_bias"] = torch.nn.Parameter(
                        torch.stack(biases), biases[0].requires_grad
                    )
                del module._modules[name]
        for name in self.parameter_names:
            module._parameters[name] = parameters[name]
        set_mixins(module, tuple(m for m in mixins_of(module) if m is not ExpertLinearsForward))
        _MODULES.pop(id(module), None)
        self.attached = False


def _linear(
    weight: torch.Tensor, bias: torch.Tensor | None, requires_grad: bool
) -> torch.nn.Linear:
    """An `nn.Linear` holding `weight` (N, K) and `bias` (views) as its parameters."""
    out_features, in_features = weight.shape
    linear = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
    linear._parameters["weight"] = torch.nn.Parameter(weight, requires_grad)
    linear._parameters["bias"] = None if bias is None else torch.nn.Parameter(bias, requires_grad)
    return linear


class ExpertLinearsForward(ModuleMixin):
    """An experts module's forward on its per-expert linears: transformers'
    batched experts semantics (tokens repeated per chosen expert, gate or
    activation, the post-expert norm, router weights, a sum per token),
    expert by expert over the experts some token chose."""

    _dp_order = 10

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        index, weights = _routing(args, kwargs)
        if compiling() and derivative_free(hidden_states, weights):
            # the loop over the chosen experts depends on the routing's values:
            # one opaque operator in a compiled inference graph (fullgraph
            # included); with gradients, the graph breaks around the eager loop
            return torch.ops.dtype_policies.experts(hidden_states, index, weights, id(self))
        if compiling():
            return _experts_outside_graphs(self, hidden_states, index, weights)
        _register(self)
        return _experts(self, hidden_states, index, weights)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        _register(self)

    def _dp_check_checkpoint(self, state_dict: dict, prefix: str) -> None:
        """Raises `ValueError` if a fused tensor of `state_dict` (transformers'
        own checkpoint of this module) cannot be split into its linears."""
        for name, expected in _fused_shapes(self).items():
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and tuple(value.shape) != expected:
                raise ValueError(
                    f"The checkpoint's '{prefix + name}' has shape {tuple(value.shape)}; the "
                    f"experts at '{prefix[:-1]}' (one linear per expert) take {expected}. "
                    "Nothing was loaded."
                )

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        # a checkpoint of the fused module (transformers' own, float): its 3-D
        # tensors become each expert linear's, which quantize them on loading
        _split_fused(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)


def _fused_shapes(module: Any) -> dict[str, tuple[int, ...]]:
    """The shapes of the expanded `module`'s fused tensors, by name."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, linears in module._modules.items():
        if not isinstance(linears, torch.nn.ModuleList) or name not in _WEIGHT_NAMES:
            continue
        first = cast(torch.nn.Linear, linears[0])
        count, rows, columns = len(linears), first.out_features, first.in_features
        shapes[name] = (count, columns, rows) if module.is_transposed else (count, rows, columns)
        if first.bias is not None:
            shapes[f"{name}_bias"] = (count, rows)
    return shapes


def _split_fused(module: Any, state_dict: dict, prefix: str) -> None:
    """Rewrites, in `state_dict`, the expanded `module`'s fused tensors
    (`<prefix>gate_up_proj`, `<prefix>down_proj_bias`, ...) as its linears'
    (`<prefix>gate_up_proj.3.weight`); shapes were checked before loading."""
    for name, shape in _fused_shapes(module).items():
        value = state_dict.get(prefix + name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            continue
        del state_dict[prefix + name]
        weight_name, is_bias = name.removesuffix("_bias"), name.endswith("_bias")
        for index in range(shape[0]):
            piece = value[index]
            if not is_bias and module.is_transposed:
                piece = piece.t()
            key = f"{prefix}{weight_name}.{index}.{'bias' if is_bias else 'weight'}"
            state_dict[key] = piece.contiguous()


def _experts(
    module: Any,
    hidden_states: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    lists: dict[str, torch.nn.ModuleList] | None = None,
) -> torch.Tensor:
    """`ExpertLinearsForward.forward`, eagerly, on the module's linears (or
    on `lists`, an expansion's linears by weight name, before it is attached)."""
    lists = module._modules if lists is None else lists
    shape = hidden_states.shape
    hidden = hidden_states.reshape(-1, shape[-1])
    k = index.shape[-1]
    expert_ids = index.reshape(-1)
    weights = weights.reshape(-1)
    down = cast(torch.nn.ModuleList, lists["down_proj"])
    count = len(down)
    first = lists["gate_up_proj"] if module.has_gate else lists["up_proj"]
    features = cast(torch.nn.Linear, down[0]).out_features
    output = torch.zeros(hidden.shape[0], features, dtype=torch.float32, device=hidden.device)
    order = torch.argsort(expert_ids, stable=True)
    # ids past the last expert (expert parallelism's sentinels) sort last, counted apart
    per_expert = torch.bincount(expert_ids.clamp(max=count), minlength=count + 1)
    start = 0
    for expert, tokens in enumerate(per_expert.tolist()[:count]):
        chosen = order[start : start + tokens]
        start += tokens
        if tokens == 0:
            continue
        token_index = chosen // k
        out = first[expert](hidden[token_index])
        out = module._apply_gate(out) if module.has_gate else module.act_fn(out)
        out = down[expert](out)
        if module.has_post_expert_norm:
            out = module.post_expert_norm(out)
        out = out * weights[chosen].unsqueeze(-1).to(out.dtype)
        output.index_add_(0, token_index, out.float())
    return output.to(hidden_states.dtype).reshape(*shape[:-1], features)


_OUTSIDE_GRAPHS: list[Any] = []  # `_experts` behind `torch.compiler.disable`, made once


def _experts_outside_graphs(module: Any, *args: torch.Tensor) -> torch.Tensor:
    # made when the first module is registered, never while tracing; not at
    # import (`torch.compiler.disable` loads Dynamo, and with it FSDP)
    return _OUTSIDE_GRAPHS[0](module, *args)


_MODULES: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
"""Expanded experts modules by `id`: the operator's `handle` (a constant of
the graph) names its module; registered when a module is expanded, copied
or unpickled, and at each eager call."""


def _register(module: torch.nn.Module) -> None:
    _MODULES[id(module)] = module
    if not _OUTSIDE_GRAPHS:
        _OUTSIDE_GRAPHS.append(torch.compiler.disable(_experts))


@torch.library.custom_op("dtype_policies::experts", mutates_args=())
def _experts_operator(
    hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, handle: int
) -> torch.Tensor:
    module = _MODULES.get(handle)
    if module is None:
        raise RuntimeError(
            "dtype_policies::experts: the experts module of this compiled graph no longer "
            "exists; compile the model again"
        )
    return _experts(module, hidden_states, index, weights)


@_experts_operator.register_fake
def _(hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, handle: int):
    return hidden_states.new_empty(hidden_states.shape)


def _routing(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' (chosen expert ids, router weights), however the call
    names them (`top_k_index`/`top_k_weights`, `router_indices`/`routing_weights`)."""
    given = [*args, *kwargs.values()]
    index = [t for t in given if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    weights = [t for t in given if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if len(given) != 2 or len(index) != 1 or len(weights) != 1:
        raise TypeError(
            "An experts module takes (hidden_states, expert ids (integers), router weights "
            f"(floating)). Received: {[type(t).__name__ for t in given]} besides hidden_states"
        )
    return index[0], weights[0]
