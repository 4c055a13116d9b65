"""The weight a quantized module without a float weight gives when read
(`module.weight` dequantized, `layer.kernel` the integer values) is a copy its
forward never reads: every in-place write to it raises a `TypeError` naming
the module and mode and leaves the stored tensors bit for bit as they were;
every read behaves as a plain tensor's. float8 keeps a float weight, and
writes to it still take effect."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtype_policies
from dtype_policies import layers, quantize, quantizers
from dtype_policies._compat import TORCH_VERSION
from dtype_policies.quantization.weight_copy import COPY_FLAGS, writes_first_argument

MODES = {
    "int8": lambda: None,
    "int4": lambda: None,
    "int4/32": lambda: quantizers.Int4QuantizationConfig(block_size=32),
    "gptq/4/8": lambda: quantizers.GPTQConfig(
        dataset=None, tokenizer=None, weight_bits=4, group_size=8
    ),
}
KINDS = (
    "nn.Linear",
    "nn.Embedding",
    "nn.Linear, deferred",
    "nn.Embedding, deferred",
    "layers.Dense",
    "layers.Embedding",
)
"""Torch modules' reads of at least `DEFERRED_MIN_ELEMENTS` are computed at
their first use (`deferred_read`), smaller ones at the read."""
DESCRIBED = {
    "nn.Linear": "Linear",
    "nn.Embedding": "Embedding",
    "nn.Linear, deferred": "Linear",
    "nn.Embedding, deferred": "Embedding",
    "layers.Dense": "Dense 'dense",
    "layers.Embedding": "Embedding 'embedding",
}


def _quantized(kind: str, mode: str) -> tuple[nn.Module, str, torch.Tensor]:
    """A quantized module of `kind`, the name of its weight and an input."""
    torch.manual_seed(0)
    config = MODES[mode]()
    mode_name = mode.split("/")[0]
    if mode_name == "gptq" and kind != "layers.Dense":
        pytest.skip("gptq without calibration data: Dense only (a torch module needs data)")
    if kind == "nn.Linear":
        module, name, x = nn.Linear(64, 16), "weight", torch.randn(3, 64)
    elif kind == "nn.Embedding":
        module, name, x = nn.Embedding(16, 64), "weight", torch.tensor([[0, 5, 15]])
    elif kind == "nn.Linear, deferred":
        module, name, x = nn.Linear(64, 4096), "weight", torch.randn(3, 64)
    elif kind == "nn.Embedding, deferred":
        module, name, x = nn.Embedding(4096, 64), "weight", torch.tensor([[0, 5, 15]])
    elif kind == "layers.Dense":
        module, name, x = layers.Dense(16), "kernel", torch.randn(3, 64)
        module.build((None, 64))
    else:
        module, name, x = layers.Embedding(16, 64), "embeddings", torch.tensor([[0, 5, 15]])
        module.build((None,))
    if isinstance(module, layers.Layer):
        with pytest.warns(UserWarning) if mode_name == "gptq" else _nothing():
            module.quantize(mode_name, config=config)
    else:
        quantize(module, mode_name, config)
    return module, name, x


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _random_like(w: torch.Tensor) -> torch.Tensor:
    return torch.randint_like(w, -3, 3) if not w.is_floating_point() else torch.randn_like(w)


WRITES: dict[str, Callable[[torch.Tensor], object]] = {
    ".data =": lambda w: setattr(w, "data", _random_like(w)),
    "zero_": lambda w: w.zero_(),
    "mul_": lambda w: w.mul_(2),
    "add_": lambda w: w.add_(_random_like(w)),
    "copy_": lambda w: w.copy_(_random_like(w)),
    "fill_": lambda w: w.fill_(1),
    "w[0] = 0": lambda w: w.__setitem__(0, 0),
    "nn.init": lambda w: nn.init.normal_(w) if w.is_floating_point() else nn.init.zeros_(w),
    "out=": lambda w: torch.mul(w, 2, out=w),
    "_foreach_mul_": lambda w: torch._foreach_mul_([w], 2),
    ".data.mul_": lambda w: w.data.mul_(2),
    ".detach().zero_": lambda w: w.detach().zero_(),
    "view: w[0].zero_": lambda w: w[0].zero_(),
    "view: w.t().copy_": lambda w: w.t().copy_(_random_like(w.t())),
    "rows: for row in w": lambda w: [row.zero_() for row in w],
}


def _stored(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.flatten().contiguous().view(torch.uint8)


def _assert_bit_identical(module: nn.Module, stored: dict[str, torch.Tensor]) -> None:
    now = module.state_dict()
    assert now.keys() == stored.keys()
    for key, value in stored.items():
        assert now[key].dtype == value.dtype, key
        assert torch.equal(_bytes(now[key]), _bytes(value)), key


REBINDING = (".data =",)
"""The writes that point the read tensor at other memory instead of writing it."""


def _reads_a_view(mode: str, kind: str) -> bool:
    """Keras's int8 `kernel`/`embeddings` are the stored integers themselves."""
    return mode == "int8" and kind.startswith("layers.")


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_a_write_to_the_weight_copy_is_refused(
    mode: str, kind: str, write: str, grad_mode: str
) -> None:
    if _reads_a_view(mode, kind) and write not in REBINDING:
        pytest.skip("a view of the stored integers: its writes reach the forward (tested below)")
    module, name, x = _quantized(kind, mode)
    expected = module(x)
    stored = _stored(module)
    context = torch.no_grad() if grad_mode == "no_grad" else torch.inference_mode()
    described = DESCRIBED[kind]
    with context:
        weight = getattr(module, name)
        with pytest.raises(
            TypeError,
            match=rf"{mode.split('/')[0]}-quantized {described}.*'{name}'.*Nothing was changed",
        ):
            WRITES[write](weight)
    _assert_bit_identical(module, stored)
    assert torch.equal(module(x), expected)


@pytest.mark.parametrize("write", [w for w in WRITES if w not in REBINDING])
@pytest.mark.parametrize("kind", ["layers.Dense", "layers.Embedding"])
def test_writes_to_a_keras_layers_int8_weight_reach_its_stored_integers(
    kind: str, write: str
) -> None:
    module, name, x = _quantized(kind, "int8")
    before = module(x)
    with torch.no_grad():
        torch.manual_seed(1)
        WRITES[write](getattr(module, name))
    integers = module.state_dict()[f"{name}_int8"] if kind == "layers.Dense" else None
    written = getattr(module, name)
    assert type(written) is not torch.Tensor or integers is None or torch.equal(written, integers)
    stored = next(v for k, v in module.state_dict().items() if v.dtype == torch.int8)
    assert torch.equal(written.as_subclass(torch.Tensor), stored.view_as(written))
    if write == ".data.mul_":  # behind torch's back: the packed layouts are dropped by hand
        dtype_policies.clear_cast_caches(module)  # (docs/apply_policy.md)
    assert not torch.equal(module(x), before)


@pytest.mark.parametrize("kind", KINDS)
def test_augmented_assignments_to_the_weight_are_refused(kind: str) -> None:
    module, name, _ = _quantized(kind, "int4")
    stored = _stored(module)
    with torch.no_grad(), pytest.raises(TypeError, match="Nothing was changed"):
        exec(f"module.{name} += 1")  # the copy declines `+=`; the assignment is refused
    with torch.no_grad(), pytest.raises(TypeError, match="'__setitem__'"):
        exec(f"module.{name}[0] += 1")
    _assert_bit_identical(module, stored)


def test_the_error_names_the_module_path_and_what_works_instead() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)))
    quantize(model, "int4")
    with torch.no_grad(), pytest.raises(TypeError) as refused:
        model[1][0].weight.zero_()
    message = str(refused.value)
    assert "int4-quantized Linear '1/0'" in message
    assert "'zero_'" in message and "'weight_int4'" in message
    assert "load_state_dict" in message and "before quantize()" in message


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_reads_of_the_weight_copy_behave_as_a_plain_tensor(mode: str, kind: str) -> None:
    module, name, _ = _quantized(kind, mode)
    weight = getattr(module, name)
    plain = weight.clone()  # (a deferred read's `as_subclass`: its own test file)
    assert isinstance(weight, torch.Tensor)
    assert repr(weight) == repr(plain)
    for result in (weight + 0, weight * 1, weight.clone(), weight.sum(), torch.cat([weight])):
        assert type(result) is torch.Tensor
    assert torch.equal(weight, plain) and torch.equal(weight.clone(), plain)
    assert torch.equal(getattr(module, name), plain)  # a new read, the same values
    if weight.is_floating_point():
        assert type(weight.float()) is type(weight)  # itself, as for a plain float32 tensor
        h = torch.randn(3, weight.shape[-1])
        assert torch.equal(F.linear(h, weight), F.linear(h, plain))
    saved = io.BytesIO()
    torch.save(weight, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, plain)
    for copied in (pickle.loads(pickle.dumps(weight)), copy.deepcopy(weight)):
        assert type(copied) is torch.Tensor and torch.equal(copied, plain)
    assert all(type(v) is torch.Tensor for v in module.state_dict().values())
    twin = copy.deepcopy(module)
    assert torch.equal(getattr(twin, name), plain)
    into = torch.empty_like(plain)
    into.copy_(weight)  # a read of the copy into a plain tensor
    into[0] = weight[1]
    assert torch.equal(into[1:], plain[1:])


def test_autograd_reads_the_weight_copy() -> None:
    module, _, _ = _quantized("nn.Embedding", "int8")
    h = torch.randn(2, 64, requires_grad=True)
    logits = F.linear(h, module.weight)  # a tied LM head
    assert type(logits) is torch.Tensor
    logits.sum().backward()
    assert torch.equal(h.grad, module.weight.as_subclass(torch.Tensor).sum(0).expand(2, 64))


def test_a_parameter_made_from_the_copy_is_the_callers_own() -> None:
    quantized, _, _ = _quantized("nn.Linear", "int8")
    linear = nn.Linear(64, 16)
    linear.weight = nn.Parameter(quantized.weight)  # dequantizing by hand
    stored = _stored(quantized)
    with torch.no_grad():
        linear.weight.mul_(0)
        linear.weight.data.add_(1)
    assert torch.equal(linear.weight, torch.ones(16, 64))
    _assert_bit_identical(quantized, stored)


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("kind", ["nn.Linear", "nn.Embedding", "layers.Dense"])
def test_float8_writes_to_its_float_weight_take_effect(kind: str, write: str) -> None:
    torch.manual_seed(0)
    if kind == "nn.Linear":
        module, name, x = nn.Linear(64, 16), "weight", torch.randn(3, 64)
    elif kind == "nn.Embedding":
        module, name, x = nn.Embedding(16, 64), "weight", torch.tensor([[0, 5, 15]])
    else:
        module, name, x = layers.Dense(16), "kernel", torch.randn(3, 64)
        module.build((None, 64))
    quantize(module, "float8")
    before = module(x)
    weight = getattr(module, name)
    assert type(weight) is nn.Parameter
    with torch.no_grad():
        WRITES[write](weight)
    assert not torch.equal(module(x), before)


def test_every_op_whose_schema_writes_its_tensor_is_refused() -> None:
    """The rule `WeightCopy` refuses by agrees with torch's own schemas: a
    `Tensor` method is a write exactly when an overload of its aten op marks
    its first (tensor) argument written, except the copy's own flags."""
    disagree = []
    for name in dir(torch.Tensor):
        if name.startswith("__") and not (name.startswith("__i") or name == "__setitem__"):
            continue  # operators reading their operands (`__add__`), Python's protocols
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            continue
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        schemas = [getattr(packet, overload)._schema for overload in packet.overloads()]
        writes = any(
            s.arguments
            and str(s.arguments[0].type) == "Tensor"  # not TorchScript's list `sort`
            and s.arguments[0].alias_info is not None
            and s.arguments[0].alias_info.is_write
            for s in schemas
        )
        if writes != writes_first_argument(getattr(torch.Tensor, name)) and name not in COPY_FLAGS:
            disagree.append(name)
    assert disagree == []


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_weight_of_tensors_transformers_loaded_is_left_by_its_initialization(
    mode: str,
) -> None:
    """`from_pretrained` marks the tensors it loaded `_is_hf_initialized` and
    then initializes the rest through the model's `_init_weights`, which reads
    weights as `module.weight` (GPT-2's `c_proj`, from its parent too): the
    weight read from loaded stored tensors carries the mark, so that
    transformers' `init` functions leave it; unmarked, a write still raises."""
    init = pytest.importorskip("transformers.initialization")
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    quantize(linear, mode)
    stored = _stored(linear)
    with pytest.raises(TypeError, match=f"{mode}-quantized Linear"):
        init.normal_(linear.weight)
    for buffer in linear.buffers():  # as transformers marks what it loaded
        buffer._is_hf_initialized = True
    assert linear.weight._is_hf_initialized is True
    init.normal_(linear.weight)
    init.zeros_(linear.weight)
    _assert_bit_identical(linear, stored)
    with torch.no_grad(), pytest.raises(TypeError):  # torch's own still raise
        nn.init.normal_(linear.weight)


class _TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.embed_tokens(ids)), self.embed_tokens.weight)


def _tied_head() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _TiedHead()
    quantize(model, "int8")
    ids = torch.tensor([[1, 2, 3]])
    return model, ids, model(ids)


def test_a_compiled_forward_reads_the_weight_of_a_quantized_embedding() -> None:
    model, ids, eager = _tied_head()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(ids), eager, atol=1e-6)
    exported = torch.export.export(model, (ids,), strict=False)
    assert torch.allclose(exported.module()(ids), eager, atol=1e-6)


@pytest.mark.xfail(
    TORCH_VERSION <= (2, 6),
    raises=KeyError,
    strict=True,
    reason="torch 2.6's strict export raises KeyError (_rewrite_dynamo_tensor_constants) "
    "when a forward reads a buffer of a torch.nn submodule it also calls: "
    "`self.bn(x) + self.bn.running_mean` of a plain nn.BatchNorm1d fails the same way",
)
def test_a_strict_export_reads_the_weight_of_a_quantized_embedding() -> None:
    model, ids, eager = _tied_head()
    exported = torch.export.export(model, (ids,), strict=True)
    assert torch.allclose(exported.module()(ids), eager, atol=1e-6)


@pytest.mark.parametrize("merge", ["merge_adapter", "merge_and_unload"])
def test_merging_peft_adapters_into_a_float8_base_computes_the_merged_weight(merge) -> None:
    """float8 keeps its float weight, so a merge is written; under plain
    `quantize()` (no application watching the tuners) the base went on
    computing from its kept cast of the unmerged weight: the adapter was
    silently dropped (53% off on a 64 x 64 layer)."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(0)
    tuned = peft.get_peft_model(
        nn.Sequential(nn.Linear(64, 64)),
        peft.LoraConfig(target_modules=["0"], init_lora_weights=False),
    )
    quantize(tuned, "float8")
    x = torch.randn(16, 64)
    with torch.no_grad():
        adapted = tuned(x)
        with tuned.disable_adapter():
            base = tuned(x)
    model = tuned.merge_and_unload() if merge == "merge_and_unload" else tuned
    if merge == "merge_adapter":
        tuned.base_model.merge_adapter()
    with torch.no_grad():
        merged = model(x)
    error = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert error(merged, adapted) < 0.1 < error(merged, base)  # float8's rounding of the sum
    if merge == "merge_adapter":
        tuned.base_model.unmerge_adapter()
        with torch.no_grad():
            assert error(tuned(x), adapted) < 0.1


_PEFT_IMPORTED_AFTER_QUANTIZING = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from dtype_policies import quantize

    torch.manual_seed(0)
    float8_model = nn.Sequential(nn.Linear(64, 64))
    int4_model = nn.Sequential(nn.Linear(64, 64))
    quantize(float8_model, "float8")
    quantize(int4_model, "int4")
    assert "peft" not in sys.modules
    import peft

    config = dict(target_modules=["0"], init_lora_weights=False)
    tuned = peft.get_peft_model(float8_model, peft.LoraConfig(**config))
    x = torch.randn(16, 64)
    with torch.no_grad():
        adapted = tuned(x)
        with tuned.disable_adapter():
            base = tuned(x)
        merged = tuned.merge_and_unload()(x)
    error = lambda a, b: float((a - b).norm() / b.norm())
    print(error(merged, adapted), error(merged, base))
    try:
        peft.get_peft_model(int4_model, peft.LoraConfig(**config)).merge_and_unload()
    except TypeError as refused:
        print(refused)
    import copy, pickle
    tuners_utils = sys.modules["peft.tuners.tuners_utils"]
    copy.deepcopy(tuners_utils.__spec__), pickle.dumps(tuners_utils.__loader__)  # recursed
    print("copied")
    """
)


@pytest.mark.slow  # a fresh process importing torch and peft
def test_a_quantized_model_unpickled_in_a_fresh_process_has_peft_s_merge_check(tmp_path) -> None:
    """`torch.load` of a whole quantized model never ran `attach`: peft's
    merge check was not extended, and merging into its float8 base dropped
    the adapter (0.9 off the adapted outputs)."""
    pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    quantize(model, "float8")
    torch.save(model, tmp_path / "model.pt")
    script = textwrap.dedent(
        f"""
        import torch, peft, dtype_policies
        model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        tuned = peft.get_peft_model(
            model, peft.LoraConfig(target_modules=["0"], init_lora_weights=False)
        )
        x = torch.randn(16, 64)
        with torch.no_grad():
            adapted = tuned(x)
            merged = tuned.merge_and_unload()(x)
        print(float((merged - adapted).norm() / adapted.norm()))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=True
    )
    assert float(run.stdout.splitlines()[-1]) < 0.1


@pytest.mark.slow  # a fresh process importing torch and peft
def test_merging_into_a_float8_base_with_peft_imported_after_quantizing() -> None:
    """The merge check is extended when peft loads, not only when a weight is
    quantized with peft loaded: imported later, the float8 merge was dropped
    (48% off the adapted outputs) and an int4 merge was not refused first."""
    pytest.importorskip("peft", reason="peft is not installed")
    run = subprocess.run(
        [sys.executable, "-c", _PEFT_IMPORTED_AFTER_QUANTIZING],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    errors, refusal, copied = run.stdout.splitlines()[-3:]
    assert copied == "copied"
    to_adapted, to_base = map(float, errors.split())
    assert to_adapted < 0.1 < to_base
    assert "tuner layer '0' is int4-quantized" in refusal and "Nothing was merged" in refusal


def _tiny_classifier_config(config_class):
    """A one-layer sequence classifier's config (3 labels, hidden 32)."""
    return config_class(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_labels=3,
    )  # fmt: skip


def test_peft_training_a_copy_of_a_head_holding_quantized_linears_warns(recwarn) -> None:
    """RoBERTa's classifier is a container (dense, out_proj): the warning
    looked at the copy alone and stayed quiet."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = _tiny_classifier_config(transformers.RobertaConfig)
    model = transformers.RobertaForSequenceClassification(config)
    quantize(model, "int8", filters=r".*classifier.*")
    peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query"]))
    [warned] = {str(w.message) for w in recwarn if "peft trains a copy" in str(w.message)}
    assert "'classifier/dense' (int8), 'classifier/out_proj' (int8)" in warned


@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_peft_training_a_copy_of_an_integer_quantized_head_warns(mode, recwarn) -> None:
    """`task_type="SEQ_CLS"` trains a copy of the classifier (peft's
    `modules_to_save`); a copy of an int8 head trained its bias alone, its
    random weight frozen, silently. float8 keeps a float weight, which trains."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = _tiny_classifier_config(transformers.BertConfig)
    model = transformers.BertForSequenceClassification(config)
    quantize(model, mode, filters=r".*classifier")
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query"])
    tuned = peft.get_peft_model(model, lora)
    warned = [str(w.message) for w in recwarn if "peft trains a copy" in str(w.message)]
    trained = {
        n.rsplit(".", 1)[-1]
        for n, p in tuned.named_parameters()
        if "classifier" in n and p.requires_grad
    }
    if mode == "float8":
        assert warned == [] and trained == {"weight", "bias"}
    else:
        assert trained == {"bias"}
        assert warned and f"weights: 'classifier' ({mode})" in warned[0]
    recwarn.clear()
    peft_first = peft.get_peft_model(transformers.BertForSequenceClassification(config), lora)
    quantize(peft_first, mode)  # peft's copies are adapters: left float
    assert not [w for w in recwarn if "peft trains a copy" in str(w.message)]
    trained = {
        n.rsplit(".", 1)[-1]
        for n, p in peft_first.named_parameters()
        if "classifier" in n and p.requires_grad
    }
    assert trained == {"weight", "bias"}


@pytest.mark.parametrize("quantized", ["every base", "the second base"])
@pytest.mark.parametrize("merge", ["merge_and_unload", "merge_adapter"])
def test_merging_peft_adapters_into_a_quantized_base_is_refused(quantized, merge) -> None:
    """peft merges tuner by tuner: with the first base float and the second
    quantized, the first was merged and unloaded before the second's write
    raised. peft's check before any merge refuses the model instead."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
    tuned = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False)
    )
    quantize(tuned, "int4", filters=None if quantized == "every base" else r".*2/base_layer")
    stored = _stored(tuned)
    tuners = [type(m) for m in tuned.modules()]
    x = torch.randn(3, 32)
    with torch.no_grad():
        before = tuned(x)
    first = "0" if quantized == "every base" else "2"
    with pytest.raises(TypeError, match=rf"tuner layer '{first}' is int4-quantized.*Nothing was"):
        getattr(tuned, merge)()  # it adds the adapters' product into `weight.data`
    _assert_bit_identical(tuned, stored)
    assert [type(m) for m in tuned.modules()] == tuners
    with torch.no_grad():
        assert torch.equal(tuned(x), before)
    tuner = tuned.base_model.model[2]
    with pytest.raises(TypeError, match=r"int4-quantized Linear '.*2/base_layer'"):
        tuner.merge()  # one tuner by hand: its write is refused
    _assert_bit_identical(tuned, stored)


def test_a_parametrized_bias_of_a_quantized_linear_is_added() -> None:
    """`register_parametrization(linear, "bias", ...)` moves the bias out of
    `_parameters`: the quantized forward read it there and added none."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    quantize(linear, "int8")
    x = torch.randn(3, 16)
    with torch.no_grad():
        before = linear(x)

    class Double(nn.Module):
        def forward(self, bias: torch.Tensor) -> torch.Tensor:
            return 2 * bias

    torch.nn.utils.parametrize.register_parametrization(linear, "bias", Double())
    with torch.no_grad():
        after = linear(x)
    original = linear.parametrizations.bias.original
    assert torch.allclose(after - before, original.expand_as(after), atol=1e-6)
