"""The Keras-mirror namespaces (`activations`, `initializers`, `regularizers`,
`constraints`, `quantizers`) compute as Keras 3 does and read Keras's
serialized forms (skipped without keras)."""

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras")

from dtype_policies import activations  # noqa: E402


def _random(shape, seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype("float32")


def _numpy(value):
    return (
        keras.ops.convert_to_numpy(value)
        if not isinstance(value, torch.Tensor)
        else (value.detach().cpu().numpy())
    )


def _close(ours, theirs, rtol=1e-6, atol=1e-7):
    np.testing.assert_allclose(_numpy(ours), _numpy(theirs), rtol=rtol, atol=atol)


# ----------------------------------------------------------------- activations

ACTIVATION_ARGUMENTS = {"threshold": {"threshold": 0.3, "default_value": -2.0}}
SERIALIZATION_FUNCTIONS = {"get", "serialize", "deserialize"}
KERAS_ACTIVATIONS = sorted(
    name
    for name in dir(keras.activations)
    if not name.startswith("_") and name not in SERIALIZATION_FUNCTIONS
)


@pytest.mark.parametrize("name", KERAS_ACTIVATIONS)
def test_every_keras_activation_computes_as_keras(name):
    x = _random((4, 6), seed=len(name))
    kwargs = ACTIVATION_ARGUMENTS.get(name, {})
    if name == "sparsemax":  # Keras agrees with the definition only on one-entry supports
        x[:, 0] += 10.0
    expected = getattr(keras.activations, name)(x, **kwargs)
    _close(getattr(activations, name)(torch.from_numpy(x), **kwargs), expected)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"negative_slope": 0.1},
        {"max_value": 6.0},
        {"max_value": 2.5},
        {"threshold": 0.5},
        {"negative_slope": 0.3, "max_value": 4.0},
        {"negative_slope": 0.3, "threshold": -0.5},
        {"negative_slope": 0.2, "max_value": 3.0, "threshold": 1.0},
    ],
)
def test_relu_takes_keras_arguments(kwargs):
    x = _random((5, 7), seed=1)
    _close(activations.relu(torch.from_numpy(x), **kwargs), keras.activations.relu(x, **kwargs))


@pytest.mark.parametrize("axis", [-1, 0, None, (0, 2), (1, 2)])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_axes_as_keras(name, axis):
    x = _random((2, 3, 4), seed=2, scale=1.0)
    expected = getattr(keras.ops, name)(x, axis=axis)
    _close(getattr(activations, name)(torch.from_numpy(x), axis=axis), expected)


def test_sparsemax_is_the_projection_onto_the_simplex():
    """Keras 3.15's sparsemax misses its threshold where more than one entry
    survives (`[0.5, 1, 0]` gives `[0, 0.25, 0]`); this one is the projection."""
    x = torch.from_numpy(_random((8, 5), seed=3, scale=0.5))
    p = activations.sparsemax(x)
    torch.testing.assert_close(p.sum(-1), torch.ones(8))
    assert (p >= 0).all() and ((p > 0).sum(-1) > 1).any()
    # the projection: p = max(x - tau, 0) with one tau per row, so the kept
    # entries differ from x by the same amount
    shift = torch.where(p > 0, x - p, torch.nan)
    spread = shift.nan_to_num(nan=-1e9).amax(-1) + shift.nan_to_num(nan=1e9).amin(-1).neg()
    assert spread.abs().max() < 1e-6
    torch.testing.assert_close(
        activations.sparsemax(torch.tensor([0.5, 1.0, 0.0])), torch.tensor([0.25, 0.75, 0.0])
    )


@pytest.mark.parametrize("name", sorted(activations.ACTIVATIONS))
def test_activation_serialization_round_trips_with_keras(name):
    function = activations.get(name)
    written = activations.serialize(function)
    assert written == keras.activations.serialize(keras.activations.get(name))
    assert activations.deserialize(written) is function
    assert activations.get(written) is function
    keras_dict = keras.saving.serialize_keras_object(keras.activations.get(name))
    assert activations.deserialize(keras_dict) is function
    assert activations.get(keras_dict) is function


def test_activation_deserialize_reads_custom_objects():
    def scaled(x):
        return 2 * x

    keras_dict = keras.saving.serialize_keras_object(scaled)
    assert activations.deserialize(keras_dict, custom_objects={"scaled": scaled}) is scaled
    assert activations.deserialize("scaled", custom_objects={"scaled": scaled}) is scaled
    with pytest.raises(ValueError, match="Unknown activation"):
        activations.deserialize("no_such_activation")


# ---------------------------------------------------------------- regularizers

REGULARIZER_CASES = [
    ("L1", {"l1": 0.3}),
    ("L2", {"l2": 0.2}),
    ("L1L2", {"l1": 0.1, "l2": 0.05}),
    ("L1L2", {"l1": None, "l2": 0.05}),
    ("OrthogonalRegularizer", {"factor": 0.5, "mode": "rows"}),
    ("OrthogonalRegularizer", {"factor": 0.25, "mode": "columns"}),
]


@pytest.mark.parametrize(("name", "kwargs"), REGULARIZER_CASES)
def test_regularizers_compute_as_keras_and_read_keras_dicts(name, kwargs):
    from dtype_policies import regularizers

    x = _random((6, 4), seed=4)
    theirs = getattr(keras.regularizers, name)(**kwargs)
    ours = getattr(regularizers, name)(**kwargs)
    _close(ours(torch.from_numpy(x)), theirs(keras.ops.convert_to_tensor(x)))
    keras_dict = keras.regularizers.serialize(theirs)
    for read in (regularizers.deserialize(keras_dict), regularizers.get(keras_dict)):
        assert type(read) is type(ours)
        assert read.get_config() == pytest.approx(ours.get_config())
    written = regularizers.serialize(ours)
    assert written.keys() == keras_dict.keys()
    assert written["module"] == keras_dict["module"] and written["class_name"] == name
    assert keras.regularizers.deserialize(written).get_config() == pytest.approx(
        theirs.get_config()
    )
    assert type(ours).from_config(ours.get_config()).get_config() == ours.get_config()


@pytest.mark.parametrize("name", ["l1", "l2", "l1_l2", "orthogonal_regularizer"])
def test_regularizer_lowercase_names_are_keras_classes(name):
    from dtype_policies import regularizers

    assert getattr(regularizers, name).__name__ == getattr(keras.regularizers, name).__name__
    assert regularizers.get(getattr(regularizers, name)).get_config() == pytest.approx(
        getattr(keras.regularizers, name)().get_config()
    )


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "0.1"])
def test_regularizer_factors_are_checked_as_keras_does(bad):
    from dtype_policies import regularizers

    with pytest.raises(ValueError, match="non-negative float"):
        regularizers.L2(bad)
    with pytest.raises(ValueError):
        keras.regularizers.L2(bad)


# ----------------------------------------------------------------- constraints

CONSTRAINT_CASES = [
    ("NonNeg", {}),
    ("MaxNorm", {}),
    ("MaxNorm", {"max_value": 1.5, "axis": 1}),
    ("UnitNorm", {"axis": 1}),
    ("MinMaxNorm", {"min_value": 0.5, "max_value": 2.0, "rate": 0.7, "axis": 0}),
]


@pytest.mark.parametrize(("name", "kwargs"), CONSTRAINT_CASES)
def test_constraints_compute_as_keras_and_read_keras_dicts(name, kwargs):
    from dtype_policies import constraints

    x = _random((6, 4), seed=5)
    theirs = getattr(keras.constraints, name)(**kwargs)
    ours = getattr(constraints, name)(**kwargs)
    _close(ours(torch.from_numpy(x)), theirs(keras.ops.convert_to_tensor(x)))
    keras_dict = keras.constraints.serialize(theirs)
    assert constraints.serialize(ours) == keras_dict
    for read in (constraints.deserialize(keras_dict), constraints.get(keras_dict)):
        assert type(read) is type(ours) and read.get_config() == ours.get_config()
    assert keras.constraints.deserialize(constraints.serialize(ours)).get_config() == (
        theirs.get_config()
    )
    assert type(ours).from_config(ours.get_config()).get_config() == ours.get_config()


@pytest.mark.parametrize("name", ["max_norm", "min_max_norm", "non_neg", "unit_norm"])
def test_constraint_lowercase_names_are_keras_classes(name):
    from dtype_policies import constraints

    assert getattr(constraints, name).__name__ == getattr(keras.constraints, name).__name__
    assert constraints.get(name).get_config() == keras.constraints.get(name).get_config()
    assert constraints.get(getattr(constraints, name)).get_config() == (
        getattr(keras.constraints, name)().get_config()
    )


# ---------------------------------------------------------------- initializers

INITIALIZER_CLASSES = [
    "Constant",
    "GlorotNormal",
    "GlorotUniform",
    "HeNormal",
    "HeUniform",
    "Identity",
    "LecunNormal",
    "LecunUniform",
    "Ones",
    "Orthogonal",
    "RandomNormal",
    "RandomUniform",
    "STFT",
    "TruncatedNormal",
    "VarianceScaling",
    "Zeros",
]


@pytest.mark.parametrize("name", INITIALIZER_CLASSES)
def test_initializer_serialization_round_trips_with_keras(name):
    from dtype_policies import initializers

    theirs, ours = getattr(keras.initializers, name)(), getattr(initializers, name)()
    keras_dict = keras.initializers.serialize(theirs)
    written = initializers.serialize(ours)
    if name == "Identity":  # Keras 3.15 writes no `gain` (so it is lost); here it is kept
        assert written["config"] == {"gain": 1.0}
        written = {**written, "config": {}}
    assert written == keras_dict
    for read in (initializers.deserialize(keras_dict), initializers.get(keras_dict)):
        assert type(read) is type(ours) and read.get_config() == ours.get_config()
    back = keras.initializers.deserialize(initializers.serialize(ours))
    assert type(back) is type(theirs)
    assert type(ours).from_config(ours.get_config()).get_config() == ours.get_config()


@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n in dir(keras.initializers)
        if not n.startswith("_") and n not in ("get", "serialize", "deserialize", "Initializer")
    ),
)
def test_initializer_names_are_keras_classes(name):
    from dtype_policies import initializers

    theirs = getattr(keras.initializers, name)
    assert getattr(initializers, name).__name__ == theirs.__name__
    expected = theirs().get_config()  # (Keras's own get("constant") fails)
    assert initializers.get(name).get_config() == (
        {"gain": 1.0} if theirs.__name__ == "Identity" else expected
    )


@pytest.mark.parametrize(("shape", "gain"), [((3, 3), 1.0), ((2, 5), 0.5), ((4, 2), 3.0)])
def test_identity_computes_as_keras(shape, gain):
    from dtype_policies import initializers

    expected = keras.initializers.Identity(gain)(shape)
    _close(initializers.Identity(gain)(shape), expected)
    assert initializers.Identity()((2, 2), torch.int64).dtype == torch.int64
    with pytest.raises(ValueError, match="2D"):
        initializers.Identity()((2, 2, 2))


WINDOWS = ["hann", "hamming", "blackman", "bartlett", "cosine", "nuttall", "boxcar", None]


@pytest.mark.parametrize("window", [*WINDOWS, [0.5, 1.0, 2.0, 1.0, 0.5, 0.25, 0.1, 1.5]])
@pytest.mark.parametrize("periodic", [False, True])
@pytest.mark.parametrize("scaling", ["density", "spectrum", None])
@pytest.mark.parametrize("side", ["real", "imag"])
def test_stft_computes_as_keras(window, periodic, scaling, side):
    from dtype_policies import initializers

    expected = keras.initializers.STFT(side, window, scaling, periodic)((8, 1, 5))
    ours = initializers.STFT(side, window, scaling, periodic)((8, 1, 5))
    _close(ours, expected, rtol=1e-6, atol=1e-6)


def test_stft_names_the_windows_it_computes():
    from dtype_policies import initializers

    with pytest.raises(ValueError, match="hann"):
        initializers.STFT(window="taylor")


# ------------------------------------------------------------------ quantizers


@pytest.mark.parametrize(("shape", "block_size"), [((16, 5), 4), ((13, 6), 4), ((3, 4), 8)])
@pytest.mark.parametrize("value_range", [(-8, 7), (-2, 1), (-128, 127)])
@pytest.mark.parametrize("to_numpy", [False, True])
def test_grouped_zero_point_quantization_as_keras(shape, block_size, value_range, to_numpy):
    from dtype_policies import quantizers

    x = _random(shape, seed=6, scale=1.0)
    x[:block_size, 0] = 0.5  # a group whose values are all equal
    theirs = keras.quantizers.abs_max_quantize_grouped_with_zero_point(
        x, block_size, value_range, to_numpy=to_numpy
    )
    ours = quantizers.abs_max_quantize_grouped_with_zero_point(
        torch.from_numpy(x), block_size, value_range, to_numpy=to_numpy
    )
    for mine, keras_value in zip(ours, theirs):
        assert str(mine.dtype).removeprefix("torch.") == str(_numpy(keras_value).dtype)
        _close(mine, keras_value)


@pytest.mark.parametrize("axis", [0, -1])
def test_abs_max_quantize_scales_and_integers_are_keras_bits(axis):
    """Keras divides `qmax` by the maxima; `qmax / tensor` in torch is the
    reciprocal times `qmax`: a quarter of the scales were 1 ulp off."""
    from dtype_policies import quantizers

    x = _random((256, 64), seed=9, scale=1.0)
    theirs = keras.quantizers.abs_max_quantize(x, axis=axis)
    ours = quantizers.abs_max_quantize(torch.from_numpy(x), axis=axis)
    assert np.array_equal(ours[1].numpy(), _numpy(theirs[1]))
    assert np.array_equal(ours[0].numpy(), _numpy(theirs[0]))


@pytest.mark.parametrize(("shape", "axis"), [((3, 2), 0), ((2, 3), 1), ((4, 5), -1), ((5,), 0)])
def test_pack_int4_returns_what_keras_returns(shape, axis):
    """Keras's `(packed, packed_shape, orig_rows)`: the mirror returned the
    packed tensor alone, which Keras-style unpacking bound row by row."""
    from dtype_policies import quantizers

    values = np.random.default_rng(3).integers(-8, 8, shape).astype(np.int8)
    theirs = keras.quantizers.pack_int4(values, axis=axis)
    ours = quantizers.pack_int4(torch.from_numpy(values), axis=axis)
    assert len(ours) == len(theirs) == 3
    assert np.array_equal(ours[0].numpy(), _numpy(theirs[0]))
    assert ours[1] == tuple(int(n) for n in theirs[1]) and ours[2] == int(theirs[2])
    unpacked = quantizers.unpack_int4(ours[0], ours[2], axis=axis)
    assert np.array_equal(unpacked.numpy(), values)


@pytest.mark.parametrize(
    ("axis", "num_bits", "narrow_range"), [(None, 8, False), (None, 4, True), (-1, 8, False)]
)
def test_fake_quant_values_and_gradients_as_keras(axis, num_bits, narrow_range):
    from dtype_policies import quantizers

    x = _random((6, 4), seed=7, scale=1.5)
    bounds = ([-1.0, -0.5, -2.0, 0.1], [1.0, 0.7, 2.0, 1.3]) if axis is not None else (-1.1, 0.9)

    def run(fake_quant, tensor):
        inputs = tensor(x)
        low, high = (tensor(np.asarray(b, dtype="float32")) for b in bounds)
        for t in (inputs, low, high):
            t.requires_grad_(True)
        out = fake_quant(inputs, low, high, num_bits, narrow_range, axis)
        (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
        return out, inputs.grad, low.grad, high.grad

    theirs = run(keras.quantizers.fake_quant_with_min_max_vars, keras.ops.convert_to_tensor)
    ours = run(quantizers.fake_quant_with_min_max_vars, torch.from_numpy)
    for mine, keras_value in zip(ours, theirs):
        _close(mine, keras_value)


@pytest.mark.parametrize("axis", [None, -1])
def test_fake_quant_forward_mode_gives_the_backwards_derivatives(axis):
    from dtype_policies import quantizers

    torch.manual_seed(3)
    x = torch.randn(6, 4) * 1.5
    low = torch.tensor([-1.0, -0.5, -2.0, 0.1]) if axis is not None else torch.tensor(-1.1)
    high = torch.tensor([1.0, 0.7, 2.0, 1.3]) if axis is not None else torch.tensor(0.9)

    def fake_quant(x, low, high):
        return quantizers.fake_quant_with_min_max_vars(x, low, high, 8, False, axis)

    forward = torch.func.jacfwd(fake_quant, argnums=(0, 1, 2))(x, low, high)
    reverse = torch.func.jacrev(fake_quant, argnums=(0, 1, 2))(x, low, high)
    for by_tangents, by_gradients in zip(forward, reverse):
        assert torch.equal(by_tangents, by_gradients)
    assert all(jacobian.abs().sum() > 0 for jacobian in forward)


def test_quantizer_base_class_is_keras():
    from dtype_policies import quantizers

    base = quantizers.Quantizer()
    assert base.output_dtype == keras.quantizers.Quantizer().output_dtype == "int8"
    x = torch.ones(2)
    assert base(x) is x
    assert isinstance(quantizers.AbsMaxQuantizer(), quantizers.Quantizer)
    with pytest.raises(NotImplementedError):
        base.get_config()
