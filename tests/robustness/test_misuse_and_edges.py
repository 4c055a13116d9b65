"""Bad inputs get clear errors and change nothing; unusual modules; threads;
numerical edges; Keras compatibility details; loss scaling edges."""

import copy
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import (
    DTypePolicyMap,
    QuantizedFloat8DTypePolicy,
    apply_policy,
    layers,
    quantize,
)
from dtype_policies._core.module_state import state_of
from dtype_policies.optimizers import LossScaleOptimizer
from dtype_policies.quantization import (
    AbsMaxQuantizer,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def snapshot(module):
    return (
        {k: v.clone() for k, v in module.state_dict().items()},
        [type(m) for m in module.modules()],
        [getattr(state_of(m), "call", None) for m in module.modules()],
    )


def unchanged(module, before):
    tensors, classes, states = before
    after = module.state_dict()
    return (
        list(after) == list(tensors)
        and all(torch.equal(after[k], tensors[k]) for k in tensors)
        and [type(m) for m in module.modules()] == classes
        and [getattr(state_of(m), "call", None) for m in module.modules()] == states
    )


def mlp():
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def test_policy_misuse_errors_name_the_value_and_change_nothing():
    model = mlp()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"'int8'.*int8_from_mixed_bfloat16.*quantize"):
        apply_policy(model, "int8")
    with pytest.raises(ValueError, match=r"Invalid regex in `filters`: '\['"):
        quantize(model, "int8", filters="[")
    assert unchanged(model, before)
    quantize(model, "int8")
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"'0'.*mode 'int8'.*int4/128_from_float32"):
        apply_policy(model, "int4/128_from_float32")
    assert unchanged(model, before)
    for name in (
        "int8_from_",
        "int4/ 128_from_float32",
        "int4/+128_from_float32",
        "int4/1.5_from_float32",
    ):
        with pytest.raises(ValueError):
            dtype_policies.get(name)
    with pytest.raises(ValueError, match=r"Invalid quantization mode.*int7"):
        QuantizedFloat8DTypePolicy(mode="int7")


def test_map_keys_matching_nothing_warn_by_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    with pytest.warns(UserWarning, match=r"'encoder\\\\\.layers\\\\\.0' matches no module path"):
        apply_policy(model, DTypePolicyMap("float32", {r"encoder\.layers\.0": "bfloat16"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_policy(model, DTypePolicyMap("float32", {"1.0": "bfloat16"}))  # dotted: matches
    assert model[1][0].dtype_policy.name == "bfloat16"


def test_quantize_is_atomic_and_names_the_failing_module():
    model = nn.Sequential(
        nn.Linear(32, 32),
        layers.Dense(16, dtype="mixed_float16"),  # int8 with float16 compute is refused
        nn.Linear(16, 8),
    )
    model[1].build((None, 32))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"module '1'.*float16"):
        quantize(model, "int8")
    assert unchanged(model, before)
    assert getattr(state_of(model[0]), "quantization", None) is None


def test_unusual_modules_stay_correct():
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)
    encoder.eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        reference = encoder(x)
    report = quantize(encoder, "int8")
    reasons = dict(report.skipped)
    assert "read by its parent" in reasons["layers/0/self_attn/out_proj"]
    assert "read by its parent" in reasons["layers/0/linear1"]
    with torch.no_grad():
        assert torch.allclose(encoder(x), reference, atol=1e-5)

    class ReadsChild(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = nn.Linear(16, 16)

        def forward(self, x):
            return nn.functional.linear(x, self.child.weight, self.child.bias)

    parent = ReadsChild()
    x = torch.randn(3, 16)
    reference = parent(x)
    quantize(parent, "int8")
    assert ((parent(x) - reference).norm() / reference.norm()) < 0.02

    normed = nn.Sequential(
        nn.Linear(16, 16),
        torch.nn.utils.parametrizations.weight_norm(nn.Linear(16, 16)),
        nn.utils.spectral_norm(nn.Linear(16, 8)),
    ).eval()
    reference = normed(x)
    report = quantize(normed, "int8")
    assert [path for path, _, _ in report.quantized] == ["0"]
    assert "parametrized" in dict(report.skipped)["1"]
    assert "spectral_norm" in dict(report.skipped)["2"]
    assert ((normed(x) - reference).norm() / reference.norm()) < 0.02

    bag = nn.EmbeddingBag(10, 4, mode="sum")
    apply_policy(bag, "mixed_bfloat16")
    ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    for weights in (torch.rand(4), torch.rand(4).bfloat16()):
        assert bag(ids, offsets, per_sample_weights=weights).dtype == torch.bfloat16

    recurrent = nn.LSTM(8, 16, batch_first=True)
    apply_policy(recurrent, "float32")
    report = quantize(recurrent, "int8")
    assert report.num_quantized == 0 and report.skipped == [("(root)", "no quantize support")]


def test_tied_weights_are_quantized_once_and_shared():
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 32)
            self.head = nn.Linear(32, 100, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    # int4 keeps a tied table in (weight-only) int8 unless told otherwise.
    for mode, config, stored in (
        ("int8", None, "int8"),
        ("int4", None, "int8"),
        ("int4", Int4QuantizationConfig(tied_embeddings="int4"), "int4"),
    ):
        model = TiedLM()
        ids = torch.randint(0, 100, (2, 5))
        reference = model(ids)
        report = quantize(model, mode, config)
        assert {m for _, m, _ in report.quantized} == {stored}
        assert getattr(model.head, f"weight_{stored}") is getattr(model.embed, f"weight_{stored}")
        assert model.head.weight_scale is model.embed.weight_scale
        assert ((model(ids) - reference).norm() / reference.norm()) < 0.2


def test_small_weight_only_int8_shapes_never_crash():
    for in_features in (17, 33, 100, 64):
        for rows in (1, 2, 5, 16, 17):
            linear = nn.Linear(in_features, 24)
            apply_policy(linear, "mixed_bfloat16")
            quantize(linear, "int8", Int8QuantizationConfig(activation_quantizer=None))
            x = torch.randn(rows, in_features)
            out = linear(x)
            reference = nn.functional.linear(
                x.bfloat16().float(), linear.weight.float(), linear.bias
            )
            assert ((out.float() - reference).norm() / reference.norm()) < 0.02


def test_training_thread_keeps_its_gradients_while_another_evaluates():
    def train(parallel):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        apply_policy(model, "mixed_bfloat16")
        x = torch.randn(8, 16)
        stop = threading.Event()

        def evaluate():
            while not stop.is_set():
                with torch.no_grad():
                    model(x)

        worker = threading.Thread(target=evaluate)
        if parallel:
            worker.start()
        grads = []
        try:
            for _ in range(25):
                model.zero_grad()
                model(x).float().sum().backward()
                grads.append([p.grad.clone() for p in model.parameters()])
        finally:
            stop.set()
            if parallel:
                worker.join()
        return grads

    together, alone = train(True), train(False)
    assert all(torch.equal(a, b) for ga, gb in zip(together, alone) for a, b in zip(ga, gb))


@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_numerical_edges(mode):
    linear = nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight.zero_()
    zero = copy.deepcopy(linear)
    quantize(zero, mode)
    x = torch.randn(4, 64)
    out = zero(x)
    assert torch.isfinite(out).all() and torch.allclose(out, linear.bias.expand(4, 32), atol=1e-6)

    outlier = nn.Linear(64, 32)
    with torch.no_grad():
        outlier.weight[3, 5] = 1e4
    reference = outlier(x)
    quantize(outlier, mode)
    assert torch.isfinite(outlier(x)).all()
    if mode != "float8":  # delayed scaling starts at scale 1: an outlier saturates until calibrated
        assert ((outlier(x) - reference).norm() / reference.norm()) < 0.2

    if mode == "int8":  # a bad row stays in its row (per-row activation scales)
        bad = x.clone()
        bad[1, 7] = float("inf")
        bad[2, 0] = float("nan")
        result = outlier(bad)
        assert torch.isfinite(result[[0, 3]]).all()


def test_loss_scaling_never_writes_non_finite_values():
    for initial_scale in (1e-44, 1e-30, 2.0**15):
        weight = nn.Parameter(torch.ones(4))
        optimizer = LossScaleOptimizer(
            torch.optim.SGD([weight], lr=0.1), initial_scale=initial_scale
        )
        for step in range(200):
            loss = (weight * (1e30 if step < 150 else 1.0)).sum()
            optimizer.scale_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert torch.isfinite(weight).all(), (initial_scale, step)


def test_keras_compatibility_details():
    quantizer = AbsMaxQuantizer(axis=-1, value_range=(-63, 63))
    assert quantizer.axis == (-1,) and quantizer.get_config()["axis"] == (-1,)  # as Keras
    q, scale = quantizer(torch.tensor([[0.5, -1.0]]))
    assert q.tolist() == [[31, -63]] and q.dtype == torch.int8  # 31.49999..., epsilon included
    assert torch.allclose(scale, torch.tensor([[63.0]]))
    assert Int4QuantizationConfig(block_size=None).block_size is None

    embedding = layers.Embedding(50, 16)
    embedding.build()
    embedding.quantize("int8", Int8QuantizationConfig(weight_quantizer=quantizer))
    assert embedding.embeddings.abs().max() <= 63

    dense = layers.Dense(10)
    dense.build((None, 20))
    float_kernel = dense.kernel.detach().clone()
    dense.quantize("int4", Int4QuantizationConfig(block_size=-1))
    values = dense.kernel
    assert values.shape == float_kernel.shape and values.dtype == torch.int8
    assert values.min() >= -8 and values.max() <= 7
