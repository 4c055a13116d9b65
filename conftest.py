"""Shared pytest set-up: every test (doctests included) starts from the float32 default."""

import importlib.util

import pytest
import torch

import dtype_policies

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
