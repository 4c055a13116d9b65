"""The manifest of a saved model: every module's policy and quantization,
written out per module path (so that no regex resolves differently on load),
as versioned JSON.

Paths are torch's dotted module names from the saved module (`""` for the
module itself, `"encoder.layers.0.linear1"`), the same names `state_dict()`
keys use.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from dtype_policies._core.checkpoints import CheckpointError
from dtype_policies._core.compose import original_class, original_of
from dtype_policies._core.policy_module import ModuleOptions, top_options
from dtype_policies._core.sharded import class_under_fsdp
from dtype_policies._core.slots import non_persistent_buffer_names
from dtype_policies.layers.layer import Layer, resolved_policy
from dtype_policies.policies import DTypePolicy, deserialize, serialize
from dtype_policies.quantization.attach import quantization_of
from dtype_policies.quantization.experts import expanded
from dtype_policies.quantization.modules import computes_in_own_dtype
from dtype_policies.quantizers.config import deserialize_config, serialize_config

FORMAT_NAME = "dtype_policies"
FORMAT_VERSION = 1


@dataclass
class ModuleRecord:
    """How a torch module computes: its call options under `apply_policy`."""

    policy: dict[str, Any]
    island: bool = False
    half_inputs_ok: bool = False
    norm: bool = False
    gather: bool = False
    cast_buffers: bool = True
    weight_cache: bool = True
    outputs: str | None = None

    @classmethod
    def of(cls, options: ModuleOptions) -> ModuleRecord:
        values = {k: v for k, v in asdict(options).items() if k != "policy"}
        return cls(policy=serialize(options.policy), **values)

    def options(self) -> ModuleOptions:
        values = {k: v for k, v in asdict(self).items() if k != "policy"}
        if self.outputs is not None and not isinstance(
            getattr(torch, str(self.outputs), None), torch.dtype
        ):
            raise ValueError(f"'outputs' must name a torch dtype. Received: {self.outputs!r}")
        return ModuleOptions(policy=deserialize(self.policy), **values)


@dataclass
class QuantizedRecord:
    """A quantized weight: everything needed to rebuild its module's structure."""

    mode: str
    config: dict[str, Any]
    weight: str
    layout: str
    role: str
    float_shape: list[int]
    float_dtype: str
    stored: list[str]

    @property
    def quantization_config(self):
        return deserialize_config(self.config)

    def checked_config(self) -> Any:
        """The config, of the record's mode (`ValueError` otherwise)."""
        config = self.quantization_config
        if getattr(config, "mode", self.mode) != self.mode:
            raise ValueError(
                f"the record's mode '{self.mode}' and its quantization config, one of mode "
                f"'{config.mode}' ({config}), disagree"
            )
        return config


@dataclass
class LayerMap:
    """A layer whose policy is a `DTypePolicyMap`: the map (an index into the
    manifest's `policy_maps`, one entry per map object, however many layers
    share it) and the path the layer resolves it at."""

    map: int
    path: str


@dataclass
class Manifest:
    """What `saving.save` writes besides the tensors."""

    library_version: str
    modules: dict[str, ModuleRecord] = field(default_factory=dict)
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    quantized: dict[str, QuantizedRecord] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    non_persistent: list[str] = field(default_factory=list)
    # the persistent buffers besides quantized modules' stored tensors (a
    # norm's running statistics): what is not a parameter, for `inspect`;
    # None in checkpoints written before 2026-12-03
    buffers: list[str] | None = None
    classes: dict[str, str] = field(default_factory=dict)
    # mixture-of-experts modules computing with one linear per expert
    # (`quantization.experts`): expanded again before loading
    experts: list[str] = field(default_factory=list)
    # `layers` holds each layer's resolved policy; a layer given a map also
    # gets the map back (Keras's saved configs hold the map, not its entries)
    policy_maps: list[dict[str, Any]] = field(default_factory=list)
    layer_maps: dict[str, LayerMap] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self, indent: int | None = None) -> str:
        data = {"format": FORMAT_NAME, **asdict(self)}
        return json.dumps(data, indent=indent, sort_keys=True)

    def renamed(self, rename: Callable[[str], str | None]) -> Manifest:
        """This manifest with every module path and tensor key (dotted names,
        `""` for the root) passed through `rename`; a name it maps to `None`
        leaves with its entry. An alias whose tensor's owner left while the
        alias stays cannot be renamed: a CheckpointError names it.

        >>> manifest = Manifest("0", classes={"": "Outer", "inner": "Inner", "head": "Head"})
        >>> def inside(path):
        ...     return path.removeprefix("inner").lstrip(".") if path.startswith("inner") else None
        >>> manifest.renamed(inside).classes
        {'': 'Inner'}
        """

        def keyed(values: dict[str, Any]) -> dict[str, Any]:
            return {new: v for k, v in values.items() if (new := rename(k)) is not None}

        aliases = {}
        for alias, key in self.aliases.items():
            new_alias, new_key = rename(alias), rename(key)
            if new_alias is None:
                continue
            if new_key is None:
                raise CheckpointError(
                    f"'{alias}' shares the stored tensor '{key}', which belongs to a module the "
                    "target does not have: the checkpoint holds it only under that name."
                )
            aliases[new_alias] = new_key
        return replace(
            self,
            modules=keyed(self.modules),
            layers=keyed(self.layers),
            quantized=keyed(self.quantized),
            aliases=aliases,
            non_persistent=[n for k in self.non_persistent if (n := rename(k)) is not None],
            buffers=None
            if self.buffers is None
            else [n for k in self.buffers if (n := rename(k)) is not None],
            classes=keyed(self.classes),
            experts=[n for k in self.experts if (n := rename(k)) is not None],
            layer_maps=keyed(self.layer_maps),
        )

    @classmethod
    def from_json(cls, text: str, source: str = "the checkpoint") -> Manifest:
        try:
            data = json.loads(text)
        except (TypeError, ValueError, RecursionError) as e:
            raise CheckpointError(
                f"{source}: the dtype_policies manifest is not JSON ({e})."
            ) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{source} is not a dtype_policies checkpoint (no manifest).")
        version = data.get("format_version")
        if (
            not isinstance(version, int)
            or isinstance(version, bool)
            or version > FORMAT_VERSION
            or version < 1
        ):
            raise CheckpointError(
                f"{source} has format version {version!r}; this dtype_policies reads versions "
                f"1 to {FORMAT_VERSION}. Upgrade dtype_policies to read it."
            )
        try:
            manifest = cls._checked(data, version)
            manifest._check_policies()
        except _Malformed as e:
            raise CheckpointError(f"{source}: malformed dtype_policies manifest: {e}.") from None
        return manifest

    def _check_policies(self) -> None:
        """Every policy and quantization config the manifest names can be
        read (else the error would name neither the file nor the entry)."""
        reads: list[tuple[str, Callable[[], Any]]] = [
            *((f"'modules' entry '{k}'", record.options) for k, record in self.modules.items()),
            *(
                (f"'layers' entry '{k}'", functools.partial(layer_policy, record))
                for k, record in self.layers.items()
            ),
            *(
                (f"'quantized' entry '{k}'", record.checked_config)
                for k, record in self.quantized.items()
            ),
        ]
        for what, read in reads:
            try:
                read()
            except (ValueError, TypeError, KeyError) as e:
                raise _Malformed(f"{what}: {str(e).rstrip('.')}") from None

    @classmethod
    def _checked(cls, data: dict[str, Any], version: int) -> Manifest:
        """The manifest in `data`, every field checked for its JSON type."""
        aliases = _str_map(data, "aliases", str)
        for alias, key in aliases.items():
            if alias == key:
                raise _Malformed(f"'aliases' maps '{alias}' to itself")
        buffers = data.get("buffers")
        return cls(
            library_version=_typed(data.get("library_version"), str, "'library_version'"),
            modules={
                k: _record(ModuleRecord, v, _MODULE_TYPES, f"'modules' entry '{k}'")
                for k, v in _str_map(data, "modules", dict).items()
            },
            layers=_str_map(data, "layers", dict),
            quantized={
                k: _record(QuantizedRecord, v, _QUANTIZED_TYPES, f"'quantized' entry '{k}'")
                for k, v in _str_map(data, "quantized", dict).items()
            },
            aliases=aliases,
            non_persistent=_strings(data.get("non_persistent"), "'non_persistent'"),
            buffers=None if buffers is None else _strings(buffers, "'buffers'"),
            classes=_str_map(data, "classes", str, required=False),
            experts=_strings(data.get("experts", []), "'experts'"),
            policy_maps=[
                _typed(m, dict, f"'policy_maps' entry {i}")
                for i, m in enumerate(_typed(data.get("policy_maps", []), list, "'policy_maps'"))
            ],
            layer_maps={
                k: _record(LayerMap, v, _LAYER_MAP_TYPES, f"'layer_maps' entry '{k}'")
                for k, v in _str_map(data, "layer_maps", dict, required=False).items()
            },
            format_version=version,
        )


class _Malformed(Exception):
    """A manifest field of the wrong JSON type (reported as a CheckpointError)."""


_TYPE_NAMES = {str: "a string", bool: "true or false", int: "an integer", dict: "an object",
               list: "a list", type(None): "null"}  # fmt: skip


def _typed(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # JSON's true/false are not integers here
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        expected = " or ".join(_TYPE_NAMES[k] for k in kinds)
        raise _Malformed(f"{what} must be {expected}, not {value!r}")
    return value


def _str_map(data: dict, key: str, values: type, required: bool = True) -> dict[str, Any]:
    if key not in data and not required:
        return {}
    if key not in data:
        raise _Malformed(f"'{key}' is missing")
    found = _typed(data[key], dict, f"'{key}'")
    for name, value in found.items():
        _typed(value, values, f"'{key}' entry '{name}'")
    return dict(found)


def _strings(value: Any, what: str) -> list[str]:
    return [
        _typed(item, str, f"{what} entry {i}") for i, item in enumerate(_typed(value, list, what))
    ]


def _record(record: type, value: Any, types: dict[str, Any], what: str) -> Any:
    """The dataclass `record` made from `value`, an object holding its fields
    (those without a default required), each of its JSON type in `types` (a
    list's items of the type in `_ITEMS`)."""
    _typed(value, dict, what)
    unknown = sorted(set(value) - set(types))
    if unknown:
        raise _Malformed(f"{what} has unknown fields {unknown}")
    for declared in dataclasses.fields(record):
        name = declared.name
        if name not in value:
            if declared.default is dataclasses.MISSING:
                raise _Malformed(f"{what} lacks '{name}'")
            continue
        if isinstance(_typed(value[name], types[name], f"{what}: '{name}'"), list):
            for i, item in enumerate(value[name]):
                _typed(item, _ITEMS[name], f"{what}: '{name}' entry {i}")
    return record(**value)


# The JSON type of each field of the records (their names are the dataclasses').
_MODULE_TYPES = {
    "policy": dict, "island": bool, "half_inputs_ok": bool, "norm": bool, "gather": bool,
    "cast_buffers": bool, "weight_cache": bool, "outputs": (str, type(None)),
}  # fmt: skip
_QUANTIZED_TYPES = {
    "mode": str, "config": dict, "weight": str, "layout": str, "role": str,
    "float_shape": list, "float_dtype": str, "stored": list,
}  # fmt: skip
_LAYER_MAP_TYPES = {"map": int, "path": str}
_ITEMS = {"float_shape": int, "stored": str}
"""The type of the items of the records' list fields."""


def describe(module: torch.nn.Module, library_version: str) -> Manifest:
    """The manifest of `module` as it is now."""
    buffers: list[str] = []
    manifest = Manifest(library_version=library_version, buffers=buffers)
    map_indices: dict[int, int] = {}  # id of a map -> its index in `policy_maps`
    for name, submodule in module.named_modules():
        manifest.classes[name] = class_name(submodule)
        if expanded(submodule):
            manifest.experts.append(name)
        if isinstance(submodule, Layer):
            manifest.layers[name] = serialize(resolved_policy(submodule))
            in_force = submodule.dtype_policy
            if in_force.is_map and submodule.path is not None:
                if id(in_force) not in map_indices:
                    map_indices[id(in_force)] = len(manifest.policy_maps)
                    manifest.policy_maps.append(serialize(in_force))
                manifest.layer_maps[name] = LayerMap(map_indices[id(in_force)], submodule.path)
        else:
            options = top_options(submodule)
            # quantize()'s own application is rebuilt with the quantized record
            # from the loaded weight's dtype (it follows `from_pretrained(dtype=)`)
            if options is not None and not computes_in_own_dtype(submodule):
                manifest.modules[name] = ModuleRecord.of(options)
        quantized = quantization_of(submodule)
        if quantized is not None:
            spec = quantized.spec
            manifest.quantized[name] = QuantizedRecord(
                mode=quantized.mode,
                config=serialize_config(quantized.config),
                weight=spec.weight,
                layout=spec.layout,
                role=spec.role,
                float_shape=list(spec.float_shape),
                float_dtype=str(quantized.float_dtype).removeprefix("torch."),
                stored=sorted(quantized.stored_names),
            )
        not_saved = non_persistent_buffer_names(submodule)
        for buffer_name in not_saved:
            manifest.non_persistent.append(_join(name, buffer_name))
        stored = set() if quantized is None else quantized.stored_names
        for buffer_name, _ in submodule.named_buffers(recurse=False):
            if buffer_name not in not_saved and buffer_name not in stored:
                buffers.append(_join(name, buffer_name))
    return manifest


def class_name(module: torch.nn.Module) -> str:
    """The module's own class name, without this library's mixins or FSDP2's
    `FSDP<class>` wrapper class."""
    cls = original_class(module)
    wrapped = class_under_fsdp(cls)
    if wrapped is not cls:
        cls = original_of(wrapped)
    return cls.__name__


def layer_policy(record: dict[str, Any]) -> DTypePolicy:
    return deserialize(record)


def _join(module_name: str, tensor_name: str) -> str:
    return f"{module_name}.{tensor_name}" if module_name else tensor_name
