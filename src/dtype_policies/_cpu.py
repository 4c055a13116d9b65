"""What this processor can do, as the kernel choices need it: read once.

Every product path (prepacked bfloat16 weights, int8 kernels, half-precision
products) is chosen from a `Processor`, never by trying a kernel and catching
its error. The description combines three sources, each capped by the next:

* the hardware's flags (`/proc/cpuinfo`, else `torch.cpu.get_capabilities()`);
* what torch and oneDNN are allowed to use: torch's `ATEN_CPU_CAPABILITY`
  (seen through `torch.backends.cpu.get_cpu_capability()`) and oneDNN's
  `ONEDNN_MAX_CPU_ISA` (or `DNNL_MAX_CPU_ISA`), both read by torch and oneDNN
  themselves when set before torch is imported;
* `DTYPE_POLICIES_CPU_CLASS`, naming one of `CPU_CLASSES`: this library then
  chooses its paths as on that class (features the machine lacks stay off).
  Set it with the two variables above to emulate a smaller CPU, e.g.
  `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 DTYPE_POLICIES_CPU_CLASS=avx2`
  (torch and oneDNN then run their AVX2 kernels; speed is not that of a real
  AVX2 CPU, results are). A different `TORCHINDUCTOR_CACHE_DIR` per class is
  needed for compiled code: Inductor's cache is not keyed on these variables.

>>> from dtype_policies._cpu import processor
>>> info = processor()
>>> info.name in CPU_CLASSES
True
>>> info.exact_int8 in (True, False)
True
"""

from __future__ import annotations

import contextlib
import os
import platform
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

CLASS_VARIABLE = "DTYPE_POLICIES_CPU_CLASS"

# Each class and the features it implies (x86 features as oneDNN names them).
CPU_CLASSES: dict[str, frozenset[str]] = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2"}),
    "avx2_vnni": frozenset({"avx2", "avx2_vnni"}),
    "avx512": frozenset({"avx2", "avx512"}),
    "avx512_vnni": frozenset({"avx2", "avx512", "avx512_vnni"}),
    "avx512_bf16": frozenset({"avx2", "avx512", "avx512_vnni", "avx512_bf16"}),
    "amx": frozenset(
        {"avx2", "avx2_vnni", "avx512", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx"}
    ),
    "neon": frozenset({"neon"}),
    "neon_bf16": frozenset({"neon", "bf16_dot"}),
    "sve": frozenset({"neon", "sve"}),
    "sve_bf16": frozenset({"neon", "sve", "bf16_dot"}),
}

# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) and the x86 features each allows.
_ONEDNN_CAPS: dict[str, frozenset[str]] = {
    "SSE41": frozenset(),
    "AVX": frozenset(),
    "AVX2": CPU_CLASSES["avx2"],
    "AVX2_VNNI": CPU_CLASSES["avx2_vnni"],
    "AVX2_VNNI_2": CPU_CLASSES["avx2_vnni"],
    "AVX512_CORE": CPU_CLASSES["avx512"],
    "AVX512_CORE_VNNI": CPU_CLASSES["avx512_vnni"],
    "AVX512_CORE_BF16": CPU_CLASSES["avx512_bf16"],
    "AVX512_CORE_FP16": CPU_CLASSES["avx512_bf16"] | {"avx2_vnni", "avx512_fp16"},
    "AVX10_1_512": CPU_CLASSES["avx512_bf16"] | {"avx2_vnni", "avx512_fp16"},
}
_ALL_X86 = CPU_CLASSES["amx"]

# The variables that make torch and oneDNN run as on a smaller x86 class
# (set before torch is imported; `.ci/run` runs the suite under each).
EMULATION: dict[str, dict[str, str]] = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx2_vnni": {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"},
    "avx512_vnni": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "ATEN_CPU_CAPABILITY": "avx512"},
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx512"},
}

# torch's ATEN_CPU_CAPABILITY levels and the x86 features its kernels may use.
_ATEN_LEVELS: dict[str, frozenset[str]] = {
    "DEFAULT": frozenset(),
    "AVX2": CPU_CLASSES["avx2"] | {"avx2_vnni"},
    "AVX512": _ALL_X86,
}

# /proc/cpuinfo (Linux) and torch.cpu.get_capabilities() spellings of the features.
_X86_FLAGS = {
    "avx2": ("avx2",),
    "avx2_vnni": ("avx_vnni",),
    "avx512": ("avx512f", "avx512_f"),
    "avx512_vnni": ("avx512_vnni",),
    "avx512_bf16": ("avx512_bf16",),
    "avx512_fp16": ("avx512_fp16",),
    "amx": ("amx_int8",),
}
_ARM_FLAGS = {"neon": ("asimd", "neon"), "sve": ("sve",), "bf16_dot": ("bf16",)}


@dataclass(frozen=True)
class Processor:
    """What the kernel choices need to know about this CPU.

    Attributes:
        name: The class (a key of `CPU_CLASSES`): the most capable class all
            of whose features are usable here.
        architecture: `"x86_64"`, `"aarch64"`, ...
        torch_isa: The ISA level torch's own kernels dispatch to.
        features: The usable features (the class's vocabulary).
        exact_int8: oneDNN's u8 x s8 int8 products accumulate without
            saturating (VNNI, AMX; aarch64). Without VNNI, x86 int8 kernels add
            adjacent u8 x s8 products in saturating 16-bit sums.
        native_bf16: bfloat16 products run on hardware bfloat16 instructions
            (AVX512_BF16, AMX, aarch64 BF16); elsewhere they are emulated and
            slower than float32 beyond a few rows.
        native_fp16: float16 products run on hardware float16 instructions.
        onednn_bf16: oneDNN's bfloat16 primitives (the prepacked weights) run.
        amx: AMX tiles (bfloat16 and int8).
        capped_by: The variables that lowered the class, e.g.
            `("ONEDNN_MAX_CPU_ISA=AVX2",)`.
    """

    name: str
    architecture: str
    torch_isa: str
    features: frozenset[str] = field(default_factory=frozenset)
    exact_int8: bool = True
    native_bf16: bool = False
    native_fp16: bool = False
    onednn_bf16: bool = False
    amx: bool = False
    capped_by: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for reports: the class and what it implies for the kernels."""
        parts = [
            f"bf16 products {'native' if self.native_bf16 else 'emulated'}",
            f"int8 {'exact (VNNI/AMX)' if self.exact_int8 else 'without VNNI'}",
        ]
        if self.amx:
            parts.append("AMX")
        cap = f"; capped by {', '.join(self.capped_by)}" if self.capped_by else ""
        return f"{self.name} ({self.architecture}, torch {self.torch_isa}; {', '.join(parts)}{cap})"


def hardware_flags() -> set[str]:
    """The processor's own flags (`/proc/cpuinfo`, else torch's), before any cap."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if not flags:
        get = getattr(getattr(torch, "cpu", None), "get_capabilities", None)
        if get is not None:
            with contextlib.suppress(Exception):
                flags.update(name for name, value in get().items() if value is True)
    return flags


def _features(flags: set[str], spellings: dict[str, tuple[str, ...]]) -> set[str]:
    return {name for name, names in spellings.items() if any(n in flags for n in names)}


def _onednn_cap() -> tuple[str, str] | None:
    for variable in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(variable, "").strip().upper()
        if value and value not in ("ALL", "DEFAULT"):
            return variable, value
    return None


def _classify(features: set[str], arm: bool) -> str:
    candidates = [
        name
        for name, needs in CPU_CLASSES.items()
        if needs <= features and (name in ("neon", "neon_bf16", "sve", "sve_bf16")) == arm
    ]
    return max(candidates, key=lambda name: len(CPU_CLASSES[name]), default="generic")


def detect(requested: str | None = None) -> Processor:
    """The processor as seen now (no caching): hardware, capped by torch's
    and oneDNN's variables, then by the class `requested` (default: the
    `DTYPE_POLICIES_CPU_CLASS` variable)."""
    requested = os.environ.get(CLASS_VARIABLE) if requested is None else requested
    if requested is not None:
        requested = requested.strip().lower() or None
    if requested is not None and requested not in CPU_CLASSES:
        raise ValueError(
            f"{CLASS_VARIABLE}={requested!r} is not a CPU class. "
            f"Expected one of {sorted(CPU_CLASSES)}."
        )
    machine = platform.machine().lower()
    arm = machine in ("aarch64", "arm64")
    architecture = "aarch64" if arm else ("x86_64" if machine in ("x86_64", "amd64") else machine)
    torch_isa = torch.backends.cpu.get_cpu_capability()
    flags = hardware_flags()
    capped_by: list[str] = []
    if arm:
        features = _features(flags, _ARM_FLAGS) | ({"neon"} if architecture == "aarch64" else set())
        if torch_isa.startswith("SVE"):
            features.add("sve")
    else:
        features = _features(flags, _X86_FLAGS)
        aten = _ATEN_LEVELS.get(torch_isa)
        if aten is not None and not features <= aten:
            features &= aten
            capped_by.append(f"ATEN_CPU_CAPABILITY ({torch_isa})")
        cap = _onednn_cap()
        if cap is not None:
            allowed = _ONEDNN_CAPS.get(cap[1], _ALL_X86)
            if not features <= allowed:
                features &= allowed
                capped_by.append(f"{cap[0]}={cap[1]}")
    if requested is not None:
        wanted = CPU_CLASSES[requested]
        missing = wanted - features
        if missing:
            warnings.warn(
                f"{CLASS_VARIABLE}={requested}: this CPU cannot use {sorted(missing)}; "
                "choosing kernels for what it can do.",
                RuntimeWarning,
                stacklevel=2,
            )
        if not features <= wanted:
            features &= wanted
            capped_by.append(f"{CLASS_VARIABLE}={requested}")
    if arm:
        exact_int8 = True  # int8 dot products accumulate in 32 bits
        native_bf16 = "bf16_dot" in features
        native_fp16 = "fphp" in flags or "asimdhp" in flags
        onednn_bf16 = _onednn_bf16()
    else:
        exact_int8 = bool(features & {"avx2_vnni", "avx512_vnni", "amx"})
        # oneDNN's bf16 needs AVX-512 (emulated without AVX512_BF16) here.
        onednn_bf16 = "avx512" in features and _onednn_bf16()
        native_bf16 = onednn_bf16 and bool(features & {"avx512_bf16", "amx"})
        native_fp16 = "avx512_fp16" in features and _onednn_fp16()
    return Processor(
        name=_classify(features, arm),
        architecture=architecture,
        torch_isa=torch_isa,
        features=frozenset(features),
        exact_int8=exact_int8,
        native_bf16=native_bf16,
        native_fp16=native_fp16,
        onednn_bf16=onednn_bf16,
        amx="amx" in features,
        capped_by=tuple(capped_by),
    )


def _onednn_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and check is not None and check())


def _onednn_fp16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and check is not None and check())


_current: Processor | None = None


def processor() -> Processor:
    """This process's `Processor`, detected on first use (outside any
    `torch.jit.trace` under way: the detection's queries are not model ops)."""
    global _current
    current = _current
    if current is None:
        tracing = torch._C._get_tracing_state()
        set_tracing_state: Any = torch._C._set_tracing_state  # type: ignore[attr-defined]
        set_tracing_state(None)
        try:
            current = _current = detect()
        finally:
            set_tracing_state(tracing)
    return current


@contextlib.contextmanager
def emulate(name: str) -> Iterator[Processor]:
    """Chooses kernels as on CPU class `name` inside the block (for tests).
    torch's and oneDNN's own kernels are unchanged: only this library's
    choices follow. Weights re-choose their paths on their next call.

    >>> with emulate("avx2") as info:
    ...     info.native_bf16
    False
    """
    global _current
    previous = _current
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            _current = replace(detect(name))
        yield _current
    finally:
        _current = previous


def emulations(info: Processor | None = None) -> dict[str, dict[str, str]]:
    """The smaller classes this CPU can run as, with the variables for each
    (`DTYPE_POLICIES_CPU_CLASS` included).

    >>> all(env[CLASS_VARIABLE] == name for name, env in emulations().items())
    True
    """
    info = processor() if info is None else info
    return {
        name: {**variables, CLASS_VARIABLE: name}
        for name, variables in EMULATION.items()
        if CPU_CLASSES[name] < info.features
    }


# Detected when the package is imported, not on first use: the path choices
# read it inside code that compilers trace (`torch.compile`), where the
# detection cannot run (it reads files and asks torch for strings: a graph
# break, an error under `fullgraph=True`). An invalid `DTYPE_POLICIES_CPU_CLASS`
# raises on first use instead.
with contextlib.suppress(ValueError):
    processor()


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """One intra-op thread for the calling thread (restored after), for loops
    of thousands of small ops, which threads only slow down: GPTQ's column
    loop (18 s against 0.3 s for a 1536 x 576 weight on a loaded 2-core
    machine) and int4's zero-point solver (a 8192 x 2048 weight 4.0-6.0 s
    against 12.6-16.3 s beside a test run, 2026-12-06).

    >>> import torch
    >>> before = torch.get_num_threads()
    >>> with single_threaded():
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
