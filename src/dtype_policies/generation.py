"""A fast small-batch path for Hugging Face `generate`: `torch.compile`
(Inductor, with frozen weights) on a static KV cache.

At batch 1 an eager decoder spends most of each token outside its matrix
products (Python, module calls, the policies' per-call bookkeeping). Compiled,
one decode step is one graph. `compile_for_generation` sets this up on the
model's own generation config, so that `model.generate(...)` stays the call:

* `cache_implementation="static"`: a fixed-size KV cache, so that every
  decode step has the same shapes (one graph, no recompilation per token);
  `save_pretrained` writes the model's own value (and `compile_config`'s),
  so a checkpoint of a compiled model loads as it would have;
* `compile_config`: the decode step compiled with `fullgraph=True`,
  `dynamic=False`, by Inductor with weight freezing (`freezing=True` for this
  compilation only). Freezing folds what depends on weights alone into
  constants once: the policies' compute-dtype casts of float weights (bf16
  copies, as the eager weight cache keeps) and oneDNN's prepacked layouts.
  Quantized models keep their storage: int4 (and GPTQ/AWQ at 2-4 bits) and
  weight-only int8 call the eager kernels, on the packed layout the graph
  computes from the stored tensors and freezing folds into a constant (one
  more copy of the int4 storage; int8 keeps an aligned copy of its int8
  weight); other quantized products fold their traced forms.
* attention written out on CPU: a decode step attends one query per head,
  where torch's fused SDPA kernel (after copies of the shared key/value
  heads) costs more to set up than its arithmetic; in place of `"sdpa"`, the
  compiled step runs `_one_query_attention` (two fused loops over the cache,
  float32 arithmetic, each shared key/value head read once). The prompt's
  forward keeps the model's own setting;
* autotuning (`autotune=True`, the default): for each product shape Inductor
  times its C++ GEMM template (float, weight-only int8, int4) against the
  eager kernel and keeps the faster; SmolLM2-135M decodes 1.1-1.6x faster,
  its first compilation takes up to 1.5x longer.
* the step's kernels called from C++ (Inductor's C++ wrapper,
  the default here from torch 2.13): at batch 1 a step is hundreds of
  small calls, each a Python frame and a boxed dispatch from the Python
  wrapper;
* sibling products merged: where this library's packed int8 and int4
  operators multiply one input by several weights (query, key and value;
  gate and up), the compiled step makes one call on the concatenated weights
  (`quantization.kernels.siblings`; the same values, bit for bit).

The policies, the float32 islands and the quantized products are what the
compiled graph computes (the traced forms of the same products): on a float32
model the tokens are those of eager `generate`; with bfloat16 compute they may
differ where Inductor rounds differently (fused normalizations).

What is compiled is the decode step of greedy and sampled generation
(transformers' `_sample` loop, the only one transformers calls a compiled
forward from). Beam search (`num_beams > 1`) runs transformers' eager loop,
without a word, as under transformers' own compiled `generate`.

A cache of your own (`generate(..., past_key_values=cache)`) is used in place
of the static cache the generation config asks for (a static one of yours
runs the compiled step; a dynamic one, transformers' eager loop). A call whose options the
compiled step cannot hold (`output_attentions=True`, whose attention logs a
warning Dynamo cannot trace) runs that generation eagerly, with a warning.

Cost: the first `generate` compiles (tens of seconds to minutes for a
30-layer model on 2 cores; measured in docs/speed.md); later calls with the
same batch size and the same `max_new_tokens` bound reuse the graph. Inductor
keeps compiled kernels in its cache (`TORCHINDUCTOR_CACHE_DIR`), which makes
the next process's first call faster. Frozen weights are read once: after
changing weights (training, `load_state_dict`), `generate` runs eagerly (with
a warning) until `compile_for_generation` is called again, which compiles the
new weights; it never starts a generation on a graph of the old ones. The
model is read at the first decode step of each `generate` (not at every
step: 1.1-1.6 ms of a 12-20 ms SmolLM2-135M step), so a change made during a
generation (from a streamer, another thread) is seen at the next one.

>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> from dtype_policies import apply_policy, compile_for_generation
>>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
...                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
>>> model = LlamaForCausalLM(config).eval()
>>> _ = apply_policy(model, "mixed_bfloat16")
>>> model = compile_for_generation(model)
>>> model.generation_config.cache_implementation
'static'
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dtype_policies import _attention_dispatch, _one_query_attention
from dtype_policies._frozen import FrozenCompiledCall, check_flags, resolved_cpp_wrapper

_COMPILED_CALL = "_compiled_call"  # where transformers keeps the compiled forward


def _unmark_static_cache(cache: Any) -> None:
    """Makes the tensors of a static KV cache ordinary graph inputs.

    transformers marks them as static addresses (for CUDA graphs); freezing
    would then fold them into the graph as constants, and the next `generate`
    (a new cache) would write into the first one's. Every tensor reachable
    from the cache is unmarked: its layers', and those of the caches it holds
    (an encoder-decoder model's `EncoderDecoderCache` holds a self-attention
    and a cross-attention cache, and no layers of its own)."""
    for tensor in _tensors_in(cache, set()):
        if hasattr(tensor, "_dynamo_static_input_type"):
            del tensor._dynamo_static_input_type


def _tensors_in(value: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    """The tensors held by `value`: itself, the items of its lists, tuples and
    dicts, and the attributes of transformers' objects (caches, layers)."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, seen)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, seen)
    elif type(value).__module__.startswith("transformers.") and hasattr(value, "__dict__"):
        for item in vars(value).values():
            yield from _tensors_in(item, seen)


def _cache_of(kwargs: dict) -> Any:
    """The KV cache of a decode step's arguments (transformers 5, 4), or `None`."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


@contextlib.contextmanager
def _decode_step(
    model: torch.nn.Module, kwargs: dict, continuing: bool, *, attention: str | None
) -> Iterator[None]:
    """The settings of one compiled decode step: the static cache's tensors
    as ordinary inputs (at the first step of a generation; `continuing`: a
    later step, on the same cache), and on CPU, `attention` (the one-query attention
    written out for Inductor) selected behind `"sdpa"` (a model with one config:
    a composite model's sub-configs keep theirs). The model's own attention is
    back in force after the step, so that the prompt's forward (eager, many
    queries) keeps torch's fused kernel. Another thread calling the model
    during the step runs this implementation too (the same attention, up to
    rounding)."""
    if not continuing:
        _unmark_static_cache(_cache_of(kwargs))
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if attention is None or not isinstance(tokens, torch.Tensor) or tokens.device.type != "cpu":
        yield
        return
    with _attention_dispatch.selecting(model, attention):
        yield


class _ModelMethod:
    """A method of one model, set on the instance in place of its class's:
    holds the model weakly; a copy of the model (deepcopy, pickle) gets one
    of its own."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_ref = weakref.ref(model)

    def model(self) -> torch.nn.Module:
        model = self.model_ref()
        if model is None:
            raise ReferenceError("compile_for_generation: the model no longer exists")
        return model

    def __reduce__(self) -> tuple[Any, tuple]:
        return (type(self), (self.model(),))

    def __deepcopy__(self, memo: dict) -> _ModelMethod:
        model = self.model_ref()
        if model is None:
            return self
        # The copy of the model is in `memo` before its attributes are copied.
        return type(self)(memo.get(id(model), model))


class _GenerationStart(_ModelMethod):
    """`model.get_compiled_call`, which transformers calls once before each
    generation loop: the compiled decode step (`model._compiled_call`) begins
    a session, so that it reads the model (its weights, policies, modes) at
    the generation's first step and runs the later steps on the same cache
    without reading it again."""

    def __call__(self, compile_config: Any) -> Callable[..., Any]:
        model = self.model()
        compiled = model.__dict__.get(_COMPILED_CALL)
        if isinstance(compiled, FrozenCompiledCall):
            compiled.begin_session()
        hugging_face: Any = type(model)
        return hugging_face.get_compiled_call(model, compile_config)


class _CallersCacheFirst(_ModelMethod):
    """`model._prepare_cache_for_generation`: a cache the caller passes to
    `generate` is used, in place of the static cache the generation config
    asks for since `compile_for_generation` (transformers refuses a cache
    and a `cache_implementation` together). `generation_config` is the
    call's own copy."""

    def __call__(self, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any):
        model = self.model()
        if _cache_of(model_kwargs) is not None:
            generation_config.cache_implementation = None
        hugging_face: Any = type(model)
        return hugging_face._prepare_cache_for_generation(
            model, generation_config, model_kwargs, *args, **kwargs
        )


class _DecodeStepContext:
    """`_decode_step` with the attention of this process (a copy unpickled in
    another process registers it there)."""

    def __init__(self) -> None:
        self.attention = _decode_attention()

    def __call__(self, model: torch.nn.Module, kwargs: dict, continuing: bool) -> Any:
        return _decode_step(model, kwargs, continuing, attention=self.attention)

    def __reduce__(self) -> tuple[Any, tuple]:
        return (_DecodeStepContext, ())


def _decode_attention() -> str | None:
    """The attention implementation of a compiled decode step on CPU:
    `_one_query_attention`'s, or `None` (the model's own) where this
    transformers has no attention interface to register it with (older
    releases pick attention by other rules)."""
    try:
        return _one_query_attention.register()
    except ImportError:
        return None


def compile_for_generation(
    model: torch.nn.Module,
    *,
    freeze_weights: bool = True,
    autotune: bool = True,
    cpp_wrapper: bool | None = None,
) -> Any:
    """Makes `model.generate(...)` run its decode steps compiled, on a static
    KV cache (see the module docstring for what is compiled and its cost).

    Args:
        model: A Hugging Face generative model (with `generate` and a
            `generation_config`), policied and/or quantized by this library
            or not.
        freeze_weights: Fold weight-only computations (casts, packing) into
            constants at compile time (default). Without it, the compiled
            step casts float weights to the compute dtype on every call.
        autotune: Let Inductor time its C++ GEMM templates against ATen's
            kernels for each product shape and keep the faster (default):
            faster decode steps, a longer first compilation (docs/speed.md).
        cpp_wrapper: Call the step's kernels and operators from generated
            C++ instead of Python; `None` (default): C++ from torch 2.13,
            Python before (torch 2.6's cannot compile a quantized model's
            graph). A decode step at batch 1 is hundreds of small calls:
            SmolLM2-135M decodes 1.01-1.05x (mixed_bfloat16), 1.03-1.08x
            (int4 W4A8) and 1.02-1.26x (int8) faster than with the Python
            wrapper (AMD Zen 4, 2 threads, three runs); its first
            compilation takes up to 1.3x longer with a cold Inductor cache
            (int4 W4A8: 127 s against 97 s), as long with the cache kept
            (68 s each; docs/speed.md).

    Returns:
        `model`, changed in place: its generation config asks for a static
        cache and a compiled forward (compiled at the first decode step); an
        earlier compiled forward is dropped. A copy of the model (deepcopy,
        pickle, `torch.save`) has a compiled forward of its own with the same
        options, compiled at its first decode step (compiled graphs are not
        copied). Beam search stays eager (see the module docstring).

    Raises:
        TypeError: `model` has no `generate` or no `generation_config`.

    The compiled step keeps this library's quantized storage: no float weight
    becomes a parameter or a buffer of the model.

    >>> try:
    ...     compile_for_generation(torch.nn.Linear(2, 2))
    ... except TypeError as error:
    ...     print(str(error)[-10:])
    got Linear
    """
    if not callable(getattr(model, "generate", None)) or not hasattr(model, "generation_config"):
        raise TypeError(
            "compile_for_generation needs a Hugging Face generative model (with `generate` "
            f"and `generation_config`), got {type(model).__name__}"
        )
    cpp_wrapper = resolved_cpp_wrapper(cpp_wrapper)
    check_flags(
        "compile_for_generation",
        freeze_weights=freeze_weights,
        autotune=autotune,
        cpp_wrapper=cpp_wrapper,
    )
    from transformers.generation.configuration_utils import CompileConfig

    compile_config: Any = CompileConfig(fullgraph=True, dynamic=False, mode=None)  # type: ignore[arg-type]
    # transformers compiles on accelerators only, unless this is set.
    compile_config._compile_all_devices = True
    from dtype_policies._generation_config import compiled_generation_config

    # in force for generate(); what save_pretrained writes keeps the model's own
    generation_config: Any = model.generation_config
    compiled_generation_config(
        generation_config, cache_implementation="static", compile_config=compile_config
    )
    # transformers reuses `_compiled_call` while `_last_compile_config` equals
    # the config it is asked for (`get_compiled_call`).
    compiled = FrozenCompiledCall(
        model,
        freeze_weights,
        call_context=_DecodeStepContext(),
        session_of=_cache_of,
        autotune=autotune,
        cpp_wrapper=cpp_wrapper,
    )
    setattr(model, _COMPILED_CALL, compiled)
    # transformers asks for the compiled call once per generation loop.
    model.__dict__["get_compiled_call"] = _GenerationStart(model)
    if hasattr(type(model), "_prepare_cache_for_generation"):
        model.__dict__["_prepare_cache_for_generation"] = _CallersCacheFirst(model)
    setattr(model, "_last_compile_config", compile_config)  # noqa: B010 (a Module attribute)
    return model
