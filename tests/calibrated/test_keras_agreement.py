"""GPTQ's and AWQ's integers agree exactly with Keras 3.15's own (run here,
`KERAS_BACKEND=torch`) on Dense layers given the same calibration data,
where Keras's algorithms are deterministic and free of its two bugs (a
negative zero point wrapped by a uint8 cast; scales recomputed per block for
groups wider than 128 columns). The one deliberate difference is the matrix
GPTQ's column loop is fed: the library feeds the upper Cholesky factor of the
inverse Hessian (the reference GPTQ), Keras the plain inverse;
`gptq_quantize(..., inverse="keras", grid="keras")` reproduces Keras."""

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":  # pragma: no cover
    pytest.skip("Keras must run on its torch backend here", allow_module_level=True)

from keras.src import quantizers as keras_quantizers  # noqa: E402
from keras.src.quantizers.awq import AWQ, awq_quantize_matrix  # noqa: E402
from keras.src.quantizers.awq_config import AWQConfig as KerasAWQConfig  # noqa: E402
from keras.src.quantizers.gptq import GPTQ  # noqa: E402
from keras.src.quantizers.gptq_config import GPTQConfig as KerasGPTQConfig  # noqa: E402

from dtype_policies import layers  # noqa: E402
from dtype_policies.quantization.schemes.calibrated_int import InputStatistics  # noqa: E402
from dtype_policies.quantizers import GPTQConfig, awq, gptq  # noqa: E402

CASES = [  # (in, out, bits, group, activation order, symmetric)
    (64, 48, 4, 16, False, False),
    (64, 48, 4, -1, False, False),
    (64, 48, 4, 8, True, False),
    (64, 48, 4, 16, False, True),
    (64, 48, 8, 8, False, True),
    (64, 48, 3, 16, False, False),
    (64, 48, 2, 16, False, False),
    (384, 64, 4, 64, False, False),  # three blocks of 128 columns
    (384, 64, 4, 128, True, False),
]


def array(variable) -> np.ndarray:
    value = getattr(variable, "value", variable)
    return np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value)


def calibration(k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    kernel = rng.standard_normal((k, 48 if k == 64 else 64)).astype("float32")
    rows = rng.standard_normal((256, k)).astype("float32") * rng.uniform(0.1, 3, k).astype(
        "float32"
    )
    return kernel, rows


def keras_gptq(kernel, rows, bits, group, act_order, symmetric):
    k, n = kernel.shape
    layer = keras.layers.Dense(n, use_bias=False)
    layer.build((None, k))
    layer.set_weights([kernel])
    config = KerasGPTQConfig(
        dataset=None,
        tokenizer=None,
        weight_bits=bits,
        group_size=group,
        activation_order=act_order,
        symmetric=symmetric,
    )
    layer.quantize("gptq", config=config)
    quantizer = GPTQ(layer, config)
    quantizer.update_hessian_with_batch(rows)
    hessian = torch.as_tensor(array(quantizer.hessian))
    quantizer.quantize_and_correct_layer()
    levels = layer.quantized_kernel
    if bits == 4:
        levels = keras_quantizers.unpack_int4(levels, orig_len=n, axis=0, dtype="uint8")
    return hessian, array(levels), array(layer.kernel_scale), array(layer.kernel_zero), layer


@pytest.mark.parametrize("k, n, bits, group, act_order, symmetric", CASES)
def test_gptq_fed_keras_matrix_gives_keras_integers(k, n, bits, group, act_order, symmetric):
    kernel, rows = calibration(k, seed=k + bits + group + 1)
    hessian, levels, scale, zero, layer = keras_gptq(
        kernel, rows, bits, group, act_order, symmetric
    )
    q, our_scale, our_zero, g_idx = gptq.gptq_quantize(
        torch.from_numpy(kernel.T.copy()),
        hessian,
        bits=bits,
        group_size=group,
        activation_order=act_order,
        symmetric=symmetric,
        inverse="keras",
        grid="keras",
    )
    assert (our_zero >= 0).all()  # no group for Keras's uint8 cast to wrap (seeds chosen so)
    assert np.array_equal(q.numpy(), levels.astype(np.int64))
    assert np.array_equal(our_scale.numpy(), scale)
    assert np.array_equal(our_zero.numpy(), zero.astype(np.float32))
    # Keras stores g_idx as k / group (read back through an int cast): the same groups
    assert np.array_equal(g_idx.numpy(), np.floor(array(layer.g_idx)).astype(np.int64))
    # and the same rows give the same Hessian (Keras's running mean, ours a sum)
    statistics = InputStatistics(k)
    statistics.update(torch.from_numpy(rows))
    assert torch.allclose(statistics.hessian, hessian, rtol=1e-5, atol=1e-5)


def test_the_library_feeds_the_cholesky_factor_and_keras_the_plain_inverse():
    """Same data: Keras's integers differ from the library's (which are
    the reference GPTQ's); the library's layer output error is lower."""
    kernel, rows = calibration(384, seed=3)
    correlated = rows @ np.random.default_rng(4).standard_normal((384, 384)).astype("float32")
    correlated /= np.sqrt(384)
    hessian, levels, scale, zero, _ = keras_gptq(kernel, correlated, 4, 64, False, False)
    w = torch.from_numpy(kernel.T.copy())
    ours = gptq.gptq_quantize(w, hessian, bits=4, group_size=64)
    keras_weight = gptq.dequantize_with_sz_map(
        torch.from_numpy(levels.astype(np.int64)),
        torch.from_numpy(scale),
        torch.from_numpy(zero.astype(np.float32)),
        torch.arange(384) // 64,
    )
    x = torch.from_numpy(correlated)

    def output_error(weight):
        return float(((x @ (w - weight).T) ** 2).mean())

    assert not np.array_equal(ours[0].numpy(), levels)
    assert output_error(gptq.dequantize_with_sz_map(*ours)) < 0.8 * output_error(keras_weight)


def test_keras_uint8_zero_point_wraps_ours_does_not():
    """A group whose values are all positive: Keras's zero point round(-min /
    scale) is negative and its uint8 cast wraps it (its levels saturate);
    ours keeps the real value and reconstructs the group."""
    w = torch.tensor([[0.5, 0.6, 0.9, 1.3], [-1.0, 0.2, 0.4, 0.8]])
    scale, zero, maxq = gptq.compute_quantization_parameters(w, bits=4, per_channel=True)
    keras_scale, keras_zero, _ = keras_quantizers.compute_quantization_parameters(
        w, bits=4, per_channel=True
    )
    assert np.allclose(array(keras_scale), scale.numpy())
    assert zero[0, 0] < 0 and array(keras_zero)[0, 0] > maxq  # wrapped
    levels = gptq.quantize_with_zero_point(w, scale, zero, maxq)
    restored = gptq.dequantize_with_zero_point(levels, scale, zero)
    assert torch.allclose(restored, w, atol=float(scale.max()) / 2 + 1e-6)


@pytest.mark.parametrize("group", [-1, 8, 16])
def test_awq_weight_objective_gives_keras_integers(group):
    rng = np.random.default_rng(group + 2)
    kernel = rng.standard_normal((32, 24)).astype("float32")
    rows = rng.standard_normal((128, 32)).astype("float32") * rng.uniform(0.1, 4, 32).astype(
        "float32"
    )
    layer = keras.layers.Dense(24, use_bias=False)
    layer.build((None, 32))
    layer.set_weights([kernel])
    config = KerasAWQConfig(dataset=None, tokenizer=None, group_size=group, num_grid_points=10)
    layer.quantize("awq", config=config)
    quantizer = AWQ(layer, config)
    quantizer.update_activation_magnitudes(rows)
    magnitudes = torch.as_tensor(array(quantizer.activation_magnitudes))
    expected = awq_quantize_matrix(
        kernel.T.copy(), magnitudes, num_grid_points=10, group_size=group
    )
    q, scale, zero, awq_scales, _ = awq.awq_quantize_matrix(
        torch.from_numpy(kernel.T.copy()), magnitudes, num_grid_points=10, group_size=group
    )
    assert np.array_equal(q.numpy(), array(expected[0]))
    assert np.array_equal(scale.numpy(), array(expected[1]))
    assert np.array_equal(zero.numpy(), array(expected[2]).astype(np.float32))
    assert np.array_equal(awq_scales.numpy(), array(expected[3]))
    statistics = InputStatistics(32, gram=False, max_abs=True)
    statistics.update(torch.from_numpy(rows))
    assert torch.equal(statistics.abs_max, magnitudes)


def test_a_keras_calibrated_dense_and_ours_compute_the_same():
    """Keras's results stored in our convention (signed levels, real zero
    points, g_idx) stand for Keras's weight, and our Dense computes with it."""
    kernel, rows = calibration(64, seed=9)
    hessian, *_, keras_layer = keras_gptq(kernel, rows, 4, 16, True, False)
    ours = layers.Dense(48, use_bias=False)
    ours.build((None, 64))
    with torch.no_grad():
        ours.kernel.copy_(torch.from_numpy(kernel))
    config = GPTQConfig(None, None, group_size=16, activation_order=True)
    with pytest.warns(UserWarning, match="without calibration data"):
        ours.quantize("gptq", config=config)  # data-free storage, overwritten below
    quantized = ours._quantized
    q, s, z, g = gptq.gptq_quantize(
        torch.from_numpy(kernel.T.copy()),
        hessian,
        group_size=16,
        activation_order=True,
        inverse="keras",
        grid="keras",
    )
    for name, tensor in quantized.scheme.stored_tensors(quantized.spec, config, q, s, z, g).items():
        ours._buffers[name] = tensor
    keras_weight = keras_quantizers.dequantize_with_sz_map(
        keras_quantizers.unpack_int4(
            keras_layer.quantized_kernel, orig_len=48, axis=0, dtype="uint8"
        ),
        keras_layer.kernel_scale,
        keras_layer.kernel_zero,
        keras_layer.g_idx,
    )
    assert torch.allclose(quantized.dequantized(ours), torch.as_tensor(array(keras_weight)).T)
    x = torch.from_numpy(rows[:8])
    expected = torch.as_tensor(array(keras_layer(x)))
    with torch.no_grad():
        assert torch.allclose(ours(x), expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))
