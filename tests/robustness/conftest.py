"""Shared set-up of the robustness suite.

The int8 epilogues run eagerly by default (compilation is opt-in); the tests
that ask for `compiled_epilogues` turn it on for their duration only. Tests
that exercise warning paths without checking them ask for `quiet`.
"""

import warnings

import pytest

from dtype_policies.quantization import set_compile_epilogues


@pytest.fixture
def compiled_epilogues():
    set_compile_epilogues(True)
    yield
    set_compile_epilogues(False)


@pytest.fixture
def quiet():
    """Ignores UserWarnings (skipped modules, mode notes) for the test's duration."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
