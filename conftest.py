"""Shared pytest set-up: every test (doctests included) starts from the float32 default."""

import importlib.util
import os
import sys

import pytest
import torch
from hypothesis import settings

import dtype_policies

# Property tests draw the same examples on every run (deterministic CI); set
# HYPOTHESIS_PROFILE=explore locally to search with fresh random examples.
settings.register_profile("deterministic", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# Under pytest-xdist each worker gets its share of the cores for torch's
# threads (2 workers on 2 cores: one each), not every core: OpenMP regions of
# workers sharing cores wait on each other. Tests of multi-threaded kernels
# set their thread counts themselves (tests/test_kernel_threads.py).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

# The Hugging Face integration module imports transformers (an optional dependency).
collect_ignore = []
if importlib.util.find_spec("transformers") is None:
    collect_ignore.append("src/dtype_policies/saving/huggingface.py")


@pytest.fixture(autouse=True)
def _reset_default_policy():
    dtype_policies.set_dtype_policy("float32")
    torch.manual_seed(0)
    yield
    dtype_policies.set_dtype_policy("float32")


@pytest.fixture(autouse=True)
def _without_earlier_compiled_containers():
    """torch compiles every `torch.nn` container it is given (`Sequential`,
    ...) under one shared frame (`torch._dynamo.external_utils.wrap_inline`),
    at most `cache_size_limit` (8) entries in a process: the earlier tests'
    containers of other shapes would make a later full-graph compile fail.
    Each test starts without them (Dynamo is not loaded for it)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.eval_frame.remove_from_cache(dynamo.external_utils.wrap_inline(len))


# Doctests that run FSDP2 on CPU (gloo): skipped where this torch's FSDP2
# cannot run there (torch 2.6), with the reason `fully_shard` itself gives.
FSDP_ON_CPU_DOCTESTS = {"dtype_policies.distributed.fsdp.fully_shard"}


def pytest_collection_modifyitems(config, items):
    from dtype_policies.distributed.support import fsdp_refusal

    refusal = fsdp_refusal("cpu")
    if refusal is None:
        return
    for item in items:
        if item.name in FSDP_ON_CPU_DOCTESTS:
            item.add_marker(pytest.mark.skip(reason=refusal))
