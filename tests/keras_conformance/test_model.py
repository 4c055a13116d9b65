"""Origin: keras/src/models/model_test.py (Keras 3.15), its quantization
cases (`model.quantize(...)` is `dtype_policies.quantize(model, ...)`).

Keras's functional models are `Layer` subclasses or `layers.Sequential`
here, built by a first call; Keras's `model.variables` are the model's
parameters and buffers.
"""

import pytest
import torch

from dtype_policies import layers, quantize

from .helpers import deliberate, quantize_quietly, variables

MODES = pytest.mark.parametrize("mode", ["int8", "float8"], ids=["int8", "float8"])
QUANTIZED_STATE_IS_BUFFERS = deliberate("buffers")


class TwoInputs(layers.Layer):
    """Keras's `_get_model()`: `Dense(4)(Dense(5)(input_a + input_b))`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(5)
        self.dense_1 = layers.Dense(4)

    def call(self, inputs):
        input_a, input_b = inputs
        return self.dense_1(self.dense(input_a + input_b))


def _get_model():
    model = TwoInputs()
    model((torch.rand(2, 3), torch.rand(2, 3)))
    return model


class TestModelTest:
    @MODES
    def test_quantize(self, mode):
        model = _get_model()
        x1, x2 = torch.rand(2, 3), torch.rand(2, 3)
        quantize_quietly(model, mode)
        model((x1, x2))
        for layer in model.modules():
            if isinstance(layer, (layers.Dense, layers.EinsumDense)):
                assert layer.dtype_policy.name == f"{mode}_from_float32"
                assert layer.dtype_policy.quantization_mode == mode
        assert len(variables(model)) == {"int8": 6, "float8": 16}[mode]

    @QUANTIZED_STATE_IS_BUFFERS
    @MODES
    def test_quantize_torch_parameters(self, mode):
        """The torch half of Keras's test_quantize: every variable a parameter."""
        model = _get_model()
        quantize_quietly(model, mode)
        assert len(list(model.named_parameters())) == {"int8": 6, "float8": 16}[mode]

    @pytest.mark.parametrize(
        "filters, expected_quantized_layers",
        [
            ("dense_1", ["dense_1"]),
            (["dense_1", "output"], ["dense_1", "output"]),
            (lambda layer: "dense" in layer.name, ["dense_1", "dense_2"]),
        ],
        ids=["regex_string", "list_of_regex", "callable"],
    )
    def test_quantize_with_filters(self, filters, expected_quantized_layers):
        mode = "int8"
        model = layers.Sequential(
            [
                layers.Dense(32, name="dense_1"),
                layers.Dense(32, name="dense_2"),
                layers.Dense(32, name="output"),
            ]
        )
        model(torch.rand(2, 3))
        quantize(model, mode, filters=filters)
        for layer in model.modules():
            if getattr(layer, "name", None) in expected_quantized_layers:
                assert layer.dtype_policy.name == f"{mode}_from_float32"
            elif isinstance(layer, layers.Dense):
                assert layer.dtype_policy.name != f"{mode}_from_float32"

    @MODES
    def test_quantize_unbuilt(self, mode):
        class MyModel(layers.Layer):
            def __init__(self):
                super().__init__()
                self.dense1 = layers.Dense(32, activation="relu")
                self.dense2 = layers.Dense(5, activation="softmax")
                self.dropout = layers.Dropout(0.5)

            def call(self, inputs, training=False):
                x = self.dense1(inputs)
                x = self.dropout(x, training=training)
                return self.dense2(x)

        model = MyModel()
        with pytest.raises(ValueError, match="Cannot quantize a layer that isn't yet built."):
            quantize(model, mode)
        model(torch.rand(2, 3))
        quantize(model, mode)

    def test_quantize_invalid_args(self):
        model = _get_model()
        with pytest.raises(ValueError, match="Invalid quantization mode. Expected one of"):
            quantize(model, "abc")
        with pytest.raises(ValueError, match="Unrecognized keyword arguments"):
            quantize(model, "int8", unrecognized_kwargs=None)
        with pytest.raises(ValueError, match="Invalid quantization mode"):
            quantize(model, "int7")

    @MODES
    def test_quantize_nested_model(self, mode):
        class NestedLayer(layers.Layer):
            def __init__(self, units):
                super().__init__()
                self.dense = layers.Dense(units)

            def call(self, x):
                return self.dense(x)

        class DoubleNestedLayer(layers.Layer):
            def __init__(self, units):
                super().__init__()
                self.nested_dense1 = NestedLayer(units)
                self.nested_dense2 = NestedLayer(units)
                self.dense = layers.Dense(units)

            def call(self, x):
                return self.dense(self.nested_dense2(self.nested_dense1(x)))

        model = DoubleNestedLayer(8)
        model(torch.rand(2, 3))
        quantize_quietly(model, mode)
        if mode == "int8":
            kernels = [t for name, t in model.named_buffers() if name.endswith("kernel_int8")]
            assert len(kernels) == 3 and all(k.dtype == torch.int8 for k in kernels)
        if mode == "float8":
            assert len(variables(model)) == 3 * 8
