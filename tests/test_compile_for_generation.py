"""`compile_for_generation`: a compiled, static-cache `generate` that gives
eager's tokens and keeps the policies and the quantized storage."""

import copy
import io
import pickle
import warnings

import pytest
import torch

import dtype_policies
from dtype_policies import _frozen as frozen
from dtype_policies import _native as native
from dtype_policies import apply_policy, compile_for_generation, quantize
from dtype_policies._attention_dispatch import SELECTION
from dtype_policies._compat import CPP_WRAPPER_BY_DEFAULT, TORCH_VERSION
from dtype_policies._frozen import FrozenCompiledCall, ModelWatch
from dtype_policies._one_query_attention import NAME as ONE_QUERY
from dtype_policies.generation import _unmark_static_cache
from dtype_policies.quantization import Int4QuantizationConfig, Int8QuantizationConfig
from dtype_policies.quantization.kernels import int4 as int4_kernels
from dtype_policies.quantization.kernels import int8 as int8_kernels

transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        vocab_size=256,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config).eval()


PROMPT = torch.arange(3, 19)[None]


def greedy(model: torch.nn.Module, new_tokens: int = 6) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(
            PROMPT,
            attention_mask=torch.ones_like(PROMPT),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def step_scores(model: torch.nn.Module, new_tokens: int = 4) -> torch.Tensor:
    """The raw logits of each greedy step, (steps, vocab), float32 (the first
    step is the eager prefill, the others the compiled decode step)."""
    with torch.inference_mode():
        out = model.generate(
            PROMPT,
            attention_mask=torch.ones_like(PROMPT),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return torch.cat([logits.float() for logits in out.logits])


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_refuses_a_model_without_generate_naming_its_type():
    with pytest.raises(TypeError, match="got Linear"):
        compile_for_generation(torch.nn.Linear(2, 2))


def test_sets_a_static_cache_and_replaces_an_earlier_compiled_forward():
    model = tiny_llama()
    first = compile_for_generation(model)._compiled_call
    assert model.generation_config.cache_implementation == "static"
    assert model.generation_config.compile_config.fullgraph is True
    assert model._last_compile_config is model.generation_config.compile_config
    assert compile_for_generation(model)._compiled_call is not first


def test_the_decode_step_calls_its_kernels_from_cpp_unless_asked_for_python():
    model = tiny_llama()
    default = compile_for_generation(model)._compiled_call.inductor_options.get("cpp_wrapper")
    assert bool(default) is (TORCH_VERSION >= (2, 13))  # 2.6's cannot compile quantized graphs
    python = compile_for_generation(model, cpp_wrapper=False)._compiled_call
    assert "cpp_wrapper" not in python.inductor_options
    assert python.settings["cpp_wrapper"] is False
    with pytest.raises(TypeError, match="cpp_wrapper"):
        compile_for_generation(model, cpp_wrapper="yes")  # type: ignore[arg-type]


def test_save_pretrained_writes_the_models_own_generation_settings(tmp_path):
    import copy
    import json
    import pickle

    model = tiny_llama()
    model.generation_config.cache_implementation = "dynamic"
    compile_for_generation(model)
    compile_for_generation(model)  # twice: still the model's own value is written
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written.get("cache_implementation") == "dynamic" and "compile_config" not in written
    assert "_dtype_policies_saved" not in written
    assert model.generation_config.cache_implementation == "static"  # in force for generate
    assert "_dtype_policies_saved" not in model.generation_config.to_dict()
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert copied.generation_config.cache_implementation == "static"
        assert '"cache_implementation": "dynamic"' in copied.generation_config.to_json_string()
    loaded = type(model).from_pretrained(tmp_path)
    assert loaded.generation_config.cache_implementation == "dynamic"


def test_static_cache_tensors_become_ordinary_graph_inputs():
    cache = transformers.StaticCache(config=tiny_llama().config, max_cache_len=8)
    keys = torch.zeros(2)
    torch._dynamo.mark_static_address(keys)
    cache.layers[0].keys = keys
    _unmark_static_cache(cache)
    assert not hasattr(keys, "_dynamo_static_input_type")
    _unmark_static_cache(None)  # no cache: nothing to do


def test_an_encoder_decoder_caches_tensors_become_ordinary_graph_inputs_too():
    # `EncoderDecoderCache` holds two caches and no layers of its own: left
    # marked, freezing folded their tensors into T5's graph (an index error
    # in Inductor's cache update at the first generate)
    config = tiny_llama().config
    caches = [transformers.StaticCache(config=config, max_cache_len=8) for _ in range(2)]
    cache = transformers.EncoderDecoderCache(*caches)
    marked = []
    for inner in caches:
        for layer in inner.layers:
            tensor = torch.zeros(2)
            torch._dynamo.mark_static_address(tensor)
            layer.keys = tensor
            marked.append(tensor)
    _unmark_static_cache(cache)
    assert marked and not any(hasattr(t, "_dynamo_static_input_type") for t in marked)


@pytest.mark.slow
def test_an_encoder_decoder_model_generates_the_eager_tokens():
    torch.manual_seed(0)
    config = transformers.T5Config(
        d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=128,
        decoder_start_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(1))

    def generated():
        with torch.inference_mode():
            return model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip

    expected = generated()
    compile_for_generation(model, autotune=False)
    assert torch.equal(generated(), expected)
    assert torch.equal(generated(), expected)  # a second generate, a new cache


def attention_in_step(
    model, tokens: torch.Tensor, *, seen: list | None = None, fail: bool = False
) -> list[str]:
    """Compiles `model` for generation, then calls its decode step once with
    the compiled graph replaced by a spy: the attention implementation the
    call selected (or the model's own), appended to `seen` (the spy then
    raises RuntimeError when `fail`)."""
    compile_for_generation(model)
    seen = [] if seen is None else seen
    name = model.config._attn_implementation

    def compiled_step(**kwargs):
        config = model.config
        assert config._attn_implementation == name  # the name a model reads never changes
        seen.append(getattr(config, SELECTION, None) or name)
        if fail:
            raise RuntimeError("the step failed")

    model._compiled_call.compiled = compiled_step
    with torch.no_grad():
        model._compiled_call(input_ids=tokens)
    return seen


ONE_TOKEN = torch.zeros(1, 1, dtype=torch.long)


@pytest.mark.parametrize(
    ("implementation", "device", "in_step"),
    [("sdpa", "cpu", ONE_QUERY), ("eager", "cpu", "eager"), ("sdpa", "meta", "sdpa")],
)
def test_the_decode_step_writes_attention_out_on_cpu_only_for_its_call(
    implementation, device, in_step
):
    """On CPU the compiled step runs transformers' written-out attention in
    place of the fused SDPA kernel, for the step only: the model's own
    setting is back after it, even when the step raises."""
    model = tiny_llama()
    model.config._attn_implementation = implementation
    seen: list[str] = []
    with pytest.raises(RuntimeError, match="the step failed"):
        attention_in_step(model, ONE_TOKEN.to(device), seen=seen, fail=True)
    assert seen == [in_step]
    assert model.config._attn_implementation == implementation


def test_a_composite_config_keeps_its_attention(monkeypatch):
    """A config with sub-configs sets theirs with its own: the step leaves it."""
    model = tiny_llama()
    monkeypatch.setattr(type(model.config), "sub_configs", {"text_config": type(model.config)})
    assert attention_in_step(model, ONE_TOKEN) == ["sdpa"]


def test_without_transformers_attention_interfaces_the_step_keeps_sdpa(monkeypatch):
    from dtype_policies import _one_query_attention

    def unavailable():
        raise ImportError("no masking_utils")

    monkeypatch.setattr(_one_query_attention, "register", unavailable)
    assert attention_in_step(tiny_llama(), ONE_TOKEN) == ["sdpa"]


def _changes():
    """Each way a frozen graph can go stale, as (name, change)."""

    def write_in_place(m):
        with torch.no_grad():
            m.model.layers[0].mlp.up_proj.weight.mul_(2)

    def assign_data(m):
        proj = m.model.layers[0].mlp.up_proj
        proj.weight.data = proj.weight.data.clone()

    def replace_parameter(m):
        proj = m.model.layers[1].self_attn.q_proj
        proj.weight = torch.nn.Parameter(proj.weight.detach().clone())

    def load_state_dict(m):
        m.load_state_dict(tiny_llama(seed=1).state_dict())

    def replace_child(m):
        m.model.layers[0].mlp.act_fn = torch.nn.GELU()

    def remove_parameter(m):
        m.model.layers[0].mlp.up_proj.weight = None

    def fused_step(m):  # a fused optimizer step moves no version counter
        parameters = list(m.model.layers[0].parameters())
        for p in parameters:
            p.grad = torch.ones_like(p)
        torch.optim.AdamW(parameters, lr=0.1, fused=True).step()

    def parameter_in_an_empty_slot(m):  # `bias=False` linears hold None there
        m.model.layers[0].mlp.down_proj.bias = torch.nn.Parameter(torch.ones(m.config.hidden_size))

    def swap_tensors(m):  # no weak reference of the watch's stands in its way
        proj = m.model.layers[0].mlp.up_proj
        torch.utils.swap_tensors(proj.weight, torch.nn.Parameter(proj.weight.detach() * 2))

    def reinterpret_buffer(m):  # the same memory, address, shape and strides
        rotary = m.model.rotary_emb
        rotary.inv_freq.data = rotary.inv_freq.data.view(torch.int32)

    def new_buffer(m):
        m.model.layers[0].mlp.register_buffer("offset", torch.ones(m.config.hidden_size))

    def data_copy_then_clear(m):  # `p.data.copy_` neither: clear_cast_caches tells
        m.model.layers[0].mlp.up_proj.weight.data.copy_(torch.zeros(1))
        dtype_policies.clear_cast_caches(m)

    return [
        ("in-place write", write_in_place),
        ("p.data", assign_data),
        ("new Parameter", replace_parameter),
        ("load_state_dict", load_state_dict),
        ("a policy", lambda m: apply_policy(m.model.layers[0], "float32")),
        ("quantize", lambda m: quantize(m, "int8", filters="down_proj")),
        ("train()", lambda m: m.train()),
        ("a child", replace_child),
        ("a removed parameter", remove_parameter),
        ("a fused optimizer step", fused_step),
        ("p.data.copy_ and clear_cast_caches", data_copy_then_clear),
        ("a parameter where there was None", parameter_in_an_empty_slot),
        ("a buffer of a new name", new_buffer),
        ("a buffer's memory read as another dtype", reinterpret_buffer),
        ("torch.utils.swap_tensors", swap_tensors),
    ]


@pytest.fixture(params=["native", "python"])
def watch_reads(request, monkeypatch):
    """`ModelWatch` reading its tensors' layouts in one native call, or from
    Python (where the native kernels are not built, or for tensor subclasses)."""
    if request.param == "python":
        monkeypatch.setattr(frozen, "_native_layouts", lambda tensors: None)
    elif not native.available("avx2"):
        pytest.skip("this library's native kernels are not built here")
    return request.param


def _made_watch(model: torch.nn.Module, reads: str) -> ModelWatch:
    watch = ModelWatch(model)
    assert (watch.layouts is not None) == (reads == "native")
    return watch


@pytest.mark.parametrize(("name", "change"), _changes(), ids=[n for n, _ in _changes()])
def test_the_model_watch_sees_every_change_a_frozen_graph_depends_on(name, change, watch_reads):
    """`ModelWatch` stands in for Dynamo's module guards under frozen weights:
    unchanged through a call, changed after any way of changing the model."""
    model = tiny_llama()
    apply_policy(model, "mixed_bfloat16")
    watch = _made_watch(model, watch_reads)
    with torch.inference_mode():
        model(PROMPT)  # a call changes nothing it watches (kept casts are not weights)
    assert watch.unchanged()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize's report of skipped modules
        change(model)
    assert not watch.unchanged()


@pytest.mark.parametrize("policy", [None, "mixed_bfloat16"])
def test_the_model_watch_sees_a_parameter_where_a_slot_held_none(policy, watch_reads):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    if policy is not None:
        apply_policy(model, policy)
    watch = _made_watch(model, watch_reads)
    assert watch.unchanged()
    model[0].bias = torch.nn.Parameter(torch.full((8,), 5.0))
    assert not watch.unchanged()


def test_the_native_layouts_are_the_tensors_addresses_versions_sizes_and_strides():
    if not native.available("avx2"):
        pytest.skip("this library's native kernels are not built here")
    with torch.inference_mode():
        inference = torch.ones(3, 2)
    tensors = [
        torch.nn.Parameter(torch.ones(4, 3)),
        torch.zeros(5, 6).t(),
        torch.tensor(2.0),  # no sizes, no strides
        inference,  # no version counter: -1
        torch.empty(2, 3, device="meta"),  # an address of 0
    ]
    tensors[0].data.add_(1)  # version 1 on the `.data`, 0 on the parameter
    tensors[1].add_(1)
    tensors[1].add_(1)
    recorded = torch.ops.dtype_policies.tensor_layouts(tensors).tolist()
    expected, dtype_codes = [], []
    for tensor in tensors:
        version = -1 if tensor.is_inference() else tensor._version
        dtype_codes.append(len(expected) + 2)
        expected += [tensor.data_ptr(), version, None, *tensor.shape, *tensor.stride()]
    assert len(recorded) == len(expected)
    assert [r for r, e in zip(recorded, expected) if e is not None] == [
        e for e in expected if e is not None
    ]
    assert len({recorded[i] for i in dtype_codes}) == 1  # float32 throughout
    assert expected[1] == 0 and expected[expected.index(-1) - 1] == inference.data_ptr()
    recorded = torch.tensor(recorded)
    assert torch.ops.dtype_policies.tensor_layouts_match(tensors, recorded)
    for changed in (
        tensors[:-1],  # one tensor fewer
        [*tensors, torch.ones(1)],  # one more
        [tensors[1], tensors[0], *tensors[2:]],  # in another order
        [tensors[0].view(torch.int32), *tensors[1:]],  # the same memory, another dtype
    ):
        assert not torch.ops.dtype_policies.tensor_layouts_match(changed, recorded)
    tensors[1].mul_(2)
    assert not torch.ops.dtype_policies.tensor_layouts_match(tensors, recorded)
    with pytest.raises(RuntimeError, match="tensor_layouts' int64 tensor"):
        torch.ops.dtype_policies.tensor_layouts_match(tensors, recorded.float())


def test_a_model_holding_a_tensor_subclass_is_watched_from_python():
    class Tagged(torch.Tensor):
        pass

    model = torch.nn.Linear(4, 4)
    model.register_buffer("tagged", torch.ones(2).as_subclass(Tagged))
    watch = ModelWatch(model)
    assert watch.layouts is None and watch.unchanged()
    model.tagged.add_(1)
    assert not watch.unchanged()


def test_the_model_is_read_once_per_generation_not_per_step(monkeypatch):
    """Each generation reads the model at its first compiled step (transformers
    asks for the compiled call before each generation loop: `begin_session`);
    later steps on the same cache skip the watch and the cache's unmarking.
    A change made during a generation is seen at the next one."""
    model = tiny_llama()
    apply_policy(model, "mixed_bfloat16")
    compile_for_generation(model)
    step = model._compiled_call
    ran: list[int] = []
    step.compiled = lambda **kwargs: ran.append(1)
    reads: list[int] = []
    unchanged = ModelWatch.unchanged
    monkeypatch.setattr(ModelWatch, "unchanged", lambda self: reads.append(1) or unchanged(self))
    cache = transformers.StaticCache(config=model.config, max_cache_len=8)
    other_cache = transformers.StaticCache(config=model.config, max_cache_len=8)

    def generation_starts():
        config = model.generation_config.compile_config
        assert model.get_compiled_call(config) is step

    def decode(cache):
        with torch.no_grad():
            step(input_ids=ONE_TOKEN, past_key_values=cache)

    decode(cache)  # the first call records the watch
    decode(cache)
    assert (len(ran), len(reads)) == (2, 0)
    generation_starts()
    decode(cache)
    marked = torch.zeros(2)
    torch._dynamo.mark_static_address(marked)
    cache.layers[0].keys = marked
    decode(cache)
    assert (len(ran), len(reads)) == (4, 1)
    assert hasattr(marked, "_dynamo_static_input_type")  # unmarked at a first step only
    decode(other_cache)  # another cache: another session, read again
    assert (len(ran), len(reads)) == (5, 2)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
    decode(other_cache)  # within the generation: not seen
    assert len(ran) == 6
    generation_starts()
    with pytest.warns(UserWarning, match="weights, policies or mode changed"):
        decode(other_cache)  # the next generation: seen, run eagerly
    assert len(ran) == 6


@pytest.mark.parametrize("compiled_steps", [1, 2])
def test_a_model_meeting_the_recompile_limit_in_every_generation_gives_up(
    compiled_steps, monkeypatch
):
    """Gemma2's sliding-window cache: each generation's first step runs the
    graph compiled for it and the next meets Dynamo's limit (the rest of the
    generation runs eagerly). After a few such generations in a row, every
    call runs eagerly, without asking Dynamo again."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from dtype_policies._frozen import GIVE_UP_AFTER_LIMIT_HITS

    model = tiny_llama()
    compile_for_generation(model)
    step = model._compiled_call
    attempts: list[object] = []

    def compiled(**kwargs):
        attempts.append(kwargs["past_key_values"])
        if sum(cache is kwargs["past_key_values"] for cache in attempts) > compiled_steps:
            raise FailOnRecompileLimitHit("recompile_limit reached: ___check_obj_id")
        return "compiled"

    step.compiled = compiled
    monkeypatch.setattr(step, "eager", lambda *args, **kwargs: "eager")

    def generation() -> list[str]:
        assert model.get_compiled_call(model.generation_config.compile_config) is step
        cache = transformers.StaticCache(config=model.config, max_cache_len=8)
        with torch.no_grad():
            return [step(input_ids=ONE_TOKEN, past_key_values=cache) for _ in range(3)]

    steps = ["compiled"] * compiled_steps + ["eager"] * (3 - compiled_steps)
    with pytest.warns(UserWarning, match="met its recompile limit on this call"):
        assert generation() == steps
    for _ in range(GIVE_UP_AFTER_LIMIT_HITS - 2):
        assert generation() == steps
    with pytest.warns(UserWarning, match="gave up"):
        assert generation() == steps
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert generation() == ["eager"] * 3
    assert len(attempts) == (compiled_steps + 1) * GIVE_UP_AFTER_LIMIT_HITS


def test_a_cache_passed_again_gets_a_compiled_try_in_each_generation(monkeypatch):
    """A generation that met the limit runs its later steps eagerly; the next
    generation on the same cache (a user's `past_key_values`) tries again."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    model = tiny_llama()
    compile_for_generation(model)
    step = model._compiled_call
    calls: list[int] = []

    def compiled(**kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise FailOnRecompileLimitHit("recompile_limit reached: ___check_obj_id")
        return "compiled"

    step.compiled = compiled
    monkeypatch.setattr(step, "eager", lambda *args, **kwargs: "eager")
    cache = transformers.StaticCache(config=model.config, max_cache_len=8)

    def generation() -> list[str]:
        assert model.get_compiled_call(model.generation_config.compile_config) is step
        with torch.no_grad():
            return [step(input_ids=ONE_TOKEN, past_key_values=cache) for _ in range(2)]

    with pytest.warns(UserWarning, match="met its recompile limit on this call"):
        assert generation() == ["compiled", "eager"]
    assert generation() == ["compiled", "compiled"]


def test_limits_met_between_one_step_generations_are_not_in_a_row(monkeypatch):
    """A new batch size meets the limit in its generation only; generations of
    one decode step in between ran compiled and met none: the run of limits
    is broken, the model never gives up."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from dtype_policies._frozen import GIVE_UP_AFTER_LIMIT_HITS

    model = tiny_llama()
    compile_for_generation(model)
    step = model._compiled_call

    def compiled(**kwargs):
        if kwargs["input_ids"].shape[0] == 2:
            raise FailOnRecompileLimitHit("recompile_limit reached: size mismatch at index 0")
        return "compiled"

    step.compiled = compiled
    monkeypatch.setattr(step, "eager", lambda *args, **kwargs: "eager")

    def generation(batch: int) -> str:
        assert model.get_compiled_call(model.generation_config.compile_config) is step
        cache = transformers.StaticCache(config=model.config, max_cache_len=8)
        with torch.no_grad():
            return step(input_ids=ONE_TOKEN.expand(batch, 1), past_key_values=cache)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(GIVE_UP_AFTER_LIMIT_HITS + 1):
            assert [generation(1), generation(1), generation(2)] == ["compiled"] * 2 + ["eager"]
        for _ in range(GIVE_UP_AFTER_LIMIT_HITS + 1):
            assert [generation(1), generation(2)] == ["compiled", "eager"]
    assert step.given_up is None and generation(1) == "compiled"


def test_beam_search_runs_transformers_eager_loop_as_documented():
    model = tiny_llama()
    expected = model.generate(PROMPT, max_new_tokens=4, num_beams=2, do_sample=False)
    compile_for_generation(model)
    calls: list[int] = []
    model._compiled_call.compiled = lambda **kwargs: calls.append(1)
    got = model.generate(PROMPT, max_new_tokens=4, num_beams=2, do_sample=False)
    assert calls == [] and torch.equal(got, expected)


def test_a_deep_copy_begins_its_own_generations():
    """The copy's hook begins sessions of the copy's compiled step, and
    outlives the original."""
    model = tiny_llama()
    compile_for_generation(model)
    copied = copy.deepcopy(model)
    config = model.generation_config.compile_config
    copied._compiled_call.session = "a session"
    model._compiled_call.session = "the original's"
    del model
    assert copied.get_compiled_call(config) is copied._compiled_call
    assert copied._compiled_call.session is None


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_a_copy_compiles_its_own_decode_step_lazily(how):
    """Compiled graphs are not copied: a pickled, saved or deep-copied model
    gets a decode step of its own with the same options, compiled at its
    first call, which reads the copy (not the original)."""
    model = tiny_llama()
    apply_policy(model, "mixed_bfloat16")
    compile_for_generation(model, autotune=False)
    if how == "pickle":
        copied = pickle.loads(pickle.dumps(model))
    elif how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        copied = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    else:
        copied = copy.deepcopy(model)
    step = copied._compiled_call
    assert isinstance(step, FrozenCompiledCall) and step is not model._compiled_call
    assert step.model_ref() is copied and step.watch is None
    assert step.settings["autotune"] is False
    assert step.inductor_options.keys() == model._compiled_call.inductor_options.keys()
    config = copied.generation_config.compile_config
    assert copied.get_compiled_call(config) is step
    assert copied.generation_config.cache_implementation == "static"
    with torch.no_grad():
        copied.model.layers[0].mlp.up_proj.weight.mul_(2)
    # with gradients, as `out`: attention without them may run this library's
    # kernel, whose sums differ from torch's in the last bit on some CPUs (AMX)
    expected = copied(PROMPT).logits
    del model
    with torch.inference_mode():
        step.compiled = lambda *args, **kwargs: "compiled"  # not compiling here
        assert step(PROMPT) == "compiled"
    out = step(PROMPT).logits  # gradients enabled: the copy's eager call
    assert torch.equal(out, expected)


@pytest.mark.slow
def test_int8_generation_merges_sibling_products_and_reads_the_model_once(monkeypatch):
    """q/k/v and gate/up of each layer run as one product each (the same
    tokens as without merging), and each `generate` reads the model once."""
    from dtype_policies import _frozen
    from dtype_policies.quantization.kernels import siblings

    model = tiny_llama()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    removed: list[int] = []
    merge = siblings.merge_sibling_products
    monkeypatch.setattr(
        siblings, "merge_sibling_products", lambda g: removed.append(merge(g)) or removed[-1]
    )
    fast = compile_for_generation(copy.deepcopy(model))
    reads: list[int] = []
    unchanged = ModelWatch.unchanged
    monkeypatch.setattr(ModelWatch, "unchanged", lambda self: reads.append(1) or unchanged(self))
    first = step_scores(fast, new_tokens=6)
    second = step_scores(fast, new_tokens=6)
    assert torch.equal(first, second)
    assert sum(removed) == 2 * 3  # per layer: q, k, v -> 1 and gate, up -> 1
    assert len(reads) == 1  # the first generation records the watch, the second reads it
    monkeypatch.setattr(_frozen, "sibling_options", lambda: {})
    unmerged = compile_for_generation(copy.deepcopy(model))
    assert torch.equal(step_scores(unmerged, new_tokens=6), first)


@pytest.mark.slow
def test_float32_policy_gives_eager_tokens_across_calls_and_lengths():
    model = tiny_llama()
    apply_policy(model, "float32")
    fast = compile_for_generation(copy.deepcopy(model))
    expected = greedy(model)
    assert torch.equal(greedy(fast), expected)
    assert torch.equal(greedy(fast), expected)  # a new static cache per call
    # A longer generation (a larger cache) recompiles and stays right.
    assert torch.equal(greedy(fast, 10), greedy(model, 10))


@pytest.mark.slow
@pytest.mark.skipif(
    not CPP_WRAPPER_BY_DEFAULT, reason="the C++ wrapper is the default from torch 2.13"
)
def test_the_default_decode_step_is_cpp_code_with_eager_scores():
    """The C++ wrapper (the default) calls Inductor's kernels and this
    library's int8 product: eager's scores, from a compiled C++ step."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_llama()
    apply_policy(model, "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(model, "int8")
    fast = compile_for_generation(copy.deepcopy(model), autotune=False)
    scores, codes = run_and_get_code(step_scores, fast)
    assert any('extern "C"' in code or "AOTI" in code for code in codes)
    assert close(scores[1:], step_scores(model)[1:]) < 1e-2


@pytest.mark.slow
def test_int4_keeps_its_storage_and_eager_scores_and_sees_new_weights():
    model = tiny_llama()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4", Int4QuantizationConfig(block_size=32))
    fast = compile_for_generation(copy.deepcopy(model))
    # The compiled step runs int4's traced form (the kernel's values, another
    # summation order): the same scores up to bfloat16 rounding, not always
    # the same argmax on a random model whose logits are nearly tied.
    assert close(step_scores(fast)[1:2], step_scores(model)[1:2]) < 0.02
    proj = fast.model.layers[0].mlp.down_proj
    assert "weight" not in dict(proj.named_parameters())
    assert proj.weight_int4.dtype == torch.int8
    floats = [
        name
        for name, p in fast.named_parameters()
        if ".layers." in name and p.dim() == 2 and p.is_floating_point()
    ]
    assert floats == []  # no float weight of a quantized linear became a parameter
    # New weights (a checkpoint load), then compile again: the new tokens.
    other = tiny_llama(seed=1)
    apply_policy(other, "mixed_bfloat16")
    quantize(other, "int4", Int4QuantizationConfig(block_size=32))
    fast.load_state_dict(other.state_dict())
    with pytest.warns(UserWarning, match="weights, policies or mode changed"):
        stale_guarded = step_scores(fast)[1:2]  # eager until compiled again
    assert close(stale_guarded, step_scores(other)[1:2]) < 0.02
    compile_for_generation(fast)
    new_scores, other_scores = step_scores(fast)[1:2], step_scores(other)[1:2]
    assert close(new_scores, other_scores) < 0.02
    assert close(new_scores, step_scores(model)[1:2]) > 0.2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "config", "kernel", "template"),
    [
        (
            "int4",
            Int4QuantizationConfig(block_size=32),
            "_weight_int4pack_mm_for_cpu",
            "CppMicroGemmWoQInt4",
        ),
        (
            "int8",
            Int8QuantizationConfig(activation_quantizer=None),
            "_weight_int8pack_mm",
            "CppMicroGemm",
        ),
        ("int8", None, "dtype_policies.int8_mm_q8b_", "-"),  # the default: Q8_0 x Q8_0
    ],
)
@pytest.mark.parametrize("autotune", [False, True])
def test_frozen_quantized_steps_multiply_integer_weights(mode, config, kernel, template, autotune):
    """The compiled decode step multiplies integer weights on layouts folded at
    compile time (no float copy of the weight): the eager path's kernels, or
    with autotuning, whichever of them and Inductor's C++ templates for them
    was faster; and so scores what eager scores. Attention is written out
    (`_one_query_attention`), not torch's fused SDPA kernel."""
    from torch._inductor.utils import run_and_get_code

    if (
        mode == "int8"
        and config is None
        and not int8_kernels.blocked_kernel_applies(torch.device("cpu"))
    ):
        pytest.skip("the default int8's integer kernel needs x86 AVX2+FMA and a C++ compiler")
    if mode == "int4" and int4_kernels.cpu_kernel() == "native":
        kernel = "dtype_policies.int4_mm_avx2"  # this library's AVX2 kernel (no template there)
    model = tiny_llama()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, mode, config)
    fast = compile_for_generation(copy.deepcopy(model), autotune=autotune)
    scores, codes = run_and_get_code(step_scores, fast)
    if autotune:
        assert any(kernel in code or template in code for code in codes)
    else:
        assert any(kernel in code for code in codes)
    assert not any("scaled_dot_product" in code for code in codes)
    # its inputs realized before the loops over the cache (`_computed_once`)
    assert any("inductor_force_stride_order" in code for code in codes)
    # Inductor's fused elementwise ops round once where eager rounds each op to
    # bfloat16: inputs an ulp apart, which rounding them to int8 per block
    # can move by a step (the same kernel, measured 1.1% on this tiny model).
    tolerance = 2e-2 if mode == "int8" and config is None else 1e-2
    assert close(scores[1:], step_scores(model)[1:]) < tolerance


def test_an_optimizer_step_elsewhere_leaves_the_watch_unchanged():
    """The step hook marks only the watches of the tensors the step updates."""
    model = tiny_llama()
    watch = ModelWatch(model)
    other = torch.nn.Linear(4, 4)
    other.weight.grad = torch.ones_like(other.weight)
    torch.optim.AdamW([other.weight], fused=True).step()
    dtype_policies.clear_cast_caches(other)
    assert watch.unchanged()


def test_the_eager_call_after_remove_is_the_restored_class():
    """The eager call was the policied class's bound `__call__`: after
    `remove()` restored the class it raised "super(type, obj)"."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    handle = apply_policy(model, "mixed_bfloat16")
    fast = dtype_policies.compile_for_inference(model, autotune=False)
    handle.remove()
    x = torch.randn(2, 8)
    with torch.no_grad(), pytest.warns(UserWarning, match="changed after it was compiled"):
        out = fast(x)
    assert out.dtype == torch.float32 and torch.equal(out, model(x))


def test_a_call_asking_for_hidden_states_leaves_the_watch_unchanged():
    """transformers 5 installs its output-recording hooks at the first call
    that asks for hidden states: the watch does not count hooks, or such a
    call would send every later compiled call to the eager path."""
    model = tiny_llama()
    apply_policy(model, "mixed_bfloat16")
    watch = ModelWatch(model)
    with torch.inference_mode():
        model(PROMPT, output_hidden_states=True)
        model(PROMPT)
    assert watch.unchanged()


def test_a_watch_made_while_writes_are_marked_is_no_error():
    """`clear_cast_caches` marks the watches of the model's tensors while
    another thread may be making one (a compiled call's first call): the
    set of watches changed size during the iteration. Here the watch is made
    from inside the marking, deterministically."""
    import dtype_policies

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    made = []

    class MakesAnother(ModelWatch):
        @property
        def written(self):
            return self.__dict__.get("flag", False)

        @written.setter
        def written(self, value):
            self.__dict__["flag"] = value
            if value and len(made) < 3:
                made.append(ModelWatch(model))

    watch = MakesAnother(model)
    dtype_policies.clear_cast_caches(model)
    assert watch.written and made  # (a watch made meanwhile may be marked too: conservative)


@pytest.mark.slow  # compiles
def test_a_generation_the_step_cannot_compile_runs_eagerly_with_a_warning():
    """`generate(output_attentions=True)`: transformers' attention logs a
    warning, which Dynamo cannot trace under `fullgraph=True`; the compiled
    model raised `Unsupported` where the eager one runs."""
    model = tiny_llama()

    def with_attentions(model):
        with torch.inference_mode():
            return model.generate(
                PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=4,
                min_new_tokens=4, do_sample=False, pad_token_id=0, output_attentions=True,
                return_dict_in_generate=True,
            ).sequences  # fmt: skip

    want = with_attentions(model)
    plain = greedy(model)
    compile_for_generation(model, autotune=False)
    assert torch.equal(greedy(model), plain)  # compiled
    with pytest.warns(UserWarning, match=r"cannot compile this call \(Unsupported: .*eagerly"):
        assert torch.equal(with_attentions(model), want)
    compiled = model._compiled_call
    assert compiled.given_up is None and compiled.eager_session is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(greedy(model), plain)  # the next generation runs compiled again


def test_a_cache_of_the_callers_own_is_used_in_place_of_the_static_one():
    """transformers refuses a cache beside a `cache_implementation`, which
    the generation config holds since `compile_for_generation`: passing one's
    own cache raised where the eager model takes it. A static one runs the
    compiled step, a dynamic one transformers' eager loop."""
    model = tiny_llama()
    want = greedy(model)
    compile_for_generation(model)
    step = model._compiled_call
    calls = []

    def compiled(*args, **kwargs):  # the eager step, counted: no compilation in this test
        calls.append(kwargs.get("past_key_values", kwargs.get("cache")))
        return step.eager(*args, **kwargs)

    step.compiled = compiled

    def with_cache(cache):
        with torch.inference_mode():
            return model.generate(
                PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=6,
                min_new_tokens=6, do_sample=False, pad_token_id=0, past_key_values=cache,
            )  # fmt: skip

    static = transformers.StaticCache(config=model.config, max_cache_len=64)
    assert torch.equal(with_cache(static), want)
    assert len(calls) == 5 and all(cache is static for cache in calls)  # its decode steps
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: the dynamic cache is not compileable
        assert torch.equal(with_cache(transformers.DynamicCache(config=model.config)), want)
    assert calls == []
    assert model.generation_config.cache_implementation == "static"  # the model's own, kept
    copied = copy.deepcopy(model)
    assert copied._prepare_cache_for_generation.model() is copied
