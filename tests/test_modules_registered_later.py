"""Modules registered under a policied model after `apply_policy` (a new head,
a block appended, a resized embedding) join the applications in force on
their parent, as if the policy were applied again; modules that carry a
policy or quantization of their own are left as they are."""

import copy
import gc
import pickle

import pytest
import torch
import torch.nn as nn

from dtype_policies import DTypePolicyMap, apply_policy, layers, quantize, saving

X = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_a_new_head_computes_with_the_policy_and_leaves_with_remove():
    model = _model()
    handle = apply_policy(model, "mixed_bfloat16")
    model[2] = nn.Linear(16, 3)
    out = model(X)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 3)
    assert model[2].dtype_policy.name == "mixed_bfloat16"
    assert model[2].weight.dtype == torch.float32  # float32 masters
    assert handle.policies["2"].name == "mixed_bfloat16"
    out.float().sum().backward()
    assert model[2].weight.grad.dtype == torch.float32
    handle.remove()
    assert type(model[2]) is nn.Linear and model(X).dtype == torch.float32


def test_the_same_values_as_applying_the_policy_again():
    model = _model()
    apply_policy(model, "mixed_bfloat16")
    torch.manual_seed(1)
    model.append(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2)))
    joined = model(X)
    assert model[3][0].dtype_policy.name == "float32"  # the norm an island
    apply_policy(model, "mixed_bfloat16")
    assert torch.equal(model(X), joined)


def test_a_policy_map_is_read_at_the_new_modules_path():
    model = _model()
    handle = apply_policy(
        model, DTypePolicyMap("mixed_bfloat16", {"2": "float32", "3": "int8_from_float32"})
    )
    model[2] = nn.Linear(16, 4)
    model.append(nn.Linear(4, 4))
    assert model[2].dtype_policy.name == "float32"
    # a quantized entry gives its float source: a new module is not quantized
    assert model[3].dtype_policy.name == "float32"
    assert "weight_int8" not in model[3].state_dict()
    assert handle.policies["3"].name == "float32"
    assert model(X).dtype == torch.float32


def test_nested_applications_the_latest_wins_on_the_new_module():
    model = nn.Sequential(_model())
    apply_policy(model, "mixed_bfloat16")
    inner = apply_policy(model[0], "float16")
    model[0][2] = nn.Linear(16, 2)
    assert model[0][2].dtype_policy.name == "float16"
    assert model(X).dtype == torch.float16
    inner.remove()  # the outer application is in force on it again
    assert model[0][2].dtype_policy.name == "mixed_bfloat16"
    assert model(X).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["policied", "quantized", "layer", "wrapping"])
def test_a_module_with_a_policy_of_its_own_is_left_as_it_is(kind):
    model = _model()
    handle = apply_policy(model, "mixed_bfloat16")
    torch.manual_seed(2)
    if kind == "policied":
        child = nn.Linear(16, 4)
        apply_policy(child, "float16")
        expected = "float16"
    elif kind == "quantized":
        child = nn.Linear(16, 4)
        quantize(child, "int8")
        expected = "int8_from_float32"
    elif kind == "layer":
        child = layers.Dense(4, dtype="float32")
        child.build((None, 16))
        expected = "float32"
    else:  # an adapter around the model's own policied linear, as peft wraps it
        child = nn.ModuleDict({"base_layer": model[2], "lora_A": nn.Linear(16, 2)})
        expected = None
    model[2] = child
    if expected is not None:
        assert child.dtype_policy.name == expected
    else:  # the base keeps its own; the new modules around it join (as applied again)
        assert child["base_layer"].dtype_policy.name == "mixed_bfloat16"
        assert child["lora_A"].dtype_policy.name == "mixed_bfloat16"
        # the records follow: the base moved to 2/base_layer, the adapter joined
        assert {k: handle.policies[k].name for k in ("2", "2/base_layer", "2/lora_A")} == {
            "2": "mixed_bfloat16",
            "2/base_layer": "mixed_bfloat16",
            "2/lora_A": "mixed_bfloat16",
        }


@pytest.mark.parametrize("release", ["replaced", "removed"])
def test_a_module_moved_from_another_policied_model_takes_this_ones_when_let_go(release):
    """It keeps the other model's policy while that model holds it; once
    that model lets it go (replaced out of it, or its application removed)
    it computes with this model's, where it had none and broke the forward
    (`mat1 and mat2 must have the same dtype`)."""
    torch.manual_seed(0)
    source, target = _model(), _model()
    source_handle = apply_policy(source, "float32")
    target_handle = apply_policy(target, "mixed_bfloat16")
    target[2] = source[2]
    assert target[2].dtype_policy.name == "float32"
    if release == "replaced":
        source[2] = nn.Identity()
    else:
        source_handle.remove()
    assert target[2].dtype_policy.name == "mixed_bfloat16"
    assert target(X).dtype == torch.bfloat16
    target_handle.remove()
    assert type(target[2]) is nn.Linear


def test_a_planning_error_leaves_the_registration_undone():
    """Two keys matching the new module's path (and no path before it): the
    error apply_policy would raise there, from the assignment, which does
    not happen."""
    model = _model()
    old_head = model[2]
    policies = DTypePolicyMap("mixed_bfloat16", {"^[3]$": "float32", "[3]": "float16"})
    apply_policy(model, policies)
    with pytest.raises(ValueError, match="'3'"):
        model.append(nn.Linear(4, 4))
    assert len(model) == 3 and model[2] is old_head
    assert model(X).dtype == torch.bfloat16


def test_a_parametrization_registered_later_is_planned_as_one_registered_before():
    before = _model()
    torch.nn.utils.parametrizations.weight_norm(before[0])
    expected = apply_policy(before, "mixed_bfloat16").policies
    model = _model()
    handle = apply_policy(model, "mixed_bfloat16")
    torch.nn.utils.parametrizations.weight_norm(model[0])
    assert handle.policies == expected
    assert expected["0/parametrizations/weight"].name == "float32"  # a weight is a variable
    assert torch.equal(model(X), before(X))
    handle.remove()
    assert not hasattr(model[0].parametrizations.weight, "dtype_policy")
    assert model(X).dtype == torch.float32


def test_the_new_head_is_saved_with_its_policy(tmp_path):
    model = _model()
    apply_policy(model, "mixed_bfloat16")
    model[2] = nn.Linear(16, 3)
    saving.save(model, tmp_path / "model.safetensors")
    target = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    saving.load(target, tmp_path / "model.safetensors")
    assert target[2].dtype_policy.name == "mixed_bfloat16"
    assert torch.equal(target(X), model(X))


def test_a_transformers_head_replaced_and_embeddings_resized():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    apply_policy(model, "mixed_bfloat16")
    model.classifier = nn.Linear(32, 5)
    model.resize_token_embeddings(80)
    ids = torch.tensor([[3, 70, 79, 5]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5) and logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()
    assert model.bert.embeddings.word_embeddings.dtype_policy.name == "mixed_bfloat16"
    assert model.classifier.dtype_policy.name == "mixed_bfloat16"


def test_a_copy_and_a_pickle_of_the_model_take_new_modules_in_too():
    model = _model()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"2": "float16"}))
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        copied[2] = nn.Linear(16, 3)
        assert copied[2].dtype_policy.name == "float16"  # the map, read at its path
        assert copied(X).dtype == torch.float16
    assert model[2].out_features == 4  # the original is untouched


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "fuse_linear_bn_eval"])
def test_a_copy_of_a_policied_part_put_back_joins_and_leaves_with_remove(how):
    """`model[0] = copy.deepcopy(model[0])` (torch's fusion helpers copy so):
    the copy carried an application no handle owned, so it did not join, and
    after `remove()` it still computed in bfloat16 and the model failed."""
    from torch.nn.utils.fusion import fuse_linear_bn_eval

    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model.eval()
    with torch.no_grad():
        reference = model(X)
    handle = apply_policy(model, "mixed_bfloat16")
    if how == "fuse_linear_bn_eval":
        model[0], model[1] = fuse_linear_bn_eval(model[0], model[1]), nn.Identity()
    else:
        copied = (
            copy.deepcopy(model[0]) if how == "deepcopy" else pickle.loads(pickle.dumps(model[0]))
        )
        model[0] = copied
    assert handle.policies["0"].name == "mixed_bfloat16"
    assert model(X).dtype == torch.bfloat16
    handle.remove()
    assert getattr(model[0], "dtype_policy", None) is None
    with torch.no_grad():
        out = model(X)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)  # fusion: float32 sums


@pytest.mark.parametrize("kind", ["quantized", "layer"])
def test_a_copy_of_a_quantized_module_or_layer_put_back_leaves_its_copied_application(kind):
    """The copy keeps what is its own (its quantization, its layer policy),
    as any such module registered later, and not the application it was
    copied with, which no handle owns: after `remove()` it computed bfloat16."""
    torch.manual_seed(0)
    if kind == "quantized":
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))
        quantize(model[1], "int8")
    else:
        model = nn.Sequential(nn.Linear(8, 16), layers.Dense(16), nn.Linear(16, 4))
        model(X)
    handle = apply_policy(model, "mixed_bfloat16")
    copied = copy.deepcopy(model[1])
    model.append(copied)
    model[2] = nn.Linear(16, 16)
    handle.remove()
    assert [m(torch.randn(2, 16)).dtype for m in (model[1], copied)] == [torch.float32] * 2
    assert model[1].dtype_policy.name == copied.dtype_policy.name
    assert model(X).dtype == torch.float32


def test_a_submodule_kept_after_its_model_takes_its_own_policy_in():
    def backbone():
        model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8)))
        apply_policy(model, "mixed_bfloat16")
        return model[1]  # the model and its handle go

    encoder = backbone()
    gc.collect()
    encoder.append(nn.Linear(8, 2))
    assert encoder[1].dtype_policy.name == "mixed_bfloat16"
    assert encoder(X).dtype == torch.bfloat16


def test_a_loaded_model_gives_a_new_module_its_parents_policy(tmp_path):
    model = _model()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"0": "float16"}))
    saving.save(model, tmp_path / "model.safetensors")
    loaded = _model()
    saving.load(loaded, tmp_path / "model.safetensors")
    loaded[0].extra = nn.Linear(8, 8)  # the map is not saved: its parent's policy
    loaded.append(nn.Linear(4, 4))
    assert loaded[0].extra.dtype_policy.name == "float16"
    assert loaded[3].dtype_policy.name == "mixed_bfloat16"
    assert loaded(X).dtype == torch.bfloat16


def test_paths_are_read_when_the_module_registers_not_when_the_policy_was_applied():
    model = nn.Sequential(nn.Identity(), nn.Sequential(nn.Linear(8, 8)))
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"0/x": "float16"}))
    del model[0]  # the Sequential renumbers: the inner one is at '0' now
    model[0].x = nn.Linear(8, 8)
    assert model[0].x.dtype_policy.name == "float16"


def test_a_replaced_module_leaves_the_application_unless_still_in_the_model():
    model = _model()
    handle = apply_policy(model, "mixed_bfloat16")
    old_head = model[2]
    model[2] = nn.LayerNorm(16)
    assert not hasattr(old_head, "dtype_policy")  # out of the model: out of the application
    assert old_head(torch.randn(2, 16)).dtype == torch.float32
    assert handle.float32_paths == ["2"] and handle.policies["2"].name == "float32"
    model[2] = nn.LayerNorm(16)
    assert handle.float32_paths == ["2"]
    assert all(m is not old_head for m in handle._modules)
    shared = model[0]
    model.append(shared)  # the same module in two places
    model[3] = nn.Linear(16, 16)
    assert shared.dtype_policy.name == "mixed_bfloat16"  # still in the model at '0'
    old_head2 = model[2]
    model[2] = old_head  # a module that left joins again
    assert old_head.dtype_policy.name == "mixed_bfloat16"
    assert not hasattr(old_head2, "dtype_policy")


def test_a_new_module_around_one_of_the_models_own_joins_around_it():
    """`model.head = nn.Sequential(model.head, nn.ReLU(), nn.Linear(...))`:
    the old head keeps its policy at its new path, the new ones join."""
    model = _model()
    handle = apply_policy(model, "mixed_bfloat16")
    head = model[2]
    model[2] = nn.Sequential(head, nn.ReLU(), nn.Linear(4, 2))
    out = model(X)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 2)
    assert model[2][2].dtype_policy.name == "mixed_bfloat16"
    assert {"2", "2/0", "2/1", "2/2"} <= set(handle.policies)
    handle.remove()
    assert model(X).dtype == torch.float32


def test_a_module_set_to_none_leaves_and_a_deleted_ones_new_children_are_undone():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.extra = nn.Sequential(nn.Linear(8, 8))

        def forward(self, x):
            return self.body(x)

    model = Holder()
    handle = apply_policy(model, "mixed_bfloat16")
    old = model.extra
    model.extra = None
    assert not hasattr(old, "dtype_policy") and "extra" not in handle.policies
    assert old(X).dtype == torch.float32
    model.extra = block = nn.Sequential(nn.Linear(8, 8))
    del model.extra  # no hook runs: the block keeps its policy, outside the model
    block.append(nn.Linear(8, 8))  # joins the application it still carries
    assert block[1].dtype_policy.name == "mixed_bfloat16"
    handle.remove()
    assert not hasattr(block[0], "dtype_policy") and not hasattr(block[1], "dtype_policy")
    assert block(X).dtype == torch.float32


def test_a_slice_of_a_policied_sequential_has_no_policy_of_its_own_until_it_joins():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    apply_policy(model, "mixed_bfloat16")
    part = model[:2]
    assert not hasattr(part, "dtype_policy")  # an AttributeError, not a KeyError
    assert part(X).dtype == torch.bfloat16  # its linear keeps its policy
    model.trunk = model[:2]
    assert model.trunk.dtype_policy.name == "mixed_bfloat16"


def test_a_parametrization_appended_later_computes_in_the_variable_dtype():
    from torch.nn.utils import parametrize

    class Scale(nn.Module):
        def forward(self, weight):
            return weight * 1.001

    def parametrized():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8))
        parametrize.register_parametrization(model[0], "weight", Scale())
        return model

    joined = parametrized()
    apply_policy(joined, "mixed_bfloat16")
    parametrize.register_parametrization(joined[0], "weight", Scale())
    fresh = parametrized()
    parametrize.register_parametrization(fresh[0], "weight", Scale())
    apply_policy(fresh, "mixed_bfloat16")
    weights = joined[0].parametrizations.weight
    assert weights[1].dtype_policy.name == "float32"
    assert torch.equal(joined(X), fresh(X))


def test_registrations_from_threads_each_join_and_are_recorded():
    import threading

    model = nn.Sequential(nn.Linear(8, 8), nn.Module())
    handle = apply_policy(model, "mixed_bfloat16")
    errors = []

    def register(worker):
        try:
            for i in range(40):
                model[1].add_module(f"w{worker}_{i}", nn.Linear(8, 8))
                model[1].add_module(f"w{worker}_{i}", nn.Linear(8, 8))  # replaced
        except Exception as e:  # pragma: no cover - the failure this test looks for
            errors.append(e)

    threads = [threading.Thread(target=register, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    names = {f"w{w}_{i}" for w in range(4) for i in range(40)}
    assert set(model[1]._modules) == names
    assert all(m.dtype_policy.name == "mixed_bfloat16" for m in model[1].children())
    assert {f"1/{name}" for name in names} <= set(handle.policies)


def test_a_hugging_face_models_manifest_follows_registrations_when_read():
    tiny_models = pytest.importorskip("tiny_models")
    model = tiny_models.tiny_decoder()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"lm_head": "float32"}))
    model.lm_head = nn.Linear(64, 128, bias=False)
    model.model.layers[0].mlp.extra = nn.Linear(64, 64)
    assert "model.layers.0.mlp.extra" in model.config.quantization_config.manifest["modules"]
    modules = model.config.quantization_config.to_dict()["manifest"]["modules"]
    assert modules["lm_head"]["policy"]["config"]["name"] == "float32"
    assert modules["model.layers.0.mlp.extra"]["policy"]["config"]["name"] == "mixed_bfloat16"
    assert "_dtype_policies_stale_model" not in model.config.to_dict()["quantization_config"]


def test_a_replaced_quantized_module_leaves_the_records():
    model = _model()
    handle = apply_policy(model, "int8_from_mixed_bfloat16")
    assert handle.quantized_paths == ["0", "2"]
    model[2] = nn.Linear(16, 4)
    assert handle.quantized_paths == ["0"]
    assert all(module is not model[2] for _, module in handle._quantized)


def test_a_hugging_face_model_with_deferred_joins_pickles_and_copies_described():
    tiny_models = pytest.importorskip("tiny_models")
    model = tiny_models.tiny_decoder()
    apply_policy(model, "mixed_bfloat16")
    model.model.layers[0].mlp.extra = nn.Linear(64, 64)
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        modules = copied.config.quantization_config.manifest["modules"]
        assert modules["model.layers.0.mlp.extra"]["policy"]["config"]["name"] == "mixed_bfloat16"


def test_a_policy_applied_to_a_wrapper_of_a_transformers_model_reaches_its_config(tmp_path):
    peft = pytest.importorskip("peft")
    tiny_models = pytest.importorskip("tiny_models")
    model = tiny_models.tiny_decoder()
    tuned = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    apply_policy(tuned, "mixed_bfloat16")
    merged = tuned.merge_and_unload()
    merged.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert reloaded.model.layers[0].self_attn.q_proj.dtype_policy.name == "mixed_bfloat16"
