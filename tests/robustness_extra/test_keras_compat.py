"""Contract (Keras compatibility): error wording, custom quantizers honoured,
`AbsMaxQuantizer(axis=...)`, `Int4QuantizationConfig(block_size=None)`, and
`layer.kernel` of quantized layers giving integer values."""

import pytest
import torch
from robust_helpers import unpack_int4

import dtype_policies
from dtype_policies import layers
from dtype_policies.quantization import (
    AbsMaxQuantizer,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
)


@pytest.mark.parametrize("mode", ["int7", "float7", "float16"])
def test_float8_policy_with_an_invalid_mode(mode):
    with pytest.raises(ValueError, match=r"^Invalid quantization mode"):
        dtype_policies.QuantizedFloat8DTypePolicy(mode=mode)


@pytest.mark.parametrize("mode", ["int7", "float7"])
def test_quantized_policy_with_an_invalid_mode(mode):
    with pytest.raises(ValueError, match=r"^Invalid quantization mode"):
        dtype_policies.QuantizedDTypePolicy(mode=mode)


def _int8_values(layer):
    """The int8 tensor a quantized layer stores (found by dtype, whatever its name)."""
    found = [v for v in layer.state_dict().values() if v.dtype == torch.int8]
    assert len(found) == 1, list(layer.state_dict())
    return found[0]


@pytest.mark.parametrize("how", ["quantize", "policy"])
def test_embedding_int8_honours_a_custom_weight_quantizer(how):
    torch.manual_seed(0)
    config = Int8QuantizationConfig(weight_quantizer=AbsMaxQuantizer(value_range=(-63, 63)))
    if how == "quantize":
        layer = layers.Embedding(20, 16)
        layer.build()
        reference = layer.embeddings.detach().clone()
        layer.quantize("int8", config)
    else:
        layer = layers.Embedding(20, 16, dtype="int8_from_float32", quantization_config=config)
        layer.build()
        reference = None
    values = _int8_values(layer)
    assert values.min() >= -63 and values.max() <= 63
    assert values.abs().amax(dim=1).eq(63).all()  # every row uses the custom range
    if reference is not None:
        out = layer(torch.arange(20))
        error = (out - reference).norm() / reference.norm()
        assert error < 0.03


def test_dense_int8_honours_a_custom_weight_quantizer():
    torch.manual_seed(0)
    layer = layers.Dense(16)
    layer.build((None, 32))
    layer.quantize(
        "int8", Int8QuantizationConfig(weight_quantizer=AbsMaxQuantizer(value_range=(-63, 63)))
    )
    values = _int8_values(layer)
    assert values.min() >= -63 and values.max() <= 63
    assert values.abs().amax(dim=0).eq(63).all()  # per output channel


@pytest.mark.parametrize("axis", [-1, 0, (0,), (0, 1)])
def test_abs_max_quantizer_axis(axis):
    quantizer = AbsMaxQuantizer(axis=axis)
    expected = axis if isinstance(axis, tuple) else (axis,)
    got = quantizer.axis if isinstance(quantizer.axis, tuple) else (quantizer.axis,)
    assert got == expected  # Keras keeps a tuple


def test_abs_max_quantizer_without_axis():
    assert AbsMaxQuantizer().axis is None


def test_abs_max_quantizer_is_callable():
    torch.manual_seed(0)
    x = torch.randn(6, 10) * 3
    quantizer = AbsMaxQuantizer()
    q, scale = quantizer(x)  # axis -1 by default (Keras)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.shape == (6, 1)
    assert q.abs().amax(dim=-1).eq(127).all()
    torch.testing.assert_close(q.float() / scale, x, atol=x.abs().max().item() / 127, rtol=0)

    q0, scale0 = quantizer(x, axis=0)
    assert scale0.shape == (1, 10)
    assert q0.abs().amax(dim=0).eq(127).all()

    q_axis, _ = AbsMaxQuantizer(axis=0)(x)  # the constructor's axis
    assert torch.equal(q_axis, q0)

    q_explicit, _ = AbsMaxQuantizer(axis=0)(x, axis=-1)  # the call's axis wins
    assert torch.equal(q_explicit, q)


def test_abs_max_quantizer_custom_range_when_called():
    x = torch.linspace(-2, 2, 9)[None, :]
    q, _scale = AbsMaxQuantizer(value_range=(-8, 7))(x, axis=-1)
    assert q.min() >= -8 and q.max() <= 7


def test_abs_max_quantizer_config_round_trip_with_axis():
    quantizer = AbsMaxQuantizer(axis=-1, value_range=(-63, 63))
    again = AbsMaxQuantizer.from_config(quantizer.get_config())
    assert again.value_range == (-63, 63)
    assert again.axis in (-1, (-1,))


def test_int4_config_block_size_none_is_kept():
    config = Int4QuantizationConfig(block_size=None)
    assert config.block_size is None
    assert Int4QuantizationConfig.from_config(config.get_config()).block_size is None


def test_int4_config_block_size_none_quantizes_per_channel():
    torch.manual_seed(0)
    layer = layers.Dense(16)
    layer.build((None, 64))
    layer.quantize("int4", Int4QuantizationConfig(block_size=None))
    scales = [k for k in layer.state_dict() if k.endswith("scale")]
    assert len(scales) == 1 and layer.state_dict()[scales[0]].shape == (16,)
    assert not [k for k in layer.state_dict() if k.endswith("zero")]


@pytest.mark.parametrize("block_size", [128, 16, -1])
@pytest.mark.parametrize("units", [16, 7])
def test_int4_dense_kernel_gives_unpacked_values(block_size, units):
    torch.manual_seed(0)
    layer = layers.Dense(units)
    layer.build((None, 32))
    float_shape = tuple(layer.kernel.shape)
    layer.quantize("int4", Int4QuantizationConfig(block_size=block_size))
    kernel = layer.kernel
    assert kernel.dtype == torch.int8
    assert tuple(kernel.shape) == float_shape
    assert kernel.min() >= -8 and kernel.max() <= 7
    # The same values as the packed storage holds (packed along units, Keras's layout).
    packed = [v for k, v in layer.state_dict().items() if v.dtype == torch.int8]
    assert len(packed) == 1  # the data (zero points are float32)
    data = packed[0]
    assert torch.equal(unpack_int4(data, units, axis=1), kernel)


def test_int8_dense_kernel_gives_int8_values():
    torch.manual_seed(0)
    layer = layers.Dense(16)
    layer.build((None, 32))
    layer.quantize("int8")
    kernel = layer.kernel
    assert kernel.dtype == torch.int8 and tuple(kernel.shape) == (32, 16)
    assert kernel.abs().amax(dim=0).eq(127).all()


def test_int8_einsum_kernel_gives_int8_values():
    torch.manual_seed(0)
    layer = layers.EinsumDense("abc,cde->abde", output_shape=(None, 2, 8), bias_axes="de")
    layer.build((None, 5, 16))
    layer.quantize("int8")
    kernel = layer.kernel
    assert kernel.dtype == torch.int8 and kernel.numel() == 16 * 2 * 8
