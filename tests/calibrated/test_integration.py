"""GPTQ and AWQ through the rest of the library: a Keras archive whose layers
use their policies reads into a policy map; `inspect` reads a checkpoint of
a calibrated model; the advisor offers a calibrated candidate."""

import json
import os
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

from dtype_policies import apply_policy, layers, quantize, saving
from dtype_policies.policies import AWQDTypePolicy, GPTQDTypePolicy
from dtype_policies.quantizers import AWQConfig, GPTQConfig
from dtype_policies.saving import policy_map_from_keras


def _keras_policy(class_name, mode, source):
    return {
        "module": "keras.dtype_policies",
        "class_name": class_name,
        "config": {"mode": mode, "source_name": source},
        "registered_name": None,
    }


def _dense(name, dtype):
    return {
        "module": "keras.layers",
        "class_name": "Dense",
        "config": {"name": name, "trainable": True, "dtype": dtype, "units": 4},
        "registered_name": None,
        "build_config": {"input_shape": [None, 4]},
    }


def test_a_keras_archive_with_gptq_and_awq_layers_reads_into_a_policy_map(tmp_path):
    config = {
        "module": "keras",
        "class_name": "Sequential",
        "config": {
            "name": "sequential",
            "trainable": True,
            "layers": [
                _dense("a", _keras_policy("GPTQDTypePolicy", "gptq/4/128", "float32")),
                _dense("b", _keras_policy("AWQDTypePolicy", "awq/4/64", "mixed_bfloat16")),
                _dense("c", "float32"),
            ],
        },
    }
    file = tmp_path / "m.keras"
    with zipfile.ZipFile(file, "w") as archive:
        archive.writestr("metadata.json", json.dumps({"keras_version": "3.15.1"}))
        archive.writestr("config.json", json.dumps(config))
        archive.writestr("model.weights.h5", b"not read")
    policy_map = policy_map_from_keras(str(file))
    assert policy_map["sequential/a"] == GPTQDTypePolicy("gptq/4/128", "float32")
    assert isinstance(policy_map["sequential/b"], AWQDTypePolicy)
    assert policy_map["sequential/b"].name == "awq/4/64_from_mixed_bfloat16"
    assert policy_map["sequential/c"].name == "float32"


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.Linear(64, 8)
    )


def test_inspect_reads_a_calibrated_checkpoint(tmp_path):
    model = _mlp()
    apply_policy(model, "mixed_bfloat16")
    data = [torch.randn(16, 64) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantize(model, config=GPTQConfig(data, None, group_size=32), filters="^0$", progress=False)
        quantize(model, config=AWQConfig(data, None, group_size=64), filters="^2$", progress=False)
    saving.save(model, tmp_path / "ckpt")
    result = subprocess.run(
        [sys.executable, "-m", "dtype_policies", "inspect", str(tmp_path / "ckpt"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    rows = {row["path"]: row for row in json.loads(result.stdout)["modules"]}
    assert rows["0"]["quantization"] == "gptq/4/32"
    assert rows["0"]["policy"] == "gptq/4/32_from_mixed_bfloat16"
    assert rows["2"]["quantization"] == "awq/4/64"
    assert rows["3"]["quantization"] in (None, "", "-")


def test_the_advisor_offers_calibrated_int4_and_applies_it_as_measured(tmp_path):
    """A gptq candidate is calibrated on each module's recorded inputs, both
    when measured and when the advice is applied; it beats data-free int4
    where inputs have outlier channels."""
    import copy

    from dtype_policies import advise

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16)
    ).eval()
    x = torch.randn(64, 64)
    x[:, :4] *= 20.0
    both = advise(model, x, candidates=("gptq", "int4"), progress=False, repeats=1)
    errors = {row.path: row.errors for row in both.modules}
    assert all(errors[p]["gptq"] < 0.7 * errors[p]["int4"] for p in ("0", "2"))
    advice = advise(
        model,
        x,
        candidates=("gptq",),
        max_error=0.05,
        objective="memory",
        progress=False,
        repeats=1,
    )
    assert {row.path: row.choice for row in advice.modules} == {"0": "gptq", "2": "gptq"}
    fresh = copy.deepcopy(model)
    advice.apply(fresh)
    assert fresh[0].dtype_policy.name == "gptq/4/128_from_mixed_bfloat16"
    with torch.no_grad():
        got, want = fresh(x), model(x)
    error = float((got - want).norm() / want.norm())
    assert error == pytest.approx(advice.error, rel=1e-3, abs=1e-6) and error <= 0.05
    # the policy file holds the map, not the calibration inputs: said when saved
    with pytest.warns(UserWarning, match=r"2 entries \('0', '2'\) are calibrated modes"):
        advice.save(tmp_path / "map.json")


def test_an_advice_that_cannot_calibrate_on_a_model_changes_nothing():
    """`advice.apply(other)` with a gptq entry and an int8 one: the int8
    module was quantized and the policies applied before the gptq
    calibration failed with a bare shape error."""
    import copy

    from dtype_policies import advise

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    ).eval()
    x = torch.randn(8, 32)
    advice = advise(
        model, x, max_error=0.05, candidates=("int8", "gptq"), objective="memory",
        progress=False, repeats=1,
    )  # fmt: skip
    choices = {path: policy.quantization_mode for path, policy in advice.policy_map.items()}
    assert choices == {"0": "gptq", "2": "int8"}
    other = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"cannot calibrate '0' \(Linear\) by gptq/4/128.*"
                       r"recorded there \(is this the model that was advised\?\): .*shape.*"
                       r"nothing was changed"):  # fmt: skip
        advice.apply(other)
    assert other.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    assert not hasattr(other[2], "dtype_policy")


def _calibrated_mlp(mode):
    model = _mlp(seed=3)
    apply_policy(model, "mixed_bfloat16")
    data = [torch.randn(32, 64) for _ in range(4)]
    config = (
        GPTQConfig(data, None, group_size=32, activation_order=True)
        if mode == "gptq"
        else AWQConfig(data, None, group_size=32)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantize(model, config=config, progress=False)
    return model.eval()


@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_compiled_inference_mode_and_threads_compute_what_eager_does(mode):
    import threading

    model = _calibrated_mlp(mode)
    x = torch.randn(5, 64)
    with torch.no_grad():
        eager = model(x).float()
    with torch.inference_mode():
        assert torch.allclose(model(x).float(), eager)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        traced = compiled(x).float()
    assert torch.allclose(traced, eager, rtol=2e-2, atol=2e-2 * float(eager.abs().max()))
    results = [None] * 4

    def run(i):
        with torch.no_grad():
            results[i] = model(x).float()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(r, eager) for r in results)


@pytest.mark.parametrize("config_class", [GPTQConfig, AWQConfig])
def test_the_grid_setting_is_checked_and_serialized_only_when_not_the_default(config_class):
    default = config_class(None, None, group_size=64)
    keras_grids = config_class(None, None, group_size=64, grid="keras")
    assert default.grid == "refined" and "grid" not in default.get_config()
    assert keras_grids.get_config()["grid"] == "keras"
    assert config_class.from_config(keras_grids.get_config()).grid == "keras"
    assert default == keras_grids  # a quantize-time setting: the stored layout is the same
    with pytest.raises(
        ValueError, match=r"grid must be one of \('refined', 'keras'\)\. Received: grid='minmax'"
    ):
        config_class(None, None, grid="minmax")


@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_calibrating_a_model_the_policy_rounded_says_it_is_left_as_it_is(mode):
    """`apply_policy(model, "gptq/...")` rounds to nearest and its warning
    points at the calibrated config; that config then compared equal (data is
    no part of equality) and every module was skipped without a word."""
    model = _mlp()
    with pytest.warns(UserWarning, match="quantize the float model"):
        apply_policy(model, f"{mode}/4/32_from_float32")
    before = {name: t.clone() for name, t in model.state_dict().items()}
    data = [torch.randn(16, 64) for _ in range(4)]
    config_class = GPTQConfig if mode == "gptq" else AWQConfig
    with pytest.warns(
        UserWarning, match=r"another configuration.*rounded to nearest, without data"
    ):
        report = quantize(model, config=config_class(data, None, group_size=32), progress=False)
    assert report.num_quantized == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_calibration_data_of_the_wrong_width_is_named_at_the_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    data = [torch.randn(8, 31)]  # the model takes 32 features
    with pytest.raises(ValueError, match=r"module '0' takes 32 input features.*\(8, 31\)"):
        quantize(model, config=GPTQConfig(data, None, num_samples=4, group_size=16), progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_token_ids_outside_a_plain_models_first_embedding_are_named():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 32), torch.nn.Linear(32, 32))
    ids = torch.arange(40) % 20  # ids up to 19 for a table of 16
    with pytest.raises(ValueError, match=r"token id 19 is outside the model's vocabulary"):
        quantize(
            model,
            "gptq",
            GPTQConfig(ids, None, num_samples=2, sequence_length=8, group_size=16),
            progress=False,
        )


def test_a_graph_compiled_after_new_gptq_weights_takes_their_block_order():
    """The int4 plan's choice of a permuting `g_idx` is the new weights', not
    the last eager call's: an eager call on a model of natural order, then a
    `load_state_dict` of one calibrated with activation order on Keras's
    grids (a permuting `g_idx`), then `compile_for_inference`. (The frozen
    graph packed the permuted weight as if in natural order: off by 0.26 on
    outputs of 0.7.)"""
    from dtype_policies import compile_for_inference

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 32)
        )

    torch.manual_seed(0)
    samples = [torch.randn(16, 64) * torch.linspace(0.1, 3, 64) for _ in range(2)]
    model, other = make(0), make(1)
    quantize(model, config=GPTQConfig(samples, None, weight_bits=4, group_size=16), progress=False)
    permuting = GPTQConfig(
        samples, None, weight_bits=4, group_size=16, activation_order=True, grid="keras"
    )
    quantize(other, config=permuting, progress=False)
    x = torch.randn(4, 64)
    with torch.no_grad():
        model(x)
        model.load_state_dict(other.state_dict())
        compiled = compile_for_inference(model, autotune=False)(x)
        eager = model(x)
        assert torch.equal(eager, other(x))
    assert torch.equal(compiled, eager)


def test_a_sequential_under_gptq_policies_builds_by_shape_and_takes_a_calibration():
    """As Keras builds a Sequential symbolically: a layer awaiting calibrated
    weights is built from its input shape (no values run through it), and
    then takes a calibrated checkpoint."""
    torch.manual_seed(0)
    source = layers.Sequential(
        [layers.Dense(32, dtype="float32"), layers.Dense(8, dtype="float32")]
    )
    source.build((None, 16))
    data = [torch.randn(8, 16) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantize(source, config=GPTQConfig(data, None, group_size=8), progress=False)
    names = [layer.dtype_policy.name for layer in source.layers]
    assert names == ["gptq/4/8_from_float32"] * 2
    target = layers.Sequential(
        [layers.Sequential([layers.Dense(32, dtype=names[0])]), layers.Dense(8, dtype=names[1])]
    )
    target.build((None, 16))  # a nested stack: by its own output shape
    assert [layer.built for layer in target.layers] == [True, True]
    assert target.layers[1].compute_output_shape((None, 32)) == (None, 8)
    state = source.state_dict()
    target.load_state_dict({("0." + k if k.startswith("0.") else k): v for k, v in state.items()})
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(target(x), source(x))


def test_a_sequential_builds_layers_without_an_output_shape_on_zeros():
    """From the first layer that cannot say its output shape, zeros of the
    shape so far run through the rest of the stack."""
    stack = layers.Sequential(
        [layers.Dense(6), layers.Sequential([torch.nn.Tanh()]), layers.Dense(3)]
    )
    stack.build((None, 4))
    assert all(layer.built for layer in stack.layers)
    assert tuple(stack.layers[2].kernel.shape) == (6, 3)
    with pytest.raises(NotImplementedError, match="Tanh"):
        stack.compute_output_shape((None, 4))


@pytest.mark.parametrize("mode", [None, "int8", "int4"])
def test_a_built_sequential_config_builds_again_and_takes_its_state(mode):
    """As Keras's: a built stack's config holds the shape it was built on, so
    `from_config` gives a built stack that loads the original's state."""
    torch.manual_seed(0)
    stack = layers.Sequential([layers.Dense(8), layers.Dense(3)])
    stack.build((None, 5))
    if mode is not None:
        quantize(stack, mode)
    config = stack.get_config()
    assert config["build_input_shape"] == (None, 5)
    copy = layers.Sequential.from_config(json.loads(json.dumps(config)))
    copy.load_state_dict(stack.state_dict())
    x = torch.randn(2, 5)
    with torch.no_grad():
        assert torch.equal(copy(x), stack(x))
    assert "build_input_shape" not in layers.Sequential([layers.Dense(2)]).get_config()


def test_a_nested_stack_holding_a_torch_module_runs_it_once_at_build():
    calls: list[tuple] = []

    class Counting(torch.nn.Module):
        def forward(self, x):
            calls.append(tuple(x.shape))
            return x

    stack = layers.Sequential([layers.Dense(4), layers.Sequential([Counting()]), layers.Dense(2)])
    stack.build((None, 3))
    assert calls == [(1, 4)] and all(layer.built for layer in stack.layers)


def test_a_stack_first_called_on_a_pair_keeps_no_build_shape_in_its_config():
    """Keras's Sequential takes one input: a first call on anything else
    records no shape (`from_config` gives a stack built by its first call)."""

    @layers.register_serializable("TestsIntegration")
    class AddPair(layers.Layer):
        def call(self, inputs):
            return inputs[0] + inputs[1]

    stack = layers.Sequential([AddPair(), layers.Dense(3)])
    stack((torch.ones(2, 4), torch.ones(2, 4)))
    config = json.loads(json.dumps(stack.get_config()))
    assert stack.built and "build_input_shape" not in config
    copy = layers.Sequential.from_config(config)  # built by its first call, as before
    x = (torch.randn(5, 4), torch.randn(5, 4))
    assert copy(x).shape == (5, 3)


@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_calls_from_another_thread_during_calibration_are_not_observed(mode):
    """A server thread calling the model while it calibrates: the
    calibration's hooks took its inputs into the statistics (every stored
    tensor then differed from calibrating alone) and raised the calibration's
    private exceptions into it. Its calls now pass through unobserved."""
    import threading

    transformers = pytest.importorskip("transformers")

    def model_and_config():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        model = transformers.LlamaForCausalLM(config).eval()
        generator = torch.Generator().manual_seed(1)
        data = [torch.randint(0, 256, (2, 16), generator=generator) for _ in range(3)]
        calibration = (
            GPTQConfig(data, None, group_size=32)
            if mode == "gptq"
            else AWQConfig(data, None, group_size=32)
        )
        return model, calibration

    alone, calibration = model_and_config()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantize(alone, config=calibration, progress=False)
    served, calibration = model_and_config()
    server_ids = (
        torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(2)) * 3 % 256
    )
    calibrating, outcomes = threading.get_ident(), []

    def serve_once(module, args):
        if threading.get_ident() != calibrating or len(outcomes) >= 6:
            return

        def call():
            try:
                with torch.inference_mode():
                    served(server_ids)
                outcomes.append("ok")
            except BaseException as error:  # the test reports what the server saw
                outcomes.append(repr(error))

        server = threading.Thread(target=call)
        server.start()
        server.join(timeout=120)
        assert not server.is_alive()

    handles = [layer.register_forward_pre_hook(serve_once) for layer in served.model.layers]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            quantize(served, config=calibration, progress=False)
    finally:
        for handle in handles:
            handle.remove()
    assert outcomes == ["ok"] * 6
    expected, state = alone.state_dict(), served.state_dict()
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[key], expected[key]) for key in expected)


@pytest.mark.parametrize("rows", [1, 300, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_awq_divides_its_inputs_as_one_float32_division_rounded_once(rows, dtype):
    """Large inputs are divided piece by piece into the result (their float32
    copy would be a fresh mapping each call); every size gives the values of
    `(x.float() / s).to(compute)`, and a float32 input is left unchanged."""
    from dtype_policies.quantization.schemes import calibrated_int

    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1536, generator=generator).to(dtype)
    before = x.clone()
    divisor = torch.rand(1536, generator=generator) + 0.25
    for compute in (torch.bfloat16, torch.float32):
        with torch.inference_mode():
            divided = calibrated_int._divided(x, divisor, compute)
        assert divided.dtype == compute
        assert torch.equal(divided, (x.float() / divisor).to(compute))
        assert torch.equal(x, before)
    assert (rows * 1536 > calibrated_int.DIVISION_CHUNK) == (rows > 1)


def test_awq_division_keeps_gradients():
    from dtype_policies.quantization.schemes import calibrated_int

    x = torch.randn(400, 1536, requires_grad=True)
    divisor = torch.rand(1536) + 0.25
    calibrated_int._divided(x, divisor, torch.float32).sum().backward()
    assert torch.equal(x.grad, torch.ones(400, 1536) / divisor)
