"""Origin: keras/src/quantizers/utils_test.py (Keras 3.15):
`should_quantize_layer(layer, filters)` is `quantize()`'s `filters`
argument here, matched against each layer's path and name."""

import pytest
import torch

from dtype_policies import layers

from .helpers import quantize_quietly


class TestUtilsTest:
    @pytest.mark.parametrize(
        "filters, layer_name, expected",
        [
            (None, "dense", True),
            ("dense", "dense_1", True),
            ("conv", "dense_1", False),
            (["dense", "conv"], "dense_1", True),
            (["conv", "pool"], "dense_1", False),
            (lambda layer: "dense" in layer.name, "dense_1", True),
            (lambda layer: "conv" in layer.name, "dense_1", False),
        ],
        ids=[
            "none_filter",
            "regex_match",
            "regex_no_match",
            "list_match",
            "list_no_match",
            "callable_match",
            "callable_no_match",
        ],
    )
    def test_should_quantize_layer(self, filters, layer_name, expected):
        layer = layers.Dense(2, name=layer_name)
        model = layers.Sequential([layer])
        model(torch.ones(1, 2))
        report = quantize_quietly(model, "int8", filters=filters)
        assert layer.is_quantized == expected, report.render()


def test_deliberate_differences_quote_the_readme():
    """Not in Keras: each strict expected failure's reason is in the README."""
    from pathlib import Path

    from .helpers import DELIBERATE

    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    for text in DELIBERATE.values():
        assert " ".join(text.split()) in readme
