"""Returning freed C-heap memory to the system (glibc), as quantization does."""

import sys

import pytest
import torch

from dtype_policies import _memory
from dtype_policies._memory import FreedMemoryLimit, _malloc_trim, release_freed_memory


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc only"
)
def test_freed_heap_pages_go_back_to_the_system():
    # 64 KiB tensors sit below glibc's smallest mmap threshold: they come from
    # the heap, whose pages stay resident when freed in the middle of it.
    tensors = [torch.ones(16384) for _ in range(3200)]  # 200 MiB, touched
    kept = tensors[::16]  # pins the heap's extent
    del tensors
    before = _memory._resident_bytes()
    release_freed_memory()
    after = _memory._resident_bytes()
    assert before - after > 100 * 2**20, (before, after)
    assert all(float(t.sum()) == 16384.0 for t in kept)  # what is alive is untouched


def test_release_is_safe_anywhere():
    release_freed_memory()
    release_freed_memory()


MB = 2**20


def test_limit_trims_once_memory_grew_past_its_slack(monkeypatch):
    trims = []
    resident = [1000 * MB]
    monkeypatch.setattr(_memory, "_trim", lambda pad: trims.append(pad) or 0)
    monkeypatch.setattr(_memory, "_resident_bytes", lambda: resident[0])
    limit = FreedMemoryLimit(slack=64 * MB)
    resident[0] += 60 * MB
    limit()
    assert trims == []
    resident[0] += 10 * MB  # 70 MB above the floor
    limit()
    assert trims == [0]
    resident[0] += 60 * MB  # the trim freed nothing: the floor moved up to 1070 MB
    limit()
    assert trims == [0]
    resident[0] -= 500 * MB  # memory went down: so does the floor
    limit()
    resident[0] += 65 * MB
    limit()
    assert trims == [0, 0]


def test_limit_without_proc_does_nothing(monkeypatch):
    trims = []
    monkeypatch.setattr(_memory, "_trim", lambda pad: trims.append(pad) or 0)
    monkeypatch.setattr(_memory, "_resident_bytes", lambda: None)
    limit = FreedMemoryLimit(slack=0)
    limit()
    assert trims == []


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc only"
)
def test_limit_gives_back_freed_heap_pages():
    limit = FreedMemoryLimit(slack=64 * MB)
    tensors = [torch.ones(16384) for _ in range(3200)]  # 200 MiB on the heap, touched
    kept = tensors[::16]
    del tensors
    before = _memory._resident_bytes()
    limit()
    assert before - _memory._resident_bytes() > 100 * MB
    assert all(float(t.sum()) == 16384.0 for t in kept)
