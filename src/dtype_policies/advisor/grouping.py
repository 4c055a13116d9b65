"""Groups of units that must share one precision: modules that read the same
input (Llama's q/k/v projections, gate/up projections), so that the products
that combine their outputs (attention scores, `act(gate) * up`) see one
dtype, and modules that share a weight (tied embeddings)."""

from __future__ import annotations

import torch

from dtype_policies._core.slots import own_parameters
from dtype_policies.advisor.units import Unit, _first_floating


class _UnionFind:
    def __init__(self, items: list[str]) -> None:
        self.parent = {item: item for item in items}

    def find(self, item: str) -> str:
        while self.parent[item] != item:
            self.parent[item] = self.parent[self.parent[item]]
            item = self.parent[item]
        return item

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def _same_input(a: Unit, b: Unit) -> bool:
    x, y = _first_floating(a.args, a.kwargs), _first_floating(b.args, b.kwargs)
    return (
        x is not None
        and y is not None
        and x.shape == y.shape
        and x.dtype == y.dtype
        and bool(torch.equal(x, y))
    )


def group_units(units: list[Unit], shared_inputs: list[list[str]]) -> list[list[Unit]]:
    """The groups, in model order (each a list of units in model order).

    Joined: units that received the same input tensor object in the recorded
    pass (`shared_inputs`); siblings (same parent) whose first inputs are
    equal tensors (a parent that hands each a copy); units holding the same
    weight `Parameter`.
    """
    order = {unit.path: i for i, unit in enumerate(units)}
    sets = _UnionFind(list(order))
    for paths in shared_inputs:
        for other in paths[1:]:
            sets.union(paths[0], other)
    by_parent: dict[str, list[Unit]] = {}
    for unit in units:
        by_parent.setdefault(unit.path.rpartition("/")[0], []).append(unit)
    for siblings in by_parent.values():
        for i, a in enumerate(siblings):
            for b in siblings[i + 1 :]:
                if sets.find(a.path) != sets.find(b.path) and _same_input(a, b):
                    sets.union(a.path, b.path)
    owners: dict[int, str] = {}
    for unit in units:
        for parameter in own_parameters(unit.module):
            first = owners.setdefault(id(parameter), unit.path)
            sets.union(first, unit.path)
    groups: dict[str, list[Unit]] = {}
    for unit in units:
        groups.setdefault(sets.find(unit.path), []).append(unit)
    return sorted(groups.values(), key=lambda members: order[members[0].path])
