"""`QuantizationReport`: what a model-level `quantize` call did, and skipped."""

from __future__ import annotations

from dataclasses import dataclass, field

SKIP_NO_SUPPORT = "no quantize support"
SKIP_FILTERED = "filtered out"
SKIP_ALREADY_QUANTIZED = "already quantized"
SKIP_NOT_READY = "not initialized yet"
SKIP_OUTSIDE_STRUCTURE = "outside quantization structure"  # calibrated modes (as Keras)


@dataclass
class QuantizationReport:
    """The quantized modules `(path, mode, policy name)` and the skipped ones
    `(path, reason)`.

    >>> report = QuantizationReport("int8")
    >>> report.quantized.append(("0", "int8", "int8_from_float32"))
    >>> report.skipped.append(("1", SKIP_NO_SUPPORT))
    >>> report
    QuantizationReport(mode='int8', quantized=1, skipped=1, errors=0)
    """

    mode: str
    quantized: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)

    @property
    def num_quantized(self) -> int:
        return len(self.quantized)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def skipped_by_reason(self, reason: str) -> list[str]:
        """Paths skipped for `reason` (a reason's detail after ": " is ignored)."""
        return [path for path, why in self.skipped if why.split(": ", 1)[0] == reason]

    def summary_warning(self, max_examples: int = 5) -> str | None:
        """The one warning a `quantize` call emits, or `None` when only filtered
        modules were skipped."""
        quiet = (SKIP_FILTERED, SKIP_ALREADY_QUANTIZED)
        not_ready = self.skipped_by_reason(SKIP_NOT_READY)
        unsupported = [
            path
            for path, why in self.skipped
            if why not in quiet and path not in not_ready and why != SKIP_OUTSIDE_STRUCTURE
        ]
        if not unsupported and not not_ready:
            return None
        parts = []
        if unsupported:
            parts.append(
                f"{len(unsupported)} module(s) were skipped because they do not support "
                f"quantization (e.g. {_examples(unsupported, max_examples)})."
            )
        if not_ready:
            parts.append(
                f"{len(not_ready)} module(s) were skipped because their weights are not "
                f"initialized yet (lazy modules: call the model once first; e.g. "
                f"{_examples(not_ready, max_examples)})."
            )
        return (
            f"quantize(): {' '.join(parts)} Quantized {self.num_quantized} module(s) in mode "
            f"'{self.mode}'. Inspect the returned QuantizationReport for details."
        )

    def render(self) -> str:
        lines = [f"Quantization report (mode={self.mode!r})"]
        lines += [f"  quantized  {path}  ->  {policy}" for path, _, policy in self.quantized]
        lines += [f"  skipped    {path}  ({reason})" for path, reason in self.skipped]
        lines += [f"  error      {path}  ({message})" for path, message in self.errors]
        lines.append(
            f"  {self.num_quantized} quantized, {self.num_skipped} skipped, "
            f"{self.num_errors} errors"
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"QuantizationReport(mode={self.mode!r}, quantized={self.num_quantized}, "
            f"skipped={self.num_skipped}, errors={self.num_errors})"
        )


def _examples(paths: list[str], count: int) -> str:
    return ", ".join(repr(path) for path in paths[:count]) + (", ..." if len(paths) > count else "")
