"""apply_policy on plain torch modules, torchvision-free CNNs and Hugging Face models."""

import copy
import io
import re
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtype_policies
from dtype_policies import DTypePolicy, DTypePolicyMap, apply_policy, layers
from dtype_policies._core.module_state import state_of
from tiny_models import tiny_decoder


def mlp():
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 8)
    )


def test_state_dict_parameters_and_optimizer_identity():
    model = mlp()
    before_params = list(model.parameters())
    before_state = {k: (v.data_ptr(), v.dtype) for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = apply_policy(model, "mixed_bfloat16")
    assert [p is q for p, q in zip(model.parameters(), before_params)] == [True] * 6
    assert {k: (v.data_ptr(), v.dtype) for k, v in model.state_dict().items()} == before_state
    x = torch.randn(16, 32)
    loss = model(x).float().square().mean()
    loss.backward()
    for parameter in model.parameters():
        assert parameter.dtype == torch.float32 and parameter.grad.dtype == torch.float32
    snapshot = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(snapshot, model.parameters()))
    late_optimizer = torch.optim.Adam(model.parameters())  # built after apply_policy
    late_optimizer.step()
    handle.remove()


def test_mlp_outputs_close_to_float32():
    model = mlp()
    x = torch.randn(16, 32)
    reference = model(x)
    apply_policy(model, "mixed_bfloat16")
    out = model(x)
    assert out.dtype == torch.bfloat16
    # Stated tolerance for bfloat16 compute (8-bit mantissa): 3% of the output scale.
    torch.testing.assert_close(
        out.float(), reference, atol=0.03 * reference.abs().max().item(), rtol=0.03
    )


def test_gradients_close_to_float32():
    model = mlp()
    x = torch.randn(16, 32)
    model(x).square().mean().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_policy(model, "mixed_bfloat16")
    model(x).float().square().mean().backward()
    for got, want in zip((p.grad for p in model.parameters()), reference):
        torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.05)


def test_inputs_and_weights_cast_inside_forward():
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))
            self.register_buffer("offset", torch.zeros(3))
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

        def forward(self, x, scale=None, ids=None):
            seen.update(
                x=x.dtype,
                scale=scale.dtype,
                ids=ids.dtype,
                weight=self.weight.dtype,
                offset=self.offset.dtype,
                steps=self.steps.dtype,
            )
            return x * self.weight + self.offset

    probe = Probe()
    apply_policy(probe, "mixed_bfloat16")
    out = probe(torch.ones(3, dtype=torch.float64), scale=torch.ones(1), ids=torch.ones(1).long())
    assert seen == dict(
        x=torch.bfloat16,
        scale=torch.bfloat16,
        ids=torch.int64,
        weight=torch.bfloat16,
        offset=torch.bfloat16,
        steps=torch.int64,
    )
    assert out.dtype == torch.bfloat16
    assert probe.weight.dtype == torch.float32 and isinstance(probe.weight, nn.Parameter)


class _TensorSubclass(torch.Tensor):
    pass


@pytest.mark.parametrize("kind", ["parameter", "subclass"])
def test_tensor_subclass_inputs_are_cast_by_a_leaf(kind):
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    apply_policy(layer, "mixed_bfloat16")
    x = torch.randn(3, 8)
    expected = F.linear(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16())
    x = nn.Parameter(x) if kind == "parameter" else x.as_subclass(_TensorSubclass)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.as_subclass(torch.Tensor), expected)


def test_cast_buffers_false_keeps_buffers():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.rand(4))

        def forward(self, x):
            self.seen = self.inv_freq.dtype
            return x

    module = WithBuffer()
    apply_policy(module, "mixed_bfloat16", cast_buffers=False)
    module(torch.ones(1))
    assert module.seen == torch.float32


def test_non_persistent_buffers_keep_their_dtype_and_persistent_ones_are_cast():
    """A non-persistent buffer is a constant of the module's own code, not
    model state: transformers' rotary embedding keeps `inv_freq` so and
    multiplies it in float32 on purpose. Read in bfloat16, its cos/sin table
    was 0.34 off at position 1,000 and a Llama's logits drifted from
    position 500 on (worse than transformers' own bfloat16 load)."""

    class WithBuffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.rand(4), persistent=False)
            self.register_buffer("running", torch.rand(4))

        def forward(self, x):
            self.seen = (self.inv_freq.dtype, self.running.dtype)
            return x

    module = WithBuffers()
    apply_policy(module, "mixed_bfloat16")
    module(torch.ones(1))
    assert module.seen == (torch.float32, torch.bfloat16)


def test_a_llama_rotary_table_under_mixed_bfloat16_is_transformers_bfloat16s():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    x = torch.randn(1, 4, 64)
    positions = torch.tensor([[0, 500, 1000, 2000]])
    with torch.no_grad():
        cos32, sin32 = model.model.rotary_emb(x, positions)
        apply_policy(model, "mixed_bfloat16")
        cos, sin = model.model.rotary_emb(x, positions)
    # the float32 table rounded once to bfloat16, as transformers' bfloat16 model gives it
    assert cos.dtype == sin.dtype == torch.bfloat16
    assert torch.equal(cos, cos32.bfloat16()) and torch.equal(sin, sin32.bfloat16())


def test_transformer_encoder_close_to_float32():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 7, 32)
    reference = encoder(x)
    handle = apply_policy(encoder, "mixed_bfloat16")
    assert "layers/0/norm1" in handle.float32_paths
    out = encoder(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=0.05, rtol=0.05)
    out.float().sum().backward()
    assert {p.grad.dtype for p in encoder.parameters()} == {torch.float32}


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        self.bn_input_dtype = None
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class _WithLosses(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 40)
        self.cross_entropy = nn.CrossEntropyLoss()
        self.mse = nn.MSELoss()

    def forward(self, x, labels, targets):
        logits = self.fc(x)
        return self.cross_entropy(logits, labels), self.mse(logits[:, :4], targets)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_loss_modules_a_model_holds_compute_in_float32(policy):
    """As Keras's losses: an `MSELoss` of targets near 100 under
    mixed_bfloat16 computed in bfloat16 and returned 9984 for 9992. (The
    targets the model itself is given are cast by its own call, as Keras
    casts every floating argument of a layer's call.)"""
    torch.manual_seed(0)
    model = _WithLosses()
    x, labels = torch.randn(64, 16), torch.randint(0, 40, (64,))
    targets = torch.randn(64, 4) + 100
    handle = apply_policy(model, policy)
    assert handle.float32_paths == ["cross_entropy", "mse"]
    cross_entropy, mse = model(x, labels, targets)
    assert cross_entropy.dtype == mse.dtype == torch.float32
    logits = model.fc(x).detach().float()  # the same call's logits, then float32 losses
    compute = getattr(torch, handle.policies[""].compute_dtype)
    given = targets.to(compute).float()  # cast by the model's own call
    torch.testing.assert_close(cross_entropy, F.cross_entropy(logits, labels), rtol=1e-6, atol=0)
    torch.testing.assert_close(mse, F.mse_loss(logits[:, :4], given), rtol=1e-6, atol=0)
    (cross_entropy + mse).backward()
    assert model.fc.weight.grad.dtype == torch.float32
    handle.remove()
    assert apply_policy(model, policy, float32_modules=()).float32_paths == []


def test_small_cnn_with_batchnorm_islands():
    torch.manual_seed(0)
    model = SmallCNN()
    x = torch.randn(8, 1, 8, 8)
    reference_model = copy.deepcopy(model)
    reference = reference_model(x)
    handle = apply_policy(model, "mixed_bfloat16")
    assert handle.float32_paths == ["bn1", "bn2"]
    out = model(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=0.05, rtol=0.05)
    # Running statistics are updated in float32, in place, as in float32 training.
    assert model.bn1.running_mean.dtype == torch.float32
    torch.testing.assert_close(
        model.bn1.running_mean, reference_model.bn1.running_mean, atol=1e-2, rtol=1e-2
    )
    assert model.bn1.num_batches_tracked.item() == 1
    model.eval()
    reference_model.eval()
    torch.testing.assert_close(model(x).float(), reference_model(x), atol=0.05, rtol=0.05)


@pytest.mark.parametrize(
    "norm", [nn.LayerNorm(16), nn.GroupNorm(4, 16), nn.BatchNorm1d(16), nn.RMSNorm(16)]
)
def test_norm_islands_compute_in_float32_and_return_callers_dtype(norm):
    x = torch.randn(6, 16) * 50 + 10
    reference = copy.deepcopy(norm)(x)
    apply_policy(norm, "mixed_bfloat16")
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=0.05, rtol=0.02)
    out32 = norm(x)  # a float32 caller gets float32 back
    assert out32.dtype == torch.float32


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LayerNorm(72),
        lambda: nn.GroupNorm(4, 72),
        lambda: nn.BatchNorm1d(72),
        lambda: layers.LayerNormalization(),
    ],
    ids=["LayerNorm", "GroupNorm", "BatchNorm1d", "LayerNormalization"],
)
def test_norm_islands_weight_gradients_are_float32_exact_over_many_rows(make, half):
    """torch's CPU layer_norm given half inputs sums its weight and bias
    gradients over the rows in the half dtype: under mixed_bfloat16 every
    LayerNorm trained on gradients 6% off at 4096 rows. Checked against float64
    on the same half inputs; a forward without gradients keeps the kernel."""
    torch.manual_seed(0)
    norm = make()
    x = (torch.randn(4096, 72) * 3).to(half)
    norm(x.float())  # builds the Keras-style layer
    with torch.no_grad():
        for parameter in norm.parameters():
            parameter.uniform_(0.5, 1.5)
    reference = copy.deepcopy(norm).double()
    if isinstance(norm, nn.Module) and not isinstance(norm, layers.Layer):
        apply_policy(norm, f"mixed_{'bfloat16' if half is torch.bfloat16 else 'float16'}")
    else:
        norm.dtype_policy = f"mixed_{'bfloat16' if half is torch.bfloat16 else 'float16'}"
    upstream = torch.randn(4096, 72).to(half)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dtype_policies.CPUFloat16Warning)
        norm(x).backward(upstream)
        reference(x.double()).backward(upstream.double())
        for (name, got), expected in zip(norm.named_parameters(), reference.parameters()):
            error = (got.grad.double() - expected.grad).norm() / expected.grad.norm()
            assert error < 1e-5, (name, float(error))
        if isinstance(norm, (nn.LayerNorm, layers.LayerNormalization)):
            weights = [*norm.parameters()]  # weight and bias, gamma and beta
            epsilon = getattr(norm, "eps", getattr(norm, "epsilon", None))
            with torch.no_grad():  # the mixed-dtype kernel, with nothing to differentiate
                assert torch.equal(norm(x), F.layer_norm(x, (72,), *weights, epsilon))


def test_a_block_named_after_its_norms_takes_the_policy_and_its_norms_stay_float32():
    """Wav2Vec2's `Wav2Vec2EncoderLayerStableLayerNorm` (attention and MLPs)
    and `...EncoderStableLayerNorm` ended with "Norm": whole encoders became
    float32 islands, their residual stream float32 under mixed_bfloat16."""

    class MyRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(72))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class EncoderLayerStableLayerNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_norm, self.dense, self.rms = nn.LayerNorm(72), nn.Linear(72, 72), MyRMSNorm()

        def forward(self, x):
            return x + self.rms(self.dense(self.layer_norm(x)))

    model = nn.Sequential(nn.Linear(72, 72), EncoderLayerStableLayerNorm(), nn.Linear(72, 8))
    seen = {}
    for name in ("1", "1.dense", "1.rms"):
        model.get_submodule(name).register_forward_pre_hook(
            lambda module, args, name=name: seen.__setitem__(name, args[0].dtype)
        )
    handle = apply_policy(model, "mixed_bfloat16")
    model(torch.randn(3, 72))
    assert handle.float32_paths == ["1/layer_norm", "1/rms"]
    assert seen == {"1": torch.bfloat16, "1.dense": torch.bfloat16, "1.rms": torch.float32}

    class PlusOne(nn.Module):
        def forward(self, weight):
            return weight + 1

    parametrized = MyRMSNorm()  # its own weight parametrized (Gemma's 1 + w): still a norm
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", PlusOne())
    assert apply_policy(parametrized, "mixed_bfloat16").float32_paths == [""]


def test_a_dtype_error_where_a_wider_modules_outputs_meet_others_names_it():
    """CLIP with its text projection in float32: torch's matmul of float32
    and bfloat16 embeddings failed with no word of the policy behind it."""

    class TwoTowers(nn.Module):
        def __init__(self):
            super().__init__()
            self.text, self.image = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x):
            return torch.matmul(self.text(x), self.image(x).t())

    model = TwoTowers()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"text": "float32"}))
    with pytest.raises(RuntimeError, match="same dtype") as raised:
        model(torch.randn(2, 8))
    notes = getattr(raised.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert notes == [
            "dtype_policies: inside TwoTowers, which computes in bfloat16, 'text' (float32) "
            "computes in a wider dtype and keeps its outputs, as Keras's layers do; torch's ops "
            "do not promote mixed float dtypes as Keras's do. Give the modules whose outputs "
            "meet the same policy (or their parent the wider one)."
        ]
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"text|image": "float32"}))
    assert model(torch.randn(2, 8)).dtype == torch.float32

    class Block(nn.Module):  # a dtype error of its own, nothing to do with 'head'
        def forward(self, x):
            return torch.matmul(x, torch.ones(8, 8, dtype=torch.float64))

    other = nn.Sequential(Block(), nn.Linear(8, 4))
    apply_policy(other, DTypePolicyMap("mixed_bfloat16", {"1": "float32"}))
    with pytest.raises(RuntimeError, match="same dtype") as raised:
        other(torch.randn(2, 8))
    assert not getattr(raised.value, "__notes__", [])


def test_map_keeps_one_block_in_float32():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    seen = {}

    def record(name):
        def hook(module, args, output):
            seen[name] = (args[0].dtype, output.dtype, module.weight.dtype)

        return hook

    for index in range(3):
        encoder.layers[index].linear1.register_forward_hook(record(f"layers/{index}/linear1"))
    policy_map = DTypePolicyMap("mixed_bfloat16", {"layers.1(/.*)?": "float32"})
    handle = apply_policy(encoder, policy_map)
    assert handle.policies["layers/1/linear1"].name == "float32"
    assert handle.policies["layers/2/linear1"].name == "mixed_bfloat16"
    out = encoder(torch.randn(2, 5, 16))
    assert seen["layers/0/linear1"][:2] == (torch.bfloat16, torch.bfloat16)
    assert seen["layers/1/linear1"][:2] == (torch.float32, torch.float32)
    assert seen["layers/2/linear1"][:2] == (torch.bfloat16, torch.bfloat16)
    assert out.dtype == torch.bfloat16


def test_a_narrower_module_hands_its_outputs_back_in_the_enclosing_dtype(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    inner = []
    model[0].register_forward_hook(lambda module, args, output: inner.append(output.dtype))
    apply_policy(model, DTypePolicyMap("float32", {"0": "mixed_bfloat16"}))
    y0 = model[0](x)
    assert inner == [torch.bfloat16]  # computed in bfloat16 ...
    assert y0.dtype == torch.float32  # ... handed back in the float32 around it
    w, b = model[0].weight, model[0].bias
    assert torch.equal(y0, F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).float())
    assert model(x).dtype == torch.float32

    # the saved manifest keeps it
    path = dtype_policies.saving.save(model, tmp_path / "model.safetensors")
    fresh = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    dtype_policies.saving.load(fresh, path)
    assert torch.equal(fresh[0](x), y0)

    # the same policy everywhere: nothing handed back, outputs in bfloat16 as before
    apply_policy(model, "mixed_bfloat16")
    assert model[0](x).dtype == torch.bfloat16 and model(x).dtype == torch.bfloat16
    # a wider module keeps its outputs (a float32 head of a bfloat16 model)
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"2": "float32"}))
    assert model[0](x).dtype == torch.bfloat16 and model(x).dtype == torch.float32
    # the root's own entry: the map's default is what the code around it computes in
    leaf = model[0]
    apply_policy(leaf, DTypePolicyMap("float32", {"": "mixed_bfloat16"}))
    assert torch.equal(leaf(x), y0)
    apply_policy(leaf, "mixed_bfloat16")  # a policy, not a map: nothing around it
    assert torch.equal(leaf(x), y0.bfloat16())


def test_a_weight_already_in_the_compute_dtype_beside_a_float32_bias():
    # (calibration swaps planned weights in this way; a user may convert a weight alone)
    torch.manual_seed(0)
    linear = nn.Linear(8, 4)
    linear.weight.data = linear.weight.data.bfloat16()
    apply_policy(linear, "mixed_bfloat16")
    x = torch.randn(3, 8)
    y = linear(x)
    expected = F.linear(x.bfloat16(), linear.weight, linear.bias.bfloat16())
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
    assert linear.bias.dtype == torch.float32


@pytest.mark.parametrize("shape", [(2, 3, 8), (4, 5, 3, 8)])
def test_a_weight_cast_in_the_call_or_stored_in_the_compute_dtype_gives_the_same_bits(shape):
    # FSDP2 gathers parameters already in bfloat16; a single process casts them
    # in the call. A strided input (attention's transposed output) once ran as
    # a batched product in the first case only: other bits on AMX.
    torch.manual_seed(0)
    cast_in_call = nn.Linear(8, 6)
    stored = copy.deepcopy(cast_in_call).bfloat16()
    apply_policy(cast_in_call, "mixed_bfloat16")
    apply_policy(stored, "mixed_bfloat16")
    x = torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2).bfloat16()
    assert not x.is_contiguous()
    folded = F.linear(x.reshape(-1, 8), stored.weight, stored.bias).view(*shape[:-1], 6)
    for train in (True, False):
        cast_in_call.train(train), stored.train(train)
        assert torch.equal(cast_in_call(x), folded) and torch.equal(stored(x), folded)


def test_attention_projections_alone_in_bfloat16_run_in_a_float32_model():
    model = tiny_decoder("qwen3")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    # q and k meet float32 q/k norms and rotary tables, v does not
    apply_policy(
        model,
        DTypePolicyMap(
            "float32", {r"model/layers/\d+/self_attn/[qkv]_proj": "int8_from_mixed_bfloat16"}
        ),
    )
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert got.dtype == torch.float32
    error = float((got - want).norm() / want.norm())
    assert 0 < error < 0.05


def test_map_entry_overrides_float32_island():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    handle = apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"1": "bfloat16"}))
    assert handle.float32_paths == []
    assert handle.policies["1"].name == "bfloat16"
    custom = apply_policy(model, "mixed_bfloat16", float32_modules=[nn.Linear])
    assert custom.float32_paths == ["0"]
    none = apply_policy(model, "mixed_bfloat16", float32_modules=())
    assert none.float32_paths == []


def test_remove_restores_exactly_and_reapply_replaces():
    model = mlp()
    x = torch.randn(4, 32)
    reference = model(x)
    classes = [type(m) for m in model.modules()]
    dicts = [set(m.__dict__) for m in model.modules()]
    first = apply_policy(model, "mixed_bfloat16")
    second = apply_policy(model, "bfloat16")
    assert first.removed
    assert model(x).dtype == torch.bfloat16
    second.remove()
    second.remove()  # idempotent
    assert [type(m) for m in model.modules()] == classes
    assert [set(m.__dict__) for m in model.modules()] == dicts
    torch.testing.assert_close(model(x), reference)
    with apply_policy(model, "mixed_bfloat16"):
        assert model(x).dtype == torch.bfloat16
    assert model(x).dtype == torch.float32


def test_errors_leave_model_untouched():
    model = mlp()
    with pytest.raises(ValueError, match="matches multiple dtype policy"):
        apply_policy(model, DTypePolicyMap("float32", {"[0-2]": "bfloat16", "[0-1]": "float16"}))
    assert all(type(m).__module__.startswith("torch") for m in model.modules())
    with pytest.raises(ValueError, match="invalid policy"):
        apply_policy(model, "mixed_float15")
    with pytest.raises(TypeError, match=r"expects a torch\.nn\.Module"):
        apply_policy("model", "float32")
    with pytest.raises(TypeError, match="float32_modules entries"):
        apply_policy(model, "float32", float32_modules=[3])
    with pytest.raises(TypeError, match=r"a module instance: pass its class"):
        apply_policy(model, "float32", float32_modules=[torch.nn.LayerNorm(4)])
    with pytest.raises(TypeError, match=r"float32_modules must be .* Received: 3"):
        apply_policy(model, "float32", float32_modules=3)
    with pytest.raises(TypeError, match=r"weight_cache must be True or False. Received: 'no'"):
        apply_policy(model, "float32", weight_cache="no")
    with pytest.raises(TypeError, match=r"cast_buffers must be True or False. Received: None"):
        apply_policy(model, "float32", cast_buffers=None)
    assert not hasattr(model[0], "dtype_policy")


@pytest.mark.parametrize("rule", ["Norm", torch.nn.LayerNorm, lambda path, module: path == "1"])
def test_one_float32_rule_on_its_own_is_one_rule(rule):
    """A bare string was read letter by letter: "LayerNorm" made every class
    ending in r, m, o, ... (`Linear`) a float32 island."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    handle = apply_policy(model, "mixed_bfloat16", float32_modules=rule)
    assert handle.float32_paths == ["1"]
    assert [model[i].dtype_policy.name for i in (0, 2)] == ["mixed_bfloat16"] * 2


def test_no_grad_and_inference_mode():
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(2, 32)
    with torch.no_grad():
        a = model(x)
    with torch.inference_mode():
        b = model(x)
    c = model(x)  # after inference mode, grad mode still works
    c.float().sum().backward()
    assert a.dtype == b.dtype == c.dtype == torch.bfloat16
    torch.testing.assert_close(a, b)
    assert model[0].weight.grad is not None


def test_pickle_and_deepcopy_keep_policy():
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    clone = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(2, 32)
    for other in (clone, loaded):
        assert other(x).dtype == torch.bfloat16
        torch.testing.assert_close(other(x), model(x))
        assert other[0].dtype_policy == DTypePolicy("mixed_bfloat16")


def test_tied_and_shared_weights_read_by_parent():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(20, 8)
            self.proj = nn.Linear(8, 8)

        def forward(self, ids):
            hidden = self.proj(self.embed(ids))
            return hidden @ self.embed.weight.T  # reads a child's weight directly

    model = Tied()
    apply_policy(model, "mixed_bfloat16")
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert model.embed.weight.grad.dtype == torch.float32


def test_layers_inside_a_plain_model_follow_the_map():
    model = nn.Sequential(layers.Dense(8), nn.ReLU(), layers.Dense(4))
    handle = apply_policy(model, DTypePolicyMap("float32", {"2": "mixed_bfloat16"}))
    assert model[0].path == "0" and model[2].path == "2"
    assert model(torch.randn(2, 3)).dtype == torch.bfloat16
    assert model[0].compute_dtype == "float32"
    handle.remove()
    assert model[2].dtype_policy.name == "float32"


@pytest.mark.parametrize("mode", [None, "int8"])
def test_summary_total_counts_a_tied_table_once(mode):
    """The rows show the shared table under both modules; the total counted
    it twice (279,360 bytes for a model of 213,824)."""
    model = tiny_decoder(tie=True)
    if mode is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dtype_policies.quantize(model, mode)
    stored = {}  # each tensor once, by identity
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None:
                stored[id(tensor)] = tensor.numel() * tensor.element_size()
    assert dtype_policies.apply.model_totals(model)[1] == sum(stored.values())
    assert f"{sum(stored.values()):,} bytes" in dtype_policies.summary(model)
    if mode is None:
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
        unique = sum(p.numel() for p in model.parameters())  # torch counts it once too
        assert dtype_policies.apply.model_totals(model)[0] == unique


def test_summary_lists_every_module():
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    text = dtype_policies.summary(model)
    assert re.search(
        r"^0\s+Linear\s+mixed_bfloat16\s+bfloat16\s+float32\s+-\s+2112\s+8448$", text, re.MULTILINE
    )
    rows = dtype_policies.apply.module_summaries(model)
    assert [r.path for r in rows] == ["(root)", "0", "1", "2", "3", "4"]
    assert rows[1].parameters == 32 * 64 + 64 and rows[1].bytes == 4 * (32 * 64 + 64)
    assert rows[1].policy == "mixed_bfloat16" and rows[1].variable_dtype == "float32"
    assert f"Total: {sum(p.numel() for p in model.parameters()):,} parameters" in text
    dtype_policies.quantize(
        model, "int4", dtype_policies.quantization.Int4QuantizationConfig(block_size=32)
    )
    rows = dtype_policies.apply.module_summaries(model)
    assert rows[1].quantization == "int4/32" and rows[1].parameters == 32 * 64 + 64
    assert (
        rows[1].policy == "int4/32_from_mixed_bfloat16" and rows[1].variable_dtype == "float32,int8"
    )
    assert rows[1].bytes < 4 * (32 * 64 + 64) / 3


@pytest.mark.slow
def test_compile_without_graph_breaks_matches_eager():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(4, 16)
    eager = model(x)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), eager.float(), atol=0.02, rtol=0.02)
    out.float().sum().backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}


def test_get_layer_policy_on_applied_module():
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    assert dtype_policies.mixed_precision.get_layer_policy(model[0]).name == "mixed_bfloat16"
    with pytest.raises(TypeError, match="expects a dtype_policies layer"):
        dtype_policies.mixed_precision.get_layer_policy(nn.Linear(2, 2))


def test_weight_cache_keeps_copies_until_parameters_change():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 4))
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(2, 300)
    with torch.no_grad():
        first = model(x)
        cached = state_of(model[0]).casts.pair[3]
        assert cached.dtype == torch.bfloat16
        model(x)
        assert state_of(model[0]).casts.pair[3] is cached  # no recast
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x).float().sum().backward()
    assert model[0].weight.grad.dtype == torch.float32
    optimizer.step()
    with torch.no_grad():
        after = model(x)
        assert state_of(model[0]).casts.pair[3] is not cached  # recast
    assert not torch.equal(first, after)
    reference = nn.Sequential(nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 4))
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(after.float(), reference(x), atol=0.05, rtol=0.05)
    uncached = nn.Sequential(nn.Linear(300, 300))
    apply_policy(uncached, "mixed_bfloat16", weight_cache=False)
    with torch.no_grad():
        uncached(x)
    assert state_of(uncached[0]).casts.pair is None  # nothing kept


def test_listeners_hear_each_committed_change_once():
    from dtype_policies._core import listeners

    heard = []

    def listener(module, minor):
        heard.append(type(module).__name__ if not minor else "minor")

    def broken(module, minor):
        raise KeyError("boom")

    listeners.add_listener(listener)
    listeners.add_listener(listener)  # once
    try:
        model = mlp()
        handle = apply_policy(model, "mixed_bfloat16")
        apply_policy(model, "float32")  # replaces the first application: one change
        dtype_policies.quantize(model, "int8", filters=r"^0$")
        dtype_policies.quantize(model, "int8", filters="nothing matches")  # no change
        handle.remove()  # already replaced: nothing
        state_of(model).handle.remove()
        assert heard == ["Sequential"] * 4
        listeners.add_listener(broken)
        with pytest.warns(RuntimeWarning, match=r"broken failed after a change to Sequential"):
            apply_policy(model, "mixed_bfloat16")
        assert model[2].dtype_policy.name == "mixed_bfloat16"  # committed all the same
        listeners.remove_listener(broken)
        model.append(nn.Linear(8, 8))  # a module joining: a minor change
        assert heard == ["Sequential"] * 5 + ["minor"]
        with pytest.raises(TypeError, match="Received: 3"):
            listeners.add_listener(3)
    finally:
        listeners.remove_listener(listener)
        listeners.remove_listener(broken)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "bfloat16", "mixed_float16"])
def test_a_transformer_encoder_with_a_padding_mask_in_eval_mode(policy):
    """torch's default `nn.TransformerEncoder` (nested tensors enabled) turns
    a padded batch into nested tensors in eval mode, and its fused layer
    refuses float32 norm weights beside half activations: under a half
    policy it takes the dense path (padded positions are not compared: the
    nested path gives zeros there, the dense path values)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2).eval()
    reference = copy.deepcopy(encoder)
    x = torch.randn(2, 5, 8)
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    handle = apply_policy(encoder, policy)
    with torch.no_grad():
        out = encoder(x, src_key_padding_mask=padding)
        expected = reference(x, src_key_padding_mask=padding)
    assert out.dtype == (torch.bfloat16 if "bfloat16" in policy else torch.float16)
    valid = ~padding
    assert float((out.float() - expected)[valid].abs().max()) < 0.05
    assert encoder.__dict__["use_nested_tensor"] is True  # its own value, kept
    handle.remove()
    assert type(encoder) is nn.TransformerEncoder and encoder.use_nested_tensor is True
    with torch.no_grad():
        assert torch.equal(encoder(x, src_key_padding_mask=padding), expected)


def test_a_map_entry_asking_a_module_for_a_mode_it_cannot_take_is_named():
    """A quantized policy by default (the map's or the whole model's) quietly
    leaves modules of no quantizable kind in its float source; an explicit
    map key that asks for it warns, naming them."""
    model = nn.Sequential(nn.Conv1d(4, 4, 3), nn.Flatten(), nn.Linear(8, 2))
    with pytest.warns(UserWarning, match=r"cannot be quantized in its mode .*'0' \(Conv1d\)"):
        apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"0|1": "int8_from_mixed_bfloat16"}))
    assert model[0].dtype_policy.name == "mixed_bfloat16"
    quiet = nn.Sequential(nn.Conv1d(4, 4, 3), nn.Flatten(), nn.Linear(8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_policy(quiet, "int8_from_mixed_bfloat16")
    assert quiet[2].dtype_policy.name == "int8_from_mixed_bfloat16"


# -- torch.autocast -----------------------------------------------------------------------------


def _autocast_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 24)).eval()


def test_a_float32_island_stays_float32_under_autocast():
    model = _autocast_mlp()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"2": "float32"}))
    x = torch.randn(16, 96)
    with torch.no_grad():
        expected = model[2](x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model[2](x)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_a_policy_computes_as_it_says_under_autocast(autocast_dtype):
    model = _autocast_mlp()
    apply_policy(model, "mixed_float16")
    x = torch.randn(16, 48)
    with torch.no_grad():
        expected = model(x)
        with torch.autocast("cpu", dtype=autocast_dtype):
            out = model(x)
    assert out.dtype == torch.float16
    assert torch.equal(out, expected)


def test_a_policied_model_compiled_under_autocast_computes_as_eager():
    model = _autocast_mlp()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"2": "float32"}))
    x = torch.randn(16, 48)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        expected = compiled(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


@pytest.mark.parametrize("width", range(9))
def test_each_test_compiles_its_containers_without_the_earlier_tests_ones(width):
    """torch compiles every `Sequential` under one shared frame, at most 8
    entries a process (conftest clears them before each test): nine
    policied containers of nine shapes, one per test, each compile whole."""
    from torch._dynamo import external_utils
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = nn.Sequential(nn.Linear(8 + width, 8)).eval()
    apply_policy(model, "mixed_bfloat16")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert compiled(torch.randn(2, 8 + width)).dtype == torch.bfloat16
    shared = external_utils.wrap_inline(len).__code__
    assert len(_debug_get_cache_entry_list(shared)) == 1


def test_autocast_applies_around_policied_modules_not_inside_them():
    torch.manual_seed(0)
    policied = nn.Linear(48, 48)
    apply_policy(policied, "float32")
    plain = nn.Linear(48, 48)
    model = nn.Sequential(plain, policied)
    x = torch.randn(4, 48)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model[0](x).dtype == torch.bfloat16  # no policy: autocast's
        assert model(x).dtype == torch.float32
        # a module without a policy called inside a policied one computes as
        # the policied one does (autocast is disabled for its whole call)
        policied.add_module("inner", nn.Linear(48, 48))
        policied.forward = lambda t: policied.inner(F.linear(t, policied.weight, policied.bias))
        assert policied(x).dtype == torch.float32


@pytest.mark.parametrize(
    "policy", ["float16", "mixed_float16", DTypePolicyMap("mixed_bfloat16", {"1": "float16"})]
)
def test_a_compute_dtype_a_quantized_module_refuses_changes_nothing(policy):
    """int8 does not compute in float16: a policy asking it is refused while
    planning, naming the module, and the model, its earlier application
    included, stays as it was (it was half-applied: the root cast its inputs
    to float16, and the earlier application was removed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    dtype_policies.quantize(model, "int8")
    handle = apply_policy(model, "mixed_bfloat16")
    x = torch.randn(2, 16) * 1e3
    before = model(x)
    classes = [type(m) for m in model.modules()]
    with pytest.raises(
        ValueError, match=r"apply_policy\(\): the module at '[01]' is quantized in mode 'int8'"
    ):
        apply_policy(model, policy)
    assert not handle.removed
    assert [type(m) for m in model.modules()] == classes
    assert torch.equal(model(x), before) and before.dtype == torch.bfloat16


def test_int8_modules_a_float16_policy_keeps_as_float32_islands_take_it():
    """The compute dtype a quantized module's mode must accept is the one it
    computes in: a float32 island of a float16 policy is one int8 takes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    dtype_policies.quantize(model, "int8")
    handle = apply_policy(model, "float16", float32_modules=[nn.Linear])
    assert handle.float32_paths == ["0", "2"]
    with torch.no_grad():
        y = model(torch.randn(2, 64))
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
