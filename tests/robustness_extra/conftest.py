"""Shared set-up of the extra robustness suite.

The int8 epilogues run eagerly by default (compilation is opt-in); the tests
that ask for `compiled_epilogues` turn it on for their duration only.
"""

import pytest

from dtype_policies.quantization import set_compile_epilogues


@pytest.fixture
def compiled_epilogues():
    set_compile_epilogues(True)
    yield
    set_compile_epilogues(False)
