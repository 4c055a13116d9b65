"""Reading the per-layer dtype policies of a Keras 3 `.keras` archive.

`policy_map_from_keras(path)` opens the archive (a zip), parses its
`config.json` and nothing else (no weights, no `import keras`, no code from the
archive), and returns a `DTypePolicyMap` from each layer's Keras `layer.path` to
its policy.

How Keras gives paths (`keras/src/layers/layer.py`: `build` runs inside
`name_scope(layer.name)`, and `layer.path` is the `/`-joined scope stack at that
moment), checked against Keras 3.15 models saved and reloaded:

* A layer of a Functional model is built when the model is constructed, when it
  is called on a `keras.Input` outside any scope: its path is its bare name
  (`"dense_4"`), also inside a Functional nested in another model
  (`"fdense"`, not `"finner/fdense"`).
* A layer of a Sequential model is built inside the Sequential's `build`:
  `"sequential/dense"`, `"inner/dense_2"` for a Sequential nested in a
  Functional, `"outer/inner/dense"` for one nested in a Sequential.
* A layer held by another layer or by a subclassed model (a sublayer that the
  parent's `get_config` lists, a `TimeDistributed`/`Bidirectional` wrapped
  layer) is built inside its parent's build or call:
  `"my_model/encoder"`, `"time_distributed/dense"`,
  `"bidirectional/forward_lstm"`.
* Sublayers that a built-in layer creates itself and does not list in its
  config: `MultiHeadAttention` and `GroupedQueryAttention` build EinsumDense
  sublayers `query`, `key`, `value` (`gate` when `use_gate`) and
  `attention_output` with their own `dtype` (`"mha/query"`), and `LSTM`, `GRU`,
  `SimpleRNN`, `ConvLSTM1D/2D/3D` build a cell (`"lstm/lstm_cell"`) with their
  own `dtype`. Their Softmax and Dropout have no path in Keras (`None`: layers
  without a `build` are never built in a scope), so they get no key.
* `InputLayer`s have no path (and their `dtype` is the input tensor's dtype,
  not a policy): they get no key. Other layers without a `build` (`Dropout`,
  `Activation`, ...) have no path either, but the config does not say which
  layers these are: they get a key that no Keras layer has.

The same layer can have other paths, and with `include_other_paths=True` (the
default) the map holds them too, as extra exact keys with the same policy,
unless one is the path of another layer or stands for layers with different
policies (then it is left out):

* `keras.saving.load_model` builds every layer config that carries a
  `build_config` as soon as it is deserialized, before any parent scope is
  open, so in the reloaded model the layers of a Sequential, a wrapper's
  inner layer and the layers a subclassed model deserializes get their bare
  name (`"dense"`, `"forward_lstm"`, `"forward_lstm/lstm_cell"`) instead of
  `"sequential/dense"`, ...
* A Sequential made with an `Input` is built when it is constructed: nested
  in another Sequential or in a subclassed model, its layers have the path
  from its own name on (`"inner/dense"`, not `"outer/inner/dense"`).
"""

from __future__ import annotations

import collections
import json
import os
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, cast

from dtype_policies._modes import KERAS_ONLY_MODES
from dtype_policies.policies import DTypePolicy, DTypePolicyMap, deserialize, get
from dtype_policies.policies.dtype_policy import POLICY_CLASSES

__all__ = ["policy_map_from_keras"]

_CONFIG_NAME = "config.json"
_MAX_CONFIG_BYTES = 256 * 2**20  # config.json of real models is kilobytes to a few megabytes

# Built-in layers that build sublayers from their own `dtype` without listing
# them in their config (names from keras/src/layers/attention and layers/rnn).
_ATTENTION_CLASSES = frozenset(
    {"MultiHeadAttention", "GroupedQueryAttention", "GroupQueryAttention"}
)
_RNN_CELL_NAMES = {
    "LSTM": "lstm_cell",
    "GRU": "gru_cell",
    "SimpleRNN": "simple_rnn_cell",
    "ConvLSTM1D": "conv_lstm_cell",
    "ConvLSTM2D": "conv_lstm_cell",
    "ConvLSTM3D": "conv_lstm_cell",
}

# Policy dicts have a "config" with a "name" too; they are never layers.
_POLICY_CLASS_NAMES = frozenset(POLICY_CLASSES) | frozenset(KERAS_ONLY_MODES.values())
# Keys of a serialized object (outside its "config") that hold no sublayers.
_NODE_KEYS_WITHOUT_LAYERS = frozenset(
    {"build_config", "compile_config", "inbound_nodes", "module", "registered_name", "name"}
)
# Keys of a layer's "config" that hold no sublayers ("dtype" is read separately).
_CONFIG_KEYS_WITHOUT_LAYERS = frozenset({"dtype", "input_layers", "output_layers"})

_NO_DTYPE = object()  # the layer config has no "dtype" key (Functional models)


def policy_map_from_keras(
    path: str | os.PathLike, *, include_other_paths: bool = True
) -> DTypePolicyMap:
    """Returns a `DTypePolicyMap` of the layer policies saved in a `.keras` archive.

    Only `config.json` is read. Each layer found in it gets an exact key, its
    Keras `layer.path` in the model that was saved (see the module docstring
    for the rules), with the policy Keras gives that layer:

    * a string `dtype` (Keras 3.0-3.3 and Keras 2 archives write
      `"mixed_float16"`) is a policy name; a dict is a serialized policy
      (`DTypePolicy`, `FloatDTypePolicy`, `QuantizedDTypePolicy`,
      `Int4DTypePolicy`, `QuantizedFloat8DTypePolicy`, or a Keras 2
      `{"class_name": "Policy"}`); `null` means the default policy in force,
      as Keras resolves it at load time.
    * a `DTypePolicyMap` dict (a layer or model built with `dtype=` a map, or a
      composite layer whose `get_config` records its quantized sublayers, as
      Keras recommends) is resolved by the layer's own path, with the map's
      rules (exact key, else the one regex key that fullmatches, else the map's
      default); if no key matches the saved path but one matches another path
      of the layer, that entry wins (the map was written by a model whose
      layers had that path). Each other path gets the map's answer for it,
      which is what Keras gives the layer that has it: the key `"tower/norm"`
      of a subclassed model's map does not reach the `"norm"` of the model
      `load_model` rebuilds. The entries of such maps are also copied into the result
      (the first map wins for a key written twice), so quantized sublayers
      that a config does not list, e.g. `"block/mha/query"`, keep their policy.
      A `null` default or `source_name` in such a map (Keras writes these for
      `DTypePolicyMap()` created without a default) takes the default policy in
      force, as Keras does at load time: call this function inside
      `dtype_policies.policy_scope(...)` to choose it.

    Keys are literal paths. A path without regex metacharacters (one that
    `re.escape` leaves alone: letters, digits, `_`, `/`, as in every name Keras
    generates) is its own key and, as a regex, fullmatches only itself; any
    other path is stored as `re.escape(path)`, so that no key
    matches another layer's path by regex (and `"block.1"` does not match
    `"blockx1"`); such a key still finds its layer: the exact lookup misses and
    the escaped regex fullmatches. Keys copied from maps in the archive are kept
    as Keras wrote them (they may be regexes on purpose).

    The map's default policy (for paths without a key) is the model's own
    policy when the config records one (Sequential and subclassed models; the
    map's default if it is a map). A Functional model's config records none;
    the default is then the most common layer policy, a quantized policy
    counting as its source policy (`"int8_from_float32"` as `"float32"`: Keras
    quantizes layer by layer, and a layer the archive does not describe must
    not be quantized by default); the first one seen wins a tie; a model
    without layers gets the default policy in force.

    Limits: only what `config.json` holds can be read. A subclassed model or
    layer whose `get_config` does not list its sublayers gives no key for them
    (they get the default policy) unless a map in the archive names them. Paths
    are those of the usual construction, in which a parent builds its
    sublayers: a layer built before it was added to a Sequential or to a
    subclassed model had a shorter path, found only among the other paths.
    Built-in layers with sublayers missing from their config are known by
    class name (attention and recurrent layers, see the module docstring); a
    custom subclass of them is not. Keras 3.15 does not save the quantized policies of the
    sublayers of a `MultiHeadAttention` whose own `dtype` is a plain policy
    (`model.quantize()` changes them, its `get_config` writes its own policy,
    and `keras.saving.load_model` then fails on the variable count): those
    sublayers get the attention layer's policy, which is what `config.json`
    says.

    Args:
        path: A `.keras` file.
        include_other_paths: Also add the other paths Keras can give the same
            layers (in the model `keras.saving.load_model` rebuilds, or when a
            nested Sequential was built on its own; see the module docstring).

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: `path` is not a zip file, has no `config.json`, or its
            config is not valid JSON, does not describe a Keras model, or holds a
            dtype policy this library cannot read (an unknown class, a ternary
            policy, an invalid name). GPTQ and AWQ policies are read.

    >>> import json, pathlib, tempfile, zipfile
    >>> archive = pathlib.Path(tempfile.mkdtemp()) / "model.keras"
    >>> dense = {"class_name": "Dense", "config": {"name": "head", "dtype": "mixed_bfloat16"}}
    >>> config = {"class_name": "Sequential", "config": {"name": "seq", "layers": [dense]}}
    >>> with zipfile.ZipFile(archive, "w") as z:
    ...     z.writestr("config.json", json.dumps(config))
    >>> policy_map_from_keras(archive)["seq/head"]
    <DTypePolicy "mixed_bfloat16">
    """
    name = os.fspath(path)
    config = _read_config(name)
    reader = _Reader(name)
    try:
        reader.read_model(config)
    except RecursionError:
        raise ValueError(f"'{name}': {_CONFIG_NAME} is nested too deeply to read.") from None
    return reader.policy_map(include_other_paths)


def _read_config(name: str) -> dict[str, Any]:
    if not os.path.exists(name):
        raise FileNotFoundError(f"No such Keras archive: '{name}'")
    if os.path.isdir(name):
        raise ValueError(f"'{name}' is a directory, not a Keras .keras archive (a zip file).")
    if not zipfile.is_zipfile(name):
        raise ValueError(f"'{name}' is not a Keras .keras archive: it is not a zip file.")
    try:
        with zipfile.ZipFile(name) as archive:
            try:
                info = archive.getinfo(_CONFIG_NAME)
            except KeyError:
                raise ValueError(
                    f"'{name}' is a zip file without '{_CONFIG_NAME}': not a Keras 3 .keras "
                    f"archive (it holds {sorted(archive.namelist())[:10]})."
                ) from None
            if info.file_size > _MAX_CONFIG_BYTES:
                raise ValueError(
                    f"'{name}': {_CONFIG_NAME} is {info.file_size} bytes, more than the "
                    f"{_MAX_CONFIG_BYTES} bytes a model config can reasonably be."
                )
            raw = archive.read(info)
    # zlib.error: a damaged compressed entry; RuntimeError: an encrypted one
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        NotImplementedError,
        OSError,
        zlib.error,
        RuntimeError,
    ) as e:
        raise ValueError(f"'{name}': cannot read {_CONFIG_NAME} from the zip file: {e}") from None
    try:
        config = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"'{name}': {_CONFIG_NAME} is not UTF-8 text: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"'{name}': {_CONFIG_NAME} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"'{name}': {_CONFIG_NAME} is nested too deeply to read.") from None
    if not _is_layer(config, root=True):
        raise ValueError(
            f"'{name}': {_CONFIG_NAME} does not describe a Keras model: expected an object "
            "with 'class_name' and a 'config' holding a 'name'. "
            + (
                f"Received top-level keys: {sorted(config)[:10]}"
                if isinstance(config, dict)
                else f"Received a JSON {type(config).__name__}."
            )
        )
    return config


def _is_layer(node: Any, root: bool = False) -> bool:
    """Whether `node` is a serialized Keras layer (or model)."""
    if not isinstance(node, dict):
        return False
    class_name, config = node.get("class_name"), node.get("config")
    if not isinstance(class_name, str) or not isinstance(config, dict):
        return False
    if not isinstance(config.get("name"), str) or class_name in _POLICY_CLASS_NAMES:
        return False
    # Layer.get_config always writes "trainable" and "dtype"; a model's custom
    # get_config may write neither, but then it is the root or has a build_config.
    return (
        root
        or any(key in config for key in ("trainable", "dtype", "layers"))
        or ("build_config" in node)
    )


def _key(path: str) -> str:
    """The map key for a literal layer path (see `policy_map_from_keras`)."""
    escaped = re.escape(path)
    return path if escaped == path else escaped


@dataclass
class _Layer:
    saved_path: str
    other_paths: list[str]  # the reload path, then standalone-Sequential paths
    where: str  # for error messages
    dtype: Any = _NO_DTYPE  # a DTypePolicy (maybe a map), or _NO_DTYPE
    policy: DTypePolicy | None = None  # resolved


def _other_paths(
    saved_path: str, reload_path: str, sequential_starts: tuple[int, ...]
) -> list[str]:
    """The reload path, then the path from each nested Sequential ancestor on."""
    parts = saved_path.split("/")
    paths = [reload_path, *("/".join(parts[start:]) for start in sequential_starts)]
    return [p for p in dict.fromkeys(paths) if p != saved_path]


@dataclass
class _Reader:
    archive: str
    layers: list[_Layer] = field(default_factory=list)
    root_dtype: Any = _NO_DTYPE
    archive_maps: list[DTypePolicyMap] = field(default_factory=list)
    _seen_shared: set = field(default_factory=set)

    def read_model(self, config: dict[str, Any]) -> None:
        name = config["config"]["name"]
        root = self._visit_layer(config, name, name, (), is_root=True)
        self.root_dtype = root.dtype if root is not None else _NO_DTYPE
        for layer in self.layers:
            layer.policy = self._resolve(layer)

    # -- walking the config -------------------------------------------------
    def _visit_layer(
        self,
        node: dict[str, Any],
        saved_path: str,
        reload_path: str,
        sequential_starts: tuple[int, ...],
        is_root: bool = False,
    ) -> _Layer | None:
        """Records the layer `node` and its sublayers.

        `sequential_starts` are the indices, in `saved_path.split("/")`, of the
        names of the Sequential models (other than the root) this layer is in: a
        Sequential with an `Input` is built when it is constructed, outside any
        scope, so its layers can have the path from its name on.
        """
        shared = node.get("shared_object_id")
        if shared is not None:  # a layer used in several places has one path: its first
            if shared in self._seen_shared:
                return None
            self._seen_shared.add(shared)
        class_name = node["class_name"]
        config = node["config"]
        if class_name == "InputLayer":
            return None
        layer = _Layer(
            saved_path,
            _other_paths(saved_path, reload_path, sequential_starts),
            f"layer '{saved_path}' ({class_name})",
        )
        if "dtype" in config:
            layer.dtype = self._read_policy(config["dtype"], layer.where)
        self.layers.append(layer)

        has_layer_list = isinstance(config.get("layers"), list)
        functional = has_layer_list and "input_layers" in config
        sequential = class_name == "Sequential" or (has_layer_list and not functional)
        child_starts = sequential_starts
        if sequential and not is_root:
            child_starts = (*sequential_starts, saved_path.count("/"))
        for child in self._child_layers(node):
            child_name = child["config"]["name"]
            if functional:  # built at the Functional's construction, outside any scope
                self._visit_layer(child, child_name, child_name, ())
            else:  # built in this layer's build or call scope
                # ...but load_model builds a layer from its build_config first.
                child_reload = (
                    child_name if "build_config" in child else f"{reload_path}/{child_name}"
                )
                self._visit_layer(child, f"{saved_path}/{child_name}", child_reload, child_starts)

        for sub_name in self._implicit_sublayers(class_name, config):
            sub_path = f"{saved_path}/{sub_name}"
            self.layers.append(
                _Layer(
                    sub_path,
                    _other_paths(sub_path, f"{reload_path}/{sub_name}", sequential_starts),
                    f"layer '{sub_path}' (built by {class_name})",
                    layer.dtype,
                )
            )
        return layer

    def _child_layers(self, node: dict[str, Any]) -> list[dict[str, Any]]:
        """The layer configs nested in `node`'s config (not inside other layers)."""
        found: list[dict[str, Any]] = []

        def search(value: Any) -> None:
            if _is_layer(value):
                found.append(value)
            elif isinstance(value, dict):
                for key, item in value.items():
                    if key not in _NODE_KEYS_WITHOUT_LAYERS:
                        search(item)
            elif isinstance(value, list):
                for item in value:
                    search(item)

        for key, value in node["config"].items():
            if key not in _CONFIG_KEYS_WITHOUT_LAYERS:
                search(value)
        return found

    @staticmethod
    def _implicit_sublayers(class_name: str, config: dict[str, Any]) -> list[str]:
        if class_name in _ATTENTION_CLASSES:
            gate = ["gate"] if config.get("use_gate") else []
            return ["query", "key", *gate, "value", "attention_output"]
        if class_name in _RNN_CELL_NAMES:
            return [_RNN_CELL_NAMES[class_name]]
        return []

    # -- policies -----------------------------------------------------------
    def _read_policy(self, value: Any, where: str) -> DTypePolicy:
        try:
            if value is None or isinstance(value, str):
                return get(value)
            if isinstance(value, dict):
                class_name = value.get("class_name")
                inner = value.get("config")
                if class_name == "DTypePolicyMap" and isinstance(inner, dict):
                    # (its class name is 'DTypePolicyMap')
                    policy_map = cast(DTypePolicyMap, deserialize(_with_compilable_keys(value)))
                    self.archive_maps.append(policy_map)
                    return policy_map
                return deserialize(value)
            raise ValueError(
                "expected a policy name, a serialized policy dict or null, "
                f"got {type(value).__name__} {value!r}"
            )
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"'{self.archive}': cannot read the dtype policy of {where}: {e}"
            ) from None

    def _resolve(self, layer: _Layer, path: str | None = None) -> DTypePolicy | None:
        """The policy of `layer` at its saved path or, given `path`, at that path.

        A map is looked up by the path. At the saved path, a map without a key
        for it but with one for another path of the layer gives that entry (a
        map written by a model whose layers had the other paths, e.g. a reloaded
        model saved again); at another path, the map's answer for that path is
        what Keras gives a layer with that path.
        """
        policy = layer.dtype
        if policy is _NO_DTYPE:
            return None
        if not isinstance(policy, DTypePolicyMap):
            return policy
        try:
            if path is not None:
                return policy[path]
            key = policy.matching_key(layer.saved_path)
            for other in layer.other_paths:
                if key is not None:
                    break
                key = policy.matching_key(other)
        except ValueError as e:
            raise ValueError(f"'{self.archive}': {layer.where}: {e}") from None
        return policy.default_policy if key is None else policy.policy_map[key]

    # -- the result ---------------------------------------------------------
    def policy_map(self, include_other_paths: bool) -> DTypePolicyMap:
        entries: dict[str, DTypePolicy] = {}
        for layer in self.layers:
            if layer.policy is not None:
                entries.setdefault(_key(layer.saved_path), layer.policy)

        if include_other_paths:
            aliases: dict[str, DTypePolicy | None] = {}
            for layer in self.layers:
                for path in layer.other_paths if layer.policy is not None else ():
                    key, policy = _key(path), self._resolve(layer, path)
                    if key in entries:
                        continue
                    if key in aliases and aliases[key] != policy:
                        aliases[key] = None  # stands for layers with different policies
                    else:
                        aliases.setdefault(key, policy)
            entries.update({k: p for k, p in aliases.items() if p is not None})

        copied = []
        for archive_map in self.archive_maps:
            for key, policy in archive_map.policy_map.items():
                if key not in entries:
                    entries[key] = policy
                    copied.append(key)
        # A layer keyed by its escaped path ("proj\-in") that a copied regex
        # also matches ("proj-.*") would match two keys: keyed by its path as
        # it is, the exact key is found first
        for layer in self.layers:
            for path in (layer.saved_path, *layer.other_paths):
                key = _key(path)
                escaped = key != path and key in entries and path not in entries
                if escaped and any(re.fullmatch(other, path) for other in copied):
                    entries[path] = entries.pop(key)

        return DTypePolicyMap(self._default_policy(), entries)

    def _default_policy(self) -> DTypePolicy | None:
        root = self.root_dtype
        if isinstance(root, DTypePolicyMap):
            return root.default_policy
        if root is not _NO_DTYPE:
            return root
        # A quantized policy counts as its source: quantization is a decision
        # Keras makes per layer with quantizable weights, never a default.
        counts = collections.Counter(
            getattr(layer.policy, "source_policy", layer.policy)
            for layer in self.layers
            if layer.policy is not None
        )
        if not counts:
            return None  # the default policy in force
        return counts.most_common(1)[0][0]


def _with_compilable_keys(serialized_map: dict[str, Any]) -> dict[str, Any]:
    """A copy of a serialized Keras map whose keys that are not valid regexes are
    escaped (Keras accepts them as exact keys; this library compiles every key)."""
    inner = dict(serialized_map["config"])
    entries = inner.get("policy_map")
    if entries is not None and not isinstance(entries, dict):
        raise ValueError(f"a DTypePolicyMap's 'policy_map' must be a dict, got {entries!r}")
    if entries:
        fixed = {}
        for key, value in entries.items():
            try:
                re.compile(key)
            except re.error:  # JSON keys are strings
                key = re.escape(key)
            fixed[key] = value
        inner["policy_map"] = fixed
    return {**serialized_map, "config": inner}
