"""Shared pytest set-up: every test (doctests included) starts from the float32 default."""

import importlib.util
import os

import pytest
import torch
from hypothesis import settings

import dtype_policies

# Property tests draw the same examples on every run (deterministic CI); set
# HYPOTHESIS_PROFILE=explore locally to search with fresh random examples.
settings.register_profile("deterministic", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

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
