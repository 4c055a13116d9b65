"""GPTQ and AWQ on whole models: a Hugging Face decoder without a hand-written
structure (its decoder layers found and checked to chain), a Keras-style
stack of this library's layers, a structure the user passes; the result
computes better than round to nearest on the same grid; progress; an
interrupt part-way leaves the model unchanged; save/load, `save_pretrained`
/ `from_pretrained`, summary, module lifecycle."""

import copy
import pickle
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from dtype_policies import apply_policy, layers, quantize, saving, summary
from dtype_policies._core.module_state import STATE_KEY
from dtype_policies.quantization import calibration
from dtype_policies.quantization.attach import quantization_of
from dtype_policies.quantization.kernels import int4 as int4_kernels
from dtype_policies.quantization.report import SKIP_OUTSIDE_STRUCTURE
from dtype_policies.quantization.schemes import calibrated_int
from dtype_policies.quantization.structure import blocks_chain, find_blocks
from dtype_policies.quantizers import AWQConfig, GPTQConfig, Int4QuantizationConfig, gptq
from dtype_policies.quantizers.calibration_data import token_windows

transformers = pytest.importorskip("transformers")

VOCAB = 128


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.utils.logging.disable_progress_bar()
    yield
    transformers.utils.logging.enable_progress_bar()


def llama(layers_count: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers_count,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # trained weights are not flat: give some input channels weight
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(1 + 3 * torch.rand(p.shape[1]) ** 4)
    return model


def token_data(count: int = 2000, seed: int = 1) -> list[torch.Tensor]:
    """Token ids with some structure (a random walk over the vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    steps = torch.randint(-3, 4, (count,), generator=generator)
    return [torch.remainder(torch.cumsum(steps, 0), VOCAB - 1) + 1]


EVAL = token_data(64, seed=2)[0].reshape(2, 32)  # held out, from the calibration distribution


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(EVAL, use_cache=False).logits.float()


def error(model: nn.Module, reference: torch.Tensor) -> float:
    return float(((logits(model) - reference) ** 2).mean())


def quiet_quantize(model, config, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return quantize(model, config=config, progress=False, **kwargs)


def test_the_decoder_layers_of_a_hugging_face_model_are_found():
    model = llama()
    blocks = find_blocks(model)
    assert [path for path, _ in blocks] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert all(b is m for (_, b), m in zip(blocks, model.model.layers))


@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_a_hugging_face_decoder_calibrates_block_by_block(mode):
    model = llama()
    reference = logits(model)
    calls = {i: 0 for i in range(3)}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    cls = GPTQConfig if mode == "gptq" else AWQConfig
    config = cls(token_data(), None, num_samples=6, sequence_length=32, group_size=32)
    report = quiet_quantize(model, config)
    quantized = [path for path, *_ in report.quantized]
    assert len(quantized) == 3 * 7 and all(p.startswith("model/layers/") for p in quantized)
    assert report.skipped_by_reason("outside quantization structure") == ["lm_head"]
    # one chain check (one batch), then per block: statistics (one whole call,
    # the later ones stopped after the last target), and next inputs but the last
    batches = 2  # 6 windows in batches of 4
    assert config.calibration_batch_size == 4
    assert calls == {0: 1 + 1 + batches, 1: 1 + 1 + batches, 2: 1 + 1}
    # six short windows are too few for quality (the comparison with round to
    # nearest below uses more): here only that the result is not broken
    assert error(model, reference) < 0.2 * float(reference.var())
    rows = summary(model).splitlines()
    assert sum(row.split().count(f"{mode}/4/32") for row in rows) == 21  # the label column


@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_an_embedding_holding_nan_is_blamed_not_the_first_blocks_weight(mode):
    """The first block's q_proj was named, with advice to calibrate from
    float32: the NaN came from the embedding table, before any block."""
    model = llama(layers_count=2)
    with torch.no_grad():
        model.model.embed_tokens.weight[5, 3] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cls = GPTQConfig if mode == "gptq" else AWQConfig
    config = cls(token_data(), None, num_samples=4, sequence_length=32, group_size=32)
    with pytest.raises(ValueError, match=r"the inputs of the first block 'model.layers.0' hold "
                       r"\d+ non-finite value\(s\) .*its embeddings"):  # fmt: skip
        quiet_quantize(model, config)
    state = model.state_dict()
    for key, value in state.items():
        assert torch.allclose(value, before[key], rtol=0, atol=0, equal_nan=True), key


def rtn_copy(model: nn.Module, bits: int, group: int) -> nn.Module:
    """The same model, each weight of its blocks rounded to nearest on GPTQ's grid."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for module in rounded.model.layers.modules():
            if isinstance(module, nn.Linear):
                levels = gptq.quantize_rtn(module.weight, bits=bits, group_size=group)
                module.weight.copy_(gptq.dequantize_with_sz_map(*levels))
    return rounded


@pytest.mark.parametrize("bits", [pytest.param(3, marks=pytest.mark.slow), 4])
def test_gptq_beats_round_to_nearest_on_held_out_data(bits):
    model = llama()
    reference = logits(model)
    rtn = error(rtn_copy(model, bits, 32), reference)
    config = GPTQConfig(
        token_data(), None, weight_bits=bits, num_samples=32, sequence_length=48, group_size=32
    )
    quiet_quantize(model, config)
    assert error(model, reference) < 0.8 * rtn


@pytest.mark.parametrize("grid", ["keras", "refined"])
def test_activation_order_stores_g_idx_and_the_kernel_permutes_the_input(grid):
    """Keras's grids follow the order (a permuted `g_idx`, folded into the
    packed kernel); the refined grids keep the natural groups."""
    model = llama(layers_count=1)
    config = GPTQConfig(
        token_data(),
        None,
        num_samples=4,
        sequence_length=32,
        group_size=16,
        activation_order=True,
        grid=grid,
    )
    quiet_quantize(model, config)
    proj = model.model.layers[0].mlp.down_proj
    g_idx = proj.weight_g_idx
    natural = (torch.arange(128) // 16).float()
    assert g_idx.dtype == torch.float32 and g_idx.shape == (128,)
    assert torch.equal(g_idx, natural) == (grid == "refined")
    assert torch.equal(g_idx.sort().values, natural)
    x = torch.randn(5, 128)
    weight = quantization_of(proj).dequantized(proj)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            out = proj(x.to(dtype)).float()
            expected = x.to(dtype).float() @ weight.t()
            assert torch.allclose(out, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))
    # int4's own runtime and packed kernel, the permutation folded into it
    runtime = quantization_of(proj).runtime
    assert isinstance(runtime, int4_kernels.Int4Runtime) and runtime.packed is not None
    assert int4_kernels.int4_path(runtime, 1, 16) == int4_kernels.cpu_kernel()


@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_calibrated_int4_is_stored_and_runs_as_round_to_nearest_int4(mode):
    """The same buffers (names, dtypes, shapes laid out like the weight) and
    the same packed kernel as `int4/<block>`: the same decode speed."""
    model = llama(layers_count=1)
    rtn = copy.deepcopy(model)
    quantize(rtn.model.layers, config=Int4QuantizationConfig(block_size=32))
    cls = GPTQConfig if mode == "gptq" else AWQConfig
    quiet_quantize(model, cls(token_data(), None, num_samples=4, sequence_length=32, group_size=32))
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        ours = model.model.layers[0].get_submodule(name)
        theirs = rtn.model.layers[0].get_submodule(name)
        for suffix in ("_int4", "_scale", "_zero", "_g_idx"):
            a, b = ours._buffers["weight" + suffix], theirs._buffers["weight" + suffix]
            assert (a.dtype, a.shape) == (b.dtype, b.shape)
        with torch.no_grad():
            ours(torch.randn(1, ours.in_features))
            theirs(torch.randn(1, ours.in_features))
        mine, reference = quantization_of(ours).runtime, quantization_of(theirs).runtime
        assert type(mine) is type(reference) is int4_kernels.Int4Runtime
        assert mine.layout == reference.layout and mine.plan.order is None
        assert mine.packed.shape == reference.packed.shape


def test_int8_after_calibrating_stores_what_is_still_float():
    """GPTQ leaves the embedding and the head float; `quantize(model, "int8")`
    afterwards quantizes those and skips the calibrated layers."""
    model = llama(layers_count=2)
    quiet_quantize(model, GPTQConfig(token_data(), None, num_samples=4, sequence_length=32))
    calibrated = {name for name, m in model.named_modules() if quantization_of(m) is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        report = quantize(model, "int8")
    modes = {n: qw.mode for n, m in model.named_modules() if (qw := quantization_of(m))}
    assert [path for path, *_ in report.quantized] == ["model/embed_tokens", "lm_head"]
    assert modes["lm_head"] == modes["model.embed_tokens"] == "int8"
    assert all(modes[name] == "gptq" for name in calibrated) and len(calibrated) == 14
    assert torch.isfinite(logits(model)).all()


@pytest.mark.parametrize("bits, group", [(2, 32), (3, 16), (8, -1), (8, 32), (4, -1)])
def test_every_width_stores_its_range_and_computes_its_dequantized_weight(bits, group):
    model = llama(layers_count=1)
    config = GPTQConfig(
        token_data(), None, weight_bits=bits, num_samples=4, sequence_length=32, group_size=group
    )
    quiet_quantize(model, config)
    proj = model.model.layers[0].mlp.up_proj
    qw = quantization_of(proj)
    values = qw.scheme.integer_values(proj, qw)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    assert int(values.min()) >= low and int(values.max()) <= high
    assert ("weight_int8" in proj._buffers) == (bits == 8)
    x = torch.randn(7, 64)
    weight = qw.dequantized(proj)
    with torch.no_grad():
        out = proj(x)
    expected = x @ weight.t()
    assert torch.allclose(out, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))
    # summary (and `inspect`) read the integer data under its width's name
    label = f"gptq/{bits}/{group}"
    row = next(r for r in summary(model).splitlines() if "mlp/up_proj" in r)
    assert label in row.split() and str(64 * 128) in row.split()  # up_proj: no bias


def test_a_keras_style_stack_calibrates_its_repeated_blocks():
    torch.manual_seed(0)

    class Block(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.up = layers.Dense(32, activation="relu")
            self.down = layers.Dense(16)

        def call(self, x):
            return x + self.down(self.up(x))

    model = layers.Sequential([layers.Dense(16), Block(), Block(), Block(), layers.Dense(4)])
    data = [torch.randn(8, 16) for _ in range(3)]
    model(data[0])
    assert [path for path, _ in find_blocks(model)] == ["1", "2", "3"]
    config = GPTQConfig(data, None, group_size=16)
    report = quiet_quantize(model, config)
    outside = report.skipped_by_reason("outside quantization structure")
    root = model.name  # "sequential", or "sequential_<n>" after other tests built one
    assert sorted(outside) == [f"{root}/0", f"{root}/4"]
    quantized = [path for path, *_ in report.quantized]
    assert quantized == [f"{root}/{i}/{n}" for i in (1, 2, 3) for n in ("up", "down")]


def test_blocks_that_do_not_chain_fall_back_to_the_whole_model():
    class Parallel(nn.Module):  # two "blocks" both applied to the input: not a chain
        def __init__(self):
            super().__init__()
            self.branches = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])

        def forward(self, x):
            return self.branches[0](x) + self.branches[1](x)

    torch.manual_seed(0)
    model = Parallel()
    data = [torch.randn(8, 16)]
    with pytest.warns(UserWarning, match="do not run one after the other"):
        report = quantize(model, config=GPTQConfig(data, None, group_size=16), progress=False)
    assert len(report.quantized) == 2


def test_blocks_chain_says_why_blocks_do_not_chain():
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4) for _ in range(3)]
    x = torch.randn(2, 4)
    assert blocks_chain(blocks, lambda: blocks[2](blocks[1](blocks[0](x)))) == (True, "")
    assert blocks_chain(blocks, lambda: blocks[2](blocks[1](blocks[0](x)) + 1)) == (
        False,
        "block 2 does not take block 1's output as its input",
    )
    assert blocks_chain(blocks, lambda: blocks[1](blocks[0](x)) + blocks[2](x))[1] == (
        "block 2 does not take block 1's output as its input"
    )
    assert blocks_chain(blocks, lambda: blocks[2](blocks[0](x))) == (
        False,
        "the blocks ran in the order [0, 2]",
    )
    ran = []
    after = nn.Linear(4, 4)
    after.register_forward_hook(lambda *a: ran.append(1))
    assert blocks_chain(blocks, lambda: after(blocks[2](blocks[1](blocks[0](x)))))[0]
    assert ran == []  # what follows the last block is not run

    def looped():  # the same blocks twice over (weights shared across depth)
        h = x
        for _ in range(2):
            h = blocks[2](blocks[1](blocks[0](h)))
        return after(h)

    assert blocks_chain(blocks, looped) == (False, "the blocks ran in the order [0, 1, 2, 0]")


class _ResidualBlock(nn.Module):
    """Hands the next block a second tensor (a residual stream)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, hidden, residual):
        residual = residual + hidden
        return self.down(torch.relu(self.up(residual))), residual


def test_blocks_handing_on_a_second_tensor_do_not_chain():
    """Calibration gives every block the first block's other arguments: blocks
    1-3 were calibrated on block 0's residual (zeros), worse than round to
    nearest, without a word."""
    torch.manual_seed(0)
    blocks = [_ResidualBlock() for _ in range(3)]
    x = torch.randn(2, 16)

    def run():
        hidden, residual = x, torch.zeros_like(x)
        for block in blocks:
            hidden, residual = block(hidden, residual)
        return hidden

    chained, why = blocks_chain(blocks, run)
    assert not chained and why.startswith("block 1 takes another 'residual' than block 0")

    def shared():  # the same second argument for every block: a chain
        hidden, extra = x, torch.ones_like(x)
        for block in blocks:
            hidden, _ = block(hidden, extra)
        return hidden

    assert blocks_chain(blocks, shared) == (True, "")


@pytest.mark.parametrize("config_class", [GPTQConfig, AWQConfig])
@pytest.mark.parametrize("blocks", [1, 2])
def test_a_weight_two_calibrated_modules_share_is_refused(config_class, blocks):
    """Two blocks: torch's functional_call failed on the tied keys; one block:
    the weight was calibrated twice and stored untied, silently."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
            self.b.weight = self.a.weight

        def forward(self, x):
            return x + self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = nn.Sequential(*[Tied() for _ in range(blocks)])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = [torch.randn(8, 32) for _ in range(2)]
    with pytest.raises(ValueError, match=r"modules '0/a' and '0/b' share one weight"):
        config = config_class(data, None, group_size=32, num_samples=2)
        quantize(model, config=config, progress=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model[0].b.weight is model[0].a.weight and quantization_of(model[0].a) is None


def test_a_structure_the_user_passes():
    model = llama()
    config = GPTQConfig(
        token_data(),
        None,
        num_samples=4,
        sequence_length=32,
        group_size=32,
        quantization_layer_structure={
            "pre_block_layers": [model.model.embed_tokens],
            "sequential_blocks": ["model/layers/1", model.model.layers[2]],
        },
    )
    report = quiet_quantize(model, config)
    assert all(p.startswith(("model/layers/1/", "model/layers/2/")) for p, *_ in report.quantized)
    assert quantization_of(model.model.layers[0].mlp.up_proj) is None


@pytest.mark.parametrize(
    "structure, message",
    [
        # out of order: block 0 would be calibrated on block 1's outputs
        (["model.layers.1", "model.layers.0"], r"do not run one after the other \(the blocks ran"),
        # every other block: the second would be calibrated on the first's outputs
        (["model.layers.0", "model.layers.2"], r"block 1 does not take block 0's output"),
        (
            {"pre_block_layers": ["model.embeddings"], "sequential_blocks": ["model.layers.0"]},
            r"No module at 'model.embeddings' in the model \(quantization structure's pre_block",
        ),
    ],
)
def test_a_structure_that_cannot_be_calibrated_is_refused_before_anything_changes(
    structure, message
):
    model = llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = GPTQConfig(
        token_data(),
        None,
        num_samples=2,
        sequence_length=16,
        group_size=32,
        quantization_layer_structure=structure,
    )
    with pytest.raises(ValueError, match=message):
        quiet_quantize(model, config)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(quantization_of(m) is None for m in model.modules())


def test_progress_on_request_and_quiet_otherwise(monkeypatch, capsys):
    model = llama(layers_count=2)
    config = GPTQConfig(token_data(), None, num_samples=2, sequence_length=16, group_size=32)
    quiet_quantize(copy.deepcopy(model), config)  # progress=False
    assert capsys.readouterr().err == ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantize(copy.deepcopy(model), config=config)  # stderr is not a terminal here
    assert capsys.readouterr().err == ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantize(model, config=config, progress=True)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("gptq: block 1/2, ") and "remaining" in lines[0]
    assert lines[1].startswith("gptq: block 2/2, ")
    assert lines[-1].startswith("gptq: calibrated 2 blocks in ")


def snapshot(model):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [type(m) for m in model.modules()],
    )


def assert_same(model, before):
    tensors, classes = before
    after = model.state_dict()
    assert list(after) == list(tensors) and all(torch.equal(after[k], tensors[k]) for k in tensors)
    assert [type(m) for m in model.modules()] == classes


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_part_way_leaves_the_model_unchanged(monkeypatch, failure, capsys):
    model = llama()
    before = snapshot(model)
    original = calibrated_int.InputStatistics.update
    seen = []

    def interrupted(self, rows, row_weights=None):
        seen.append(1)
        if len(seen) == 16:  # in the third block
            raise failure("stopped")
        return original(self, rows, row_weights)

    monkeypatch.setattr(calibrated_int.InputStatistics, "update", interrupted)
    config = GPTQConfig(token_data(), None, num_samples=4, sequence_length=32, group_size=32)
    with pytest.raises(failure), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantize(model, config=config, progress=True)
    assert "the model is unchanged" in capsys.readouterr().err
    tensors, classes = before
    after = model.state_dict()
    assert list(after) == list(tensors) and all(torch.equal(after[k], tensors[k]) for k in tensors)
    assert [type(m) for m in model.modules()] == classes
    assert all(quantization_of(m) is None for m in model.modules())


def test_saving_and_hugging_face_round_trips(tmp_path):
    model = llama(layers_count=2)
    apply_policy(model, "mixed_bfloat16")
    config = AWQConfig(token_data(), None, num_samples=4, sequence_length=32, group_size=32)
    quiet_quantize(model, config)
    expected = logits(model)
    saving.save(model, tmp_path / "ckpt")
    fresh = llama(layers_count=2, seed=5)
    saving.load(fresh, tmp_path / "ckpt")
    assert torch.equal(logits(fresh), expected)
    model.save_pretrained(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(logits(loaded), expected)
    assert "awq/4/32" in summary(loaded)
    # lifecycle: deepcopy, pickle, state_dict into a model quantized the same way
    assert torch.equal(logits(copy.deepcopy(model)), expected)
    assert torch.equal(logits(pickle.loads(pickle.dumps(model))), expected)


def test_misuse():
    model = llama(layers_count=1)
    with pytest.raises(ValueError, match="must pass a `GPTQConfig`"):
        quantize(model, "gptq")
    with pytest.raises(ValueError, match="requires a dataset"):
        quantize(model, config=GPTQConfig(None, None), progress=False)
    with pytest.raises(ValueError, match="no `tokenizer` was given"):
        quantize(model, config=GPTQConfig(["some text"], None), progress=False)
    with pytest.raises(ValueError, match="Unrecognized keyword"):
        quantize(model, config=GPTQConfig(token_data(), None), progres=False)
    before = logits(model)
    with pytest.raises(TypeError, match=r"floating-point tensors \(torch.float32, shape \(4, 32\)"):
        quiet_quantize(model, GPTQConfig([torch.randn(4, 32)], None, sequence_length=16))
    for ids, bad in ((torch.full((64,), VOCAB + 5), VOCAB + 5), (torch.full((64,), -3), -3)):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the model's vocabulary"):
            quiet_quantize(model, GPTQConfig([ids], None, num_samples=2, sequence_length=16))
    assert all(quantization_of(m) is None for m in model.modules())
    assert torch.equal(logits(model), before)


@pytest.mark.parametrize("config_class", [GPTQConfig, AWQConfig])
@pytest.mark.parametrize(
    "dataset",
    [
        [torch.randn(0, 64)],
        [torch.randn(0, 64), torch.randn(2, 0, 64)],
        [(torch.randn(0, 64), torch.tensor(1.0))],  # a 0-d argument (a timestep) is no row
    ],
)
def test_float_inputs_without_rows_are_refused_before_anything_changes(config_class, dataset):
    """Calibrating on no rows was round to nearest under a calibrated label."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    with pytest.raises(ValueError, match=r"inputs hold no rows \(shapes \(0, 64\)"):
        quantize(mlp, config=config_class(dataset, None, group_size=32), progress=False)
    assert all(quantization_of(m) is None for m in mlp.modules())
    assert all(torch.equal(v, before[k]) for k, v in mlp.state_dict().items())


def _whisper() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(config).eval()


@pytest.mark.parametrize("config_class", [GPTQConfig, AWQConfig])
def test_an_encoder_decoder_reading_features_says_what_to_pass_and_calibrates_on_it(
    config_class,
):
    """Whisper's input table is its decoder's, but it reads `input_features`:
    token ids are refused naming that input, before anything changes, and
    its features (a tensor, or a dict) calibrate the encoder's blocks."""
    model = _whisper()
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    decoder_ids = torch.tensor([[1, 5, 9, 4]] * 2)

    def outputs():
        with torch.no_grad():
            return model(input_features=features, decoder_input_ids=decoder_ids).logits

    before = outputs()
    settings = dict(num_samples=2, sequence_length=8, group_size=16)
    with pytest.raises(TypeError, match=r"reads 'input_features' \(its main_input_name\)"):
        quiet_quantize(model, config_class(token_data(), None, **settings))
    assert all(quantization_of(m) is None for m in model.modules())
    assert torch.equal(outputs(), before)
    report = quiet_quantize(model, config_class([features], None, **settings))
    quantized = {path for path, *_ in report.quantized}
    assert {"model/encoder/layers/0/fc1", "model/encoder/layers/1/self_attn/q_proj"} <= quantized
    assert torch.isfinite(outputs()).all()
    assert float((outputs() - before).abs().max() / before.abs().max()) < 0.2


@pytest.mark.parametrize("config_class", [GPTQConfig, AWQConfig])
def test_a_model_with_no_token_table_calibrates_on_its_own_inputs(config_class):
    """Wav2Vec2 has no input embeddings: transformers' `get_input_embeddings`
    raises NotImplementedError, which ended every calibration of it."""
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=40,
        hidden_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=136,
        conv_dim=(24, 24),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    model = transformers.Wav2Vec2ForCTC(config).eval()
    audio = [{"input_values": torch.randn(2, 800, generator=torch.Generator().manual_seed(i))}
             for i in range(2)]  # fmt: skip
    with torch.no_grad():
        before = model(**audio[0]).logits
    report = quiet_quantize(model, config_class(audio, None, num_samples=4, group_size=24))
    quantized = {path for path, *_ in report.quantized}
    assert "wav2vec2/encoder/layers/1/feed_forward/output_dense" in quantized
    with torch.no_grad():
        after = model(**audio[0]).logits
    assert torch.isfinite(after).all()
    assert float((after - before).abs().max() / before.abs().max()) < 0.2


def test_a_second_call_keeps_the_structure_and_changes_nothing():
    # the first call skips what lies outside the decoder blocks (the LM head); a second call,
    # every block already quantized, once took the whole model as the block and calibrated it
    model = llama(layers_count=2)
    config = GPTQConfig(token_data(), None, num_samples=4, sequence_length=32, group_size=32)
    quiet_quantize(model, config)
    assert quantization_of(model.lm_head) is None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = quiet_quantize(model, config)
    assert report.quantized == []
    assert ("lm_head", SKIP_OUTSIDE_STRUCTURE) in report.skipped
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_tokenizers_output_calibrates_without_its_padding():
    ids = token_data()[0][:192].reshape(3, 64)
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0  # padding: never part of a window
    encoding = transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask})
    windows = token_windows([encoding], None, num_samples=2, sequence_length=64)
    stream = torch.cat([ids[0], ids[1, :40], ids[2]])  # row after row, the padding left out
    starts = [0, (stream.numel() - 64 + 1) // 2]
    assert torch.equal(windows, torch.stack([stream[s : s + 64] for s in starts]))
    model, reference = llama(layers_count=1), llama(layers_count=1)
    quiet_quantize(model, GPTQConfig([encoding], None, num_samples=2, sequence_length=64))
    assert quantization_of(model.model.layers[0].mlp.down_proj) is not None
    assert 0 < error(model, logits(reference)) < 0.05 * float(logits(reference).pow(2).mean())
    with pytest.raises(TypeError, match=r"needs 'input_ids'.*Received keys: \['ids'\]"):
        token_windows([{"ids": ids}], None, num_samples=2, sequence_length=16)
    with pytest.raises(ValueError, match=r"attention_mask has 64 entries for 192 input_ids"):
        token_windows([{"input_ids": ids, "attention_mask": mask[0]}], None, 2, 16)


def test_a_tokenizers_unpadded_output_and_a_float_mask_are_read_as_ids():
    """`tokenizer(texts)` without padding gives rows of different lengths;
    a float mask (`(ids != 0).float()`) is still a mask: the ids are
    windowed, the masked positions left out."""
    ids = token_data()[0]
    rows = [ids[:50].tolist(), ids[50:130].tolist(), ids[130:150].tolist()]
    ragged = transformers.BatchEncoding(
        {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}
    )
    stream = ids[:150]
    windows = token_windows([ragged], None, num_samples=2, sequence_length=64)
    assert torch.equal(windows[0], stream[:64])
    assert torch.equal(token_windows(rows, None, 2, 64), windows)  # a list of rows
    padded = ids[:128].reshape(2, 64).clone()
    float_mask = torch.ones(2, 64)
    float_mask[1, 40:] = 0.0
    windows = token_windows([{"input_ids": padded, "attention_mask": float_mask}], None, 1, 104)
    assert torch.equal(windows[0], torch.cat([padded[0], padded[1, :40]]))


def test_an_array_of_texts_is_read_text_by_text():
    texts = np.array(["abcd", "ghij"])
    windows = token_windows(texts, lambda text: [ord(c) for c in text], 2, 4)
    assert windows.tolist() == [[97, 98, 99, 100], [99, 100, 103, 104]]
    assert torch.equal(
        windows, token_windows(["abcd", "ghij"], lambda t: [ord(c) for c in t], 2, 4)
    )


def test_a_structure_given_as_a_generator_is_read_once_and_kept():
    model = llama(layers_count=2)
    config = GPTQConfig(
        token_data(),
        None,
        num_samples=4,
        sequence_length=32,
        group_size=32,
        quantization_layer_structure=(f"model.layers.{i}" for i in range(2)),
    )
    assert config.get_config()["quantization_layer_structure"] == [
        "model.layers.0",
        "model.layers.1",
    ]
    quiet_quantize(model, config)
    assert quantization_of(model.model.layers[1].mlp.down_proj) is not None
    with pytest.raises(ValueError, match=r"\['sequential_blocks'\] must hold the blocks"):
        GPTQConfig(token_data(), None, quantization_layer_structure={"sequential_blocks": None})


_SHARED = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
# (model, what the error names of its limit, a window one past it)
_POSITION_TABLES = {
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
            bos_token_id=0, eos_token_id=0,
        )),
        "'n_positions': 32", 48,
    ),
    "bert": (
        lambda: transformers.BertForSequenceClassification(transformers.BertConfig(
            **_SHARED, intermediate_size=64, max_position_embeddings=32,
        )),
        "'max_position_embeddings': 32", 48,
    ),
    "roberta": (  # its table starts past its padding index: 34 rows for 32 positions
        lambda: transformers.RobertaModel(transformers.RobertaConfig(
            **_SHARED, intermediate_size=64, max_position_embeddings=34, pad_token_id=1,
        )),
        "'max_position_embeddings': 34}; its table of positions holds 32", 33,
    ),
    "opt": (  # its table starts at 2: 34 rows for 32 positions
        lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
            **_SHARED, ffn_dim=64, max_position_embeddings=32, word_embed_proj_dim=32,
        )),
        "'max_position_embeddings': 32}; its table of positions holds 32", 48,
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(_POSITION_TABLES))
def test_windows_longer_than_the_models_positions_are_named(kind):
    """Named before the model runs: BERT's positions failed on a tensor
    expansion (a RuntimeError naming 512 and 64), not on an index; RoBERTa's
    table starts past its padding index (34 rows hold 32 positions)."""
    torch.manual_seed(0)
    make, limit, length = _POSITION_TABLES[kind]
    model = make().eval()
    before = snapshot(model)
    data = GPTQConfig(token_data(), None, num_samples=2, sequence_length=length, group_size=32)
    with pytest.raises(ValueError, match=rf"windows of {length} tokens .*{limit}.*sequence_length"):
        quiet_quantize(model, data)
    assert_same(model, before)


def test_windows_past_a_rotary_models_configured_positions_calibrate():
    """A Llama's `max_position_embeddings` is no table: it runs longer windows
    (a first version of the check above refused them)."""
    model = llama(layers_count=1)  # max_position_embeddings=64
    config = GPTQConfig(token_data(), None, num_samples=2, sequence_length=96, group_size=32)
    report = quiet_quantize(model, config)
    assert report.quantized
    # nor is a token table that happens to have as many rows
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    ids = [torch.randint(0, 64, (512,), generator=torch.Generator().manual_seed(2))]
    report = quiet_quantize(model, GPTQConfig(ids, None, num_samples=2, sequence_length=96))
    assert report.quantized


def test_one_model_calibrated_by_two_calls_at_once_is_refused():
    model = llama(layers_count=1)
    config = GPTQConfig(token_data(), None, num_samples=4, sequence_length=32, group_size=32)
    with calibration._calibrating(model):  # another call's calibration in progress
        before = snapshot(model)
        with pytest.raises(RuntimeError, match="being calibrated by another quantize"):
            quiet_quantize(model, config)
        assert_same(model, before)
    quiet_quantize(model, config)  # once it is over
    assert quantization_of(model.model.layers[0].mlp.down_proj) is not None
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        quantize(llama(layers_count=1), config=config, progress="yes")


def test_a_short_dataset_is_repeated_with_a_warning_naming_its_size():
    ids = torch.arange(10)
    with pytest.warns(UserWarning, match=r"holds 10 tokens, fewer than .* 4 x 8 = 32 asked"):
        windows = token_windows([ids], None, num_samples=4, sequence_length=8)
    assert windows.shape == (4, 8)
    assert set(windows.flatten().tolist()) <= set(range(10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # enough tokens: nothing to say
        token_windows([torch.arange(32)], None, num_samples=4, sequence_length=8)


@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_calibrating_under_inference_mode_stores_what_it_stores_outside(mode):
    # the rows made under inference_mode have no version counter (this raised)
    config_class = GPTQConfig if mode == "gptq" else AWQConfig
    models = [llama(layers_count=1), llama(layers_count=1)]
    for model, inference in zip(models, (False, True)):
        config = config_class(token_data(), None, num_samples=4, sequence_length=32, group_size=32)
        with torch.inference_mode(inference):
            quiet_quantize(model, config)
    outside, inside = (dict(m.named_buffers()) for m in models)
    assert outside.keys() == inside.keys() and any(k.endswith("_int4") for k in inside)
    assert all(torch.equal(outside[k], inside[k]) for k in outside)
    assert not any(b.is_inference() for b in inside.values())
    models[1].train()
    loss = models[1](EVAL, labels=EVAL, use_cache=False).loss
    loss.backward()  # the float parameters that remain train
    assert models[1].model.norm.weight.grad is not None


def test_calibrations_in_two_threads_store_what_each_stores_alone():
    originals = [llama(layers_count=2, seed=seed) for seed in (0, 1)]  # the global RNG: before

    def calibrate(index, out):
        model = copy.deepcopy(originals[index])
        config = GPTQConfig(
            token_data(seed=index + 1), None, num_samples=8, sequence_length=32, group_size=32
        )
        quiet_quantize(model, config)
        out[index] = {k: v.clone() for k, v in model.named_buffers()}

    alone: dict = {}
    for index in (0, 1):
        calibrate(index, alone)
    together: dict = {}
    threads = [threading.Thread(target=calibrate, args=(i, together)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for index in (0, 1):
        assert alone[index].keys() == together[index].keys()
        assert all(torch.equal(alone[index][k], together[index][k]) for k in alone[index])


def test_a_failing_weight_is_named_and_the_model_is_unchanged():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    inputs = torch.randn(32, 64)
    inputs[3, 5] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"module '0': its calibration inputs hold inf or NaN"):
        quiet_quantize(model, GPTQConfig([inputs], None, num_samples=1, group_size=32))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(quantization_of(m) is None for m in model.modules())


def kept_casts(module: nn.Module) -> int:
    """How many of `module`'s submodules keep compute-dtype casts between calls."""
    states = [m.__dict__.get(STATE_KEY) for m in module.modules()]
    return sum(1 for s in states if s is not None and (s.casts.entries or s.casts.pair))


@pytest.mark.parametrize("mode", ["gptq", pytest.param("awq", marks=pytest.mark.slow)])
def test_calibration_keeps_no_casts_and_inference_keeps_them_again(mode):
    model = llama()
    apply_policy(model, "mixed_bfloat16")
    with torch.no_grad():
        model(EVAL, use_cache=False)  # every block now keeps its bfloat16 casts
    assert all(kept_casts(layer) > 0 for layer in model.model.layers)
    during = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *a: during.append(kept_casts(model)))
    cls = GPTQConfig if mode == "gptq" else AWQConfig
    quiet_quantize(model, cls(token_data(), None, num_samples=6, sequence_length=32, group_size=32))
    # the chain check, the capture, then each block's calls: none kept a cast
    assert len(during) >= 3 + 5 and set(during) == {0}
    with torch.no_grad():
        model(EVAL, use_cache=False)
    assert kept_casts(model.lm_head) > 0  # not quantized: its casts are kept again


def test_calibration_data_fed_straight_to_the_first_block_is_not_written():
    """Each block's outputs go into its inputs' tensors from the second block
    on; the first block's inputs can be the caller's own tensors (a stack
    whose first block takes the model's input), which stay as they were."""

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    model = nn.Sequential(Residual(), Residual(), Residual()).eval()
    data = [torch.randn(8, 16) for _ in range(3)]
    copies = [tensor.clone() for tensor in data]
    config = GPTQConfig(data, None, group_size=16, quantization_layer_structure=list(model))
    report = quantize(model, config=config, progress=False)
    assert len(report.quantized) == 6
    assert all(torch.equal(a, b) for a, b in zip(data, copies))
