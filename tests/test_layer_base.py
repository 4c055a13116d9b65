"""The Layer base class: input casting, variable autocasting, build, weights, config."""

import warnings

import numpy as np
import pytest
import torch

import dtype_policies
from dtype_policies import CPUFloat16Warning, DTypePolicy, DTypePolicyMap, layers, mixed_precision
from dtype_policies.layers import Dense, Layer


class SimpleDense(Layer):
    """The seed's tf.keras example, written against this library."""

    def build(self, input_shape):
        self.kernel = self.add_weight("kernel", (input_shape[-1], 10))

    def call(self, inputs):
        return torch.matmul(inputs, self.kernel)


class AddRandom(Layer):
    def call(self, inputs):
        rand = torch.randn(inputs.shape, dtype=inputs.dtype)
        return inputs + rand


class TwoInputs(Layer):
    def call(self, a, b):
        return a + 1.0, b + 1.0


class Recorder(Layer):
    """Records the dtype of its weight as read inside call."""

    def __init__(self, weight_autocast=True, **kwargs):
        super().__init__(**kwargs)
        self.weight_autocast = weight_autocast
        self.seen = None

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="ones", autocast=self.weight_autocast)

    def call(self, inputs):
        self.seen = self.w.dtype
        return inputs


class Parent(Layer):
    def __init__(self, child, **kwargs):
        super().__init__(**kwargs)
        self.child = child
        self.seen = None

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="ones")

    def call(self, inputs):
        self.seen = self.w.dtype
        return self.child(inputs)


# ---------------------------------------------------------------- seed behaviour


@pytest.mark.parametrize(
    ("policy", "dtype"), [("mixed_float16", torch.float16), ("mixed_bfloat16", torch.bfloat16)]
)
def test_seed_global_policy_and_override(policy, dtype):
    dtype_policies.set_dtype_policy(policy)
    layer1 = Dense(10)
    assert repr(layer1.dtype_policy) == f'<DTypePolicy "{policy}">'
    layer2 = Dense(10, dtype="float32")
    assert repr(layer2.dtype_policy) == '<DTypePolicy "float32">'
    x = torch.ones(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)
        y1 = layer1(x)
    y2 = layer2(x)
    assert layer1.kernel.dtype == torch.float32 and layer1.bias.dtype == torch.float32
    assert y1.dtype == dtype
    assert y2.dtype == torch.float32
    assert (layer1.compute_dtype, layer1.variable_dtype) == (str(dtype)[6:], "float32")
    assert layer1.dtype == "float32"


def test_seed_float64_input_to_float32_layer_comes_out_float32():
    x = torch.ones((4, 4, 4, 4), dtype=torch.float64)
    layer = Dense(4)
    assert layer.compute_dtype == "float32"
    assert layer(x).dtype == torch.float32


def test_all_float_inputs_are_cast_not_only_the_first():
    a = torch.tensor(1.0, dtype=torch.float32)
    b = torch.tensor(1.0, dtype=torch.float32)
    x, y = TwoInputs(dtype="float64")(a, b)
    assert x.dtype == torch.float64 and y.dtype == torch.float64
    x, y = TwoInputs(dtype="float64")(a, b=b)
    assert y.dtype == torch.float64


def test_seed_simple_dense_autocasts_its_kernel():
    layer = SimpleDense(dtype=mixed_precision.Policy("mixed_float16"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)
        y = layer(torch.ones(10, 10))
    assert y.dtype == torch.float16
    assert layer.kernel.dtype == torch.float32
    assert mixed_precision.get_layer_policy(layer).name == "mixed_float16"


def test_seed_add_random_with_inputs_dtype():
    layer = AddRandom(dtype="mixed_bfloat16")
    y = layer(torch.ones(4, 4, dtype=torch.float64))
    assert y.dtype == torch.bfloat16


def test_nested_structures_are_cast_and_non_floats_untouched():
    seen = {}

    class Probe(Layer):
        def call(self, inputs, extra=None, flag=True, scale=2.0):
            seen["inputs"] = inputs
            seen["extra"] = extra
            seen["flag"], seen["scale"] = flag, scale
            return inputs["a"]

    ids = torch.tensor([1, 2])
    mask = torch.tensor([True, False])
    complex_x = torch.ones(2, dtype=torch.complex64)
    Probe(dtype="bfloat16")(
        {"a": torch.ones(2), "b": [torch.ones(2, dtype=torch.float64), ids], "c": (mask, None)},
        extra=[complex_x, np.ones(3, dtype=np.float64), np.array([1, 2])],
        flag=False,
        scale=3.0,
    )
    assert seen["inputs"]["a"].dtype == torch.bfloat16
    assert seen["inputs"]["b"][0].dtype == torch.bfloat16
    assert seen["inputs"]["b"][1] is ids
    assert seen["inputs"]["c"][0] is mask and seen["inputs"]["c"][1] is None
    assert seen["extra"][0] is complex_x
    assert seen["extra"][1].dtype == torch.bfloat16
    assert seen["extra"][2].dtype == torch.int64
    assert seen["flag"] is False and seen["scale"] == 3.0


def test_numpy_inputs_become_tensors_even_without_autocast():
    class Identity(Layer):
        def call(self, inputs):
            return inputs

    assert Identity(dtype="mixed_bfloat16")(np.ones(3, dtype=np.float64)).dtype == torch.bfloat16
    out = Identity(dtype="mixed_bfloat16", autocast=False)(np.ones(3, dtype=np.float64))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    assert Identity(dtype="mixed_bfloat16")(np.array([1, 2], np.int32)).dtype == torch.int32


def test_fast_path_returns_same_tensor_when_dtype_matches():
    class Identity(Layer):
        def call(self, inputs):
            return inputs

    x = torch.ones(2, dtype=torch.bfloat16)
    assert Identity(dtype="mixed_bfloat16")(x) is x
    ints = torch.ones(2, dtype=torch.int64)
    assert Identity(dtype="mixed_bfloat16")(ints) is ints


# ---------------------------------------------------------------- variable autocasting


def test_weight_is_parameter_outside_call_and_cast_inside():
    layer = Recorder(dtype="mixed_bfloat16")
    layer(torch.ones(2))
    assert layer.seen == torch.bfloat16
    assert isinstance(layer.w, torch.nn.Parameter) and layer.w.dtype == torch.float32


def test_weight_with_autocast_false_stays_float32():
    layer = Recorder(weight_autocast=False, dtype="mixed_bfloat16")
    layer(torch.ones(2))
    assert layer.seen == torch.float32


def test_keras_nested_scope_rules():
    # Inside a mixed_float16 parent, a float32 child reads float32; a mixed
    # child with an autocast=False weight reads float32; the parent reads float16.
    child = Recorder(dtype="float32")
    parent = Parent(child, dtype="mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)
        parent(torch.ones(2))
    assert parent.seen == torch.float16
    assert child.seen == torch.float32

    child = Recorder(weight_autocast=False, dtype="mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)
        Parent(child, dtype="mixed_float16")(torch.ones(2))
    assert child.seen == torch.float32

    child = Recorder(dtype="mixed_bfloat16")
    parent = Parent(child, dtype="mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)
        parent(torch.ones(2))
    assert child.seen == torch.bfloat16


def test_non_float_child_disables_autocast():
    class IntChild(Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(), initializer="ones", dtype="float32")

        def call(self, inputs):
            self.seen = self.w.dtype
            return inputs

    child = IntChild(dtype="int32")
    Parent(child, dtype="mixed_bfloat16")(torch.ones(2))
    assert child.seen == torch.float32


def test_int_weights_are_never_cast():
    class WithCounter(Layer):
        def build(self, input_shape):
            self.count = self.add_weight(shape=(), dtype="int32")

        def call(self, inputs):
            self.seen = self.count.dtype
            return inputs

    layer = WithCounter(dtype="mixed_bfloat16")
    layer(torch.ones(2))
    assert layer.seen == torch.int32
    assert not layer.count.requires_grad


def test_weight_cast_once_per_call_and_gradient_reaches_parameter():
    class ReadsTwice(Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(512, 512), initializer="ones")

        def call(self, inputs):
            self.same = self.w is self.w
            return inputs @ self.w + inputs @ self.w

    layer = ReadsTwice(dtype="mixed_bfloat16")
    y = layer(torch.ones(1, 512))
    assert layer.same
    y.float().sum().backward()
    assert layer.w.grad.dtype == torch.float32
    torch.testing.assert_close(layer.w.grad, torch.full((512, 512), 2.0))


def test_small_weight_cast_reused_until_parameter_changes():
    layer = Dense(4, dtype="mixed_bfloat16")
    x = torch.ones(1, 4)
    first = layer(x)
    with torch.no_grad():
        layer.kernel.add_(1.0)
    second = layer(x)
    assert not torch.equal(first, second)
    torch.testing.assert_close(second.float(), (x @ layer.kernel + layer.bias), atol=0.1, rtol=0.02)
    layer.load_state_dict({k: torch.zeros_like(v) for k, v in layer.state_dict().items()})
    assert torch.count_nonzero(layer(x)) == 0


def test_small_weight_cast_cache_respects_grad_mode():
    layer = Dense(4, dtype="mixed_bfloat16")
    x = torch.ones(2, 4)
    with torch.no_grad():
        layer(x)
    layer(x).float().sum().backward()
    assert layer.kernel.grad is not None and layer.kernel.grad.dtype == torch.float32
    layer.zero_grad()
    layer(x).float().sum().backward()
    assert torch.count_nonzero(layer.kernel.grad) > 0


def test_mixed_bfloat16_custom_layer_trains_with_float32_grads():
    class MyDense(Layer):
        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.units = units

        def build(self, input_shape):
            self.kernel = self.add_weight(
                shape=(input_shape[-1], self.units), initializer="he_normal"
            )
            self.bias = self.add_weight(shape=(self.units,), initializer="zeros")

        def call(self, inputs):
            return torch.relu(inputs @ self.kernel + self.bias)

    dtype_policies.set_dtype_policy("mixed_bfloat16")
    model = layers.Sequential([MyDense(32), layers.Dense(1)])
    x = torch.randn(64, 8)
    target = x.sum(dim=1, keepdim=True)
    model(x)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), target)
        loss.backward()
        for parameter in model.parameters():
            assert parameter.dtype == torch.float32
            assert parameter.grad.dtype == torch.float32
        optimizer.step()
        losses.append(loss.item())
    assert model(x).dtype == torch.bfloat16
    assert losses[-1] < 0.1 * losses[0]


# ---------------------------------------------------------------- policy handling


def test_dtype_argument_forms():
    assert Dense(2, dtype=torch.bfloat16).dtype_policy == DTypePolicy("bfloat16")
    assert Dense(2, dtype=DTypePolicy("float64")).compute_dtype == "float64"
    config = dtype_policies.serialize(DTypePolicy("mixed_bfloat16"))
    assert Dense(2, dtype=config).dtype_policy.name == "mixed_bfloat16"
    with pytest.raises(ValueError, match="Cannot convert"):
        Dense(2, dtype="mixed_float15")


def test_scoped_default_policy_applies_at_construction():
    with dtype_policies.policy_scope("mixed_bfloat16"):
        inside = Dense(2)
    outside = Dense(2)
    assert inside.dtype_policy.name == "mixed_bfloat16"
    assert outside.dtype_policy.name == "float32"


def test_dtype_policy_setter():
    layer = Dense(2)
    layer.dtype_policy = "mixed_bfloat16"
    assert layer.compute_dtype == "bfloat16"
    assert layer(torch.ones(1, 3)).dtype == torch.bfloat16
    assert layer.kernel.dtype == torch.float32
    layer.dtype_policy = DTypePolicy("float32")
    assert layer(torch.ones(1, 3)).dtype == torch.float32


def test_policy_map_resolved_by_path_and_setter_replaces_entry():
    policy_map = DTypePolicyMap("float32", {"outer/inner": "mixed_bfloat16"})

    class Outer(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = Dense(3, dtype=self.dtype_policy, name="inner_dense")
            self.other = Dense(3, dtype=self.dtype_policy)

        def call(self, inputs):
            return self.inner(inputs), self.other(inputs)

    outer = Outer(dtype=policy_map, name="outer")
    assert outer.compute_dtype == "float32"  # the map's default before build
    a, b = outer(torch.ones(1, 2))
    assert outer.inner.path == "outer/inner" and outer.other.path == "outer/other"
    assert a.dtype == torch.bfloat16 and b.dtype == torch.float32
    assert outer.inner.compute_dtype == "bfloat16"
    outer.inner.dtype_policy = "float64"
    assert policy_map["outer/inner"].name == "float64"
    assert outer.inner(torch.ones(1, 2)).dtype == torch.float64
    policy_map["outer/other"] = "bfloat16"  # a map mutation is seen on the next call
    assert outer.other(torch.ones(1, 2)).dtype == torch.bfloat16


def test_quantized_policy_on_unquantizable_layer_computes_with_source():
    dtype_policies.set_dtype_policy("int8_from_mixed_bfloat16")
    layer = AddRandom()
    assert layer.quantization_mode is None
    assert layer(torch.ones(2)).dtype == torch.bfloat16


def test_cpu_float16_warns_once(monkeypatch):
    from dtype_policies._core import cpu_float16

    monkeypatch.setattr(cpu_float16, "_warned", False)
    layer = Dense(2, dtype="mixed_float16")
    with pytest.warns(CPUFloat16Warning, match="bfloat16"):
        layer(torch.ones(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CPUFloat16Warning)
        layer(torch.ones(1, 2))
        Dense(2, dtype="float16")(torch.ones(1, 2))


# ---------------------------------------------------------------- build and weights


def test_lazy_and_explicit_build():
    layer = Dense(5)
    assert not layer.built and layer.path is None
    layer.build((None, 3))
    assert layer.built and tuple(layer.kernel.shape) == (3, 5)
    assert layer.path == layer.name
    assert tuple(layer(torch.ones(2, 3)).shape) == (2, 5)
    kernel = layer.kernel
    layer.build((None, 7))  # building twice does nothing
    assert layer.kernel is kernel


def test_build_with_subclass_super_call_runs_hooks_once():
    calls = []

    class Base(Layer):
        def build(self, input_shape):
            self.a = self.add_weight(shape=(2,))

        def _after_build(self):
            calls.append("after")

    class Child(Base):
        def build(self, input_shape):
            super().build(input_shape)
            self.b = self.add_weight(shape=(3,))

        def call(self, inputs):
            return inputs

    layer = Child()
    layer(torch.ones(1))
    assert calls == ["after"]
    assert sorted(name for name, _ in layer.named_parameters()) == ["a", "b"]


def test_add_weight_signatures_and_errors():
    layer = Layer()
    w = layer.add_weight(shape=(2, 3), initializer="zeros", name="w")
    assert isinstance(w, torch.nn.Parameter) and torch.count_nonzero(w) == 0
    legacy = layer.add_weight("legacy", (4,), "float64", "ones")
    assert legacy.dtype == torch.float64 and torch.all(legacy == 1)
    keras3 = layer.add_weight((2,), "ones", "bfloat16")
    assert keras3.dtype == torch.bfloat16
    scalar = layer.add_weight()
    assert scalar.shape == ()
    with pytest.raises(TypeError, match="at most 3 positional arguments"):
        layer.add_weight((2,), "ones", "float32", 4)
    with pytest.raises(ValueError, match="multiple values for argument 'shape'"):
        layer.add_weight((2,), shape=(2,))
    with pytest.raises(ValueError, match="already has a weight"):
        layer.add_weight(shape=(1,), name="w")
    with pytest.raises(ValueError, match="fully defined shape"):
        layer.add_weight(shape=(None, 2))
    with pytest.raises(ValueError, match="Unknown initializer"):
        layer.add_weight(shape=(2,), initializer="nope")
    with pytest.raises(ValueError, match="cannot initialize"):
        layer.add_weight(shape=(2,), dtype="int32", initializer="glorot_uniform")
    with pytest.raises(TypeError, match="unexpected keyword"):
        layer.add_weight(shape=(2,), foo=1)
    assert layer.add_weight(shape=(2,), dtype="int32").dtype == torch.int32


def test_assigned_weight_is_registered_under_attribute_name():
    class Named(Layer):
        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(2,), name="w", regularizer="l2")

        def call(self, inputs):
            return inputs * self.kernel

    layer = Named(dtype="mixed_bfloat16")
    assert layer(torch.ones(2)).dtype == torch.bfloat16
    assert list(layer.state_dict()) == ["kernel"]
    assert len(layer.losses) == 1


def test_weight_variable_dtype_and_initializers():
    layer = Layer(dtype="mixed_bfloat16")
    w = layer.add_weight(shape=(200, 100), initializer="glorot_uniform")
    assert w.dtype == torch.float32
    limit = (6 / 300) ** 0.5
    assert w.abs().max() <= limit and w.abs().max() > 0.9 * limit
    he = layer.add_weight(shape=(1000, 50), initializer="he_normal")
    assert abs(he.std().item() - (2 / 1000) ** 0.5) < 0.01
    custom = layer.add_weight(shape=(3,), initializer=lambda shape, dtype: torch.full(shape, 7.0))
    assert torch.all(custom == 7)
    const = layer.add_weight(shape=(3,), initializer=0.5)
    assert torch.all(const == 0.5)


def test_regularizer_losses_in_variable_dtype():
    dtype_policies.set_dtype_policy("mixed_bfloat16")
    layer = Dense(
        3,
        kernel_regularizer="l2",
        bias_regularizer="l1",
        kernel_initializer="ones",
        bias_initializer="ones",
    )
    layer(torch.ones(1, 2))
    losses = layer.losses
    assert [loss.dtype for loss in losses] == [torch.float32, torch.float32]
    torch.testing.assert_close(losses[0], torch.tensor(0.01 * 6))
    torch.testing.assert_close(losses[1], torch.tensor(0.01 * 3))


def test_every_registered_regularizer_name_gives_a_regularizer():
    from dtype_policies import regularizers

    weight = torch.tensor([1.0, -2.0])
    for name in regularizers.REGULARIZERS:
        assert isinstance(regularizers.get(name), regularizers.Regularizer), name
        assert regularizers.get(name)(torch.tensor([[1.0, -2.0], [0.5, 3.0]])).shape == (), name
    # tf.keras's "l1_l2": l1 = l2 = 0.01, by name and by config dict
    torch.testing.assert_close(regularizers.get("l1_l2")(weight), torch.tensor(0.01 * 3 + 0.01 * 5))
    assert regularizers.get({"class_name": "l1_l2", "config": {"l2": 0.5}}).get_config() == {
        "l1": 0.01,
        "l2": 0.5,
    }
    layer = Dense(2, kernel_initializer="ones", kernel_regularizer="l1_l2")
    layer(torch.ones(1, 3))
    torch.testing.assert_close(layer.losses[0], torch.tensor(0.02 * 6))


def test_activity_regularizer():
    layer = Dense(2, kernel_initializer="ones", activity_regularizer="l1")
    layer(torch.ones(1, 3))
    torch.testing.assert_close(layer.losses[0], torch.tensor(0.01 * 6))


def test_constraints_applied_on_request():
    layer = Dense(2, kernel_constraint="non_neg", kernel_initializer="random_normal")
    layer(torch.ones(1, 4))
    layer.apply_constraints()
    assert layer.kernel.min() >= 0


def test_trainable_flag():
    layer = Dense(2)
    layer(torch.ones(1, 3))
    layer.trainable = False
    assert not any(p.requires_grad for p in layer.parameters())
    assert layer.trainable_weights == [] and len(layer.non_trainable_weights) == 2
    layer.trainable = True
    assert all(p.requires_grad for p in layer.parameters())
    frozen = Dense(2, trainable=False)
    frozen(torch.ones(1, 3))
    assert not frozen.kernel.requires_grad


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="Unrecognized keyword arguments passed to Dense"):
        Dense(2, foo=3)
    with pytest.raises(ValueError, match="without '/'"):
        Dense(2, name="a/b")
    with pytest.raises(ValueError, match="positive integer"):
        Dense(0)


def test_call_without_call_raises():
    with pytest.raises(NotImplementedError, match="does not implement `call`"):
        Layer()(torch.ones(1))


def test_weights_follow_input_device_at_build():
    layer = Dense(2)
    layer(torch.ones(1, 3, device="cpu"))
    assert layer.kernel.device.type == "cpu"


def test_config_round_trip_carries_policy():
    layer = Dense(
        4, activation="gelu", dtype="mixed_bfloat16", name="my_dense", kernel_regularizer="l2"
    )
    config = layer.get_config()
    assert config["dtype"] == dtype_policies.serialize(DTypePolicy("mixed_bfloat16"))
    clone = Dense.from_config(config)
    assert clone.name == "my_dense"
    assert clone.dtype_policy == layer.dtype_policy
    assert clone.get_config() == config
    with pytest.raises(TypeError, match="Error when deserializing class 'Dense'"):
        Dense.from_config({**config, "units": -1})


def test_repr_shows_policy():
    assert "dtype_policy='mixed_bfloat16'" in repr(Dense(2, dtype="mixed_bfloat16", name="d"))


def test_seeded_initializers_draw_the_same_values_every_call():
    from dtype_policies import initializers

    for name in (
        "random_normal",
        "random_uniform",
        "truncated_normal",
        "glorot_uniform",
        "orthogonal",
    ):
        seeded = initializers.get({"class_name": name, "config": {"seed": 5}})
        first, second = seeded((16, 8)), seeded((16, 8))
        assert torch.equal(first, second), name
        other = initializers.get({"class_name": name, "config": {"seed": 6}})((16, 8))
        assert not torch.equal(first, other), name
    with pytest.raises(TypeError, match=r"`seed` must be an integer or None. Received: seed='5'"):
        initializers.RandomNormal(seed="5")


def test_variance_scaling_fans_from_the_given_axes():
    from dtype_policies import initializers

    # an einsum kernel (heads, in, out): fan_in = in, fan_out = heads * out
    by_axes = initializers.VarianceScaling(
        1.0, "fan_out", "uniform", seed=0, input_axes=[1], output_axes=[0, 2]
    )
    values = by_axes((4, 64, 16))
    limit = (3.0 / (4 * 16)) ** 0.5
    assert float(values.abs().max()) <= limit and float(values.abs().max()) > 0.9 * limit
    with pytest.raises(ValueError, match=r"do not fit a weight of shape \(4, 64\)"):
        initializers.VarianceScaling(input_axes=[2], output_axes=[0])((4, 64))


def test_weights_kept_in_a_list_are_read_as_stored_and_a_warning_says_so():
    class ListedBias(Layer):
        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")
            bias = self.add_weight(shape=(4,), initializer="zeros", name="bias")
            self.biases = [bias]

        def call(self, x):
            return x @ self.kernel + self.bias

    layer = ListedBias(dtype="mixed_bfloat16")
    with pytest.warns(UserWarning, match=r"ListedBias.biases holds weights of the layer in a list"):
        y = layer(torch.randn(2, 3))
    assert y.dtype == torch.bfloat16  # read by name: cast
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.names = ["kernel", "bias"]  # no weights in it: quiet


def test_a_layer_built_frozen_can_be_unfrozen():
    """`self.kernel = self.add_weight(...)` registered the weight a second
    time, which recorded the frozen layer's flag as the weight's own."""
    for layer in (Dense(4, trainable=False), layers.Embedding(10, 4, trainable=False)):
        layer.build((None, 3))
        assert layer.trainable_weights == []
        layer.trainable = True
        assert all(p.requires_grad for p in layer.parameters())
        assert len(layer.trainable_weights) == len(list(layer.parameters()))


def test_a_layer_built_by_build_compiles_with_fullgraph():
    layer = Dense(4, dtype="mixed_bfloat16")
    layer.build((2, 8))
    x = torch.randn(2, 8)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), layer(x))


def test_the_first_float16_call_on_cpu_may_be_a_compiled_one(monkeypatch):
    from dtype_policies._core import cpu_float16

    monkeypatch.setattr(cpu_float16, "_warned", False)  # as in a fresh process
    layer = Dense(4, dtype="mixed_float16")
    layer.build((2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(layer, fullgraph=True, backend="eager")(torch.randn(2, 8))
    assert out.dtype == torch.float16
    with pytest.warns(CPUFloat16Warning):
        layer(torch.randn(2, 8))  # the eager call warns, once


def test_a_layer_may_say_per_instance_that_it_casts_its_own_weights():
    """`_casts_own_weights` set on an instance (a class attribute until
    2026-12-06, a read-only property for a few hours: the assignment raised)."""

    class CastsItself(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self._casts_own_weights = True

        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], 4), name="w")

        def call(self, x):
            return x @ self.w.to(x.dtype)

    torch.manual_seed(0)
    layer = CastsItself(dtype="mixed_bfloat16")
    assert layer(torch.randn(2, 3)).dtype == torch.bfloat16
    assert layer._casts_own_weights is True and layers.Layer._casts_own_weights is False
