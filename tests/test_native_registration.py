"""The Python side of this library's C++ kernels is registered once per
process: each operator's fake (shape) implementation, however many times the
module that gives it runs (torch 2.6 refuses a second fake of one operator),
and each module of the package is imported once, under its own name."""

from __future__ import annotations

import importlib.util
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
