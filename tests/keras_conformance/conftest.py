"""Every conformance test leaves the process-wide default policy as it found
it (Keras's setUp/tearDown in its dtype policy tests) and runs with a fixed
seed (Keras's `utils.set_random_seed`)."""

import pytest
import torch

import dtype_policies


@pytest.fixture(autouse=True)
def restore_default_policy():
    before = dtype_policies.dtype_policy()
    torch.manual_seed(1337)
    yield
    dtype_policies.set_dtype_policy(before)
