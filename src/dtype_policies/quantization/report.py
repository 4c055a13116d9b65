"""`QuantizationReport`: what a model-level `quantize` call did, and skipped."""

from __future__ import annotations

from dataclasses import dataclass, field

SKIP_NO_SUPPORT = "no quantize support"
SKIP_FILTERED = "filtered out"
SKIP_ALREADY_QUANTIZED = "already quantized"
SKIP_NOT_READY = "not initialized yet"
SKIP_OUTSIDE_STRUCTURE = "outside quantization structure"  # calibrated modes (as Keras)
SKIP_NO_MATRIX = "no weight matrix"  # norms, scales: nothing any mode quantizes
SKIP_NOT_IN_MODE = "not in the mode"  # embeddings under float8 and the calibrated modes
SKIP_ROUTER = "router"  # a mixture of experts' gate: it decides which experts run
SKIP_ADAPTER = "adapter"  # a PEFT adapter (LoRA's A and B): trained on the quantized base
ROUTER_DETAIL = "a mixture of experts' gate, kept in floating point (it chooses the experts)"
ADAPTER_DETAIL = "a fine-tuning adapter (PEFT), kept in floating point to train"


def shared_float_detail(holder: str) -> str:
    """Why a module is left float: its weight is shared with `holder`, which
    keeps it float (a weight is stored quantized in all its modules or none)."""
    return f"its weight is shared with {holder!r}, which keeps it in floating point"


def shared_layout_detail(holder: str) -> str:
    """Why a module is left float: its weight is shared with `holder`, which
    lays it out otherwise (an (out, in) linear and an (in, out) kernel), so
    that no one set of stored tensors serves both."""
    return (
        f"its weight is shared with {holder!r}, which lays it out otherwise (one quantized "
        "copy cannot serve both; both keep it in floating point)"
    )


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
    total_parameters: int = 0
    """The model's parameter elements (each shared tensor once), before quantizing."""
    unsupported_parameters: int = 0
    """Those of modules skipped for want of support (each shared tensor once)."""
    outside_linears: list[str] = field(default_factory=list)
    """Linear modules a calibrated mode left outside its blocks (the output head aside)."""
    other_modes: list[str] = field(default_factory=list)
    """The modes of the modules skipped as already quantized in another mode."""
    other_configs: list[str] = field(default_factory=list)
    """The modules (with their config) skipped as already quantized in this
    mode with another config than the one the call gave."""

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
        """The one warning a `quantize` call emits, or `None` when nothing it
        skipped holds weights a user would expect quantized (filtered out,
        already quantized in this mode and config, normalization scales, weights of a
        role the mode does not quantize such as embeddings under float8 or a
        calibrated mode, a calibrated mode's output head)."""
        not_ready = self.skipped_by_reason(SKIP_NOT_READY)
        unsupported = [
            (path, why.split(": ", 1)[1] if ": " in why else "")
            for path, why in self.skipped
            if why.split(": ", 1)[0] == SKIP_NO_SUPPORT
        ]
        parts = []
        if unsupported:
            examples = [f"{path!r} ({why})" if why else repr(path) for path, why in unsupported]
            share = ""
            if self.total_parameters:
                percent = 100 * self.unsupported_parameters / self.total_parameters
                share = f"; {percent:.1f}% of the model's parameters stay in floating point"
            parts.append(
                f"{len(unsupported)} module(s) holding weight matrices were not quantized "
                f"(e.g. {_examples(examples, max_examples, quote=False)}){share}."
            )
        if self.outside_linears:
            parts.append(
                f"{len(self.outside_linears)} linear module(s) outside the calibrated blocks "
                f"stay in floating point (e.g. {_examples(self.outside_linears, max_examples)}): "
                "only the repeated blocks found (or given as quantization_layer_structure) "
                "are calibrated; quantize(model, 'int4') quantizes the rest to nearest."
            )
        if not_ready:
            parts.append(
                f"{len(not_ready)} module(s) were skipped because their weights are not "
                f"initialized yet (lazy modules: call the model once first; e.g. "
                f"{_examples(not_ready, max_examples)})."
            )
        if self.other_modes and not self.quantized:
            modes = ", ".join(repr(mode) for mode in sorted(set(self.other_modes)))
            parts.append(
                f"{len(self.other_modes)} module(s) already quantized in mode {modes} were "
                "left as they are: a module is quantized once; quantize a float copy of the "
                "model to use another mode."
            )
        if self.other_configs:
            parts.append(
                f"{len(self.other_configs)} module(s) already quantized in mode "
                f"{self.mode!r} with another configuration were left as they are (e.g. "
                f"{_examples(self.other_configs, max_examples, quote=False)}): a module is "
                "quantized once; quantize a float copy of the model to use this configuration."
            )
        if not parts:
            return None
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


def _examples(paths: list[str], count: int, quote: bool = True) -> str:
    shown = [repr(path) if quote else path for path in paths[:count]]
    return ", ".join(shown) + (", ..." if len(paths) > count else "")
