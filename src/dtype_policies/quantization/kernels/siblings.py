"""One product per input in a frozen compiled graph: sibling calls of this
library's packed operators (and of its AVX2 bfloat16 product, whose weight is
plain rows) on the same input, merged into one call.

A decoder layer multiplies one input by several weights (a Llama's query,
key and value projections; its gate and up projections). On one row each
product is a few microseconds of arithmetic and as much again of call
overhead (the dispatcher, an output allocation, an OpenMP region, Inductor's
checks of the result): SmolLM2-135M's decode step makes 211 such calls, 121
once siblings are merged. The packed weights of these operators are laid out
panel by panel along their first dimension (`int8_native.pack`: 16 output
columns per panel; the W4A8 int4 layout: 8; int4 weight-only: 1), so the
siblings' packed weights and per-panel steps concatenate into the packed
weight of the stacked matrix, exactly: the merged call computes each
sibling's columns with the same arithmetic, in the same order, bit for bit.
Each sibling's output becomes a column slice of the merged one.

`SiblingProducts` is an Inductor pass on the ATen graph before freezing
(`joint_custom_post_pass`), for graphs compiled with frozen weights
(`_frozen.FrozenCompiledCall`): the concatenations it adds depend on weights
alone, so freezing folds them, with the packing, into constants of the
graph, computed from the model's weights at each compilation (a pass after
freezing would make constants Inductor's cache does not key: a recompiled
model would run its first weights). A group whose settings differ, whose
shapes are unknown, or whose outputs are viewed in a way a column slice does
not allow, is left as it is.

>>> MERGEABLE["int8_mm_q8b_avx2"].panel
16
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Mergeable:
    """How an operator's calls on one input merge into one call.

    `panel`: output columns per row of the packed weight; `panel_args`: the
    positions of the tensors laid out panel by panel along their first
    dimension (the packed weight, per-panel steps or scales); `column_args`:
    the positions of (n,) per-column float vectors (an optional one may be
    `None`); `n_arg`: the position of the number of output columns (`None`:
    the first panel argument's rows times `panel`). Every other argument must
    be the same in each sibling.

    >>> Mergeable(panel=16, panel_args=(1,), column_args=(2, 3), n_arg=4).panel
    16
    """

    panel: int
    panel_args: tuple[int, ...]
    column_args: tuple[int, ...]
    n_arg: int | None


MERGEABLE: dict[str, Mergeable] = {
    # (x, packed, block_step, bias?, n, bf16_out)
    "int8_mm_q8b_avx2": Mergeable(16, (1, 2), (3,), 4),
    "int8_mm_q8b_vnni": Mergeable(16, (1, 2), (3,), 4),
    "int8_mm_q8b_amx": Mergeable(16, (1, 2), (3,), 4),
    # (x, packed, column_step, bias?, n, bf16_out)
    "int8_mm_q8_avx2": Mergeable(16, (1,), (2, 3), 4),
    "int8_mm_q8_vnni": Mergeable(16, (1,), (2, 3), 4),
    "int8_mm_q8_amx": Mergeable(16, (1,), (2, 3), 4),
    # (x, packed, pairs, group, n)
    "int4_mm_avx2": Mergeable(1, (1, 2), (), 4),
    "int4_mm_q8_avx2": Mergeable(8, (1, 2), (), 4),
    "int4_mm_q8_vnni": Mergeable(8, (1, 2), (), 4),
    "int4_mm_q8_amx": Mergeable(8, (1, 2), (), 4),
    # (x, weight, bias?): a plain (N, K) bfloat16 weight (`_core.products`)
    "bf16_mm_avx2": Mergeable(1, (1,), (2,), None),
}


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _spec_of(node: torch.fx.Node) -> Mergeable | None:
    """The merge rule of a call of one of this library's operators (the
    operator or its default overload), or `None`."""
    target = node.target
    if node.op != "call_function":
        return None
    if isinstance(target, torch._ops.OpOverload):
        if target._overloadname != "default":
            return None
        name = target._schema.name
    elif isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name
    else:
        return None
    namespace, _, op = name.partition("::")
    return MERGEABLE.get(op) if namespace == "dtype_policies" else None


def _example(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def _same_value(arg: Any) -> Any:
    """A key equal for nodes that are the same view of the same tensor (each
    product reshapes its input to rows: one view per product)."""
    if isinstance(arg, torch.fx.Node) and arg.target in _VIEWS and not arg.kwargs:
        source, shape = arg.args[0], arg.args[1]
        if isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape):
            return ("view", _same_value(source), tuple(shape))
    return arg


def _sibling_groups(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """Calls of one operator on the same input with the same settings, in
    graph order (the first defines where the merged call goes)."""
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        spec = _spec_of(node)
        if spec is None or node.kwargs:
            continue
        varying = {*spec.panel_args, *spec.column_args, spec.n_arg}
        shared = tuple((i, _same_value(a)) for i, a in enumerate(node.args) if i not in varying)
        groups.setdefault((str(node.target), shared), []).append(node)
    return [nodes for nodes in groups.values() if len(nodes) > 1]


def _spans(nodes: list[torch.fx.Node], spec: Mergeable) -> tuple[list[int], list[int]] | None:
    """Each sibling's columns (`n`) and the columns its packed weight spans
    (whole panels), or `None` where the siblings cannot merge: an argument
    of unknown shape, differing trailing shapes or dtypes, optional
    per-column vectors given to some siblings and not others."""
    ns: list[int] = []
    spans: list[int] = []
    for node in nodes:
        examples = [_example(node.args[i]) for i in spec.panel_args]
        if not all(isinstance(e, torch.Tensor) for e in examples):
            return None
        n = examples[0].shape[0] * spec.panel if spec.n_arg is None else node.args[spec.n_arg]
        if not isinstance(n, int):
            return None
        span = examples[0].shape[0] * spec.panel
        if any(e.shape[0] * spec.panel != span for e in examples) or span < n:
            return None
        ns.append(n)
        spans.append(span)
    for i in spec.panel_args:
        layouts = {(_example(n.args[i]).dtype, tuple(_example(n.args[i]).shape[1:])) for n in nodes}
        if len(layouts) != 1:
            return None
    for i in spec.column_args:
        if len({node.args[i] is None for node in nodes}) != 1:
            return None
    return ns, spans


def _views_allowed(node: torch.fx.Node, sliced: torch.Tensor | None) -> bool:
    """Whether every view of `node`'s output also applies to a column slice
    of the merged output (a view cannot merge strided dimensions). Views of
    symbolic sizes (dynamic shapes; `sliced` is then `None`) count as not
    allowed: deciding them would add guards to the graph."""
    for user in node.users:
        if user.target not in _VIEWS:
            continue
        shape = user.args[1] if len(user.args) == 2 else None
        if sliced is None or user.kwargs or not isinstance(shape, (list, tuple)):
            return False
        if not all(isinstance(d, int) for d in shape):
            return False
        try:
            sliced.view(shape)
        except RuntimeError:
            return False
    return True


def _add(graph: torch.fx.Graph, target: Any, *args: Any) -> torch.fx.Node:
    """A call in `graph` with its fake value (Inductor's passes read it)."""
    node = graph.call_function(target, args)
    values = torch.fx.node.map_arg(args, _example)
    fake_mode = next(
        v.fake_mode for v in torch.utils._pytree.tree_leaves(values) if hasattr(v, "fake_mode")
    )
    with fake_mode:
        node.meta["val"] = target(*values)
    return node


def _downstream(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """Every node computed from the outputs of `nodes`."""
    seen: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _merge(graph: torch.fx.Graph, nodes: list[torch.fx.Node], spec: Mergeable) -> bool:
    # The merged call needs every sibling's weights first: none may be
    # computed from a sibling's output.
    weights = {node.args[i] for node in nodes for i in (*spec.panel_args, *spec.column_args)}
    if weights & _downstream(nodes):
        return False
    shape = _spans(nodes, spec)
    out = _example(nodes[0])
    if shape is None or not isinstance(out, torch.Tensor) or out.dim() != 2:
        return False
    if not hasattr(_example(nodes[0].args[0]), "fake_mode"):
        return False
    ns, spans = shape
    starts = list(itertools.accumulate(spans[:-1], initial=0))
    total = starts[-1] + ns[-1]
    rows = out.shape[0]
    merged_out = torch.empty((rows, total), device="meta") if isinstance(rows, int) else None
    for node, start, n in zip(nodes, starts, ns, strict=True):
        sliced = None if merged_out is None else merged_out[:, start : start + n]
        if not _views_allowed(node, sliced):
            return False
    aten = torch.ops.aten
    first = nodes[0]
    args = list(first.args)
    last = len(nodes) - 1
    with graph.inserting_before(first):
        for i in spec.panel_args:
            args[i] = _add(graph, aten.cat.default, [node.args[i] for node in nodes], 0)
        for i in spec.column_args:
            if first.args[i] is None:
                continue
            pieces = [
                node.args[i]
                if j == last or span == n
                else _add(graph, aten.constant_pad_nd.default, node.args[i], [0, span - n], 0.0)
                for j, (node, n, span) in enumerate(zip(nodes, ns, spans, strict=True))
            ]
            args[i] = _add(graph, aten.cat.default, pieces, 0)
        if spec.n_arg is not None:
            args[spec.n_arg] = total
        call = _add(graph, first.target, *args)
        for node, start, n in zip(nodes, starts, ns, strict=True):
            node.replace_all_uses_with(_add(graph, aten.slice.Tensor, call, 1, start, start + n))
    for node in nodes:
        graph.erase_node(node)
    return True


def merge_sibling_products(graph: torch.fx.Graph) -> int:
    """Merges each group of sibling products in `graph` (an ATen graph before
    freezing, its values faked in `meta["val"]`); returns how many calls
    were removed."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    removed = 0
    for nodes in _sibling_groups(graph):
        spec = _spec_of(nodes[0])
        if spec is not None and _merge(graph, nodes, spec):
            removed += len(nodes) - 1
    if removed:
        # A later sibling's weights may be computed after the first sibling,
        # where the merged call stands: order the graph again.
        stable_topological_sort(graph)
    return removed


@functools.cache
def _source_hash() -> str:
    """This package's kernels: every Python file of it (the operators' fake
    kernels among them, whose shapes and strides a cached graph bakes in), the
    C++ sources, and the repairs of Inductor's code generation."""
    from dtype_policies import _inductor_repairs
    from dtype_policies import _native as native

    digest = hashlib.sha256(native.sources_digest().encode())
    for source in [*sorted(Path(__file__).parent.glob("*.py")), Path(_inductor_repairs.__file__)]:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # torch without custom graph passes: no merging
    CustomGraphPass = object  # type: ignore[assignment,misc]


class SiblingProducts(CustomGraphPass):  # type: ignore[misc,valid-type]
    """The Inductor pass (`joint_custom_post_pass`): `merge_sibling_products`
    on the graph module's graph.
    Its `uuid` (part of Inductor's cache key) is a hash of this package's
    kernels: a change of any operator or fake kernel compiles graphs again.

    >>> SiblingProducts().uuid() == SiblingProducts().uuid()
    True
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        merge_sibling_products(getattr(graph, "graph", graph))

    def uuid(self) -> str:
        return _source_hash()
