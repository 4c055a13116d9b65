"""Choosing precisions under an error budget.

Each group has options (its candidates it can take, float32 included) with a
measured error `e` (the group alone changed) and a cost (microseconds per
forward, or stored bytes). Errors of different groups are taken to add like
independent noise, `sqrt(sum e^2)`, so the budget is a knapsack on `e^2`.

Per group, a ladder: from float32 towards more aggressive candidates, only
options that cut the cost (by `min_gain`) and lie on the lower convex hull
of (e^2, cost), so each rung saves less per unit of error than the one
before. All rungs of all groups, sorted by saving per unit of error, form one
sequence of steps that does not depend on the budget; a budget takes the
longest prefix whose predicted error fits. A tighter budget therefore takes
a prefix of the same sequence: never more, never more aggressive.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """One candidate for one group: its rank (0 = float32), measured error
    with only this group changed, and cost under the objective."""

    rank: int
    error: float
    cost: float


@dataclass(frozen=True)
class Step:
    """Moving one group from one rung of its ladder to the next."""

    group: int
    before: Option
    after: Option

    @property
    def saving(self) -> float:
        return self.before.cost - self.after.cost

    @property
    def error_added(self) -> float:
        return self.after.error**2 - self.before.error**2

    @property
    def ratio(self) -> float:
        added = self.error_added
        return math.inf if added <= 0 else self.saving / added


def ladder(options: list[Option], min_gain: float = 0.0) -> list[Option]:
    """The rungs of one group: float32 first, then options of decreasing
    cost and increasing error on the lower convex hull of (e^2, cost),
    whatever order the candidates were given in (int4/32 before int8 had
    int8, dearer than int4, dropped: a group whose int4 missed the budget
    stayed float32 where int8 met it).

    `min_gain`: a rung must cost less than `(1 - min_gain)` times the one
    below it (timings are noisy; bytes are not)."""
    ordered = sorted(options, key=lambda o: (o.rank != 0, -o.cost, o.error, o.rank))
    if not ordered or ordered[0].rank != 0:
        raise ValueError("a group's options must include float32 (rank 0)")
    rungs = [ordered[0]]
    for option in ordered[1:]:
        if not math.isfinite(option.error) or option.cost >= rungs[-1].cost * (1 - min_gain):
            continue
        while len(rungs) > 1 and option.error <= rungs[-1].error:
            rungs.pop()  # cheaper and no worse: the previous rung is dominated
        while len(rungs) > 1 and _slope(rungs[-1], option) >= _slope(rungs[-2], rungs[-1]):
            rungs.pop()  # not on the convex hull
        rungs.append(option)
    return rungs


def _slope(low: Option, high: Option) -> float:
    added = high.error**2 - low.error**2
    return math.inf if added <= 0 else (low.cost - high.cost) / added


def step_sequence(ladders: list[list[Option]]) -> list[Step]:
    """Every rung of every ladder, best saving per unit of error first (ties:
    the earlier group first). Within a ladder the order is kept."""
    steps = [
        (step.ratio, index, group, step)
        for group, rungs in enumerate(ladders)
        for index, step in enumerate(
            Step(group, before, after) for before, after in itertools.pairwise(rungs)
        )
    ]
    steps.sort(key=lambda item: (-item[0], item[2], item[1]))
    return [step for *_, step in steps]


def predicted_errors(ladders: list[list[Option]], steps: list[Step]) -> list[float]:
    """The predicted error after the first k steps, for k = 0 .. len(steps)."""
    squared = sum(rungs[0].error ** 2 for rungs in ladders)
    predictions = [math.sqrt(squared)]
    for step in steps:
        squared += step.error_added
        predictions.append(math.sqrt(max(squared, 0.0)))
    return predictions


def state_after(ladders: list[list[Option]], steps: list[Step], k: int) -> list[Option]:
    """Each group's option after the first k steps."""
    state = [rungs[0] for rungs in ladders]
    for step in steps[:k]:
        state[step.group] = step.after
    return state


def predicted_prefix(predictions: list[float], budget: float) -> int:
    """The largest k whose predicted error is within the budget."""
    k = 0
    for index, value in enumerate(predictions):
        if value <= budget:
            k = index
        else:
            break
    return k
