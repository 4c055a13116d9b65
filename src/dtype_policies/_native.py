"""This library's own CPU kernels: C++ sources in `_csrc/`, compiled on first
use with the system's C++ compiler (the one `torch.compile` uses on CPU)
against torch's own headers, cached on disk, and loaded into torch
(`torch.ops.load_library`): each kernel library registers its operators in
the `dtype_policies` namespace, so eager calls and compiled graphs reach them
through the dispatcher, with no Python frame per call.

A kernel is used only where `available(name)` says so, which is decided once
per process from the processor (`dtype_policies._cpu`) and whether the
library could be built; elsewhere the callers keep torch's kernels. Nothing is
tried per call. The build is one compiler call (15-30 s on 2 cores: torch's
headers are most of it), keyed on the sources, the flags, the compiler and
its version, the C library's version and torch's, and written by an atomic
rename with its digest recorded beside it: processes sharing the cache
directory never load a half-written library, and a library that is not whole
or that this system cannot load is built again.

* `DTYPE_POLICIES_NATIVE_KERNELS=0` turns every native kernel off;
* `DTYPE_POLICIES_KERNEL_CACHE` names the cache directory (default
  `$XDG_CACHE_HOME/dtype_policies/kernels`, else `~/.cache/...`);
* `CXX` names the compiler (default `c++`, else `g++`).

OpenMP: the libraries are linked against `libgomp.so.1`, which resolves to
the copy torch has already loaded (the same soname), so that the kernels share
torch's thread pool instead of starting a second one; likewise `libc10` and
`libtorch_cpu`.

>>> from dtype_policies import _native as native
>>> native.available("avx2") in (True, False)
True
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtype_policies._cpu import Processor, hardware_flags, processor

DISABLE_VARIABLE = "DTYPE_POLICIES_NATIVE_KERNELS"
CACHE_VARIABLE = "DTYPE_POLICIES_KERNEL_CACHE"
SOURCES = Path(__file__).parent / "_csrc"


@dataclass(frozen=True)
class KernelSource:
    """One native kernel library: its source files, compiler flags, and what
    the processor needs for it (`supports`)."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]

    def supports(self, cpu: Processor) -> bool:
        x86 = cpu.architecture in ("x86_64", "AMD64")
        if self.name == "avx2":  # AVX2, FMA and F16C (the callers choose per class)
            return x86 and "avx2" in cpu.features and _has_fma_and_f16c()
        if self.name == "attention_bf16":  # vdpbf16ps
            # With AMX, torch's flash kernel multiplies bfloat16 on its tiles:
            # 1.3-2.9x this kernel at every shape measured (docs/speed.md).
            return x86 and "avx512_bf16" in cpu.features and "amx" not in cpu.features
        return False


KERNELS: dict[str, KernelSource] = {
    "avx2": KernelSource(
        "avx2",
        (
            "bf16_avx2.cpp",
            "float8_ops.cpp",
            "int4_avx2.cpp",
            "int4_ops.cpp",
            "int8_avx2.cpp",
            "watch.cpp",
        ),
        ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17"),
    ),
    # a library of its own, so that a compiler without AVX-512 bfloat16
    # support costs only this kernel
    "attention_bf16": KernelSource(
        "attention_bf16", ("attention_bf16.cpp",), ("-O3", "-fopenmp", "-std=c++17")
    ),
}


# read once; a plain global, so that compiled graphs trace through it
_fma_and_f16c: list[bool] = []


def _has_fma_and_f16c() -> bool:
    """Whether the processor has FMA and F16C (every x86 CPU with AVX2 and
    FMA has F16C: the W4A8 kernel reads float16 scales with it)."""
    if not _fma_and_f16c:
        flags = hardware_flags()
        _fma_and_f16c.append("fma" in flags and "f16c" in flags)
    return _fma_and_f16c[0]


_lock = threading.Lock()
_loaded: dict[str, Path | None] = {}
_pending_fakes: dict[str, dict[str, Callable[..., Any]]] = {}
_registered_fakes: set[str] = set()


def register_fakes(name: str, fakes: Mapping[str, Callable[..., Any]]) -> None:
    """Gives the operators of kernel `name`'s library their fake (shape)
    implementations for compilers, `{"dtype_policies::op": fake}`: registered
    with torch once kernel `name`'s library is loaded (at once if it is), and
    once per operator and process. A module that runs twice (imported under
    a second name, reloaded) registers nothing twice: torch 2.6 refuses a
    second fake of one operator.

    >>> register_fakes("avx2", {})  # the libraries' modules register theirs on import
    """
    with _lock:
        if _loaded.get(name) is None:
            _pending_fakes.setdefault(name, {}).update(fakes)
            return
        due = _unregistered(fakes)
    _register(due)


def _unregistered(fakes: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """The fakes of operators without one yet, marked registered (under `_lock`)."""
    due = {operator: fake for operator, fake in fakes.items() if operator not in _registered_fakes}
    _registered_fakes.update(due)
    return due


def _register(fakes: Mapping[str, Callable[..., Any]]) -> None:
    for operator, fake in fakes.items():
        torch.library.register_fake(operator, fake)


def operator_suffix(cpu: Processor | None = None) -> str:
    """Which copy of a kernel's operators runs on `cpu` (default this one),
    for the kernels that have one per instruction set: `"vnni"` with AVX-512
    VNNI, else `"avx2"`.

    >>> from dataclasses import replace
    >>> operator_suffix(replace(processor(), features=frozenset({"avx2", "avx512", "avx512_vnni"})))
    'vnni'
    >>> operator_suffix(replace(processor(), features=frozenset({"avx2"})))
    'avx2'
    """
    cpu = processor() if cpu is None else cpu
    return "vnni" if "avx512_vnni" in cpu.features else "avx2"


def enabled() -> bool:
    """Whether native kernels are allowed (`DTYPE_POLICIES_NATIVE_KERNELS`)."""
    return os.environ.get(DISABLE_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def available(name: str, cpu: Processor | None = None) -> bool:
    """Whether kernel `name` runs here: allowed, supported by the processor
    (`cpu`, default this one) and built (the first call builds it)."""
    kernel = KERNELS[name]
    cpu = processor() if cpu is None else cpu
    return enabled() and kernel.supports(cpu) and library(name) is not None


def loaded(name: str) -> bool:
    """Whether kernel `name`'s library is already loaded and allowed (never
    builds or loads it: safe inside a compiler's trace)."""
    return _loaded.get(name) is not None and enabled()


def library(name: str) -> Path | None:
    """The path of kernel `name`'s library, built and loaded into torch on
    first use (its operators registered); `None` when it cannot be built here
    (no compiler, or the build failed: warned once)."""
    if name in _loaded:
        return _loaded[name]
    due: dict[str, Callable[..., Any]] = {}
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build_and_load(KERNELS[name])
            if _loaded[name] is not None:
                due = _unregistered(_pending_fakes.pop(name, {}))
    _register(due)
    return _loaded[name]


def cache_dir() -> Path:
    """Where built libraries are kept."""
    configured = os.environ.get(CACHE_VARIABLE)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dtype_policies" / "kernels"


def _compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _torch_flags() -> tuple[str, ...]:
    """Compiling and linking against the running torch."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    return (
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-Wno-c++20-extensions",
        *includes,
        *libraries,
        "-lc10",
        "-ltorch_cpu",
    )


def sources_digest(directory: Path = SOURCES) -> str:
    """The SHA-256 of every file in `directory` (the sources and every file
    they include), names and contents: part of each built library's cache key."""
    digest = hashlib.sha256()
    for source in sorted(directory.iterdir()):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


@functools.cache
def toolchain() -> str:
    """What a built library depends on beyond its sources and flags, for its
    cache key: the compiler's version and the C library's. Without them a
    cache shared between systems (a container's build in a mounted home
    directory) handed one system a library built for the other, which it
    could not load, under the same name, never rebuilt."""
    compiler = _compiler()
    version = ""
    if compiler is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            version = subprocess.run(
                [compiler, "--version"],
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                timeout=60,
            ).stdout.partition("\n")[0]
    libc = ""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    return f"{version} | {libc}"


def _digest_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(target: Path) -> bool:
    """Whether `target` is whole, as this cache wrote it: its digest is the
    one recorded beside it after the build (a truncated copy, from an
    interrupted copy of the cache, crashed the process inside `dlopen`)."""
    record = target.with_name(target.name + ".sha256")
    try:
        return record.read_text().strip() == _digest_of(target)
    except OSError:
        return False


def _build(compiler: str, sources: list[Path], flags: tuple[str, ...], target: Path) -> None:
    """Compiles into `target`, then records its digest, each by an atomic rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        subprocess.run(
            [compiler, *(str(source) for source in sources), *flags, "-o", str(built)],
            check=True,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        record = Path(work) / (target.name + ".sha256")
        record.write_text(_digest_of(built))
        os.replace(built, target)
        os.replace(record, target.with_name(record.name))


def _build_and_load(kernel: KernelSource) -> Path | None:
    compiler = _compiler()
    if compiler is None:
        warnings.warn(
            f"dtype_policies: no C++ compiler found (CXX, c++, g++, clang++), so the "
            f"native kernel {kernel.name!r} is not built; torch's kernels are used instead.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    sources = [SOURCES / name for name in kernel.sources]
    flags = (*kernel.flags, "-shared", "-fPIC", *_torch_flags())
    key = " ".join((sources_digest(), compiler, toolchain(), *flags, torch.__version__))
    target = cache_dir() / f"{kernel.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    try:
        built_now = not _intact(target)
        if built_now:
            _build(compiler, sources, flags, target)
        try:
            torch.ops.load_library(str(target))
        except (OSError, RuntimeError):
            if built_now:
                raise
            # a cached library this system cannot load: built again, once
            _build(compiler, sources, flags, target)
            torch.ops.load_library(str(target))
        return target
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or str(error)
        warnings.warn(
            f"dtype_policies: the native kernel {kernel.name!r} could not be built and loaded "
            f"with {compiler} ({detail.strip()[:500]}); torch's kernels are used instead.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
