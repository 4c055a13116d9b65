"""Custom layers written the torch way: a weight assigned as
`self.w = nn.Parameter(...)` reads in the compute dtype inside `call`, as
`add_weight`'s do (Keras autocasts every variable of a layer), and a torch
module made inside a layer computes with the layer's policy."""

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

from dtype_policies import DTypePolicyMap, apply_policy, layers, quantize
from dtype_policies.layers import Layer

X = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))


class WithParameter(Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 4))
        self.steps = nn.Parameter(torch.arange(3), requires_grad=False)
        self.seen = {}

    def call(self, x):
        self.seen = {"w": self.w.dtype, "steps": self.steps.dtype}
        return x @ self.w


class WithLinear(Layer):
    def __init__(self, norm=False, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8) if norm else None
        self.seen = {}

    def call(self, x):
        y = self.proj(x)
        self.seen["proj"] = y.dtype
        if self.norm is not None:
            y = self.norm(y)
        return y


def test_a_parameter_assigned_directly_reads_in_the_compute_dtype():
    layer = WithParameter(dtype="mixed_bfloat16")
    out = layer(X)
    assert layer.seen == {"w": torch.bfloat16, "steps": torch.int64}
    assert layer.w.dtype == torch.float32  # outside `call`, the parameter itself
    expected = X.to(torch.bfloat16) @ layer.w.detach().to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().sum().backward()
    assert layer.w.grad.dtype == torch.float32
    assert layer._autocast_weight_names == {"w"}


def test_add_weight_without_autocast_and_a_parameter_set_to_none_stay_as_stored():
    class Stat(Layer):
        def build(self, input_shape):
            self.mean = self.add_weight(shape=(8,), initializer="ones", autocast=False)
            self.scale = nn.Parameter(torch.ones(8))

        def call(self, x):
            self.seen = (self.mean.dtype, self.scale.dtype)
            return x * self.scale

    layer = Stat(dtype="mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # naming a weight by assignment warns of nothing
        layer(X)
    assert layer.seen == (torch.float32, torch.bfloat16)
    layer.scale = None  # registered as None: nothing left to cast
    assert "scale" not in layer._autocast_weight_names and layer.scale is None


def test_a_torch_linear_inside_a_layer_computes_with_the_layers_policy():
    layer = WithLinear(dtype="mixed_bfloat16")
    out = layer(X)
    w, b = layer.proj.weight.detach(), layer.proj.bias.detach()
    expected = nn.functional.linear(X.bfloat16(), w.bfloat16(), b.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert layer.proj.weight.dtype == torch.float32
    assert layer.proj.dtype_policy.name == "mixed_bfloat16"
    out.float().sum().backward()
    assert layer.proj.weight.grad.dtype == torch.float32
    assert layer.proj.weight.grad.abs().sum() > 0


def test_a_norm_inside_a_layer_computes_in_float32_and_hands_back_the_compute_dtype():
    layer = WithLinear(norm=True, dtype="mixed_bfloat16")
    out = layer(X)
    assert layer.norm.dtype_policy.name == "float32"
    hidden = layer.proj(X.bfloat16())
    expected = nn.functional.layer_norm(
        hidden.float(), (8,), layer.norm.weight.detach(), layer.norm.bias.detach()
    ).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_a_float32_layer_gives_its_torch_modules_float32():
    layer = WithLinear(dtype="float32")
    assert layer.proj.dtype_policy.name == "float32"
    assert torch.equal(layer(X), nn.functional.linear(X, layer.proj.weight, layer.proj.bias))
    assert layer.proj(X.bfloat16()).dtype == torch.float32  # cast, as apply_policy's float32


def test_a_map_is_read_at_the_torch_modules_path():
    policy = DTypePolicyMap("mixed_bfloat16", {"block/proj": "float32"})
    layer = WithLinear(dtype=policy, name="block")
    assert layer.proj.dtype_policy.name == "float32"
    out = layer(X)
    assert layer.seen["proj"] == torch.float32
    assert out.dtype == torch.float32


def test_a_torch_module_kept_in_float32_by_applying_a_policy_to_it():
    class Upcast(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.proj = nn.Linear(8, 8)
            apply_policy(self.proj, "float32")  # this one stays float32

        def call(self, x):
            return self.proj(x)

    layer = Upcast(dtype="mixed_bfloat16")
    out = layer(X)
    assert out.dtype == torch.float32
    assert torch.equal(out, nn.functional.linear(X.bfloat16().float(), *layer.proj.parameters()))


def test_a_replaced_torch_module_leaves_the_layers_policy():
    layer = WithLinear(dtype="mixed_bfloat16")
    old = layer.proj
    layer.proj = nn.Linear(8, 8)
    assert layer.proj.dtype_policy.name == "mixed_bfloat16"
    assert not hasattr(old, "dtype_policy")
    assert old(X).dtype == torch.float32


def test_torch_modules_made_in_build_join_too():
    class Lazy(Layer):
        def build(self, input_shape):
            self.proj = nn.Sequential(nn.Linear(input_shape[-1], 4), nn.GELU())

        def call(self, x):
            return self.proj(x)

    layer = Lazy(dtype="mixed_bfloat16")
    assert layer(X).dtype == torch.bfloat16
    assert layer.proj[0].dtype_policy.name == "mixed_bfloat16"


def test_an_application_over_the_layer_wins_and_remove_gives_the_layers_back():
    layer = WithLinear(dtype="mixed_bfloat16")
    model = nn.Sequential(layer)
    handle = apply_policy(model, "float32")
    assert model(X).dtype == torch.float32
    assert layer.proj.dtype_policy.name == "float32"
    handle.remove()
    assert layer.proj.dtype_policy.name == "mixed_bfloat16"
    assert model(X).dtype == torch.bfloat16


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))])
def test_copies_keep_the_torch_modules_policy(copier):
    layer = WithLinear(dtype="mixed_bfloat16")
    clone = copier(layer)
    assert clone.proj.dtype_policy.name == "mixed_bfloat16"
    assert torch.equal(clone(X), layer(X))


def test_quantizing_a_layers_torch_linear():
    layer = WithLinear(dtype="mixed_bfloat16")
    reference = layer(X).float()
    quantize(layer, "int8")
    out = layer(X)
    assert out.dtype == torch.bfloat16
    error = (out.float() - reference).norm() / reference.norm()
    assert 0 < error < 0.02


def test_the_torch_modules_follow_the_layers_policy_when_it_changes():
    layer = WithLinear(dtype="float32")
    assert layer.proj.dtype_policy.name == "float32"
    layer.dtype_policy = "mixed_bfloat16"
    assert layer(X).dtype == torch.bfloat16 and layer.proj.dtype_policy.name == "mixed_bfloat16"
    layer.dtype_policy = "mixed_float16"
    assert layer(X).dtype == torch.float16
    layer.dtype_policy = "float32"
    assert layer.proj.dtype_policy.name == "float32" and layer(X).dtype == torch.float32


def test_torch_modules_take_the_layers_own_policy_not_an_application_over_it():
    class Lazy(Layer):
        def build(self, input_shape):
            self.proj = nn.Linear(input_shape[-1], 8)

        def call(self, x):
            return self.proj(x)

    for own, applied in (("mixed_bfloat16", "float32"), ("float32", "mixed_bfloat16")):
        layer = Lazy(dtype=own)
        model = nn.Sequential(layer)
        handle = apply_policy(model, applied)
        model(X)  # built under the application
        assert layer.proj.dtype_policy.name == applied
        handle.remove()
        expected = torch.bfloat16 if own == "mixed_bfloat16" else torch.float32
        assert model(X).dtype == expected


def test_a_map_is_read_at_the_path_the_layer_gets_in_its_model():
    class Outer(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = WithLinear(dtype=kwargs["dtype"])

        def call(self, x):
            return self.block(x)

    policy = DTypePolicyMap("mixed_bfloat16", {"model/block/proj": "float32"})
    model = Outer(dtype=policy, name="model")
    assert model.block.proj.dtype_policy.name == "mixed_bfloat16"  # no path yet
    model(X)
    assert model.block.path == "model/block"
    assert model.block.proj.dtype_policy.name == "float32"
    assert model.block.seen["proj"] == torch.float32


def test_a_layer_that_does_not_autocast_leaves_its_torch_modules_alone():
    layer = WithLinear(dtype="mixed_bfloat16", autocast=False)
    assert not hasattr(layer.proj, "dtype_policy")
    assert layer(X).dtype == torch.float32
    layer.autocast = True
    assert layer(X).dtype == torch.bfloat16


def test_a_float64_parameter_of_a_float32_layer_stays_float64():
    class Precise(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.offset = nn.Parameter(torch.tensor([1.0 + 2.0**-40], dtype=torch.float64))

        def call(self, x):
            self.seen = self.offset.dtype
            return x

    layer = Precise(dtype="float32")
    layer(X)
    assert layer.seen == torch.float64


def test_trainable_reaches_direct_parameters_and_torch_modules():
    class Frozen(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.gain = nn.Parameter(torch.ones(8))
            self.stat = nn.Parameter(torch.zeros(8), requires_grad=False)
            self.proj = nn.Linear(8, 8)

        def call(self, x):
            return self.proj(x) * self.gain

    assert Frozen(trainable=False).trainable_weights == []
    layer = Frozen()
    assert {id(p) for p in layer.trainable_weights} == {
        id(layer.gain),
        id(layer.proj.weight),
        id(layer.proj.bias),
    }
    layer.trainable = False
    assert layer.trainable_weights == []
    layer.trainable = True
    assert layer.proj.weight.requires_grad and layer.gain.requires_grad
    assert not layer.stat.requires_grad  # as it was made


def test_a_parameter_assigned_under_a_second_name_is_an_alias_as_in_torch():
    class Tied(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.table = nn.Parameter(torch.randn(10, 8))
            self.head = self.table  # tied: both names, one parameter

        def call(self, ids):
            return self.table[ids] @ self.head.T

    layer = Tied(dtype="mixed_bfloat16")
    assert layer.head is layer.table
    assert [n for n, _ in layer.named_parameters(remove_duplicate=False)] == ["table", "head"]
    out = layer(torch.tensor([1, 2]))
    table = layer.table.detach().bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, table[[1, 2]] @ table.T)


def test_a_torch_container_filled_in_build_computes_with_the_layers_policy():
    class Stack(Layer):
        def build(self, input_shape):
            self.blocks = nn.ModuleList()
            for _ in range(2):
                self.blocks.append(nn.Linear(input_shape[-1], input_shape[-1]))

        def call(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    layer = Stack(dtype="mixed_bfloat16")
    assert layer(X).dtype == torch.bfloat16
    assert [b.dtype_policy.name for b in layer.blocks] == ["mixed_bfloat16"] * 2


def test_a_quantized_torch_module_keeps_the_layers_compute_dtype_across_policy_changes():
    layer = WithLinear(norm=True, dtype="mixed_bfloat16")
    layer(X)
    quantize(layer.proj, "int8")
    first = layer(X)
    assert first.dtype == torch.bfloat16
    layer.dtype_policy = "float32"
    layer.dtype_policy = "mixed_bfloat16"
    assert layer.proj.dtype_policy.name == "int8_from_mixed_bfloat16"
    assert torch.equal(layer(X), first)
    with pytest.raises(ValueError):
        layer.dtype_policy = "mixed_float16"  # int8 takes no float16 compute dtype
    assert layer.dtype_policy.name == "mixed_bfloat16"  # as it was, children too
    assert layer.norm.dtype_policy.name == "float32"
    assert torch.equal(layer(X), first)


class WithKernel(Layer):
    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 8), initializer="glorot_uniform")

    def call(self, x):
        self.seen = self.kernel.dtype
        return x @ self.kernel


@pytest.mark.parametrize("autocast", [True, False])
def test_a_parametrization_of_a_layers_own_weight_computes_in_the_variable_dtype(autocast):
    """torch's `orthogonal` registered on a built layer's weight: computed in
    float32 (its bfloat16 `matrix_exp` gives NaN), read in the compute dtype
    inside `call` as the weight was; unparametrized, the weight autocasts
    again."""
    torch.manual_seed(0)
    layer = WithKernel(dtype="mixed_bfloat16", autocast=autocast)
    layer(X)
    nn.utils.parametrizations.orthogonal(layer, "kernel")
    out = layer(X)
    kernel = layer.kernel  # outside `call`: as computed
    assert kernel.dtype == torch.float32 and torch.isfinite(kernel).all()
    assert layer.seen == (torch.bfloat16 if autocast else torch.float32)
    if autocast:
        assert torch.equal(out, X.bfloat16() @ kernel.detach().bfloat16())
        out.float().sum().backward()
        original = layer.parametrizations.kernel.original
        assert original.dtype == torch.float32 and original.grad.abs().sum() > 0
    nn.utils.parametrize.remove_parametrizations(layer, "kernel")
    assert isinstance(layer.kernel, nn.Parameter) and torch.equal(layer.kernel, kernel)
    layer(X)
    assert layer.seen == (torch.bfloat16 if autocast else torch.float32)


class Doubled(nn.Module):
    def forward(self, weight):
        return weight * 2


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("kind", ["Dense", "Embedding"])
def test_a_parametrization_of_a_built_dense_or_embedding_weight(kind, policy):
    """Dense and Embedding read their own weights by name in `call` (no
    autocast scope): a parametrized weight (torch's property on the layer)
    raised a bare KeyError; it is read as `call` reads a weight."""
    torch.manual_seed(0)
    if kind == "Dense":
        layer, inputs, name = layers.Dense(5, dtype=policy), torch.randn(3, 4), "kernel"
    else:
        layer, inputs = layers.Embedding(7, 5, dtype=policy), torch.tensor([[1, 6]])
        name = "embeddings"
    layer(inputs)
    nn.utils.parametrize.register_parametrization(layer, name, Doubled())
    weight = getattr(layer, name).detach()  # outside `call`: as computed, in float32
    out = layer(inputs)
    compute = torch.float32 if policy == "float32" else torch.bfloat16
    if kind == "Dense":
        expected = inputs.to(compute) @ weight.to(compute) + layer.bias.to(compute)
    else:
        expected = weight[inputs].to(compute)
    assert weight.dtype == torch.float32 and out.dtype == compute
    torch.testing.assert_close(out, expected.detach())
    out.float().sum().backward()
    assert getattr(layer.parametrizations, name).original.grad.abs().sum() > 0


def test_a_parametrization_of_a_torch_linear_inside_a_layer():
    torch.manual_seed(0)
    layer = WithLinear(dtype="mixed_bfloat16")
    layer(X)
    nn.utils.parametrizations.spectral_norm(layer.proj)
    layer.eval()  # the power iteration stays where it is
    out = layer(X)
    weight = layer.proj.weight
    assert weight.dtype == torch.float32
    expected = torch.nn.functional.linear(
        X.bfloat16(), weight.bfloat16(), layer.proj.bias.bfloat16()
    )
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_a_second_name_for_a_weight_is_an_alias_not_a_rename():
    from dtype_policies.layers import Dense

    dense = Dense(3, dtype="mixed_bfloat16")
    dense(X[:, :4])
    dense.kernel_ref = dense.kernel
    assert "kernel" in dense._parameters and dense.kernel_ref is dense._parameters["kernel"]
    assert dense(X[:, :4]).dtype == torch.bfloat16

    class Shared(Layer):
        def build(self, shape):
            self.kernel = self.add_weight(name="kernel", shape=(shape[-1], 2))
            self.shared = self.kernel  # a tied handle, as torch's `lin.w2 = lin.weight`

        def call(self, x):
            return x @ self.kernel + x @ self.shared

    layer = Shared()
    out = layer(X)
    assert set(dict(layer.named_parameters())) == {"kernel"}
    torch.testing.assert_close(out, 2 * (X @ layer._parameters["kernel"]))

    class Renamed(Layer):  # the documented rename: the attribute names the weight
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 2))

        def call(self, x):
            return x @ self.w

    renamed = Renamed()
    renamed(X)
    renamed.alias = renamed.w  # after build: an alias
    assert list(dict(renamed.named_parameters())) == ["w"] and renamed.alias is renamed.w


def test_a_float32_layer_gives_its_torch_modules_its_policy():
    from dtype_policies.layers import Dense

    class Model(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.body = Dense(8, dtype="mixed_bfloat16")
            self.head = nn.Linear(8, 2)

        def call(self, x):
            return self.head(self.body(x))

    model = Model()
    out = model(X)  # the bfloat16 output of `body` is cast to float32 for `head`
    assert out.dtype == torch.float32
    expected = nn.functional.linear(model.body(X).float(), model.head.weight, model.head.bias)
    torch.testing.assert_close(out, expected)


def test_build_takes_the_shape_of_calls_first_argument_given_by_keyword():
    class Masked(Layer):
        def build(self, input_shape):
            self.seen_shape = input_shape
            self.w = self.add_weight(shape=(input_shape[-1], 3))

        def call(self, inputs, mask=None):
            return inputs @ self.w

    layer = Masked()
    out = layer(mask=torch.ones(2, 1), inputs=torch.randn(2, 4))
    assert layer.seen_shape == (2, 4) and out.shape == (2, 3)


def test_two_threads_making_the_first_call_build_the_layer_once():
    import threading
    import time

    class Slow(Layer):
        builds = 0

        def build(self, shape):
            type(self).builds += 1
            self.w = self.add_weight(shape=(shape[-1], 3), initializer="ones")
            time.sleep(0.05)
            self.b = self.add_weight(shape=(3,), initializer="zeros")

        def call(self, x):
            return x @ self.w + self.b

    layer = Slow()
    barrier = threading.Barrier(2)
    results, errors = [], []

    def first_call():
        barrier.wait()
        try:
            results.append(layer(torch.ones(2, 4)))
        except Exception as e:  # pragma: no cover - the failure this test is about
            errors.append(e)

    threads = [threading.Thread(target=first_call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and Slow.builds == 1
    assert list(layer._parameters) == ["w", "b"]
    assert all(torch.equal(r, torch.full((2, 3), 4.0)) for r in results) and len(results) == 2


def test_floating_weights_of_other_dtypes_read_in_the_compute_dtype_when_mixed():
    class Gain(Layer):
        def build(self, shape):
            self.gain = self.add_weight(shape=(shape[-1],), dtype="float16", initializer="ones")
            self.b64 = self.add_weight(shape=(shape[-1],), dtype="float64", initializer="zeros")
            self.raw = self.add_weight(
                shape=(shape[-1],), dtype="float64", initializer="zeros", autocast=False
            )

        def call(self, x):
            self.seen = (self.gain.dtype, self.b64.dtype, self.raw.dtype)
            return x * self.gain + self.b64

    mixed = Gain(dtype="mixed_bfloat16")
    assert mixed(X).dtype == torch.bfloat16
    assert mixed.seen == (torch.bfloat16, torch.bfloat16, torch.float64)
    assert mixed.gain.dtype == torch.float16  # stored as created
    plain = Gain()  # float32: as Keras, no autocast scope; the weights read as they are
    assert plain(X).dtype == torch.float64
    assert plain.seen == (torch.float16, torch.float64, torch.float64)


def test_floating_buffers_of_a_layer_read_in_the_compute_dtype():
    class Scaled(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.register_buffer("scale", torch.full((8,), 2.0))
            self.register_buffer("count", torch.zeros((), dtype=torch.int64))

        def call(self, x):
            self.seen = (self.scale.dtype, self.count.dtype)
            return x * self.scale

    layer = Scaled(dtype="mixed_bfloat16")
    out = layer(X)
    assert out.dtype == torch.bfloat16 and layer.seen == (torch.bfloat16, torch.int64)
    torch.testing.assert_close(out, (X.bfloat16() * 2).bfloat16())
    assert layer.scale.dtype == torch.float32 and layer.state_dict()["scale"].dtype == torch.float32


class _TiedHead(Layer):
    """A parent with no weights of its own reading its lazily built sublayer's
    kernel (a tied output head), as Keras models commonly do."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inp = layers.Dense(8, dtype=self.dtype_policy)

    def call(self, x):
        h = self.inp(x)
        return h @ self.inp.kernel.T


class _LazyWeight(Layer):
    def call(self, x):
        if not hasattr(self, "w"):
            self.w = torch.nn.Parameter(torch.ones(x.shape[-1], 3))
        return x @ self.w


@pytest.mark.parametrize("make", [_TiedHead, _LazyWeight])
def test_weights_made_after_the_layer_was_built_read_in_the_compute_dtype(make):
    layer = make(dtype="mixed_bfloat16")
    x = torch.randn(2, 8)
    for _ in range(2):  # the first call (weights made in it) and the next
        out = layer(x)
        assert out.dtype == torch.bfloat16
    weights = [p for p in layer.parameters()]
    assert all(p.dtype == torch.float32 for p in weights)


def test_activity_losses_as_keras_per_output_divided_by_the_batch():
    class TwoOutputs(Layer):
        def call(self, x):
            return x * 2, x * 3

    x = torch.ones(4, 8)
    dense = layers.Dense(2, kernel_initializer="ones", activity_regularizer="l2")
    dense(x)
    # Keras 3.15: 0.01 * sum(8**2 * 2 * 4) / 4 = 1.28
    assert [round(float(loss), 4) for loss in dense.losses] == [1.28]
    two = TwoOutputs(activity_regularizer="l2")
    two(x)
    assert [round(float(loss), 4) for loss in two.losses] == [0.32, 0.72]


class _Penalised(Layer):
    def call(self, x):
        self.add_loss(x.abs().mean())
        return x


def test_losses_of_one_forward_as_keras_a_shared_layer_counted_per_call():
    """Keras 3.15's figures for the same model (`keras.Sequential` of the
    same layers): a shared layer adds a loss at each of its calls, the next
    forward replaces them, a sublayer called alone replaces only its own."""
    torch.manual_seed(0)
    shared = _Penalised()
    dense = layers.Dense(
        3, activity_regularizer="l2", kernel_regularizer="l1", kernel_initializer="ones"
    )
    last = layers.Dense(3, kernel_regularizer="l2", kernel_initializer="ones")
    model = layers.Sequential([shared, dense, shared, dense, last])
    x = torch.ones(2, 3)

    def rounded(losses):
        return [round(float(loss), 4) for loss in losses]

    model(x)
    assert rounded(model.losses) == [1.0, 3.0, 0.27, 2.43, 0.09, 0.09]
    model(2 * x)
    assert rounded(model.losses) == [2.0, 6.0, 1.08, 9.72, 0.09, 0.09]
    dense(x)
    assert rounded(dense.losses) == [0.27, 0.09]
    assert rounded(model.losses) == [2.0, 6.0, 0.27, 0.09, 0.09]
    last.trainable = False  # a frozen weight's regularizer is not a loss
    assert rounded(model.losses) == [2.0, 6.0, 0.27, 0.09]


def test_add_loss_refuses_a_value_that_is_not_a_tensor_and_adds_nothing():
    layer = _Penalised()
    layer(torch.ones(2, 3))
    before = list(layer.losses)
    with pytest.raises(ValueError, match=r"on a tensor input. Received invalid value: 3.0"):
        layer.add_loss([torch.tensor(1.0), 3.0])
    assert len(layer.losses) == len(before) == 1


def test_losses_of_a_compiled_forward_and_of_a_forward_that_raised():
    torch.manual_seed(0)
    shared = _Penalised()
    model = layers.Sequential([shared, layers.Dense(8, activity_regularizer="l2"), shared])
    x = torch.randn(2, 8)
    model(x)
    eager = [float(loss) for loss in model.losses]
    compiled = torch.compile(model)
    compiled(x)
    compiled(x)
    assert [float(loss) for loss in model.losses] == pytest.approx(eager, rel=1e-5)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # the Dense of 8 inputs refuses 5
    model(x)  # the failed call left no layer call open: this one clears
    assert [float(loss) for loss in model.losses] == pytest.approx(eager, rel=1e-6)


def test_a_bad_regularizer_or_constraint_registers_no_weight():
    class Bad(Layer):
        def __init__(self, **options):
            super().__init__()
            self.options = options

        def build(self, shape):
            self.w = self.add_weight(shape=(4, 4), name="w", **self.options)

        def call(self, x):
            return x @ self.w

    for options, match in (
        ({"regularizer": "l3"}, "Unknown regularizer 'l3'"),
        ({"constraint": "nonneg"}, "Unknown constraint 'nonneg'"),
    ):
        layer = Bad(**options)
        for _ in range(2):  # the second try names the same mistake
            with pytest.raises(ValueError, match=match):
                layer(torch.randn(2, 4))
        assert list(layer.state_dict()) == []


def test_an_attribute_given_a_second_add_weight_holds_the_new_one_and_both_are_kept():
    class Remade(Layer):
        def build(self, shape):
            self.kernel = self.add_weight(shape=(4, 4), initializer="zeros", regularizer="l2")
            self.kernel = self.add_weight(shape=(4, 3), initializer="ones")

        def call(self, x):
            return x @ self.kernel

    layer = Remade(dtype="mixed_bfloat16")
    out = layer(torch.ones(2, 4))
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), torch.full((2, 3), 4.0))
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == {"variable": (4, 4), "kernel": (4, 3)}
    assert len(layer.losses) == 1  # the first weight's regularizer, under its new name


@pytest.mark.parametrize("before", ["none", "buffer", "module"])
def test_an_attribute_that_held_something_else_takes_the_add_weight_result(before):
    class Remade(Layer):
        def __init__(self):
            super().__init__(dtype="mixed_bfloat16")
            if before == "none":
                self.kernel = None
            elif before == "buffer":
                self.register_buffer("kernel", torch.zeros(4, 3))
            else:
                self.kernel = nn.Linear(4, 3)

        def build(self, shape):
            self.kernel = self.add_weight(shape=(4, 3), initializer="ones")

        def call(self, x):
            return x @ self.kernel

    layer = Remade()
    out = layer(torch.ones(2, 4))
    assert torch.equal(out.float(), torch.full((2, 3), 4.0)) and out.dtype == torch.bfloat16
    assert [name for name, _ in layer.named_parameters()] == ["kernel"]
    assert list(layer.state_dict()) == ["kernel"]


def test_a_sparse_buffer_reads_in_a_mixed_layer():
    class Graph(Layer):
        def __init__(self):
            super().__init__(dtype="mixed_bfloat16")
            self.register_buffer("adjacency", torch.eye(3).to_sparse_csr())

        def call(self, x):
            return self.adjacency.to_dense().to(x.dtype) @ x

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: sparse CSR support is in beta
        layer = Graph()
        out = layer(torch.ones(3, 2))
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), torch.ones(3, 2))


def test_a_sparse_weight_written_in_call_reaches_its_parameter():
    class Sparse(Layer):
        def __init__(self):
            super().__init__(dtype="mixed_bfloat16")
            self.w = nn.Parameter(torch.eye(3).to_sparse(), requires_grad=False)

        def call(self, x):
            w = self.w
            w.mul_(2)
            return torch.sparse.mm(w, x.t()).t()

    layer = Sparse()
    with torch.no_grad():
        out = layer(torch.ones(1, 3))
    assert out.dtype == torch.bfloat16 and out.tolist() == [[2.0, 2.0, 2.0]]
    assert layer.w.to_dense().diagonal().tolist() == [2.0, 2.0, 2.0]


class _CheckpointedBlock(Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = _Penalised()
        self.dense = layers.Dense(4, activity_regularizer="l2")

    def call(self, x):
        return torch.utils.checkpoint.checkpoint(
            lambda y: self.dense(self.inner(y)), x, use_reentrant=False
        )


def test_a_forward_recomputed_by_checkpointing_neither_adds_nor_clears_losses():
    """The recomputation in a backward pass is a call of the layers again:
    inside an outer call (a gradient penalty) it added the losses twice;
    as an outermost call (the model's backward) it cleared them, and
    torch's early stop of the recomputation left some out."""
    torch.manual_seed(0)
    model = layers.Sequential([_CheckpointedBlock(), _CheckpointedBlock()])
    x = torch.randn(2, 4, requires_grad=True)
    out = model(x)
    taken = [float(loss) for loss in model.losses]
    assert len(taken) == 4
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # recomputes
    assert [float(loss) for loss in model.losses] == taken
    (out.sum() + grad.square().sum()).backward()
    assert [float(loss) for loss in model.losses] == taken


def test_a_layer_holding_the_losses_of_a_forward_deep_copies_and_pickles():
    torch.manual_seed(0)
    model = layers.Sequential([_Penalised(), layers.Dense(4, activity_regularizer="l2")])
    model(torch.randn(2, 4, requires_grad=True))
    assert len(model.losses) == 2
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert copied.losses == []  # a copy starts without the forward's losses
        copied(torch.randn(2, 4))
        assert len(copied.losses) == 2
    assert len(model.losses) == 2  # the original keeps its own


class _WithBuffer(Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shift", torch.full((4,), 0.3))

    def call(self, x):
        return self.lin(x) + self.shift


def test_a_buffer_keeps_reading_in_the_compute_dtype_after_a_conversion_or_policy_change():
    """Which buffers read in the compute dtype was decided again from their
    dtype at each refresh: after `.double()` (or a policy change) the float32
    buffer no longer matched and stopped being cast, while the parameters
    were; `apply_policy` modules decide once."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    layer = _WithBuffer(dtype="mixed_bfloat16")
    assert layer(x).dtype == torch.bfloat16
    layer.double()
    assert layer(x).dtype == torch.bfloat16
    switched = _WithBuffer(dtype="float32")
    switched(x)
    switched.dtype_policy = "bfloat16"
    assert switched(x).dtype == torch.bfloat16


def test_training_reaches_the_layers_a_call_makes_without_one():
    """Keras's call context: `block(x, training=False)` left the Dropout
    inside it in torch's training mode (dropping), where Keras drops nothing."""

    class Block(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.drop = layers.Dropout(0.5)
            self.seen = []

        def call(self, x, training=None):
            self.seen.append(training)
            return self.drop(x)

    class Outer(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = Block()

        def call(self, x):  # takes no `training`, passes it on all the same
            return self.block(x)

    torch.manual_seed(0)
    x = torch.ones(2, 1000)
    model = Outer()
    model.train()
    assert torch.equal(model(x, training=False), x)
    assert model.block.seen == [False]
    assert not torch.equal(model(x, training=True), x)
    assert not torch.equal(model(x), x)  # no `training` anywhere: the module's mode
    assert model.block.seen == [False, True, None]
    assert torch.equal(model.block(x, training=False), x)  # its own beats none


class _SquaredDropout(Layer):
    """A Dropout whose `training` comes from the call context, squared."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = layers.Dropout(0.5)

    def call(self, x):
        return self.drop(x) ** 2


class _Checkpointed(Layer):
    """`inner` under activation checkpointing: its replay runs outside the
    layer calls that passed `training` on."""

    def __init__(self, inner, reentrant=False, **kwargs):
        super().__init__(**kwargs)
        self.inner, self.reentrant = inner, reentrant

    def call(self, x, training=None):
        import torch.utils.checkpoint as checkpoint

        return checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def test_a_checkpointed_replay_keeps_the_training_of_its_forward():
    """The replay runs outside the layer calls that passed `training` on: a
    Dropout given `training=False` in the forward dropped in the replay (the
    gradients belonged to another forward)."""
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = _Checkpointed(_SquaredDropout(), reentrant)
        model.train()
        x = torch.full((2, 8), 3.0, requires_grad=True)
        out = model(x, training=False)
        assert torch.equal(out, torch.full((2, 8), 9.0))
        out.sum().backward()
        assert torch.equal(x.grad, torch.full((2, 8), 6.0)), reentrant


def test_a_call_taking_only_kwargs_is_not_given_training():
    class Inner(Layer):
        def call(self, x, **kwargs):
            return torch.relu(x, **kwargs)  # relu takes no `training`

    class Outer(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = Inner()

        def call(self, x, training=None):
            return self.inner(x)

    x = torch.randn(2, 3)
    assert torch.equal(Outer()(x, training=True), torch.relu(x))  # as Keras
    assert torch.equal(Inner()(x, training=True), torch.relu(x))


def test_training_from_a_call_signature_s_default_is_passed_on_as_keras():
    class Block(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.drop = layers.Dropout(0.5)

        def call(self, x, training=False):  # inference unless told
            return self.drop(x)

    torch.manual_seed(0)
    block = Block()
    block.train()
    x = torch.ones(4, 1000)
    assert torch.equal(block(x), x)  # Keras: the default reaches the Dropout
    assert not torch.equal(block(x, training=True), x)


def test_a_replay_keeps_its_forward_s_training_while_another_thread_evaluates():
    import threading

    class Inner(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = layers.Dense(8)
            self.drop = layers.Dropout(0.5)

        def call(self, x):
            return self.drop(self.dense(x))

    torch.manual_seed(0)
    block = _Checkpointed(Inner())
    block.train()
    x = torch.randn(4, 8)
    block(x)  # built, then copied: the same weights
    plain = copy.deepcopy(block)
    torch.manual_seed(1)
    out = block(x, training=True)
    evaluation = threading.Thread(target=lambda: block(x, training=False))
    evaluation.start()
    evaluation.join()  # between the forward and its backward, in another thread
    out.square().sum().backward()
    torch.manual_seed(1)
    plain.inner(x, training=True).square().sum().backward()
    torch.testing.assert_close(block.inner.dense.kernel.grad, plain.inner.dense.kernel.grad)


def test_a_replay_in_another_thread_than_its_forward_keeps_its_training():
    """A backward pass may run in another thread (CUDA's run in the
    device's): the replay found no record for its thread and dropped."""
    import threading

    block = _Checkpointed(_SquaredDropout())
    block.train()
    x = torch.full((2, 8), 3.0, requires_grad=True)
    outputs = []
    worker = threading.Thread(target=lambda: outputs.append(block(x, training=False)))
    worker.start()
    worker.join()
    outputs[0].sum().backward()  # in this thread
    assert torch.equal(x.grad, torch.full((2, 8), 6.0))


def test_a_layer_called_from_a_backward_hook_leaves_the_forward_s_losses():
    model = layers.Dense(4, activity_regularizer="l2")
    out = model(torch.randn(2, 3))

    def hook(grad):
        model(grad[:, :3])  # a call during the backward pass

    out.register_hook(hook)
    assert len(model.losses) == 1
    out.sum().backward()
    assert len(model.losses) == 1


def test_training_passed_by_position_is_the_call_s_own():
    class WithDefault(Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.drop = layers.Dropout(0.5)

        def call(self, x, training=False):
            return self.drop(x)

    torch.manual_seed(0)
    layer = WithDefault()
    layer.eval()
    x = torch.ones(2, 1000)
    assert not torch.equal(layer(x, True), x)  # was "got multiple values for 'training'"
    assert torch.equal(layer(x, False), x)
