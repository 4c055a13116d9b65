"""The registry of quantizable module kinds: for each module class, where its
weight is, its orientation and its role (a linear product or an embedding
table). The modes a kind supports are derived: every registered mode whose
scheme quantizes weights of its role (`QuantizationMode.roles`), unless the
kind restricts them.

Third-party linear-like classes join with `register_linear_kind`:

>>> import torch
>>> from dtype_policies.quantization import register_linear_kind
>>> class MyProjection(torch.nn.Module):  # stores its weight as (in, out)
...     def __init__(self):
...         super().__init__()
...         self.w = torch.nn.Parameter(torch.randn(8, 4))
...     def forward(self, x):
...         return x @ self.w
>>> register_linear_kind(MyProjection, weight="w", layout="in_out", bias=None)
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import os
import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from dtype_policies._core.compose import original_class
from dtype_policies._modes import mode_record, registered_modes
from dtype_policies.quantization.schemes.base import LAYOUTS, ROLES, WeightSpec

SpecFunction = Callable[[torch.nn.Module, str], WeightSpec]


@dataclass(frozen=True)
class ModuleKind:
    """How to quantize modules of one class.

    Attributes:
        spec: `(module, mode) -> WeightSpec`; raises `NotImplementedError`
            (with the reason) when this module cannot take `mode`.
        role: What its weight is: `"linear"` (a product over the input's
            last axis) or `"embedding"` (rows looked up).
        only_modes: Restricts the modes to these (`None`: every mode whose
            scheme quantizes weights of this role).
        exact: Subclasses are refused unless `type_check=False` (Keras's rule
            for its layers, whose subclasses may override `call`).
        forward: The quantized forward the module gets (`"linear"`,
            `"embedding"`), or `None` for classes whose own call dispatches to
            the quantized product (this library's layers).
        after_commit: Called with `(module, plan)` once a quantization is
            committed (layers rename their policy); must not fail.
    """

    spec: SpecFunction
    role: str = "linear"
    only_modes: tuple[str, ...] | None = None
    exact: bool = False
    forward: str | None = "linear"
    after_commit: Callable[[torch.nn.Module, object], None] | None = None

    def supports(self, mode: str) -> bool:
        """Whether modules of this kind can be quantized in `mode`."""
        if self.only_modes is not None and mode not in self.only_modes:
            return False
        return mode in self.modes

    @property
    def modes(self) -> tuple[str, ...]:
        """The registered modes this kind supports, in registration order."""
        return tuple(
            record.name
            for record in registered_modes()
            if self.role in record.roles
            and (self.only_modes is None or record.name in self.only_modes)
        )


_KINDS: dict[type | str, ModuleKind] = {}


def register_module_kind(cls: type | str, kind: ModuleKind) -> None:
    """Registers `kind` for `cls` and its subclasses. `cls` may be a
    `"module.QualName"` string, matched without importing that module."""
    if kind.role not in ROLES:
        raise ValueError(f"`role` must be one of {ROLES}. Received: role={kind.role!r}")
    _KINDS[cls] = kind


def register_linear_kind(
    cls: type | str,
    weight: str = "weight",
    layout: str = "out_in",
    bias: str | None = "bias",
    modes: tuple[str, ...] | None = None,
) -> None:
    """Makes a linear-like module class quantizable.

    Args:
        cls: The class (or its `"module.QualName"`).
        weight: The name of its 2-D weight `Parameter`.
        layout: `"out_in"` for an (out, in) weight (`y = x @ W.T`, like
            `nn.Linear`), `"in_out"` for (in, out) (`y = x @ W`, like
            transformers' `Conv1D`).
        bias: The name of its bias parameter, or `None`.
        modes: The modes to allow (`None`: every mode that quantizes linear weights).

    The quantized module computes `x @ W (+ bias)` over the input's last axis
    in place of the class's own forward.

    >>> import torch
    >>> from dtype_policies import quantize
    >>> class InOutLinear(torch.nn.Module):  # y = x @ w, w of shape (in, out)
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = torch.nn.Parameter(torch.randn(64, 32))
    ...     def forward(self, x):
    ...         return x @ self.w
    >>> register_linear_kind(InOutLinear, weight="w", layout="in_out", bias=None)
    >>> model = torch.nn.Sequential(InOutLinear())
    >>> quantize(model, "int8")
    QuantizationReport(mode='int8', quantized=1, skipped=0, errors=0)
    """
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}. Received: layout={layout!r}")
    if isinstance(cls, type) and issubclass(cls, torch.nn.Embedding):
        raise TypeError(  # its forward is a lookup: a product in its place reads ids as inputs
            f"register_linear_kind() registers linear-like classes; {cls.__name__} is an "
            "nn.Embedding (a lookup, not a product)."
        )
    for mode in modes or ():
        mode_record(mode)  # an unknown mode raises
    if not isinstance(weight, str) or not weight:
        raise ValueError(f"`weight` must be a parameter name. Received: weight={weight!r}")

    def spec(module: torch.nn.Module, mode: str) -> WeightSpec:
        parameter = module._parameters.get(weight)
        if parameter is None or parameter.dim() != 2:
            raise NotImplementedError(
                f"its weight '{weight}' is not a registered 2-D parameter "
                f"(found {type(parameter).__name__})"
            )
        rows, columns = parameter.shape
        in_features, out_features = (columns, rows) if layout == "out_in" else (rows, columns)
        return WeightSpec(
            weight=weight,
            layout=layout,
            role="linear",
            in_features=in_features,
            out_features=out_features,
            bias=bias if bias is not None and module._parameters.get(bias) is not None else None,
            float_shape=tuple(parameter.shape),
        )

    register_module_kind(
        cls, ModuleKind(spec, "linear", tuple(modes) if modes is not None else None)
    )


def _embedding_spec(module: torch.nn.Module, mode: str) -> WeightSpec:
    if getattr(module, "max_norm", None) is not None:
        raise NotImplementedError("nn.Embedding with max_norm renormalizes its table in place")
    if getattr(module, "sparse", False):
        raise NotImplementedError("nn.Embedding with sparse=True")
    weight = module._parameters.get("weight")
    if weight is None:
        raise NotImplementedError("its weight is not a registered parameter")
    rows, features = weight.shape
    return WeightSpec(
        weight="weight",
        layout="out_in",
        role="embedding",
        in_features=features,
        out_features=rows,
        float_shape=tuple(weight.shape),
    )


def kind_of_class(cls: type) -> ModuleKind | None:
    """The kind registered for exactly `cls` (or recognised: `_scaled_embedding`)."""
    return (
        _KINDS.get(cls)
        or _KINDS.get(f"{cls.__module__}.{cls.__qualname__}")
        or _scaled_embedding(cls)
    )


SCALED_EMBEDDING = ModuleKind(_embedding_spec, "embedding", forward="scaled_embedding")
"""transformers' scaled word embeddings: the table's rows times `embed_scale`."""

# the two forward bodies of transformers' `*ScaledWordEmbedding` classes (25 in 5.x)
_SCALED_FORWARD = re.compile(
    r"def forward\(self, (\w+)(: torch\.Tensor)?\):"
    r"( \"\"\".*?\"\"\")? return super\(\)\.forward\(\1\) \* self\.embed_scale"
    r"(\.to\(self\.weight\.dtype\))?"
)


_SCALED_EMBEDDINGS: weakref.WeakKeyDictionary[type, ModuleKind | None] = weakref.WeakKeyDictionary()
"""`_scaled_embedding`'s answers, held weakly (a class defined at run time goes)."""


def _scaled_embedding(cls: type) -> ModuleKind | None:
    """`SCALED_EMBEDDING` for an `nn.Embedding` subclass whose own forward is
    exactly transformers' scaled lookup (`super().forward(ids) *
    self.embed_scale`, the scale optionally cast to the weight's dtype),
    recognised from its source as transformers itself recognises which
    models take an attention interface; `None` for anything else."""
    if cls in _SCALED_EMBEDDINGS:
        return _SCALED_EMBEDDINGS[cls]
    kind = _SCALED_EMBEDDINGS[cls] = _recognised_scaled_embedding(cls)
    return kind


def _recognised_scaled_embedding(cls: type) -> ModuleKind | None:
    forward = vars(cls).get("forward")
    if forward is None or not issubclass(cls, torch.nn.Embedding):
        return None
    try:
        source = " ".join(inspect.getsource(forward).split())
    except (OSError, TypeError):
        return None
    return SCALED_EMBEDDING if _SCALED_FORWARD.fullmatch(source) else None


def kind_of(module: torch.nn.Module) -> ModuleKind | None:
    """The registered kind of a module's own class (nearest base class first)."""
    for cls in original_class(module).__mro__:
        kind = kind_of_class(cls)
        if kind is not None:
            return kind
    return None


register_linear_kind(torch.nn.Linear)
register_module_kind(
    torch.nn.Embedding, ModuleKind(_embedding_spec, "embedding", forward="embedding")
)
register_linear_kind("transformers.pytorch_utils.Conv1D", layout="in_out")
# an nn.Linear subclass whose forward is the plain product, written out
register_linear_kind("transformers.models.falcon.modeling_falcon.FalconLinear")


def owns_matrix(module: torch.nn.Module) -> bool:
    """Whether a module holds a weight of 2 or more dimensions (what a mode
    could quantize), not only scales and offsets (norms) or tensors added to
    every row (ViT's class token and position embeddings, shaped (1, ...))."""
    return any(p is not None and is_weight_matrix(p) for p in module._parameters.values())


def is_weight_matrix(parameter: torch.Tensor) -> bool:
    """2 or more dimensions and more than one row (`owns_matrix`'s rule)."""
    return parameter.dim() >= 2 and parameter.shape[0] > 1


# Parents whose forward reads these children's weights directly (so a
# quantized child, or a child's own policy, would not be used through its own
# forward): `MultiheadAttention` passes `out_proj.weight` to the attention
# function; `TransformerEncoderLayer`'s inference fast path
# (`torch._transformer_encoder_layer_fwd`) reads `self_attn`'s, `linear1`'s and
# `linear2`'s, and `norm1`'s and `norm2`'s, left out here: float32 islands,
# read as stored either way (listed, they would join the layer's FSDP unit,
# which would then be gathered as stored). `TransformerDecoderLayer` has no
# such path: it calls its children.
_PARENT_READS: dict[type, tuple[str, ...]] = {
    torch.nn.MultiheadAttention: ("out_proj",),
    torch.nn.TransformerEncoderLayer: ("self_attn", "linear1", "linear2"),
}


def read_by_parent(
    path: str, module: torch.nn.Module, modules: Mapping[str, torch.nn.Module]
) -> str | None:
    """Why `module`'s weight is read directly by its parent (so that it cannot
    change how it computes on its own), or `None`; `modules` maps paths to
    modules (the advisor keeps such weights as they are too)."""
    parent_path, _, name = path.rpartition("/")
    parent = modules.get(parent_path) if path else None  # the root has no parent
    if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        # torch's class of MultiheadAttention's out_proj, wherever it sits
        owner = original_class(parent).__name__ if parent is not None else "MultiheadAttention"
        return f"weight read by its parent ({owner})"
    if parent is None:
        return None
    for cls, children in _PARENT_READS.items():
        if issubclass(original_class(parent), cls) and name in children:
            return f"weight read by its parent ({cls.__name__})"
    if name in _children_whose_weight_is_read(original_class(parent)):
        return f"weight read by its parent ({original_class(parent).__name__}, in its own code)"
    return None


# What a parent's code may read of a child's weight without reading its
# values, and the methods that set weights up rather than compute with them.
_WEIGHT_METADATA = frozenset(
    {"dtype", "device", "shape", "size", "ndim", "dim", "requires_grad", "is_floating_point",
     "numel", "nelement", "element_size", "layout", "is_meta", "is_cuda", "_is_hf_initialized"}
)  # fmt: skip
_SETUP_METHODS = frozenset(
    {"__init__", "_init_weights", "init_weights", "reset_parameters", "_reset_parameters",
     "extra_repr", "__repr__", "tie_weights", "_tie_weights", "_tie_or_clone_weights"}
)  # fmt: skip
_NON_READING_CALLS = frozenset({"isinstance", "hasattr", "getattr", "type", "id"})


# by class, weakly: a class defined at run time goes with its last module
_READ_CHILDREN: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _children_whose_weight_is_read(cls: type) -> frozenset[str]:
    found = _READ_CHILDREN.get(cls)
    if found is None:
        found = _READ_CHILDREN[cls] = _read_and_never_called(cls)
    return found


def _read_and_never_called(cls: type) -> frozenset[str]:
    """The children whose `weight` the code of `cls` (and of its bases other
    than torch's, listed above) reads itself and never calls: transformers'
    `MambaMixer` computes `self.dt_proj.weight @ ...` and never calls
    `dt_proj`, whose quantized forward would never run. A read is
    `self.<child>.weight` used as a value (not its metadata, `.dtype` or
    `.shape`; not in `isinstance`/`hasattr`; not in the methods that build or
    tie weights), or the child handed to a method of the class that reads its
    parameter's weight so (LayoutLMv3's
    `self._relative_position_lookup(..., self.rel_pos_bias, ...)`). A child
    the code also calls (`self.<child>(...)`: one path reads, another calls)
    computes through its own forward where it is called. A class whose source
    cannot be read (defined by `exec` or in an interactive session) reads none."""
    codes = [
        _own_code(klass)
        for klass in cls.__mro__
        if klass.__module__.split(".")[0] not in ("torch", "builtins")
    ]
    read = {child for code in codes for child in code.read}
    called = {child for code in codes for child in code.called}
    reading: dict[str, frozenset[int | str]] = {}  # each method as the class resolves it
    for code in codes:
        for method, parameters in code.parameters_read.items():
            reading.setdefault(method, parameters)
    for code in codes:
        for method, parameter, child in code.handed:
            if parameter in reading.get(method, ()):
                read.add(child)
    return frozenset(read - called)


@dataclass(frozen=True)
class _OwnCode:
    """What a class's own methods (not the setup ones) do with its children."""

    read: frozenset[str]  # children whose weight is read as a value
    called: frozenset[str]  # children called
    # `self.<method>(..., self.<child>, ...)`: (method, parameter position or keyword, child)
    handed: tuple[tuple[str, int | str, str], ...]
    # method -> its parameters (positions after `self`, and names) whose weight it reads
    parameters_read: dict[str, frozenset[int | str]]


# by class, weakly, as `_READ_CHILDREN`: a base's own code is read once for all its subclasses
_OWN_CODE: weakref.WeakKeyDictionary[type, _OwnCode] = weakref.WeakKeyDictionary()


def _own_code(klass: type) -> _OwnCode:
    found = _OWN_CODE.get(klass)
    if found is None:
        read: set[str] = set()
        called: set[str] = set()
        handed: list[tuple[str, int | str, str]] = []
        parameters_read: dict[str, frozenset[int | str]] = {}
        definition = _class_definition(klass)
        for method in definition.body if definition is not None else ():
            if (
                isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef))
                and method.name not in _SETUP_METHODS
            ):
                children, names = _weights_read(method)
                read |= children
                called |= _children_called(method)
                handed += _children_handed(method)
                parameters_read[method.name] = _parameters(method, names)
        found = _OWN_CODE[klass] = _OwnCode(
            frozenset(read), frozenset(called), tuple(handed), parameters_read
        )
    return found


def _parameters(
    method: ast.FunctionDef | ast.AsyncFunctionDef, names: set[str]
) -> frozenset[int | str]:
    """The positions (after `self`) and names of `method`'s parameters in `names`."""
    positional = [argument.arg for argument in (*method.args.posonlyargs, *method.args.args)]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in method.decorator_list)
    positional = positional if static else positional[1:]  # `self` (or `cls`) is not passed
    keyword = [argument.arg for argument in method.args.kwonlyargs]
    found: set[int | str] = {i for i, name in enumerate(positional) if name in names}
    return frozenset(found | {name for name in (*positional, *keyword) if name in names})


def _self_attribute(node: ast.AST) -> str | None:
    """`<name>` where `node` is `self.<name>`."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return node.attr
    return None


def _children_handed(function: ast.AST) -> list[tuple[str, int | str, str]]:
    """`(method, position or keyword, child)` of each `self.<method>(..., self.<child>, ...)`."""
    handed: list[tuple[str, int | str, str]] = []
    for call in ast.walk(function):
        if not isinstance(call, ast.Call) or (method := _self_attribute(call.func)) is None:
            continue
        for position, argument in enumerate(call.args):
            child = _self_attribute(argument)
            if child is not None:
                handed.append((method, position, child))
        for keyword in call.keywords:
            child = _self_attribute(keyword.value)
            if child is not None and keyword.arg is not None:
                handed.append((method, keyword.arg, child))
    return handed


def _class_definition(klass: type) -> ast.ClassDef | None:
    """The `class` statement that defined `klass`, from its file parsed once
    (`inspect.getsource` parses the whole file again for every class: 0.2-0.5 s
    a class of transformers, whose models' bases live in 5,000-line files), or
    `None` where the source cannot be read. Of two definitions of one name
    (`if ...: class X` / `else: class X`), the one holding its methods' code."""
    try:
        filename = inspect.getsourcefile(klass)
    except TypeError:  # built in
        return None
    if filename is None:
        return None
    candidates = _class_definitions(filename, _modified(filename)).get(klass.__qualname__, ())
    functions = [inspect.unwrap(f) for f in vars(klass).values() if inspect.isfunction(f)]
    lines = {f.__code__.co_firstlineno for f in functions if f.__code__.co_filename == filename}
    if functions and not lines:
        return None  # defined elsewhere (`exec`) under a name the file also defines
    for candidate in candidates:
        end = candidate.end_lineno or candidate.lineno
        if not lines or any(candidate.lineno <= line <= end for line in lines):
            return candidate
    return None


def _modified(filename: str) -> int | None:
    try:
        return os.stat(filename).st_mtime_ns
    except OSError:
        return None


@functools.lru_cache(maxsize=16)  # a tree is ~6 MB for transformers' modeling_utils.py
def _class_definitions(filename: str, modified: int | None) -> dict[str, list[ast.ClassDef]]:
    """Every class statement of the file, by qualified name (`modified` keys
    the cache on the file's version; a model's classes and their bases span a
    few files, and each class's reading is kept apart, in `_OWN_CODE`)."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return {}
    found: dict[str, list[ast.ClassDef]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                found.setdefault(prefix + child.name, []).append(child)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}{child.name}.<locals>.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _children_called(function: ast.AST) -> set[str]:
    """The `<name>` of each `self.<name>(...)` (children and methods alike)."""
    called = (
        _self_attribute(node.func) for node in ast.walk(function) if isinstance(node, ast.Call)
    )
    return {name for name in called if name is not None}


def _weights_read(function: ast.AST) -> tuple[set[str], set[str]]:
    """The children whose weight `function` reads as a value (`self.<child>.weight`),
    and the plain names whose weight it reads (`<name>.weight`: its parameters')."""
    children: set[str] = set()
    names: set[str] = set()
    for parent in ast.walk(function):
        for node in ast.iter_child_nodes(parent):
            owner = _weight_value_read(node, parent)
            if isinstance(owner, ast.Name):
                names.add(owner.id)
            elif owner is not None and (child := _self_attribute(owner)) is not None:
                children.add(child)
    return children, names


def _weight_value_read(node: ast.AST, parent: ast.AST) -> ast.expr | None:
    """`<owner>` where `node` (in `parent`) is `<owner>.weight` used as a value."""
    if not (
        isinstance(node, ast.Attribute) and node.attr == "weight" and isinstance(node.ctx, ast.Load)
    ):
        return None
    if isinstance(parent, ast.Attribute) and parent.attr in _WEIGHT_METADATA:
        return None
    if (
        isinstance(parent, ast.Call)
        and isinstance(parent.func, ast.Name)
        and parent.func.id in _NON_READING_CALLS
    ):
        return None
    return node.value
