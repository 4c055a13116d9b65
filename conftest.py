"""Shared pytest set-up: every test (doctests included) starts from the float32 default."""

import pytest
import torch

import dtype_policies


@pytest.fixture(autouse=True)
def _reset_default_policy():
    dtype_policies.set_dtype_policy("float32")
    torch.manual_seed(0)
    yield
    dtype_policies.set_dtype_policy("float32")
