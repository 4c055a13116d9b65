"""The Python side of this library's C++ kernels is registered once per
process: each operator's fake (shape) implementation, however many times the
module that gives it runs (torch 2.6 refuses a second fake of one operator),
and each module of the package is imported once, under its own name."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

import dtype_policies
from dtype_policies import _native as native
from dtype_policies._core import products
from dtype_policies.quantization.kernels import int8_native
from native_kernels import needs_kernel

PACKAGE_ROOT = Path(dtype_policies.__file__).parent


def _run_a_second_copy(module) -> None:
    spec = importlib.util.spec_from_file_location(
        f"second_copy_of_{module.__name__}", module.__file__
    )
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)


@needs_kernel
@pytest.mark.parametrize("module", [products, int8_native], ids=lambda m: m.__name__)
def test_a_module_run_twice_registers_no_fake_twice(module, monkeypatch):
    assert native.library(module.KERNEL) is not None  # the first copy's fakes registered
    registered = []
    monkeypatch.setattr(torch.library, "register_fake", lambda op, fake: registered.append(op))
    _run_a_second_copy(module)
    assert registered == []


def test_fakes_given_before_the_library_loads_are_registered_at_its_load(monkeypatch):
    registered = []
    monkeypatch.setattr(torch.library, "register_fake", lambda op, fake: registered.append(op))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_pending_fakes", {})
    monkeypatch.setattr(native, "_registered_fakes", set())
    monkeypatch.setattr(native, "_build_and_load", lambda kernel: Path("/built/by/the/test.so"))
    native.register_fakes("avx2", {"dtype_policies::one": len, "dtype_policies::two": len})
    native.register_fakes("avx2", {"dtype_policies::one": len})  # a module run a second time
    assert registered == []
    assert native.library("avx2") == Path("/built/by/the/test.so")
    native.register_fakes("avx2", {"dtype_policies::two": len, "dtype_policies::three": len})
    assert registered == ["dtype_policies::one", "dtype_policies::two", "dtype_policies::three"]


def test_every_directory_of_python_modules_is_a_regular_package():
    """pytest's doctest collection imports a namespace package's modules a
    second time, as top-level modules (their registrations run twice)."""
    directories = {path.parent for path in PACKAGE_ROOT.rglob("*.py")}
    assert sorted(str(d) for d in directories if not (d / "__init__.py").exists()) == []


@pytest.fixture
def tiny_kernel(tmp_path, monkeypatch):
    """A kernel library of one empty C++ file, built into a cache of its own;
    loads are recorded, not made (a broken file is never handed to dlopen)."""
    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "tiny.cpp").write_text("int dtype_policies_tiny() { return 1; }\n")
    monkeypatch.setattr(native, "SOURCES", sources)
    monkeypatch.setenv(native.CACHE_VARIABLE, str(tmp_path / "cache"))
    loads: list[tuple[str, int]] = []

    def load(path: str) -> None:
        size = Path(path).stat().st_size
        loads.append((path, size))
        if getattr(load, "refuse", 0):
            load.refuse -= 1
            raise OSError(f"{path}: version `GLIBC_2.99' not found")

    monkeypatch.setattr(torch.ops, "load_library", load)
    kernel = native.KernelSource("tiny", ("tiny.cpp",), ("-O0",))
    return kernel, loads, load


def test_a_cached_library_that_is_not_whole_is_built_again(tiny_kernel):
    kernel, loads, _ = tiny_kernel
    target = native._build_and_load(kernel)
    assert target is not None and native._intact(target)
    size = target.stat().st_size
    target.write_bytes(target.read_bytes()[:100])  # an interrupted copy of the cache
    assert not native._intact(target)
    assert native._build_and_load(kernel) == target
    assert native._intact(target) and loads[-1] == (str(target), size)


def test_a_cached_library_this_system_cannot_load_is_built_again_once(tiny_kernel):
    kernel, loads, load = tiny_kernel
    target = native._build_and_load(kernel)
    load.refuse = 1  # built on another system into a shared cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to tell: built again and loaded
        assert native._build_and_load(kernel) == target
    assert [path for path, _ in loads] == [str(target)] * 3
    load.refuse = 2  # a fresh build that cannot load either: warned, torch's kernels
    with pytest.warns(RuntimeWarning, match="could not be built and loaded.*GLIBC_2.99"):
        assert native._build_and_load(kernel) is None


def test_the_cache_key_names_the_compiler_and_c_library_versions(tiny_kernel, monkeypatch):
    kernel, _, _ = tiny_kernel
    here = native._build_and_load(kernel)
    assert native.toolchain().count("|") == 1
    monkeypatch.setattr(native, "toolchain", lambda: "c++ (Debian 12.2.0) 12.2.0 | glibc 2.31")
    elsewhere = native._build_and_load(kernel)
    assert here is not None and elsewhere is not None and here != elsewhere
