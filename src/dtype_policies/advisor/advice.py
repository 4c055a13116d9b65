"""`Advice`: the policy map `advise` chose, its measured error, and the
per-module measurements behind it (a table, JSON, a file)."""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dtype_policies._modes import mode_record
from dtype_policies.advisor.variants import apply_advised
from dtype_policies.apply import PolicyHandle
from dtype_policies.apply.summary import render_table
from dtype_policies.policies import DTypePolicyMap, serialize
from dtype_policies.saving.atomic import write_atomically
from dtype_policies.saving.policy_files import save_policy

ADVICE_FORMAT = "dtype_policies.advice"
ADVICE_VERSION = 1


@dataclass
class ModuleAdvice:
    """One module's row of an `Advice` (`advice.modules`; see `Advice` for an example).

    Attributes:
        path, class_name: The module.
        group: Its group's index (members share one precision), or `None`
            for modules the advisor left in float32 without measuring.
        calls: Calls per forward on the first batch.
        choice: The chosen candidate's label (`"float32"` when kept); of a
            module left alone, its policy.
        policy: The chosen policy's name; of a module left alone, the one it
            keeps (`"float32"`, or the quantized policy it already has).
        errors: Per candidate label, the end-to-end error with only this
            module's group changed to it (its sensitivity); `None` when the
            group cannot take it.
        micros: Per candidate label, this module's measured microseconds per call.
        bytes: Per candidate label, this module's stored bytes; a tensor
            it shares with an earlier module of its group (a head tied to
            an embedding) is counted there, as the map stores it, once.
        note: Why it was left alone, or why candidates were unavailable.
    """

    path: str
    class_name: str
    group: int | None
    calls: int
    choice: str
    policy: str
    errors: dict[str, float | None] = field(default_factory=dict)
    micros: dict[str, float | None] = field(default_factory=dict)
    bytes: dict[str, int | None] = field(default_factory=dict)
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Advice:
    """What `dtype_policies.advise` returns.

    Attributes:
        policy_map: A `DTypePolicyMap`, default float32, with an exact-path
            entry for each module that changes precision; `apply_policy`
            takes it and `saving.save_policy` writes it.
        error: The end-to-end error measured with `policy_map` applied to a
            copy of the model (not predicted).
        max_error: The budget; `error <= max_error` unless even float32
            everywhere exceeds it (a nondeterministic model).
        predicted_error: What the per-group sensitivities predicted for the
            chosen map.
        objective: `"latency"` or `"memory"`.
        candidates: `(label, policy name)` from the least to the most
            aggressive, float32 first.
        modules: One row per module with weights of its own, in model order.
        groups: The groups' paths (modules that share an input or a weight).
        checks: Every verification made: `(steps taken, measured error)`.
        steps_taken, steps_total: How far along the sequence of steps the
            chosen map is.
        seconds: Time spent measuring, verifying, and in all.
        baseline_error: The error of the model under a float32 policy
            (0 for a deterministic float32 model).
        forward_micros: The whole model's microseconds per forward on the
            first batch, `"float32"` (as given) and `"chosen"` (the map
            applied), measured interleaved (the fastest sample of each).
        model_bytes: The whole model's state-dict bytes, float32 and chosen.
        cpu: The CPU class the measurements ran on (`dtype_policies._cpu`):
            speed and the kernels chosen depend on it.

    Example:

    >>> import copy, torch
    >>> import dtype_policies
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(
    ...     torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    ... )
    >>> x = torch.randn(16, 64)
    >>> advice = dtype_policies.advise(model, x, objective="memory", progress=False)
    >>> fresh = copy.deepcopy(model)
    >>> handle = advice.apply(fresh)  # apply_policy + quantization, by the map
    >>> error = dtype_policies.advisor.relative_error(fresh(x), model(x))
    >>> error <= advice.max_error
    True
    >>> [(row.path, row.choice) for row in advice.modules]
    [('0', 'int8'), ('2', 'int8')]
    >>> "sensitivity" in advice.table() and advice.to_dict()["format"]
    'dtype_policies.advice'
    """

    policy_map: DTypePolicyMap
    error: float
    max_error: float
    predicted_error: float
    objective: str
    candidates: list[tuple[str, str]]
    modules: list[ModuleAdvice]
    groups: list[list[str]]
    checks: list[tuple[int, float]]
    steps_taken: int
    steps_total: int
    seconds: dict[str, float]
    baseline_error: float = 0.0
    forward_micros: dict[str, float] = field(default_factory=dict)
    model_bytes: dict[str, int] = field(default_factory=dict)
    cpu: str = ""
    calibration_inputs: dict[str, tuple] = field(default_factory=dict, repr=False, compare=False)

    def apply(self, model: torch.nn.Module, **kwargs: Any) -> PolicyHandle:
        """`apply_policy(model, advice.policy_map, **kwargs)`: every module
        gets its policy, and modules with int8/int4 entries are quantized
        (their float weights are replaced; `handle.remove()` leaves them
        quantized); gptq/awq entries are calibrated on the inputs each module
        received in the advisor's recorded pass (`calibration_inputs`)."""
        return apply_advised(model, self.policy_map, self.calibration_inputs, **kwargs)

    @property
    def measured(self) -> list[ModuleAdvice]:
        return [row for row in self.modules if row.group is not None]

    def totals(self) -> dict[str, float]:
        """Sums over the measured modules, per forward: microseconds (per call
        times calls) and stored bytes (each tensor once), under float32 and
        under the chosen map."""

        def total(row_values, choose) -> float:
            return float(sum(choose(row) for row in row_values))

        rows = self.measured
        return {
            "micros_float32": total(rows, lambda r: (r.micros.get("float32") or 0) * r.calls),
            "micros_chosen": total(rows, lambda r: (r.micros.get(r.choice) or 0) * r.calls),
            "bytes_float32": total(rows, lambda r: r.bytes.get("float32") or 0),
            "bytes_chosen": total(rows, lambda r: r.bytes.get(r.choice) or 0),
        }

    def table(self) -> str:
        """A plain-text table: per module its path, class, group, chosen
        policy, its sensitivity to each candidate (the end-to-end error with
        only its group changed to it), calls per forward, microseconds per
        call under float32 and under the choice, stored bytes under float32
        and under the choice; then totals, the measured error and notes."""
        labels = [label for label, _ in self.candidates[1:]][::-1]  # most aggressive first
        header = (
            "path",
            "class",
            "group",
            "policy",
            *(f"sensitivity {label}" for label in labels),
            "calls",
            "µs/call f32",
            "µs/call chosen",
            "bytes f32",
            "bytes chosen",
        )
        cells = []
        for row in self.modules:
            measured = row.group is not None
            cells.append(
                (
                    row.path or "(root)",
                    row.class_name,
                    str(row.group) if measured else "-",
                    row.choice if measured else f"{row.policy} (fixed)",
                    *(_number(row.errors.get(label)) for label in labels),
                    str(row.calls) if measured else "-",
                    _number(row.micros.get("float32"), 1),
                    _number(row.micros.get(row.choice), 1),
                    _integer(row.bytes.get("float32")),
                    _integer(row.bytes.get(row.choice)),
                )
            )
        text = render_table(header, cells, numeric=len(header) - 4)
        totals = self.totals()
        lines = [
            text,
            "sensitivity X: the end-to-end error with only the module's group at X "
            "(members of a group share one precision)",
            f"error {self.error:.4g} measured with the map applied (budget {self.max_error:g}, "
            f"predicted {self.predicted_error:.4g}; {self.steps_taken}/{self.steps_total} steps, "
            f"{len(self.checks)} verification(s)); objective: {self.objective}",
            "measured modules per forward, float32 -> chosen: "
            f"{_ratio(totals['micros_float32'], totals['micros_chosen'])} µs, "
            f"{_ratio(totals['bytes_float32'], totals['bytes_chosen'])} bytes",
            *self._whole_model_line(),
            *([f"measured on CPU class {self.cpu}"] if self.cpu else []),
        ]
        notes = [f"  {row.path or '(root)'}: {row.note}" for row in self.modules if row.note]
        if notes:
            lines += ["notes:", *notes]
        lines.append(
            f"time: {self.seconds['measure']:.1f} s measuring, {self.seconds['verify']:.1f} s "
            f"verifying, {self.seconds['total']:.1f} s in all"
        )
        return "\n".join(lines)

    def _whole_model_line(self) -> list[str]:
        forward, size = self.forward_micros, self.model_bytes
        if not forward or not size:
            return []
        return [
            "whole model, float32 -> chosen: "
            f"{_ratio(forward['float32'], forward['chosen'])} µs per forward, "
            f"{_ratio(size['float32'], size['chosen'])} bytes"
        ]

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (the map in the Keras dict format)."""
        return {
            "format": ADVICE_FORMAT,
            "format_version": ADVICE_VERSION,
            "policy": serialize(self.policy_map),
            "error": _finite(self.error),
            "max_error": self.max_error,
            "predicted_error": _finite(self.predicted_error),
            "baseline_error": _finite(self.baseline_error),
            "objective": self.objective,
            "candidates": [{"label": label, "policy": name} for label, name in self.candidates],
            "steps_taken": self.steps_taken,
            "steps_total": self.steps_total,
            "checks": [{"steps": k, "error": _finite(error)} for k, error in self.checks],
            "totals": self.totals(),
            "forward_micros": self.forward_micros,
            "model_bytes": self.model_bytes,
            "cpu": self.cpu,
            "seconds": self.seconds,
            "groups": self.groups,
            "modules": [_finite_row(row.as_dict()) for row in self.modules],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | os.PathLike) -> Path:
        """Writes a policy file (`saving.save_policy`; `saving.load_policy`
        reads the map back) with the rest of the advice under `"advice"`.

        A calibrated entry (GPTQ, AWQ) was measured calibrated on the inputs
        its module received; the file holds the map, not those inputs, so
        applying it alone rounds those modules to nearest: a warning says so.
        `advice.apply(model)` calibrates them as measured; save the model
        after it (`saving.save`) to keep the result."""
        calibrated = sorted(
            key
            for key in self.policy_map
            if (mode := self.policy_map[key].quantization_mode) is not None
            and mode_record(mode).calibrated
        )
        if calibrated:
            named = ", ".join(map(repr, calibrated[:3])) + (", ..." if len(calibrated) > 3 else "")
            warnings.warn(
                f"Advice.save(): {len(calibrated)} entr{'y' if len(calibrated) == 1 else 'ies'} "
                f"({named}) are "
                "calibrated modes measured on the inputs their modules received; the policy "
                "file does not hold those inputs, so applying it alone rounds them to nearest "
                "(a larger error than advised). Use advice.apply(model), then saving.save.",
                UserWarning,
                stacklevel=2,
            )
        path = save_policy(self.policy_map, path)
        data = json.loads(path.read_text())
        advice = self.to_dict()
        del advice["policy"]
        data["advice"] = advice
        text = json.dumps(data, indent=2) + "\n"
        write_atomically(path, lambda temporary: Path(temporary).write_text(text))
        return path

    def __repr__(self) -> str:
        changed = len(self.policy_map)
        return (
            f"Advice(error={self.error:.4g}, max_error={self.max_error:g}, "
            f"objective={self.objective!r}, entries={changed})"
        )


def _number(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "inf"
    return f"{value:.{digits}f}" if digits == 1 else f"{value:.{digits}g}"


def _integer(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _ratio(before: float, after: float) -> str:
    if after <= 0:
        return f"{before:,.0f} -> {after:,.0f}"
    return f"{before:,.0f} -> {after:,.0f} ({before / after:.2f}x)"


def _finite(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return str(value)  # "inf" and "nan" are not JSON numbers


def _finite_row(row: dict[str, Any]) -> dict[str, Any]:
    row["errors"] = {key: _finite(value) for key, value in row["errors"].items()}
    return row
