"""This library's attention implementations in transformers, behind the name
`"sdpa"`.

transformers' `"sdpa"` entry of its attention interface is replaced, once,
by `dispatch`: a call of a module whose config selects one of this library's
implementations (`selecting(model, name)`, for the duration of a call) runs
it; every other call runs transformers' own function, unchanged.

The name a model reads, `config._attn_implementation`, stays `"sdpa"`
throughout. Models that branch on it literally (Falcon's `== "sdpa"`,
the `in ("eager", "sdpa")` tests of several others) keep taking their
`"sdpa"` path with its masks; renaming it for the call sent Falcon down its
eager branch with SDPA's boolean mask added to its scores, attention no
longer causal.

>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
...     num_hidden_layers=1, num_attention_heads=2, vocab_size=64)).eval()
>>> def doubled(module, query, key, value, attention_mask, **kwargs):
...     out, weights = transformers_sdpa()(module, query, key, value, attention_mask, **kwargs)
...     return 2 * out, weights
>>> register("doctest_doubled", doubled)
>>> ids = torch.tensor([[1, 2, 3]])
>>> with torch.no_grad():
...     plain = model(ids).logits
...     with selecting(model, "doctest_doubled") as selected:
...         changed = model(ids).logits
...         name = model.config._attn_implementation
>>> selected, name, bool((plain != changed).any()), bool(torch.equal(plain, model(ids).logits))
(True, 'sdpa', True, True)
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

SELECTION = "_dtype_policies_attention"
"""The config attribute that names the selected implementation during a call."""

_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}
_LOCK = threading.Lock()


# transformers' own "sdpa" function, once `dispatch` has replaced it
_transformers_sdpa: Callable[..., Any] | None = None


def transformers_sdpa() -> Callable[..., Any]:
    """transformers' own `"sdpa"` attention function (as registered before
    `dispatch` replaced it; replacing it, the first time)."""
    global _transformers_sdpa
    if _transformers_sdpa is None:
        _transformers_sdpa = _install()
    return _transformers_sdpa


def _install() -> Callable[..., Any]:
    from transformers import AttentionInterface

    with _LOCK:
        if _transformers_sdpa is not None:  # another thread installed it
            return _transformers_sdpa
        current = cast(Callable[..., Any], AttentionInterface._global_mapping["sdpa"])
        if current is dispatch:  # pragma: no cover - replaced by a reloaded copy
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            current = cast(Callable[..., Any], sdpa_attention_forward)
        AttentionInterface.register("sdpa", dispatch)
        return current


def dispatch(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """transformers' `"sdpa"` attention function: the implementation
    `module.config` selects, else transformers' own; on one dtype (`promoted`)."""
    query, key, value, attention_mask, kwargs = _on_one_dtype(
        query, key, value, attention_mask, kwargs
    )
    name = getattr(getattr(module, "config", None), SELECTION, None)
    implementation = _IMPLEMENTATIONS.get(name) if isinstance(name, str) else None
    if implementation is None:
        # installed before `dispatch` can be reached
        implementation = cast(Callable[..., Any], _transformers_sdpa)
    return implementation(module, query, key, value, attention_mask, *args, **kwargs)


def promoted(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Query, key, value (and a float mask) in their promoted dtype where they
    differ: policies that differ inside one attention (a float32 island on its
    query projection in a bfloat16 model) meet there as Keras's ops meet
    mixed inputs, by type promotion; torch's attention takes one dtype.

    >>> q, k = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4, dtype=torch.bfloat16)
    >>> mask = torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16)
    >>> [t.dtype for t in promoted(q, k, k, mask)]
    [torch.float32, torch.float32, torch.float32, torch.float32]
    """
    if query.dtype == key.dtype == value.dtype:
        return query, key, value, attention_mask
    common = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.to(common)
    return query.to(common), key.to(common), value.to(common), attention_mask


def _on_one_dtype(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """An attention function's arguments `promoted`, T5's `position_bias` (a
    float mask added to the scores) with them."""
    query, key, value, attention_mask = promoted(query, key, value, attention_mask)
    bias = kwargs.get("position_bias")
    if isinstance(bias, torch.Tensor) and bias.is_floating_point() and bias.dtype != query.dtype:
        promoted_bias = bias.to(torch.promote_types(bias.dtype, query.dtype))
        kwargs = {**kwargs, "position_bias": promoted_bias}
    return query, key, value, attention_mask, kwargs


_PROMOTING = "_dtype_policies_promoting"


def promote_in_eager_attention(model: torch.nn.Module) -> None:
    """Makes the `eager_attention_forward` of every transformers modeling
    module `model`'s modules come from meet its query, key and value (and a
    float mask or position bias) in their promoted dtype, as `dispatch` does
    behind `"sdpa"`: each model's attention reads that function from its own
    module's globals at every call, `"eager"` being no entry of transformers'
    attention interface. Once per modeling module; a no-op where the dtypes
    agree."""
    seen: set[str] = set()
    for module in model.modules():
        for cls in type(module).__mro__:
            name = cls.__module__
            if name in seen or not name.startswith("transformers.models."):
                continue
            seen.add(name)
            python_module = sys.modules.get(name)
            function = getattr(python_module, "eager_attention_forward", None)
            if function is None or getattr(function, _PROMOTING, False):
                continue
            with _LOCK:
                current = python_module.eager_attention_forward  # type: ignore[union-attr]
                if not getattr(current, _PROMOTING, False):
                    python_module.eager_attention_forward = _promoting(current)  # type: ignore[union-attr]


def _promoting(eager: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(eager)
    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        *arguments, kwargs = _on_one_dtype(query, key, value, attention_mask, kwargs)
        return eager(module, *arguments, *args, **kwargs)

    setattr(attention, _PROMOTING, True)
    return attention


def register(name: str, implementation: Callable[..., Any]) -> None:
    """Makes `implementation` (transformers' attention-function signature,
    SDPA's masks and semantics) selectable as `name`, and installs
    `dispatch` under `"sdpa"` (once)."""
    transformers_sdpa()
    _IMPLEMENTATIONS[name] = implementation


def config_holder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose `config` is the transformers config `model`'s
    attention reads: `model` itself when it has one, else, for a part of a
    model (a decoder layer, a stack of them), its first submodule holding
    the one config they all share; `None` when they hold none or several.
    (Read `holder.config` at each use: transformers may replace a model's
    config object, `save_pretrained` among others.)"""
    if getattr(model, "config", None) is not None:
        return model
    holders: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            holders.setdefault(id(config), module)
    return next(iter(holders.values())) if len(holders) == 1 else None


def selectable(model: torch.nn.Module, config: Any = None) -> bool:
    """Whether `model` is a transformers model on `"sdpa"` with one config
    (a composite config's sub-configs are left alone); `config`: the one its
    attention reads when it is not its own (a part of a model: its
    `config_holder`'s), else the model's `config` (not searched for: this
    is read at each call)."""
    if config is None:
        config = getattr(model, "config", None)
    return (
        config is not None
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and not getattr(config, "sub_configs", None)
    )


# the selections under way, per config (by id): the innermost is in force
_ACTIVE: dict[int, list[tuple[object, str]]] = {}


@contextlib.contextmanager
def selecting(model: torch.nn.Module, name: str, config: Any = None) -> Iterator[bool]:
    """Within the block, `model`'s attention modules (those that read the
    model's config and reach attention through transformers' interface) run
    the implementation registered as `name`; yields whether it was selected
    (`False`, and nothing changes, for a model that is not `selectable`).
    The selection ends with the block, also when it raises; blocks may nest
    and overlap across threads (each ends its own selection: when none is
    left the config is as it was). Another thread calling the model
    meanwhile attends the same way (the same values, up to rounding).
    `config`: as `selectable`'s."""
    if name not in _IMPLEMENTATIONS:
        raise KeyError(f"No attention implementation registered as {name!r}")
    if config is None:
        config = getattr(model, "config", None)
    if not selectable(model, config):
        yield False
        return
    token = object()
    with _LOCK:
        active = _ACTIVE.setdefault(id(config), [])
        active.append((token, name))
        config.__dict__[SELECTION] = name
    try:
        yield True
    finally:
        with _LOCK:
            active = _ACTIVE[id(config)]
            active[:] = [entry for entry in active if entry[0] is not token]
            if active:
                config.__dict__[SELECTION] = active[-1][1]
            else:
                del _ACTIVE[id(config)]
                config.__dict__.pop(SELECTION, None)
