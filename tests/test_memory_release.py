"""Returning freed C-heap memory to the system (glibc), as quantization does."""

import sys

import pytest
import torch

from dtype_policies._memory import _malloc_trim, release_freed_memory


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc only"
)
def test_freed_heap_pages_go_back_to_the_system():
    # 64 KiB tensors sit below glibc's smallest mmap threshold: they come from
    # the heap, whose pages stay resident when freed in the middle of it.
    tensors = [torch.ones(16384) for _ in range(3200)]  # 200 MiB, touched
    kept = tensors[::16]  # pins the heap's extent
    del tensors
    before = resident_bytes()
    release_freed_memory()
    after = resident_bytes()
    assert before - after > 100 * 2**20, (before, after)
    assert all(float(t.sum()) == 16384.0 for t in kept)  # what is alive is untouched


def test_release_is_safe_anywhere():
    release_freed_memory()
    release_freed_memory()
