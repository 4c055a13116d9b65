"""Calls compiled by Inductor with frozen weights, guarded by a watch of the
model instead of Dynamo's guards on its modules (`compile_for_generation`,
`compile_for_inference`).

With weight freezing, what depends on weights alone (the policies' casts,
oneDNN's prepacked layouts, the int4 kernel's packing) is computed once, at
compile time, into constants of the graph; Dynamo's guards never look at the
values of those weights. `ModelWatch` records, per call, what such a graph
depends on besides its inputs, cheaply enough to read on every call; when it
changed, the call runs eagerly (with a warning) until compiled again.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import threading
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from dtype_policies import _native
from dtype_policies._compat import CPP_WRAPPER_BY_DEFAULT
from dtype_policies._compiled_frames import (
    EagerFrames,
    isolated,
    own_step,
    skip_guards_on_the_models_modules,
)
from dtype_policies._core.listeners import add_write_listener
from dtype_policies._core.module_state import STATE_KEY, refresh_kept
from dtype_policies._core.tensor_identity import has_strides, view_key
from dtype_policies._derivatives import transform_active
from dtype_policies._inductor_repairs import repaired


class ModelWatch:
    """What a graph compiled with frozen weights depends on besides its
    inputs, read back cheaply on every call: each parameter and buffer slot
    (the tensor in it, its address, version, dtype, shape and strides; a
    sparse or nested tensor's version and parts, `tensor_identity.view_key`),
    each child slot, and each module's training flag and this library's call
    state and quantization (replaced whenever a policy or a quantization
    changes).

    It is read before every compiled call, so each check is one pass of C
    iteration (`map`, list and dict comparison) over flat lists recorded once,
    never a Python loop per tensor: SmolLM2-135M's 487 tensors and 397 modules
    cost 1.6 ms per decode step read one by one, 1.0 ms this way. The
    tensors' addresses, versions, dtypes, shapes and strides, most of that
    time, are compared in one native call where this library's kernels are
    built (`_csrc/watch.cpp`; tensors of plain torch types): the whole check
    of all-MiniLM-L6-v2's 145 tensors and 120 modules takes 46 us against 85
    us read from Python.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> watch = ModelWatch(model)
    >>> watch.unchanged()
    True
    >>> with torch.no_grad():
    ...     _ = model[0].weight.mul_(2)
    >>> watch.unchanged()
    False
    """

    __slots__ = (
        "__weakref__",
        "addresses",
        "all_slot_dicts",
        "calls",
        "children",
        "children_now",
        "dtypes",
        "empty_dicts",
        "empty_names",
        "layouts",
        "module_dicts",
        "modules",
        "quantizations",
        "shapes",
        "slot_counts",
        "slot_dicts",
        "slot_names",
        "stateful",
        "states",
        "strided",
        "strides",
        "tensors",
        "training",
        "unstrided",
        "unstrided_keys",
        "versioned",
        "versions",
        "written",
    )

    def __init__(self, model: torch.nn.Module) -> None:
        self.slot_dicts: list[dict] = []
        self.slot_names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.all_slot_dicts: list[dict] = []
        self.empty_dicts: list[dict] = []  # slots holding `None` (`bias=False`)
        self.empty_names: list[str] = []
        for module in model.modules():
            for slots in (module._parameters, module._buffers):
                self.all_slot_dicts.append(slots)
                for name, tensor in slots.items():
                    if tensor is None:
                        self.empty_dicts.append(slots)
                        self.empty_names.append(name)
                        continue
                    self.slot_dicts.append(slots)
                    self.slot_names.append(name)
                    self.tensors.append(tensor)
        # a slot added (a parameter or buffer of a new name) or removed
        self.slot_counts = list(map(len, self.all_slot_dicts))
        # Sparse and nested tensors have no address or strides of their own.
        self.strided = [tensor for tensor in self.tensors if has_strides(tensor)]
        self.unstrided = [tensor for tensor in self.tensors if not has_strides(tensor)]
        self.unstrided_keys = list(map(view_key, self.unstrided))
        self.addresses = list(map(_data_ptr, self.strided))
        # `p.data = p.data.view(dtype)` of one item size keeps the rest
        self.dtypes = list(map(_get_dtype, self.strided))
        # `p.data = p.data[:k]` (or `.t()`) keeps the address and the version
        self.shapes = list(map(_get_shape, self.strided))
        self.strides = list(map(_stride, self.strided))
        # An inference tensor has no version counter (and stays one).
        self.versioned = [tensor for tensor in self.strided if not tensor.is_inference()]
        self.versions = list(map(_get_version, self.versioned))
        self.layouts = _native_layouts(self.strided)
        self.modules = list(model.modules())
        self.training = list(map(_get_training, self.modules))
        self.module_dicts = [module.__dict__ for module in self.modules]
        self.states = list(map(dict.get, self.module_dicts, itertools.repeat(STATE_KEY)))
        self.stateful = [state for state in self.states if state is not None]
        self.calls = list(map(_get_call, self.stateful))
        self.quantizations = list(map(_get_quantization, self.stateful))
        self.children_now = [module._modules for module in self.modules]
        self.children = [dict(children) for children in self.children_now]
        # Writes torch's version counters miss: `clear_cast_caches` after `p.data`
        # writes (fused optimizer steps move them: `_core.tensor_identity`).
        self.written = False
        _watch_writes(self)

    def unchanged(self) -> bool:
        """Whether nothing the compiled graph depends on changed since the watch was made."""
        return (
            not self.written
            and all(
                map(operator.is_, map(dict.get, self.slot_dicts, self.slot_names), self.tensors)
            )
            and list(map(len, self.all_slot_dicts)) == self.slot_counts
            and all(
                map(
                    operator.is_,
                    map(dict.get, self.empty_dicts, self.empty_names),
                    itertools.repeat(None),
                )
            )
            and (
                _layouts_match(self.strided, self.layouts)
                if self.layouts is not None
                else (
                    list(map(_data_ptr, self.strided)) == self.addresses
                    and list(map(_get_dtype, self.strided)) == self.dtypes
                    and list(map(_get_shape, self.strided)) == self.shapes
                    and list(map(_stride, self.strided)) == self.strides
                    and list(map(_get_version, self.versioned)) == self.versions
                )
            )
            and list(map(view_key, self.unstrided)) == self.unstrided_keys
            and list(map(_get_training, self.modules)) == self.training
            and all(
                map(
                    operator.is_,
                    map(dict.get, self.module_dicts, itertools.repeat(STATE_KEY)),
                    self.states,
                )
            )
            and all(map(operator.is_, map(_get_call, self.stateful), self.calls))
            and all(map(operator.is_, map(_get_quantization, self.stateful), self.quantizations))
            # Modules compare by identity: a replaced child makes the dicts differ.
            and self.children_now == self.children
        )


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _names(names: list[str]) -> str:
    """The first three of `names`, quoted, and how many more."""
    shown = ", ".join(repr(name) for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _native_layouts(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """`tensors`' addresses, versions, dtypes, shapes and strides recorded by
    the native `tensor_layouts`, or `None` where the Python reads are used:
    the native kernels are not built here, a tensor is of a subclass (whose
    storage may be another tensor's, read by its own Python), or a dispatch
    mode is active (a `FakeTensorMode` would make the record a fake tensor)."""
    if not all(type(tensor) in _PLAIN_TENSOR_TYPES for tensor in tensors):
        return None
    if _active_dispatch_mode() is not None:
        return None
    if not _native.available("avx2"):
        return None
    return torch.ops.dtype_policies.tensor_layouts(tensors)


def _active_dispatch_mode() -> Any:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def _layouts_match(tensors: list[torch.Tensor], recorded: torch.Tensor) -> bool:
    return torch.ops.dtype_policies.tensor_layouts_match(tensors, recorded)


# id(tensor) -> the watches reading it: told of writes their version checks
# miss. Keyed by id (tensors compare elementwise), with no weak reference to
# any tensor (`torch.utils.swap_tensors`, and `Module.to` swapping, refuse a
# tensor that has one): a watch holds its tensors, so while a watch in a set
# lives, the tensor of that id is the one it watches. Sets whose watches all
# died are dropped when the next watch is made.
_watches_of: dict[int, weakref.WeakSet[ModelWatch]] = {}
_listening: list[bool] = []


# Held to add to a tensor's watches and to read them (a watch made in one
# thread while another clears the model's caches).
_watches_lock = threading.Lock()


def _watch_writes(watch: ModelWatch) -> None:
    if not _listening:
        _listening.append(True)
        add_write_listener(_after_write)
    with _watches_lock:
        for key in [key for key, watches in _watches_of.items() if not watches]:
            del _watches_of[key]
        for tensor in watch.tensors:
            _watches_of.setdefault(id(tensor), weakref.WeakSet()).add(watch)


def _mark_written(tensors: Any) -> None:
    for tensor in tensors:
        entry = _watches_of.get(id(tensor))
        if entry:
            with _watches_lock:
                watches = list(entry)
            for watch in watches:
                watch.written = True


def _after_write(model: torch.nn.Module) -> None:
    if len(_watches_of):
        _mark_written(itertools.chain(model.parameters(), model.buffers()))


_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_get_shape = operator.attrgetter("shape")
_get_dtype = operator.attrgetter("dtype")
_get_version = operator.attrgetter("_version")
_get_training = operator.attrgetter("training")
_get_call = operator.attrgetter("call")
_get_quantization = operator.attrgetter("quantization")


AUTOTUNE_OPTIONS: dict[str, Any] = {
    "max_autotune": True,
    "max_autotune_gemm_backends": "ATEN,CPP,TRITON",
}
"""Inductor's settings for `autotune=True`. On CPU its C++ templates (weight
prepacked at freezing, micro-kernels per shape, int4 and weight-only int8
included) beat ATen's kernels at a few rows: SmolLM2-135M decodes 1.12x
(int4/32) to 1.63x (mixed_bfloat16) faster, int4's output kept in float32
rather than rounded to bfloat16; its first compilation takes up to 1.5x
longer (docs/speed.md).
ATen's kernel is always among the choices, so a shape never gets slower than
ATen's by more than the timing's noise."""


CPP_WRAPPER_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}
"""Inductor's settings for `cpp_wrapper=True`: the graph's kernels and
operators called from generated C++ instead of Python. At one row, where a
step is hundreds of small calls, SmolLM2-135M's decode step is 1.01-1.05x
(mixed_bfloat16), 1.03-1.08x (int4 W4A8) and 1.02-1.26x (int8) faster (AMD
Zen 4, 2 threads, three runs of 2026-12-05; 1.06-1.10x for int8 on Zen 3);
all-MiniLM-L6-v2's int8 call at 1 x 32 tokens 1.06-1.2x (AMX Xeon,
2026-12-07): the default of `compile_for_generation` and
`compile_for_inference` from torch 2.13 (`resolved_cpp_wrapper`). The first
compilation of a graph takes longer with a cold cache where the graph is
large (a C++ file per graph: 127 s against 97 s for SmolLM2's int4 W4A8
step; MiniLM's the same, 30-50 s), as long with Inductor's cache kept (68 s
each)."""


def sibling_options() -> dict[str, Any]:
    """Inductor's settings that merge sibling products of this library's
    packed operators (`quantization.kernels.siblings`), unless the user set
    a joint-graph pass of their own (kept, without merging)."""
    from torch._inductor import config

    from dtype_policies.quantization.kernels import siblings

    if getattr(config, "joint_custom_post_pass", False) is not None:
        return {}
    return {"joint_custom_post_pass": siblings.SiblingProducts()}


# Dynamo's guards on the model's modules cost milliseconds per call
# (SmolLM2-135M: 8.5 ms of 57 at 1 thread, measured): with frozen weights,
# `ModelWatch` stands in for them in the outermost frame (torch >= 2.8 lets
# them be dropped, the same release as this helper).
_GUARD_FILTERS = hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")

_EAGER_FRAMES = EagerFrames()


@functools.cache
def cpu_cache_tag() -> str:
    """The vector instructions Inductor generates code for on this CPU
    (`pick_vec_isa`), or "" where it cannot tell.

    Inductor's on-disk graph cache is not keyed on them: a cache filled on
    one CPU and read on another with other instructions (a container image
    with a warmed cache, a shared home directory) ran code generated for the
    first, with wrong values (NaN and garbage, AVX-512 code read under AVX2:
    torch's own, with or without this library). This library's compiled
    calls add it to the key (`torch.compiler.config.cache_key_tag`)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        return f"cpu:{pick_vec_isa()}".replace(" ", "+")
    except Exception:  # pragma: no cover - a torch without Inductor's CPU back end
        return ""


def keyed_on_this_cpu() -> AbstractContextManager[Any]:
    """Within, Inductor's cache keys name this CPU's instructions (`cpu_cache_tag`)."""
    compiler_config = getattr(torch.compiler, "config", None)
    tag = cpu_cache_tag()
    if not tag or compiler_config is None or not hasattr(compiler_config, "cache_key_tag"):
        return contextlib.nullcontext()
    user_tag = compiler_config.cache_key_tag
    if tag in user_tag:
        return contextlib.nullcontext()
    return compiler_config.patch(cache_key_tag=f"{user_tag}|{tag}" if user_tag else tag)


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """What Dynamo's guards on a call's inputs mostly read, cheaply and
    hashably: each tensor's shape, dtype and device, each plain value itself,
    and the type of anything else, through tuples, lists and dicts two levels
    deep.

    >>> import torch
    >>> input_signature((torch.ones(2, 3),), {"use_cache": True})
    ((((2, 3), torch.float32, 'cpu'),), (('use_cache', True),))
    """
    return _signature(args, 2), tuple((key, _signature(value, 2)) for key, value in kwargs.items())


def _signature(value: Any, depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device.type)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 0 and isinstance(value, (tuple, list)):
        return tuple(_signature(item, depth - 1) for item in value)
    if depth > 0 and isinstance(value, dict):
        return tuple((key, _signature(item, depth - 1)) for key, item in value.items())
    return type(value)


class NewInputsRunAlone:
    """Calls of one compiled model whose inputs' signature (`input_signature`)
    has not yet completed a call run one at a time; the others run at once.

    Dynamo looks a call up in a frame's compiled entries before it takes its
    compile lock and does not look again after: threads that call a model
    while another compiles it compile the same graph again, each copy one
    entry towards Dynamo's recompile limit (torch 2.13; pytorch#123177).
    Three threads calling a fresh compiled two-layer int8 model with four
    batch sizes met that limit, and parts of the model ran eagerly from
    then on. A call that may compile (new inputs) now waits for the ones
    that are compiling, and finds their graphs when it runs.

    >>> gate = NewInputsRunAlone()
    >>> gate.call(lambda x: x + 1, (1,), {})
    2
    >>> gate.seen
    {((1,), ())}
    """

    __slots__ = ("lock", "seen")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.seen: set[tuple] = set()

    def call(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        signature = input_signature(args, kwargs)  # hashable: every leaf is
        if signature in self.seen:
            return function(*args, **kwargs)
        with self.lock:
            result = function(*args, **kwargs)
            self.seen.add(signature)
        return result


class _FreezingWhileTracing:
    """Inductor's `freezing` set to `value` around a compiled call, where it
    differs: Dynamo may trace the model within the call, and the quantized
    products choose their traced paths from it
    (`quantization.kernels.freezing_weights`). Two attribute writes at most:
    a `config.patch` costs ten times as much per call."""

    __slots__ = ("prior", "value")

    def __init__(self, value: bool) -> None:
        self.value = value
        self.prior: bool | None = None

    def __enter__(self) -> None:
        from torch._inductor import config

        if config.freezing != self.value:
            self.prior = config.freezing
            config.freezing = self.value

    def __exit__(self, *exc_info: object) -> None:
        if self.prior is not None:
            from torch._inductor import config

            config.freezing = self.prior


class InductorWhileCompiling:
    """Inductor as `torch.compile`'s back end, with this library's settings
    applied only while it compiles a graph: Inductor's `options`, this CPU
    in its cache keys (`keyed_on_this_cpu`) and the repairs
    (`_inductor_repairs.repaired`). A call of a graph compiled before pays
    nothing for them (patched around every call, they cost about 0.1 ms a
    call on an AMX Xeon: 127 against 28 us for a compiled 4 x 4 linear).
    `freezing`, which Dynamo's tracing reads too, is set around each call
    (`_FreezingWhileTracing`).

    >>> InductorWhileCompiling({"freezing": True}).options
    {'freezing': True}
    """

    compiler_name = "inductor"

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = dict(options)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx

        with keyed_on_this_cpu(), repaired():
            return compile_fx(graph, example_inputs, config_patches=self.options)


GIVE_UP_AFTER_LIMIT_HITS = 3
"""Sessions (generations; calls, without sessions) in a row meeting Dynamo's
recompile limit at any step (no session between them that ran compiled and
met none; without sessions, no compiled call) after which a compiled call
runs eagerly for good: a call whose Python state changes at every step
(Gemma2's sliding-window cache) meets it in every generation, after its
first step; a new batch size in one generation only (the rest of that
generation runs eagerly), and the shapes compiled before still run
compiled."""


@functools.cache
def _recompile_limit() -> tuple[type[BaseException], ...]:
    """Dynamo's "recompile limit hit" errors (read when one is raised, so that
    importing the package does not import Dynamo)."""
    from torch._dynamo import exc

    names = ("FailOnRecompileLimitHit", "RecompileLimitExceeded")
    return tuple(getattr(exc, name) for name in names if hasattr(exc, name))


def _cannot_trace() -> tuple[type[BaseException], ...]:
    """Dynamo's error for what it cannot trace (with `fullgraph=True`)."""
    from torch._dynamo import exc

    return (exc.Unsupported,)


def resolved_cpp_wrapper(cpp_wrapper: bool | None) -> Any:
    """`cpp_wrapper` as given, or for `None` this torch's default
    (`_compat.CPP_WRAPPER_BY_DEFAULT`: the C++ wrapper from torch 2.13)."""
    return CPP_WRAPPER_BY_DEFAULT if cpp_wrapper is None else cpp_wrapper


def check_flags(function: str, **flags: Any) -> None:
    """Raises TypeError naming the first flag that is not a bool (`"no"` is
    truthy: it would have turned the option on)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{function}(): {name} must be True or False. Received: {value!r}")


class FrozenCompiledCall:
    """`model`'s call, compiled (Inductor, with weight freezing on: Dynamo
    reads the setting while tracing, so it must hold during the call, not
    only in the backend).

    Frozen weights are constants of the graph, and Dynamo's guards do not see
    their values: each instance compiles its own copy of the call's code (so
    its graphs are its own, never an earlier compilation's, and Dynamo's
    recompile limit counts its entries alone: `_compiled_frames`), and a
    call after any parameter, buffer, policy, quantization or training mode
    changed runs eagerly, with a warning naming `name`, until it is compiled
    again (`ModelWatch`, read on every call in place of Dynamo's guards on
    the model's modules in the outermost frame). A frame Dynamo gives up on
    during a call (its recompile limit, a graph break it cannot resume from)
    runs eagerly with a warning, once per reason. Calls with gradients
    enabled, forward mode or a `torch.func` transform run eagerly: a frozen
    graph has no derivatives (compiled: under `torch.no_grad()`,
    `torch.inference_mode()`).
    Each compiled call runs inside `call_context(model, kwargs, continuing)`
    (the caller's settings for the compiled step only).

    Sessions: with `session_of` (a function of the call's keyword arguments,
    for `generate` its KV cache), the model is read once per session rather
    than on every call: a call whose session is the one the previous call
    read continues it (`continuing=True`) and skips the watch (1.3-1.6 ms of
    SmolLM2-135M's 20 ms decode step, the Python objects of 487 tensors and
    397 modules read from memory after each step has streamed the weights
    through the caches). `begin_session()` ends the session (Hugging Face's
    `generate` calls it through `get_compiled_call` before each generation
    loop), so each generation reads the model at its first step. With `autotune`,
    Inductor times its own C++ GEMM templates against ATen's kernels for each
    product shape and keeps the faster (`AUTOTUNE_OPTIONS`); with
    `cpp_wrapper`, the code that calls the graph's kernels is C++ rather than
    Python (`CPP_WRAPPER_OPTIONS`; `None`: `resolved_cpp_wrapper`'s default).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        freeze_weights: bool = True,
        *,
        name: str = "compile_for_generation",
        dynamic: bool | None = False,
        fullgraph: bool = True,
        call_context: Callable[..., AbstractContextManager] | None = None,
        session_of: Callable[[dict], object] | None = None,
        autotune: bool = True,
        cpp_wrapper: bool | None = None,
    ) -> None:
        from dtype_policies.quantization import kernels

        kernels.prepare()  # built and loaded before Dynamo traces a product
        self.settings: dict[str, Any] = {
            "name": name,
            "dynamic": dynamic,
            "fullgraph": fullgraph,
            "call_context": call_context,
            "session_of": session_of,
            "autotune": autotune,
            "cpp_wrapper": resolved_cpp_wrapper(cpp_wrapper),
        }
        self.model_ref = weakref.ref(model)
        self.model_class = type(model)  # whose `__call__` the graph is traced from
        self.name = name
        self.call_context = call_context
        self.session_of = session_of
        self.session: object = None
        self.new_inputs = NewInputsRunAlone()
        self._set_up(model, freeze_weights)
        self.watch: ModelWatch | None = None
        self.given_up: str | None = None  # why the compiler gave up on this model
        self.reported: set[str] = set()  # the reasons for eager frames told so far
        self.limit_hits = 0  # sessions (calls) in a row that met Dynamo's recompile limit
        self.eager_session: weakref.ref | None = None  # the session that met it last
        self.session_met_limit = False  # the latest session (generation) met it
        self.session_ran = False  # the latest session ran a compiled step

    def _set_up(self, model: torch.nn.Module, freeze_weights: bool) -> None:
        """The compiled step and Inductor's settings, with weights frozen or not
        (before anything was compiled)."""
        settings = self.settings
        self.freeze_weights = freeze_weights
        self.inductor_options: dict[str, Any] = {"freezing": freeze_weights}
        if freeze_weights:
            self.inductor_options.update(sibling_options())
        if settings["autotune"]:
            self.inductor_options.update(AUTOTUNE_OPTIONS)
        if settings["cpp_wrapper"]:
            self.inductor_options.update(CPP_WRAPPER_OPTIONS)
        options: Any = {}
        if freeze_weights and _GUARD_FILTERS:
            options["guard_filter_fn"] = skip_guards_on_the_models_modules
        # torch.compile of a function of its own (of a `functools.partial`, it
        # runs every compiled call through one frame of torch's): Dynamo's
        # compiled entries and recompile limit are this model's alone.
        step = torch.compile(
            own_step(),
            fullgraph=settings["fullgraph"],
            dynamic=settings["dynamic"],
            backend=InductorWhileCompiling(self.inductor_options),
            options=options or None,
            **isolated(),
        )
        self.compiled = functools.partial(step, model.__call__)

    def _watch_or_unfreeze(self, model: torch.nn.Module) -> None:
        """At the first call: the watch of the model's tensors, or, where
        some cannot be frozen, the weights kept as graph inputs instead, with
        a warning: inference tensors (built or loaded under
        `torch.inference_mode()`: torch records no writes to them, so
        `load_state_dict` there would leave a frozen graph serving the old
        values) and sparse or nested tensors (Dynamo, making a frozen
        tensor an attribute of the graph, reads strides they do not have:
        an IndexError inside torch 2.13 for a policied model's sparse
        buffer)."""
        named = list(itertools.chain(model.named_parameters(), model.named_buffers()))
        inference = [name for name, tensor in named if tensor.is_inference()]
        unstrided = [name for name, tensor in named if not has_strides(tensor)]
        if not inference and not unstrided:
            refresh_kept(model)  # the graph about to be traced reads the kernels' plans
            self.watch = ModelWatch(model)
            return
        if inference:
            reason = (
                f"{_names(inference)} are inference tensors (built or loaded under "
                "torch.inference_mode()): torch records no writes to them, so a graph "
                "with frozen weights could go on serving their old values after a "
                "load_state_dict"
            )
            advice = "Build or load the model outside inference_mode to freeze them."
        else:
            reason = (
                f"{_names(unstrided)} are sparse or nested tensors, which Dynamo cannot "
                "make constants of a graph (torch's own limit)"
            )
            advice = "Hold them as dense tensors to freeze the model's weights."
        warnings.warn(
            f"{self.name}: the model's {reason}. They stay inputs of the compiled graph "
            f"instead, as with freeze_weights=False (no prepacked products). {advice}",
            stacklevel=3,
        )
        self._set_up(model, freeze_weights=False)

    def __reduce__(self) -> tuple[Any, tuple]:
        # Compiled graphs cannot be copied: a copy (pickle, `torch.save`,
        # deepcopy) is the copied model's call, compiled again at its first call.
        model = self.model_ref()
        if model is None:
            raise ReferenceError(f"{self.name}: the compiled model no longer exists")
        return (_compiled_again, (model, self.freeze_weights, self.settings))

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own call, looked up now (`remove()` of a policy
        restores its class, and with it another `__call__`)."""
        model = self.model_ref()
        if model is None:
            raise ReferenceError("the compiled model no longer exists")
        return model(*args, **kwargs)

    def begin_session(self) -> None:
        """The next call reads the model again (the start of a generation),
        and tries its compiled graph again, on a cache passed to an earlier
        generation that met the recompile limit too."""
        self.session = None
        self.eager_session = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model_ref()
        if self.given_up is not None:
            return self.eager(*args, **kwargs)
        session = None if self.session_of is None else self.session_of(kwargs)
        if session is not None and self.eager_session is not None:
            if self.eager_session() is session:  # this generation met the limit
                return self.eager(*args, **kwargs)
            self.eager_session = None
        continuing = session is not None and session is self.session
        if session is not None and not continuing:  # a session begins: did the last meet none?
            if self.session_ran and not self.session_met_limit:
                self.limit_hits = 0
            self.session_ran = self.session_met_limit = False
        if self.freeze_weights and model is not None:
            if torch.is_grad_enabled() or transform_active():  # a frozen graph has no derivatives
                return self.eager(*args, **kwargs)
            if self.watch is None and type(model) is self.model_class:
                self._watch_or_unfreeze(model)
            elif (
                type(model) is not self.model_class
                or self.watch is None
                or (not continuing and not self.watch.unchanged())
            ):
                self.session = None
                warnings.warn(
                    f"{self.name}: the model's weights, policies or mode changed after it "
                    "was compiled with frozen weights; running eagerly. Call "
                    f"{self.name}(model) again to compile the new model.",
                    stacklevel=2,
                )
                return self.eager(*args, **kwargs)
        self.session = session
        context = (
            contextlib.nullcontext()
            if self.call_context is None or model is None
            else self.call_context(model, kwargs, continuing)
        )
        mark = _EAGER_FRAMES.mark()
        try:
            with context, _FreezingWhileTracing(self.freeze_weights):
                result = self.new_inputs.call(self.compiled, args, kwargs)
        except _recompile_limit() as error:
            # raised while compiling, before the call ran: the eager call is its first run
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            self.limit_hits += 1
            self.session_met_limit = session is not None
            self._rest_of_session_eager(session)
            if self.limit_hits >= GIVE_UP_AFTER_LIMIT_HITS:
                self.given_up = reason
                warnings.warn(
                    f"{self.name}: torch.compile met its recompile limit in "
                    f"{GIVE_UP_AFTER_LIMIT_HITS} calls in a row and gave up "
                    f"({type(error).__name__}: {reason}); it runs eagerly from "
                    "now on, the shapes compiled before too. It happens when generations keep "
                    "bringing new shapes (batch sizes, max_new_tokens: reuse a few) or a "
                    "cache changes its Python state at every step (sliding-window layers; "
                    "transformers' own compiled generate stops the same way).",
                    stacklevel=2,
                )
            elif reason not in self.reported:
                self.reported.add(reason)
                warnings.warn(
                    f"{self.name}: torch.compile met its recompile limit on this call "
                    f"({type(error).__name__}: {reason}); the call runs eagerly, calls of the "
                    "shapes compiled before stay compiled. Each new batch size or mode "
                    "compiles a graph of its own: reuse a few.",
                    stacklevel=2,
                )
            return self.eager(*args, **kwargs)
        except _cannot_trace() as error:
            # raised while tracing, before the call ran (an option of this call the
            # graph cannot hold: generate(output_attentions=True) logs from the
            # attention); this generation runs eagerly, the next one tries again.
            # Outside a generation it raises, as torch.compile's fullgraph does.
            if session is None:
                raise
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            self._rest_of_session_eager(session)
            if reason not in self.reported:
                self.reported.add(reason)
                warnings.warn(
                    f"{self.name}: torch.compile cannot compile this call "
                    f"({type(error).__name__}: {reason}); it runs eagerly (the rest of this "
                    "generation too).",
                    stacklevel=2,
                )
            return self.eager(*args, **kwargs)
        # A session's first steps may run the graph compiled for it while a
        # later one meets the limit (Gemma2's sliding-window cache, every
        # generation): a session breaks the run of limits only if it met none.
        if session is None:
            self.limit_hits = 0
        else:
            self.session_ran = True
        given_up = _EAGER_FRAMES.given_up_since(mark)
        if given_up:
            self.report_eager_frames(given_up)
        return result

    def _rest_of_session_eager(self, session: Any) -> None:
        """The calls left of `session` (a generation's) run eagerly."""
        self.session = None
        if session is not None:
            try:
                self.eager_session = weakref.ref(session)
            except TypeError:  # a session that takes no weak reference
                self.eager_session = None

    def report_eager_frames(self, reasons: list[str]) -> None:
        """One warning per reason Dynamo gave up on a frame of this model's call."""
        new = [reason for reason in dict.fromkeys(reasons) if reason not in self.reported]
        if not new:
            return
        self.reported.update(new)
        warnings.warn(
            f"{self.name}: torch.compile could not compile part of "
            f"{self.model_class.__name__}'s call, which runs eagerly ({'; '.join(new)}). "
            'TORCH_LOGS="recompiles,graph_breaks" names the frames.',
            stacklevel=3,
        )


def _compiled_again(
    model: torch.nn.Module, freeze_weights: bool, settings: dict[str, Any]
) -> FrozenCompiledCall:
    """A copy of a `FrozenCompiledCall` (its `__reduce__`): the same settings
    on the copied model, compiled at its first call."""
    return FrozenCompiledCall(model, freeze_weights, **settings)
