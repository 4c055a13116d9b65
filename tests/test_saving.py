"""saving.save / saving.load: bit-exact round trips of policies and every
quantization, meta-device targets, mismatches and corrupted files that leave
the target unchanged, atomic writes, policy files."""

import copy
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

from dtype_policies import DTypePolicyMap, apply_policy, layers, quantize, saving
from dtype_policies._core.module_state import state_of
from dtype_policies.quantization import (
    Float8QuantizationConfig,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
)

pytest.importorskip("safetensors")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def mlp():
    return nn.Sequential(
        nn.Linear(64, 96), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 64), nn.Linear(64, 16)
    )


def snapshot(module):
    """Everything that must survive a failed load: tensors bit for bit, classes, policies."""
    return (
        {k: v.clone() for k, v in module.state_dict().items()},
        [type(m) for m in module.modules()],
        [getattr(state_of(m), "call", None) for m in module.modules()],
    )


def assert_unchanged(module, before):
    tensors, classes, states = before
    after = module.state_dict()
    assert list(after) == list(tensors)
    assert all(torch.equal(after[k], tensors[k]) for k in tensors)
    assert [type(m) for m in module.modules()] == classes
    assert [getattr(state_of(m), "call", None) for m in module.modules()] == states


def prepare(model, policy, mode, config):
    if policy is not None:
        apply_policy(model, policy)
    if mode is not None:
        quantize(model, mode, config)
    return model


CASES = {
    "float32": (None, None, None),
    "mixed_bfloat16": ("mixed_bfloat16", None, None),
    "map_with_islands": (
        DTypePolicyMap("mixed_bfloat16", {"3": "float32", "0": "bfloat16"}),
        None,
        None,
    ),
    "int8": ("mixed_bfloat16", "int8", None),
    "int8_weight_only": (
        "mixed_bfloat16",
        "int8",
        Int8QuantizationConfig(activation_quantizer=None),
    ),
    "int4_grouped": ("mixed_bfloat16", "int4", Int4QuantizationConfig(block_size=32)),
    "int4_per_channel": ("mixed_bfloat16", "int4", Int4QuantizationConfig(block_size=-1)),
    "int4_searched": (
        "mixed_bfloat16",
        "int4",
        Int4QuantizationConfig(block_size=32, scale_search=True),
    ),
    "int8_from_float32": (None, "int8", None),
    "float8": ("mixed_bfloat16", "float8", None),
    "float8_dynamic": ("mixed_bfloat16", "float8", Float8QuantizationConfig(scaling="dynamic")),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("on_meta", [False, True], ids=["cpu", "meta"])
def test_round_trip_is_bit_exact(case, on_meta, tmp_path):
    torch.manual_seed(0)
    model = prepare(mlp(), *CASES[case])
    x = torch.randn(20, 64)
    if CASES[case][1] == "float8":  # train a few steps so scales and histories move
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            model(x).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
    with torch.no_grad():
        expected = model(x)
    path = saving.save(model, tmp_path / "checkpoint")
    assert (
        path.name == "model.safetensors"
        and (tmp_path / "checkpoint" / "dtype_policies.json").is_file()
    )
    if on_meta:
        with torch.device("meta"):
            fresh = mlp()
    else:
        torch.manual_seed(1)
        fresh = mlp()
    loaded = saving.load(fresh, path)
    assert loaded is fresh
    loaded.eval()
    with torch.no_grad():
        out = loaded(x)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)
    original_state, loaded_state = model.state_dict(), loaded.state_dict()
    assert list(loaded_state) == list(original_state)
    assert all(torch.equal(loaded_state[k], original_state[k]) for k in original_state)
    assert [
        getattr(state_of(m), "call", None) and state_of(m).call.policy for m in loaded.modules()
    ] == [getattr(state_of(m), "call", None) and state_of(m).call.policy for m in model.modules()]
    assert not any(t.device.type == "meta" for t in loaded.state_dict().values())


def test_layers_model_round_trip_with_quantized_sublayers(tmp_path):
    torch.manual_seed(0)

    def build():
        return layers.Sequential(
            [
                layers.Embedding(50, 32, dtype="mixed_bfloat16"),
                layers.MultiHeadAttention(num_heads=2, key_dim=16, dtype="mixed_bfloat16"),
            ],
            name="model",
        )

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = layers.Embedding(50, 32, dtype="mixed_bfloat16")
            self.attention = layers.MultiHeadAttention(
                num_heads=2, key_dim=16, dtype="mixed_bfloat16"
            )
            self.head = layers.Dense(8, dtype="int4/32_from_mixed_bfloat16")

        def forward(self, ids):
            h = self.embed(ids)
            return self.head(self.attention(h, h))

    model = Block()
    ids = torch.randint(0, 50, (2, 6))
    model(ids)
    quantize(model, "int8", filters="attention")
    expected = model(ids)
    path = saving.save(model, tmp_path / "block.safetensors")
    fresh = Block()
    fresh(ids)  # built, as a user would have it
    saving.load(fresh, path)
    assert torch.equal(fresh(ids), expected)
    assert fresh.attention.query.dtype_policy.name == "int8_from_mixed_bfloat16"
    assert fresh.head.kernel.dtype == torch.int8
    del build


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
def test_a_policy_map_given_to_layers_is_restored_by_load(quantized, tmp_path):
    """Keras's saved configs hold a layer's `DTypePolicyMap`, not its entry:
    the loaded layers share one map equal to the saved one again, resolved
    at the saved paths, whatever policy the target was built with."""

    def build(dtype=None):
        kwargs = {} if dtype is None else {"dtype": dtype}
        model = layers.Sequential(
            [layers.Dense(16, **kwargs), layers.Dense(8, **kwargs)], name="model", **kwargs
        )
        model(torch.randn(2, 32))
        return model

    policy_map = DTypePolicyMap("float32", {"model/0": "mixed_bfloat16"})
    torch.manual_seed(0)
    model = build(policy_map)
    if quantized:
        quantize(model, "int8")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    expected = model(x)
    path = saving.save(model, tmp_path / "m.safetensors")
    torch.manual_seed(1)
    loaded = saving.load(build(), path)
    assert loaded.dtype_policy.is_map and loaded.dtype_policy == model.dtype_policy
    assert all(layer.dtype_policy is loaded.dtype_policy for layer in loaded.layers)
    assert [layer.path for layer in loaded.layers] == ["model/0", "model/1"]
    assert [layer.dtype_policy.name for layer in loaded.layers] == [
        layer.dtype_policy.name for layer in model.layers
    ]
    assert torch.equal(loaded(x), expected)


def test_a_loaded_layer_keeps_its_path(tmp_path):
    model = layers.Sequential([layers.Dense(8, dtype="mixed_bfloat16")], name="model")
    model(torch.randn(2, 4))
    path = saving.save(model, tmp_path / "m.safetensors")
    target = layers.Sequential([layers.Dense(8)], name="model")
    target(torch.randn(2, 4))
    saving.load(target, path)
    assert target.layers[0].dtype_policy.name == "mixed_bfloat16"
    assert target.layers[0].path == "model/0"


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("mode", [None, "int8", "int4"])
def test_a_module_registered_under_two_names_round_trips(mode, device, tmp_path):
    """`Sequential(lin, ReLU(), lin)`: the state dict has the module's keys
    under both names; quantized, the load expected the float weight under
    the second name and refused every such checkpoint."""

    def build():
        torch.manual_seed(0)
        shared = nn.Linear(16, 16)
        return nn.Sequential(shared, nn.ReLU(), shared)

    model = build()
    apply_policy(model, "mixed_bfloat16")
    if mode is not None:
        quantize(model, mode)
    x = torch.randn(3, 16)
    expected = model(x)
    saving.save(model, tmp_path / "model")
    with torch.device(device):
        target = build()
    saving.load(target, tmp_path / "model")
    assert target[0] is target[2]
    assert torch.equal(target(x), expected)


class LM(nn.Module):
    """An embedding and an output head, their weights tied or not."""

    def __init__(self, tie):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64, bias=False)
        if tie:
            self.head.weight = self.embed.weight


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_tied_checkpoint_loads_into_an_untied_target_as_two_tensors(tmp_path, device, quantized):
    torch.manual_seed(0)
    source = LM(tie=True)
    if quantized:
        quantize(source, "int8")
    path = saving.save(source, tmp_path / "tied.safetensors")
    with torch.device(device):
        target = LM(tie=False)
    saving.load(target, path)
    name = "weight_int8" if quantized else "weight"
    head, embed = getattr(target.head, name), getattr(target.embed, name)
    assert torch.equal(head, getattr(source.embed, name))
    assert head.data_ptr() != embed.data_ptr()
    with torch.no_grad():
        head.zero_()  # writing one leaves the other alone
    assert torch.equal(embed, getattr(source.embed, name))


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("policy", [None, "mixed_bfloat16", "float8", "int8", "int4"])
def test_an_untied_checkpoint_is_refused_by_a_tied_target(tmp_path, device, policy):
    torch.manual_seed(0)
    source = LM(tie=False)
    if policy in ("float8", "int8", "int4"):
        quantize(source, policy)
    elif policy:
        apply_policy(source, policy)
    path = saving.save(source, tmp_path / "untied.safetensors")
    with torch.device(device):
        target = LM(tie=True)
    before = {k: v.clone() for k, v in target.state_dict().items()} if device == "cpu" else None
    with pytest.raises(
        saving.CheckpointError, match=r"'embed.weight(_int[48])?', 'head.weight(_int[48])?' are one"
    ):
        saving.load(target, path)  # one of the two tables would be dropped
    assert target.head.weight is target.embed.weight
    if before is not None:
        for key, value in target.state_dict().items():
            assert torch.equal(value, before[key]), key
    untied = saving.load(LM(tie=False), path)  # the right target loads it
    assert torch.equal(untied.head.weight, source.head.weight)


@pytest.mark.parametrize("policy", [None, "mixed_bfloat16"])
def test_a_checkpoint_of_another_module_class_is_refused(tmp_path, policy):
    transformers = pytest.importorskip("transformers")
    source = nn.Sequential(nn.Linear(16, 16))
    if policy:
        apply_policy(source, policy)
    path = saving.save(source, tmp_path / "linear.safetensors")
    target = nn.Sequential(transformers.pytorch_utils.Conv1D(16, 16))  # its weight transposed
    before = target[0].weight.detach().clone()
    with pytest.raises(saving.CheckpointError, match="'0' is a Linear in the checkpoint"):
        saving.load(target, path)
    assert torch.equal(target[0].weight, before)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.__setitem__("non_persistent", ["0.nope"]), "'0.nope' is in neither"),
        (lambda m: m["quantized"]["0"].__setitem__("mode", "gptq"), "'0': "),
        (lambda m: m["modules"]["0"].__setitem__("outputs", "bogus"), "'outputs' must name"),
        (lambda m: m["modules"]["0"].__setitem__("island", "no"), "'island' must be true or"),
        (lambda m: m["modules"]["0"].__setitem__("islnd", True), "unknown fields ['islnd']"),
        (lambda m: m.__setitem__("modules", []), "'modules' must be an object"),
        (lambda m: m.__setitem__("library_version", 3), "'library_version' must be a string"),
        (lambda m: m["quantized"]["0"].__setitem__("float_shape", None), "'float_shape' must"),
        (lambda m: m["quantized"]["0"].__setitem__("float_shape", ["8", 8]), "entry 0 must be an"),
        (lambda m: m["quantized"]["0"].pop("stored"), "lacks 'stored'"),
        (lambda m: m.__setitem__("non_persistent", "0.x"), "'non_persistent' must be a list"),
        (lambda m: m.__setitem__("layer_maps", {"0": {"map": "a", "path": "0"}}), "'map' must"),
        (lambda m: m.__setitem__("policy_maps", ["ab"]), "'policy_maps' entry 0 must be an"),
        (lambda m: m.__setitem__("aliases", {"1.bias": "0.bias"}), "also a tensor of its own"),
        (lambda m: m.__setitem__("aliases", {"1.x": "1.x"}), "maps '1.x' to itself"),
        (
            lambda m: m["modules"]["0"]["policy"]["config"].__setitem__("name", "int3"),
            "'modules' entry '0': Cannot convert 'int3'",
        ),
        (
            lambda m: m["quantized"]["0"]["config"]["config"].__setitem__("weight_bits", 9),
            "'quantized' entry '0': ",
        ),
    ],
)
def test_a_manifest_edited_by_hand_is_refused_before_anything_changes(tmp_path, edit, message):
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    path = saving.save(model, tmp_path / "edited.safetensors")
    with safe_open(str(path), "pt") as reader:
        metadata = reader.metadata()
    manifest = json.loads(metadata["dtype_policies"])
    edit(manifest)
    save_file(load_file(str(path)), str(path), {**metadata, "dtype_policies": json.dumps(manifest)})
    target = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(saving.CheckpointError, match=re.escape(message)):
        saving.load(target, path)
    assert not any(hasattr(m, "dtype_policy") for m in target.modules())
    assert target.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


class WithBuffer(nn.Module):
    def __init__(self, persistent):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.register_buffer("scale", torch.arange(16.0), persistent=persistent)

    def forward(self, x):
        return self.linear(x) * self.scale


@pytest.mark.parametrize("saved_persistent", [False, True])
@pytest.mark.parametrize("on_meta", [False, True], ids=["cpu", "meta"])
def test_a_buffer_whose_persistence_changed_loads_as_the_target_keeps_it(
    saved_persistent, on_meta, tmp_path
):
    # a model class whose buffer became (non-)persistent between versions:
    # the file holds its tensor either way, and the target's class decides
    torch.manual_seed(0)
    model = WithBuffer(saved_persistent)
    with torch.no_grad():
        model.scale.mul_(3)
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    path = saving.save(model, tmp_path / "m.safetensors")
    with torch.device("meta" if on_meta else "cpu"):
        target = WithBuffer(not saved_persistent)
    saving.load(target, path)
    assert torch.equal(target.scale, model.scale)
    assert ("scale" in target.state_dict()) is not saved_persistent  # still the target's
    x = torch.randn(3, 16)
    # a persistent buffer is state, read in the compute dtype; a non-persistent
    # one a constant of the module's code, read as stored: each as its class says
    same_class = WithBuffer(not saved_persistent)
    apply_policy(same_class, "mixed_bfloat16")
    quantize(same_class, "int8")
    same_class.load_state_dict(model.state_dict(), strict=False)
    same_class.scale = model.scale.clone()
    assert torch.equal(target(x), same_class(x))
    assert torch.allclose(target(x).float(), model(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "built", ["cpu", "meta", "inference_mode"], ids=["cpu", "meta", "inference-tensors"]
)
@pytest.mark.parametrize("mode", [None, "int8", "int4"])
def test_a_load_inside_inference_mode_leaves_a_model_that_trains(mode, built, tmp_path):
    """A target built inside `torch.inference_mode()` (a server's) holds
    inference tensors, which no copy outside that mode may write: the load
    raised torch's RuntimeError after applying the policies and quantizing."""
    torch.manual_seed(0)
    model = prepare(mlp(), "mixed_bfloat16", mode, None)
    path = saving.save(model, tmp_path / "m.safetensors")
    with torch.device("meta" if built == "meta" else "cpu"):
        if built == "inference_mode":
            with torch.inference_mode():
                target = mlp()
        else:
            target = mlp()
    with torch.inference_mode():
        saving.load(target, path)
    tensors = [*target.parameters(), *target.buffers()]
    assert not any(t.is_inference() for t in tensors)
    x = torch.randn(4, 64)
    out = target(x)
    assert torch.equal(out, model(x))
    out.float().square().mean().backward()
    assert target[2].weight.grad is not None  # the LayerNorm trains


def test_a_target_with_one_inference_tensor_keeps_its_other_parameters(tmp_path):
    """One buffer made under inference_mode switched the whole load to
    `assign`: every parameter became a new object, and an optimizer built
    before the load stepped tensors the model no longer held, silently."""
    torch.manual_seed(0)
    model = prepare(mlp(), "mixed_bfloat16", "int8", None)
    model[3].register_buffer("statistic", torch.ones(3))
    path = saving.save(model, tmp_path / "m.safetensors")
    target = mlp()
    with torch.inference_mode():
        target[3].register_buffer("statistic", torch.zeros(3))
        # one the file does not hold (a rotary inv_freq): it keeps its values
        target[3].register_buffer("frequencies", torch.arange(4.0), persistent=False)
    first = target[2].weight  # the LayerNorm's (the linears' are quantized by the load)
    optimizer = torch.optim.SGD(target.parameters(), lr=0.1)
    saving.load(target, path)
    assert target[2].weight is first and torch.equal(target[3].statistic, torch.ones(3))
    assert torch.equal(target[3].frequencies, torch.arange(4.0))
    assert not any(t.is_inference() for t in [*target.parameters(), *target.buffers()])
    x = torch.randn(2, 64)
    assert torch.equal(target(x), model(x))
    target(x).float().square().mean().backward()
    optimizer.step()
    assert not torch.equal(target[2].weight, model[2].weight)  # the step reached the model


def test_a_data_parallel_wrapper_saves_and_loads_the_model_it_wraps(tmp_path):
    """`saving.save(ddp_model)` wrote `module.`-prefixed keys under the
    wrapper's class: the model it wraps could not load the file."""
    torch.manual_seed(0)
    model = prepare(mlp(), "mixed_bfloat16", "int8", None)
    path = saving.save(nn.DataParallel(model), tmp_path / "m.safetensors")
    x = torch.randn(2, 64)
    assert torch.equal(saving.load(mlp(), path)(x), model(x))
    # quantized before it was wrapped, as quantize() asks (a float model is
    # refused: the file would quantize under the wrapper)
    wrapped = nn.DataParallel(prepare(mlp(), "mixed_bfloat16", "int8", None))
    assert saving.load(wrapped, path) is wrapped
    assert torch.equal(wrapped(x), model(x))
    with pytest.raises(ValueError, match="DataParallel"):
        saving.load(nn.DataParallel(mlp()), path)


def test_every_dtype_safetensors_stores_round_trips_and_others_are_named(tmp_path):
    from dtype_policies.saving.checkpoint import _writable_dtypes, dtype_of_code

    class Holder(nn.Module):
        def __init__(self, dtypes):
            super().__init__()
            for i, dtype in enumerate(dtypes):
                self.register_buffer(f"b{i}", torch.ones(3, 2).to(dtype))

    writable = sorted(_writable_dtypes(), key=str)
    assert {torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn} <= set(writable)
    saving.load(Holder(writable), saving.save(Holder(writable), tmp_path / "all.safetensors"))
    assert dtype_of_code("F8_E5M2") is torch.float8_e5m2
    path = tmp_path / "c128.safetensors"
    with pytest.raises(saving.CheckpointError, match=r"'b1' \(torch\.complex128\).*float32"):
        saving.save(Holder([torch.float32, torch.complex128]), path)
    assert not path.exists()


def test_two_threads_saving_into_one_directory_leave_a_matching_pair(tmp_path, monkeypatch):
    # the model file and its review copy are written as one: a second save
    # into the directory waits for the first one's pair (forced interleaving)
    import json
    import threading

    from safetensors import safe_open

    from dtype_policies.saving import checkpoint

    original = checkpoint.write_atomically
    paused, resume = threading.Event(), threading.Event()

    def pausing(target, write):
        original(target, write)
        if target.name == checkpoint.MODEL_FILE and threading.current_thread().name == "first":
            paused.set()
            resume.wait(timeout=10)

    monkeypatch.setattr(checkpoint, "write_atomically", pausing)
    quantized = prepare(mlp(), "mixed_bfloat16", "int8", None)
    plain = prepare(mlp(), "float16", None, None)
    first = threading.Thread(target=saving.save, args=(quantized, tmp_path), name="first")
    second = threading.Thread(target=saving.save, args=(plain, tmp_path), name="second")
    first.start()
    assert paused.wait(timeout=10)
    second.start()
    second.join(timeout=0.5)
    resume.set()
    first.join()
    second.join()
    with safe_open(str(tmp_path / checkpoint.MODEL_FILE), "pt") as reader:
        in_file = json.loads(reader.metadata()["dtype_policies"])
    review = json.loads((tmp_path / checkpoint.MANIFEST_FILE).read_text())
    assert review == in_file
    assert in_file["quantized"] == {}  # the second save's, written last


def test_tied_weights_stay_tied_and_shared(tmp_path):
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 32)
            self.body = nn.Linear(32, 32)
            self.head = nn.Linear(32, 100, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.body(self.embed(ids)))

    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 7))
    # quantized: both sides, or one side only (the other keeps its float parameter)
    for quantized in (None, "embed|head", "embed", "head"):
        model = TiedLM()
        apply_policy(model, "mixed_bfloat16")
        if quantized:
            quantize(model, "int8", filters=quantized)
        expected = model(ids)
        path = saving.save(model, tmp_path / f"tied{quantized}.safetensors")
        for device in ("cpu", "meta"):
            with torch.device(device):
                fresh = TiedLM()
            saving.load(fresh, path)
            assert torch.equal(fresh(ids), expected), (quantized, device)
            if quantized == "embed|head":
                assert fresh.head.weight_int8 is fresh.embed.weight_int8
            elif quantized is None:
                assert fresh.head.weight is fresh.embed.weight
            else:
                float_side = fresh.head if quantized == "embed" else fresh.embed
                assert float_side.weight.device.type == "cpu"


def test_mismatches_raise_naming_the_path_and_change_nothing(tmp_path):
    model = prepare(mlp(), "mixed_bfloat16", "int8", None)
    path = saving.save(model, tmp_path / "m.safetensors")

    wider = nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 64), nn.Linear(64, 16)
    )
    before = snapshot(wider)
    with pytest.raises(saving.CheckpointError, match=r"'0'.*shape|'0\.weight_int8'"):
        saving.load(wider, path)
    assert_unchanged(wider, before)

    missing_layer = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 64))
    before = snapshot(missing_layer)
    with pytest.raises(saving.CheckpointError, match="'4'"):
        saving.load(missing_layer, path)
    assert_unchanged(missing_layer, before)

    other_mode = mlp()
    quantize(other_mode, "int4")
    before = snapshot(other_mode)
    with pytest.raises(
        saving.CheckpointError,
        match=r"the target is quantized in mode 'int4' .*the checkpoint holds it in mode 'int8'",
    ):
        saving.load(other_mode, path)
    assert_unchanged(other_mode, before)


def test_a_plain_model_is_unchanged_by_a_load_that_does_not_fit(tmp_path):
    """No policy anywhere, checkpoint or target: the whole load is checked
    before any tensor is copied (torch's strict load copies the tensors that
    fit, then raises), and one error lists every key that does not fit."""
    torch.manual_seed(0)
    path = saving.save(mlp(), tmp_path / "m.safetensors")
    torch.manual_seed(1)
    target = nn.Sequential(
        nn.Linear(64, 96), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 32), nn.Linear(32, 16),
        nn.Linear(16, 4),
    )  # fmt: skip
    before = snapshot(target)
    with pytest.raises(saving.CheckpointError) as info:
        saving.load(target, path)
    message = str(info.value)
    assert "'3.weight': checkpoint ((64, 96), 'F32'), target ((32, 96), 'F32')" in message
    assert "'4.weight': checkpoint ((16, 64), 'F32'), target ((16, 32), 'F32')" in message
    assert "'5.weight' is missing from the checkpoint" in message
    assert_unchanged(target, before)


def test_one_error_lists_every_way_the_target_differs(tmp_path):
    """Another quantization mode and other tensor shapes, in one error: the
    module that cannot be planned does not hide the tensors that differ."""
    model = prepare(mlp(), "mixed_bfloat16", "int8", None)
    path = saving.save(model, tmp_path / "m.safetensors")
    target = nn.Sequential(
        nn.Linear(64, 96), nn.GELU(), nn.LayerNorm(128), nn.Linear(96, 64), nn.Linear(64, 16)
    )
    quantize(target[4], "int4")
    before = snapshot(target)
    with pytest.raises(saving.CheckpointError) as info:
        saving.load(target, path)
    message = str(info.value)
    assert "'4': the target is quantized in mode 'int4'" in message
    assert "'2.weight': checkpoint ((96,), 'F32'), target ((128,), 'F32')" in message
    assert "'2.bias'" in message and "'4.weight_int4'" not in message
    assert_unchanged(target, before)


@pytest.mark.parametrize("target_policy", ["float32", "bfloat16", "mixed_float16", "float16"])
def test_the_saved_policies_win_over_the_targets(target_policy, tmp_path):
    """A target with a policy of its own gets the saved policies, quantized
    modules included (their source is the saved policy, not the target's):
    float16 compute, which int8 refuses, is no obstacle."""
    model = prepare(mlp(), "mixed_bfloat16", "int8", None)
    x = torch.randn(4, 64)
    expected = model(x)
    path = saving.save(model, tmp_path / "m.safetensors")
    target = mlp()
    apply_policy(target, target_policy)
    saving.load(target, path)
    assert target[0].dtype_policy.name == "int8_from_mixed_bfloat16"
    assert torch.equal(target(x), expected)

    extra = nn.Sequential(*mlp(), nn.Linear(16, 4))
    before = snapshot(extra)
    with pytest.raises(saving.CheckpointError, match=r"'5\.weight' is missing from the checkpoint"):
        saving.load(extra, path)
    assert_unchanged(extra, before)


@pytest.mark.parametrize("mode", [None, "int8", "float8"])
@pytest.mark.parametrize("applied_on", ["root", "part"])
def test_a_checkpoint_without_policies_leaves_the_target_none(mode, applied_on, tmp_path):
    """The manifest records every policied module, so a module it does not
    list had none: the target's policies (apply_policy on it or on a part of
    it) give way, and a quantized module computes in its weight's dtype."""
    torch.manual_seed(0)
    model = prepare(mlp(), None, mode, None)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    expected = model(x)
    path = saving.save(model, tmp_path / "m.safetensors")
    target = mlp()
    apply_policy(target if applied_on == "root" else target[:3], "mixed_bfloat16")
    saving.load(target, path)
    assert [getattr(m, "dtype_policy", None) for m in target] == [
        getattr(m, "dtype_policy", None) for m in model
    ]
    out = target(x)
    assert out.dtype == torch.float32 and torch.equal(out, expected)


def built(on_meta, dtype=torch.float32):
    if not on_meta:
        torch.manual_seed(1)
        return mlp().to(dtype)
    with torch.device("meta"):
        return mlp().to(dtype)


@pytest.mark.parametrize("case", ["float32", "mixed_bfloat16", "int8_from_float32", "int8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("on_meta", [False, True], ids=["cpu", "meta"])
def test_loading_into_a_converted_target_is_loading_then_converting(case, dtype, on_meta, tmp_path):
    """A target converted by `.half()` / `.to(dtype)` before loading ends as
    the loaded model converted after: float tensors in the target's dtype,
    stored int8 data and scales as saved, int8 without a policy computing in
    float32 and handing on float16 (as `.half()` of a quantized module)."""
    torch.manual_seed(0)
    path = saving.save(prepare(mlp(), *CASES[case]), tmp_path / "m.safetensors")
    load_then_convert = saving.load(built(on_meta), path).to(dtype)
    convert_then_load = saving.load(built(on_meta, dtype), path)
    expected, state = load_then_convert.state_dict(), convert_then_load.state_dict()
    assert list(state) == list(expected)
    assert all(state[k].dtype == expected[k].dtype for k in expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert [getattr(m, "dtype_policy", None) for m in convert_then_load] == [
        getattr(m, "dtype_policy", None) for m in load_then_convert
    ]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    out, expected_out = convert_then_load(x), load_then_convert(x)
    assert out.dtype == expected_out.dtype and torch.equal(out, expected_out)
    if case in ("float32", "int8_from_float32"):  # no policy: the model's dtype throughout
        assert out.dtype == dtype


@pytest.mark.parametrize("on_meta", [False, True], ids=["cpu", "meta"])
@pytest.mark.parametrize("mode", [None, "int8"])
def test_bfloat16_variables_load_into_a_float32_target(on_meta, mode, tmp_path):
    """A model whose variables are bfloat16 (the "bfloat16" policy on a
    `.bfloat16()` model) loads into a float32-built target: the target keeps
    its float32 parameters (a policy never re-types them), holding the saved
    values exactly, and computes the saved outputs bit for bit."""
    torch.manual_seed(0)
    model = prepare(mlp().bfloat16(), "bfloat16", mode, None)
    path = saving.save(model, tmp_path / "m.safetensors")
    target = saving.load(built(on_meta), path)
    saved = model.state_dict()
    for key, tensor in target.state_dict().items():
        expected = torch.float32 if saved[key].dtype == torch.bfloat16 else saved[key].dtype
        assert tensor.dtype == expected and torch.equal(tensor, saved[key].to(expected))
    assert target[0].dtype_policy == model[0].dtype_policy
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(target(x), model(x))


def test_a_stored_tensor_of_another_dtype_is_refused(tmp_path):
    """Only float tensors load converted: the stored tensors of a quantized
    module (int8 data, float32 scales) must have the file's dtypes."""
    torch.manual_seed(0)
    path = saving.save(prepare(mlp(), None, "int8", None), tmp_path / "m.safetensors")
    target = mlp()
    quantize(target, "int8")
    target[0].weight_scale.data = target[0].weight_scale.data.half()
    before = snapshot(target)
    with pytest.raises(
        saving.CheckpointError, match=r"'0\.weight_scale': checkpoint .*'F32'.*'F16'"
    ):
        saving.load(target, path)
    assert_unchanged(target, before)


def test_layers_keep_the_saved_policy_the_target_had_only_by_apply_policy(tmp_path):
    """A layer whose saved policy the target gave it by apply_policy keeps it
    when the load replaces that application (it compared before as equal)."""

    def build(first=None):
        kwargs = {} if first is None else {"dtype": first}
        model = layers.Sequential([layers.Dense(8, **kwargs), layers.Dense(4)], name="m")
        model(torch.randn(2, 16))
        return model

    torch.manual_seed(0)
    model = build("mixed_bfloat16")
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    expected = model(x)
    path = saving.save(model, tmp_path / "m.safetensors")
    target = build()
    apply_policy(target, "mixed_bfloat16")
    saving.load(target, path)
    assert [layer.dtype_policy.name for layer in target.layers] == ["mixed_bfloat16", "float32"]
    assert torch.equal(target(x), expected)


@pytest.mark.parametrize(
    "damage",
    [
        "truncate",
        "truncate_header",
        "garbage",
        "empty",
        "bad_manifest",
        "foreign",
        "alien_version",
        "unknown_policy",
        "mode_unlike_config",
        "non_finite_scale",
        "zero_scale",
    ],
)
def test_corrupted_files_raise_clearly_and_change_nothing(damage, tmp_path):
    model = prepare(mlp(), "mixed_bfloat16", "int8", None)
    path = saving.save(model, tmp_path / "m.safetensors")
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "truncate_header":
        path.write_bytes(data[:20])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "unknown_policy":  # a manifest edited by hand
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(path), framework="pt") as reader:
            metadata = reader.metadata()
            tensors = {key: reader.get_tensor(key) for key in reader.keys()}  # noqa: SIM118
        manifest = metadata["dtype_policies"].replace('"mixed_bfloat16"', '"mixed_bfloat17"')
        assert manifest != metadata["dtype_policies"]
        save_file(tensors, str(path), metadata={**metadata, "dtype_policies": manifest})
    elif damage in ("non_finite_scale", "zero_scale"):  # refused before the target changes
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(path), framework="pt") as reader:
            metadata = reader.metadata()
            tensors = {key: reader.get_tensor(key) for key in reader.keys()}  # noqa: SIM118
        scale = next(key for key in tensors if key.endswith("weight_scale"))
        tensors[scale].view(-1)[0] = float("inf") if damage == "non_finite_scale" else 0.0
        save_file(tensors, str(path), metadata=metadata)
    elif damage == "mode_unlike_config":  # int8's config under a record saying int4
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(path), framework="pt") as reader:
            metadata = reader.metadata()
            tensors = {key: reader.get_tensor(key) for key in reader.keys()}  # noqa: SIM118
        manifest = metadata["dtype_policies"].replace('"mode": "int8"', '"mode": "int4"', 1)
        assert manifest != metadata["dtype_policies"]
        save_file(tensors, str(path), metadata={**metadata, "dtype_policies": manifest})
    else:
        from safetensors.torch import save_file

        metadata = {
            "bad_manifest": {"dtype_policies": "{not json"},
            "foreign": {"format": "pt"},
            "alien_version": {
                "dtype_policies": '{"format": "dtype_policies", "format_version": 99}'
            },
        }[damage]
        save_file({"0.weight": torch.zeros(2)}, str(path), metadata=metadata)
    target = mlp()
    before = snapshot(target)
    with pytest.raises(saving.CheckpointError, match=str(path.name)) as raised:
        saving.load(target, path)
    assert_unchanged(target, before)
    if damage == "mode_unlike_config":
        assert "the record's mode 'int4' and its quantization config" in str(raised.value)
    if damage == "non_finite_scale":
        assert "1 non-finite value(s) (first: inf" in str(raised.value)


@pytest.mark.parametrize(
    ("group", "message"),
    [(7.0, "first: 7.0"), (-1.0, "first: -1.0"), (0.5, "first: 0.5"), (None, None)],
    ids=["past-the-last", "negative", "fraction", "permuted"],
)
def test_group_indices_out_of_range_are_refused_by_every_load(group, message, tmp_path):
    """An int4 checkpoint whose `g_idx` names no group loaded without a word:
    7 failed at the first call with a bare IndexError, -1 gathered the last
    group's scales (wrong values), 0.5 was truncated. A permutation of the
    groups (activation order's) is a valid weight and loads."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dtype_policies.quantizers import Int4QuantizationConfig

    torch.manual_seed(0)
    config = Int4QuantizationConfig(block_size=32)
    model = prepare(mlp(), "mixed_bfloat16", "int4", config)
    path = saving.save(model, tmp_path / "m.safetensors")
    with safe_open(str(path), framework="pt") as reader:
        metadata = reader.metadata()
        tensors = {key: reader.get_tensor(key) for key in reader.keys()}  # noqa: SIM118
    g_idx = tensors["3.weight_g_idx"]
    if group is None:
        g_idx.copy_(g_idx.flip(0))
    else:
        g_idx[5] = group
    save_file(tensors, str(path), metadata=metadata)
    target = mlp()
    quantized = prepare(mlp(), "mixed_bfloat16", "int4", config)
    if message is None:
        saving.load(target, path)
        quantized.load_state_dict(tensors)
        x = torch.randn(2, 64)
        assert torch.equal(target(x), quantized(x))
        return
    loads = [
        (target, lambda: saving.load(target, path)),
        (quantized, lambda: quantized.load_state_dict(tensors)),
    ]
    for module, load in loads:
        before = snapshot(module)
        with pytest.raises(ValueError, match=f"3.weight_g_idx.*{message}"):
            load()
        assert_unchanged(module, before)


def test_a_file_not_named_safetensors(tmp_path):
    """An existing file is read as a checkpoint whatever its suffix (a foreign
    one refused by its header, naming it); it was taken for a directory
    ("No checkpoint at 'model.keras/model.safetensors'"), and `save` onto it
    failed with NotADirectoryError. `save` overwrites no file not named
    `.safetensors`."""
    torch.manual_seed(0)
    model = mlp()
    quantize(model, "int8")
    renamed = tmp_path / "checkpoint.st"
    saving.save(model, tmp_path / "c.safetensors").rename(renamed)
    x = torch.randn(3, 64)
    assert torch.equal(saving.load(mlp(), renamed)(x), model(x))
    foreign = tmp_path / "model.keras"
    foreign.write_bytes(b"PK\x03\x04" + bytes(64))
    target = mlp()
    before = snapshot(target)
    with pytest.raises(
        saving.CheckpointError, match=r"model\.keras' is not a readable safetensors"
    ):
        saving.load(target, foreign)
    assert_unchanged(target, before)
    with pytest.raises(ValueError, match=r"model\.keras' is an existing file.*Nothing was written"):
        saving.save(model, foreign)
    assert foreign.read_bytes() == b"PK\x03\x04" + bytes(64)


def test_missing_file_and_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        saving.load(mlp(), tmp_path / "nowhere")
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        saving.save("model", tmp_path / "x.safetensors")
    with torch.device("meta"):
        on_meta = mlp()
    with pytest.raises(saving.CheckpointError, match="meta device"):
        saving.save(on_meta, tmp_path / "meta.safetensors")
    assert not (tmp_path / "meta.safetensors").exists()


def test_a_directory_save_failing_at_its_review_copy_leaves_no_stale_copy(tmp_path, monkeypatch):
    """The review copy is written after the model file: when it fails, the
    new model file stands whole and no copy describes the old model."""
    from dtype_policies.saving import checkpoint

    torch.manual_seed(0)
    saving.save(nn.Sequential(nn.Linear(8, 8)), tmp_path)
    new = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    real = checkpoint.write_atomically

    def failing_review_copy(path, write):
        if str(path).endswith(".json"):
            raise OSError("disk full")
        return real(path, write)

    monkeypatch.setattr(checkpoint, "write_atomically", failing_review_copy)
    with pytest.raises(OSError, match="disk full"):
        saving.save(new, tmp_path)
    assert sorted(os.listdir(tmp_path)) == [checkpoint.MODEL_FILE]
    loaded = saving.load(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), tmp_path)
    assert torch.equal(loaded[0].weight, new[0].weight)


def test_an_interrupted_save_never_leaves_a_partial_file(tmp_path):
    target = tmp_path / "m.safetensors"
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        import safetensors.torch
        from dtype_policies import saving, quantize
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
        quantize(model, "int8")
        saving.save(model, {str(target)!r})  # a complete checkpoint
        real = safetensors.torch.save_file

        def dies_half_way(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            with open(filename, "r+b") as f:  # as if the process died mid-write
                f.truncate(os.path.getsize(filename) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

        saving.checkpoint.save_file = dies_half_way
        torch.manual_seed(1)
        other = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
        saving.save(other, {str(target)!r})
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    saving.load(fresh, target)  # the first, complete checkpoint
    assert fresh[0].weight_int8.dtype == torch.int8
    partial = [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert all(name.startswith(".m.safetensors.") for name in partial)


def test_policy_files_round_trip(tmp_path):
    plan = DTypePolicyMap(
        "mixed_bfloat16",
        {"lm_head": "float32", "model/layers/.*/mlp/.*": "int4/64_from_mixed_bfloat16"},
    )
    path = saving.save_policy(plan, tmp_path / "plan.json")
    assert saving.load_policy(path) == plan
    assert saving.load_policy(saving.save_policy("mixed_float16", tmp_path / "p.json")).name == (
        "mixed_float16"
    )
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match=r"bad\.json"):
        saving.load_policy(tmp_path / "bad.json")
    (tmp_path / "alien.json").write_text('{"format": "dtype_policies.policy", "format_version": 7}')
    with pytest.raises(ValueError, match="version 7"):
        saving.load_policy(tmp_path / "alien.json")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format": "dtype_policies.policy", "format_version": true}', "version True"),
        ("[" * 100_000, "not a JSON policy file"),  # nested too deeply for the parser
        (
            '{"class_name": "DTypePolicyMap", "config": {"policy_map": [1]}}',
            "`policy_map` must be a dict",
        ),
    ],
)
def test_malformed_policy_files_raise_a_value_error_naming_the_file(text, message, tmp_path):
    path = tmp_path / "malformed.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as raised:
        saving.load_policy(path)
    assert "malformed.json" in str(raised.value)


def test_manifest_is_reviewable_json(tmp_path):
    model = prepare(mlp(), DTypePolicyMap("mixed_bfloat16", {"4": "float32"}), "int8", None)
    saving.save(model, tmp_path / "ckpt")
    text = (tmp_path / "ckpt" / "dtype_policies.json").read_text()
    assert '"format": "dtype_policies"' in text and '"int8"' in text
    manifest = saving.manifest.Manifest.from_json(text)
    assert manifest.modules["2"].island and manifest.quantized["0"].mode == "int8"
    assert manifest.modules["4"].policy["config"]["name"] == "float32"


def test_copy_of_loaded_model_is_independent(tmp_path):
    model = prepare(mlp(), "mixed_bfloat16", "int4", None)
    path = saving.save(model, tmp_path / "m.safetensors")
    loaded = saving.load(mlp(), path)
    clone = copy.deepcopy(loaded)
    x = torch.randn(3, 64)
    assert torch.equal(clone(x), loaded(x))


def test_saved_files_get_the_mode_of_a_plain_open(tmp_path):
    """Written through a private temporary file, a checkpoint still gets the
    permissions `open()` would give (the umask's), or the replaced file's."""
    model = prepare(mlp(), "mixed_bfloat16", None, None)
    old = os.umask(0o027)
    try:
        path = saving.save(model, tmp_path / "shared")
        policy_file = saving.save_policy("mixed_bfloat16", tmp_path / "policy.json")
    finally:
        os.umask(old)
    files = [*(tmp_path / "shared").iterdir(), policy_file]
    assert files and all(os.stat(f).st_mode & 0o777 == 0o640 for f in files)
    os.chmod(path, 0o600)
    saving.save(model, tmp_path / "shared")  # replaces the file: keeps its mode
    assert os.stat(path).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_buffer_shared_by_two_modules_stays_one_tensor_whatever_its_name(tmp_path, device):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            shared = torch.ones(4)
            self.a.register_buffer("layer_scale", shared)  # ends like int8's "_scale"
            self.b.register_buffer("layer_scale", shared)

    path = saving.save(Scaled(), tmp_path / "m.safetensors")
    with torch.device(device):
        target = Scaled()
    saving.load(target, path)
    assert target.a.layer_scale is target.b.layer_scale


@pytest.mark.parametrize("target_quantized", [False, True])
def test_a_tied_table_is_not_copied_into_a_target_that_ties_it_or_holds_its_own(
    tmp_path, monkeypatch, target_quantized
):
    from dtype_policies.saving import checkpoint

    source = LM(tie=True)
    quantize(source, "int8")
    path = saving.save(source, tmp_path / "tied.safetensors")
    real, copies = checkpoint._untied_copies, []

    def counting(state, *rest):
        out = real(state, *rest)
        copies.extend(key for key in out if out[key] is not state[key])
        return out

    monkeypatch.setattr(checkpoint, "_untied_copies", counting)
    tied = LM(tie=True)
    if target_quantized:  # Keras's flow: quantize, then load the weights
        quantize(tied, "int8")
    saving.load(tied, path)
    untied_float = saving.load(LM(tie=False), saving.save(LM(tie=True), tmp_path / "f.safetensors"))
    assert copies == []
    assert tied.head.weight_int8 is tied.embed.weight_int8
    assert untied_float.head.weight.data_ptr() != untied_float.embed.weight.data_ptr()


def test_a_save_failing_at_the_model_file_leaves_no_review_copy_of_another_model(
    tmp_path, monkeypatch
):
    """The review copy was renamed into place inside the model file's write,
    before the file's own rename: a failure there left `dtype_policies.json`
    describing the new (quantized) model beside the old file."""
    import json
    import os

    from dtype_policies.saving import checkpoint

    model = prepare(mlp(), "mixed_bfloat16", None, None)
    saving.save(model, tmp_path / "ckpt")
    old_file = (tmp_path / "ckpt" / checkpoint.MODEL_FILE).read_bytes()
    quantize(model, "int8")
    replace = os.replace

    def failing(source, target):
        if str(target).endswith(checkpoint.MODEL_FILE):
            raise OSError("disk gone")
        return replace(source, target)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="disk gone"):
        saving.save(model, tmp_path / "ckpt")
    monkeypatch.setattr(os, "replace", replace)
    assert (tmp_path / "ckpt" / checkpoint.MODEL_FILE).read_bytes() == old_file
    assert not (tmp_path / "ckpt" / checkpoint.MANIFEST_FILE).exists()
    saving.save(model, tmp_path / "ckpt")  # the next save writes both
    review = json.loads((tmp_path / "ckpt" / checkpoint.MANIFEST_FILE).read_text())
    assert review["quantized"]


def test_a_policy_changed_after_a_save_is_what_the_next_save_records(tmp_path):
    """`resolved_policy` was cached per layer by a stray decorator: the
    second save recorded the first policy, and the loaded model computed
    in float32."""
    torch.manual_seed(0)
    layer = layers.Dense(4)
    x = torch.randn(2, 3)
    layer(x)
    saving.save(layer, tmp_path / "a")
    layer.dtype_policy = "mixed_bfloat16"
    saving.save(layer, tmp_path / "b")
    fresh = layers.Dense(4)
    fresh.build((None, 3))
    loaded = saving.load(fresh, tmp_path / "b")
    assert loaded.dtype_policy.name == "mixed_bfloat16"
    assert torch.equal(loaded(x), layer(x))


def test_saving_to_a_model_file_by_name_removes_a_stale_review_copy(tmp_path):
    from dtype_policies.saving import checkpoint

    model = nn.Sequential(nn.Linear(4, 4))
    saving.save(model, tmp_path)
    assert (tmp_path / checkpoint.MANIFEST_FILE).exists()
    quantize(model, "int8")
    saving.save(model, tmp_path / checkpoint.MODEL_FILE)  # the file alone
    assert not (tmp_path / checkpoint.MANIFEST_FILE).exists()


def test_a_policy_file_that_is_another_document_is_named_shortly(tmp_path):
    import json

    advice = tmp_path / "advice.json"
    advice.write_text(
        json.dumps({"format": "dtype_policies.advice", "policy": {}, "x": "y" * 5000})
    )
    with pytest.raises(ValueError, match=r"'dtype_policies.advice' document, not a policy file"):
        saving.load_policy(advice)
    junk = tmp_path / "junk.json"
    junk.write_text(json.dumps({"modules": ["z" * 5000]}))
    with pytest.raises(ValueError) as raised:
        saving.load_policy(junk)
    assert len(str(raised.value)) < 600  # not the whole file
