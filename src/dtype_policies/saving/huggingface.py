"""Hugging Face transformers: `save_pretrained` / `from_pretrained` of models
with dtype policies and quantization.

A `transformers.PreTrainedModel` that `apply_policy` or `quantize()` changed
carries a `DTypePoliciesConfig` (`model.config.quantization_config`, with
`quant_method="dtype_policies"`) and a `DTypePoliciesHfQuantizer`
(`model.hf_quantizer`), kept current by a listener. So:

* `model.save_pretrained(dir)` writes, besides the usual files, this
  library's manifest (every module's policy and quantization, per module
  path; see `manifest.py`) in `config.json`, and the stored tensors of
  quantized weights under their own names (`<module>.weight_int8`, ...). For
  each int8/int4 weight it also writes a one-element int8 *sentinel* under
  the float weight's name (`<module>.weight`).
* `from_pretrained(dir)` in a process that imported `dtype_policies` rebuilds
  the quantized modules on the meta device before any tensor is read (with
  `attach.plan(..., tensors=<empty meta tensors>)`, exactly as `saving.load`
  does with the saved ones), checks the checkpoint's headers against them,
  lets transformers fill every tensor by name, then re-applies the policies.
  Outputs are bit-identical to the saved model's.
* `from_pretrained(dir)` where `dtype_policies` is not imported never loads
  garbage: transformers only warns about an unknown `quant_method`, but the
  sentinels do not fit the float weights, so it raises a size-mismatch
  `RuntimeError` (unless called with `ignore_mismatched_sizes=True`, which
  asks for re-initialized weights). A checkpoint without int8/int4 weights
  (policies only, float8) loads as the correct float model, without its
  policies.

Registration, and what `import dtype_policies` costs. `from_pretrained` finds
the `dtype_policies` method only if it is registered in transformers'
quantizer registry (`transformers.quantizers.auto`) before it reads
`config.json`. Registering means importing that registry, which imports every
quantization backend transformers has (torchao, ...): measured here, 2.6 s
(up to 5 s on a busy machine), against 0.07 to 0.15 s for `import
dtype_policies` itself, which the hooks below leave unchanged. So `import
dtype_policies` does not import transformers. Instead (`_hf_hooks.py`):

* if the registry is already imported, it registers at once;
* else it installs a post-import hook (a `sys.meta_path` finder that watches
  only that module name and removes itself once it fired): transformers
  imports its registry whenever a model class is imported, which every
  `from_pretrained` does, and the method is registered right then. So
  `import dtype_policies; AutoModelForCausalLM.from_pretrained(dir)` works in
  a fresh process, and costs nothing when transformers is never used;
* importing this module registers too (it imports transformers), the explicit
  route if some tool loads transformers' registry by other means.

The alternatives were worse: registering at `import dtype_policies` costs
every user seconds; asking users to import this module before
`from_pretrained` makes the quiet failure (an int8 checkpoint that refuses to
load) the default.

The listener (`_hf_hooks.on_model_changed`) imports nothing: it looks at a
model only if `transformers` is in `sys.modules` and the model is a
`PreTrainedModel`; only then does it import this module.

`model.is_quantized` is `True` only when some weight is stored as int8/int4
(its float weight is gone). transformers then refuses `.half()` and
`.float()` (`model.to(torch.float16)` works); policy-only and float8 models
keep `is_quantized=False` and behave like plain models. The quantizer says it
is trainable (straight-through gradients reach everything but the stored
integer weights), so `Trainer` accepts these models.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import warnings
import weakref
from typing import Any, cast

import torch

try:
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin
except ImportError as e:  # pragma: no cover - transformers missing or too old
    raise ImportError(
        "dtype_policies.saving.huggingface needs transformers with the quantizer plugin API "
        f"(transformers.quantizers.register_quantizer): {e}"
    ) from e

from dtype_policies._core.checkpoints import guard_loading
from dtype_policies._core.policy_module import is_policied, refresh
from dtype_policies._core.slots import non_persistent_buffer_names, replace_buffer
from dtype_policies._version import __version__
from dtype_policies.apply.apply import commit_application, steps_under
from dtype_policies.quantization import attach
from dtype_policies.quantization.kinds import kind_of
from dtype_policies.quantization.schemes import scheme_for
from dtype_policies.saving._hf_hooks import has_policies
from dtype_policies.saving.checkpoint import (
    dtype_code,
    plan_from_manifest,
    shard_headers,
)
from dtype_policies.saving.manifest import CheckpointError, Manifest, describe

QUANT_METHOD = "dtype_policies"
SENTINEL_DTYPE = torch.int8
"""The dtype of the one-element sentinel saved under a quantized module's
float weight name (one element: all empty tensors share a null pointer)."""

__all__ = [
    "QUANT_METHOD",
    "DTypePoliciesConfig",
    "DTypePoliciesHfQuantizer",
    "register",
    "sync",
]


class DTypePoliciesConfig(QuantizationConfigMixin):
    """The `quantization_config` of a model with dtype policies: the manifest
    of `saving.save` (every module's policy and quantization, per path).

    Args:
        manifest: A `Manifest`, its JSON text, or its JSON data (as in
            `config.json`).
    """

    def __init__(self, manifest: Manifest | str | dict | None = None, **kwargs: Any) -> None:
        method = kwargs.pop("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(
                f"DTypePoliciesConfig is for quant_method '{QUANT_METHOD}'. Received: "
                f"quant_method={method!r}"
            )
        if kwargs:
            raise TypeError(
                f"DTypePoliciesConfig got unknown fields {sorted(kwargs)} (written by a newer "
                "dtype_policies? upgrade it)."
            )
        if manifest is None:
            raise TypeError(
                "DTypePoliciesConfig needs the model's manifest: DTypePoliciesConfig(manifest=...)."
            )
        if isinstance(manifest, Manifest):
            text = manifest.to_json()
        elif isinstance(manifest, str):
            text = manifest
        elif isinstance(manifest, dict):
            text = json.dumps(manifest)
        else:
            raise TypeError(
                "DTypePoliciesConfig(manifest=...) takes a Manifest, its JSON text or its data. "
                f"Received: {type(manifest).__name__}"
            )
        parsed = Manifest.from_json(text, "the quantization_config")  # raises CheckpointError
        # (transformers' `QuantizationMethod` enum does not list this library's method)
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]
        self.manifest = json.loads(parsed.to_json())

    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest's JSON data (described again first where modules
        joined or left the model since)."""
        self._refresh()
        return self.__dict__["manifest"]

    @manifest.setter
    def manifest(self, value: dict[str, Any]) -> None:
        # what `to_dict` writes; replaced whole, never edited in place, so
        # that copies of the config share it (transformers deep-copies the
        # config of an encoder-decoder model in every forward that makes a
        # cache, and reads its `to_dict()`)
        self.__dict__["manifest"] = value
        self.__dict__[_MANIFEST_TEXT] = None

    def to_manifest(self) -> Manifest:
        return Manifest.from_json(self._manifest_text(), "the quantization_config")

    def _manifest_text(self) -> str:
        manifest = self.manifest
        text = self.__dict__.get(_MANIFEST_TEXT)
        if text is None:
            text = self.__dict__[_MANIFEST_TEXT] = json.dumps(manifest)
        return text

    def to_dict(self) -> dict[str, Any]:
        self._refresh()
        return {
            k: json.loads(self._manifest_text()) if k == "manifest" else copy.deepcopy(v)
            for k, v in self.__dict__.items()
            if not k.startswith("_")
        }

    def __iter__(self) -> Any:
        yield from self.to_dict().items()

    def __getstate__(self) -> dict[str, Any]:  # pickle: described now
        self._refresh()
        return dict(self.__dict__)

    def __deepcopy__(self, memo: dict[int, Any]) -> DTypePoliciesConfig:
        """A copy described now, sharing the manifest's data (never edited in
        place: see the `manifest` setter)."""
        self._refresh()
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        shared = ("manifest", _MANIFEST_TEXT)
        copied.__dict__.update(
            {k: v if k in shared else copy.deepcopy(v, memo) for k, v in self.__dict__.items()}
        )
        return copied

    def _refresh(self) -> None:
        """Describes the model again where modules joined or left it since
        (`defer_sync`): registrations under a large model (peft wraps every
        linear) do not describe the whole model each."""
        reference = self.__dict__.pop(_STALE_MODEL, None)
        model = None if reference is None else reference()
        if model is not None:
            manifest = describe(model, __version__)
            self.manifest = json.loads(manifest.to_json())
            _set_flags(model, manifest)


class DTypePoliciesHfQuantizer(HfQuantizer):
    """Loads and saves models described by a `DTypePoliciesConfig` (see the
    module's docstring)."""

    requires_calibration = True  # it restores saved models; it does not quantize on load
    quantization_config: DTypePoliciesConfig  # (checked in `__init__`; `sync` sets no other)

    def __init__(self, quantization_config: DTypePoliciesConfig, **kwargs: Any) -> None:
        if not isinstance(quantization_config, DTypePoliciesConfig):
            raise TypeError(
                "DTypePoliciesHfQuantizer expects a DTypePoliciesConfig. Received: "
                f"{type(quantization_config).__name__}"
            )
        if kwargs.get("pre_quantized", True) is False:
            raise ValueError(
                "A DTypePoliciesConfig describes a model saved with its policies and "
                "quantization; it cannot be passed to from_pretrained(quantization_config=...) "
                "for a float checkpoint. Load the float model, then call "
                "dtype_policies.apply_policy / dtype_policies.quantize."
            )
        super().__init__(quantization_config, **kwargs)
        self._steps: list = []  # the policies, applied once the weights are in
        self._aliases: dict[str, str] = {}  # stored tensors shared by tied modules
        self._stored: list[str] = []  # the quantized tensors the loader must fill
        self._deferred_ties: dict[str, str] = {}  # tied once the aliases are shared
        self._model: weakref.ref | None = None  # the model it describes

    # -- loading -------------------------------------------------------------------------------

    def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        manifest = self.quantization_config.to_manifest()
        source = "the dtype_policies quantization_config in config.json"
        saved_as = list(getattr(model.config, "architectures", None) or ())
        if saved_as and type(model).__name__ not in saved_as:
            source += f" (saved from {saved_as[0]}, loaded into {type(model).__name__})"
        saved = manifest
        rename = _target_names(model, manifest, saved_as)
        if rename is not None:
            manifest = manifest.renamed(rename)
        steps, plans, expansions = plan_from_manifest(model, manifest, _empty_on_meta, source)
        if rename is not None:
            steps += _steps_for_undescribed(model, manifest, model.base_model_prefix)
        header = _read_headers(kwargs.get("checkpoint_files"))
        if header is not None:
            header = _as_model_keys(model, header)
            if rename is not None:
                header = {new: v for k, v in header.items() if (new := rename(k)) is not None}
            _check_headers(model, manifest, plans, header)
        tied = _tied_keys(model)
        for expansion in expansions.values():
            expansion.attach()
        for plan in plans:
            attach.commit(plan)
            if (
                header is not None
                and _all_keys_saved(plan, header, manifest.aliases, tied)
                # non-persistent buffers (Gemma's `embed_scale`) come from the model's init
                and not non_persistent_buffer_names(plan.module)
            ):
                # every tensor of it comes from the file (transformers' flag)
                cast(Any, plan.module)._is_hf_initialized = True
        for name in manifest.experts:  # expanded: its tensors are its linears'
            model.get_submodule(name)._is_hf_initialized = True
        self._steps = steps
        self._aliases = dict(manifest.aliases)
        self._stored = [
            f"{plan.path}.{name}" if plan.path else name for plan in plans for name in plan.tensors
        ]
        gone = _integer_weights(manifest)
        untied = _untie_quantized(model, gone)
        fresh = [t for t, _ in untied if header is not None and t not in header and t not in gone]
        if fresh:
            sources = [source for target, source in untied if target in fresh]
            warnings.warn(
                f"from_pretrained: {fresh[:3]} cannot be tied to {sources[:3]}, stored as "
                "integers in the checkpoint; transformers initializes it instead (train it, "
                "or load the float checkpoint and quantize the model you load).",
                UserWarning,
                stacklevel=2,
            )
        self._deferred_ties = _defer_ties_reading_aliases(model, manifest)
        sentinels = [
            _sentinel_key(name, record)
            for written in (saved, manifest)  # as the checkpoint names them, and the model
            for name, record in _integer_records(written)
        ]
        _ignore_keys(model, "_keys_to_ignore_on_load_unexpected", sentinels)
        _ignore_keys(
            model, "_keys_to_ignore_on_load_missing", [*self._aliases, *self._deferred_ties]
        )
        _set_flags(model, manifest)
        return model

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        self._model = weakref.ref(model)
        for alias, key in self._aliases.items():
            replace_buffer(model, alias, model.get_buffer(key))
        for target, source in self._deferred_ties.items():  # as transformers ties them
            parent, _, name = target.rpartition(".")
            setattr(model.get_submodule(parent), name, model.get_parameter(source))
        self._deferred_ties = {}
        left = [key for key in self._stored if model.get_buffer(key).device.type == "meta"]
        if left:
            raise CheckpointError(
                f"from_pretrained left {len(left)} quantized tensor(s) without values: {left[:10]}"
            )
        self._stored = []
        for name, submodule in model.named_modules():
            quantized = attach.quantization_of(submodule)
            if quantized is not None:
                try:
                    quantized.check_values(submodule)
                except ValueError as e:
                    raise CheckpointError(f"from_pretrained: module '{name}': {e}") from None
        guard_loading(model)
        steps, self._steps = self._steps, []
        for submodule in model.modules():
            if is_policied(submodule):
                refresh(submodule)
        if steps:
            commit_application(model, steps, [])  # tells the listener, which calls sync
        else:
            sync(model)
        return model

    def postprocess_model(self, model: Any, **kwargs: Any) -> Any:
        result = super().postprocess_model(model, **kwargs)
        _set_flags(model, self.quantization_config.to_manifest())
        return result

    # -- saving --------------------------------------------------------------------------------

    def get_state_dict_and_metadata(self, model: Any) -> tuple[dict[str, torch.Tensor], dict]:
        """The tensors `save_pretrained` writes: the model's state dict with
        the quantized buffers shared by tied modules once, and a sentinel
        under each int8/int4 module's float weight name. Also refreshes the
        manifest (written to `config.json` after this)."""
        with attach.committing(()):  # no quantization commits between the two
            manifest = describe(model, __version__)
            state = model.state_dict()
        first: dict[tuple, str] = {}
        for name, record in manifest.quantized.items():
            prefix = f"{name}." if name else ""
            for buffer in record.stored:
                key = prefix + buffer
                tensor = state[key]
                if tensor.is_meta:  # offloaded: no storage to compare
                    continue
                identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                            tuple(tensor.shape), tensor.dtype)  # fmt: skip
                if tensor.numel() and identity in first:
                    manifest.aliases[key] = first[identity]
                    del state[key]
                else:
                    first[identity] = key
        for name, record in _integer_records(manifest):
            state[_sentinel_key(name, record)] = torch.zeros(1, dtype=SENTINEL_DTYPE)
        self.quantization_config = DTypePoliciesConfig(manifest)
        model.config.quantization_config = self.quantization_config
        _set_flags(model, manifest)
        _keep_stored_names(model, manifest, state)
        return state, {}

    def is_serializable(self, safe_serialization: Any = None) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        """Whether a linear or embedding of the model still has a float weight
        to train (a head kept float, float8's weights): transformers'
        `Trainer` refuses to fine-tune a model whose every such weight is int8
        or int4 (attach adapters, peft's LoRA, to train on it)."""
        model = None if self._model is None else self._model()
        if model is None:  # a copy's: as its model was when copied
            return bool(self.__dict__.get("_trainable_when_copied", False))
        return any(
            parameter.requires_grad and parameter.is_floating_point()
            for module in model.modules()
            if kind_of(module) is not None
            for parameter in module.parameters(recurse=False)
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_trainable_when_copied"] = self.is_qat_trainable
        state["_model"] = None  # a copy's model is another (sync or a load sets it)
        return state

    @property
    def is_compileable(self) -> bool:
        return True

    def _dequantize(self, model: Any, dtype: Any = None) -> Any:
        raise NotImplementedError(
            "dtype_policies cannot dequantize int8/int4 weights back to the original float "
            "weights; load the float checkpoint instead."
        )


def register() -> None:
    """Registers the `dtype_policies` quantization method with transformers
    (idempotent; done when this module is imported)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not DTypePoliciesConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
        register_quantization_config(QUANT_METHOD)(DTypePoliciesConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not DTypePoliciesHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(DTypePoliciesHfQuantizer)


_DESCRIBES = "_dtype_policies_describes_first"


def describe_when_saving() -> None:
    """Makes every `PreTrainedModel.save_pretrained` describe the model first
    where needed (`_describing_first`; idempotent). Called once a model has
    policies, when transformers' modeling module is loaded (never while
    transformers imports its quantizer registry, which happens inside that
    module's own import)."""
    from transformers.modeling_utils import PreTrainedModel

    if not getattr(PreTrainedModel.save_pretrained, _DESCRIBES, False):
        PreTrainedModel.save_pretrained = _describing_first(  # type: ignore[method-assign]
            PreTrainedModel.save_pretrained
        )


def _describing_first(save_pretrained: Any) -> Any:
    """`PreTrainedModel.save_pretrained`, describing the model first when
    policies or quantization were applied to a part of it that is a model of
    its own (`quantize(llm.model)`): the listener described that part, which
    has no link to the model around it, and the whole model's checkpoint
    would hold int8 tensors under a float config (transformers loads it with
    re-initialized weights and a warning)."""

    @functools.wraps(save_pretrained)
    def save(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A model built from another's config (`Model(policied.config)`,
        # `from_config(AutoConfig.from_pretrained(policied_dir))`) carries that
        # model's description without its policies: described again, it has none.
        # Described again before every save where this library describes it:
        # an application removed from a part of the model (which the
        # listener cannot trace to the model around it) left a description.
        quantizer = getattr(self, "hf_quantizer", None)
        if isinstance(quantizer, DTypePoliciesHfQuantizer) or (
            quantizer is None and (has_policies(self) or describes_policies(self.config))
        ):
            sync(self)
        return save_pretrained(self, *args, **kwargs)

    setattr(save, _DESCRIBES, True)
    return save


_STALE_MODEL = "_dtype_policies_stale_model"
_MANIFEST_TEXT = "_manifest_text_cache"


def defer_sync(model: Any) -> bool:
    """Marks `model`'s manifest out of date, where the model is described by
    this library already (modules joined or left its application): its
    `quantization_config` describes it again when read (`to_dict`, which
    `save_pretrained` and `config.json` use) or at `sync(model)`. Returns
    whether it deferred (else, `sync` now)."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if not (
        isinstance(getattr(model, "hf_quantizer", None), DTypePoliciesHfQuantizer)
        and isinstance(config, DTypePoliciesConfig)
    ):
        return False
    config.__dict__[_STALE_MODEL] = weakref.ref(model)
    return True


def sync(model: Any) -> None:
    """Makes `model.config.quantization_config` and `model.hf_quantizer`
    describe `model` as it is now: set when it has policies or quantization,
    removed when it has none. A model quantized by another method
    (bitsandbytes, torchao, ...) keeps its quantizer, with a warning."""
    from transformers.modeling_utils import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"sync() expects a transformers PreTrainedModel. Received: {type(model).__name__}"
        )
    describe_when_saving()
    current = getattr(model, "hf_quantizer", None)
    if current is not None and not isinstance(current, DTypePoliciesHfQuantizer):
        method = getattr(current.quantization_config, "quant_method", type(current).__name__)
        warnings.warn(
            f"This model is quantized with {getattr(method, 'value', method)!r} by transformers; "
            "dtype_policies leaves its hf_quantizer alone, so save_pretrained will not record "
            "the dtype policies. Use dtype_policies.saving.save instead.",
            UserWarning,
            stacklevel=4,
        )
        return
    manifest = describe(model, __version__)
    if manifest.quantized and hasattr(model, "get_expanded_tied_weights_keys"):
        # (transformers 5's tying by name; 4.x ties the modules' weights itself)
        model.__dict__["tie_weights"] = functools.partial(_tie_weights_but_quantized, model)
    else:
        model.__dict__.pop("tie_weights", None)
    if not (manifest.modules or manifest.layers or manifest.quantized):
        if current is not None:
            _own_config(model)
            current.remove_quantization_config(model)
            _set_flags(model, manifest)
        elif describes_policies(model.config):  # another model's description
            _own_config(model)
            del model.config.quantization_config
            _set_flags(model, manifest)
        return
    _own_config(model)
    config = DTypePoliciesConfig(manifest)
    if current is None:
        current = DTypePoliciesHfQuantizer(config, pre_quantized=True)
        cast(Any, model).hf_quantizer = current  # (attributes transformers reads)
    current._model = weakref.ref(model)
    current.quantization_config = config
    model.config.quantization_config = config
    cast(Any, model).quantization_method = QUANT_METHOD
    _set_flags(model, manifest)


def describes_policies(config: Any) -> bool:
    """Whether a transformers config's `quantization_config` is this
    library's (an object, or the dict `config.json` holds)."""
    found = getattr(config, "quantization_config", None)
    if isinstance(found, DTypePoliciesConfig):
        return True
    method = found.get("quant_method") if isinstance(found, dict) else None
    return getattr(method, "value", method) == QUANT_METHOD


# -- helpers -----------------------------------------------------------------------------------


_OWN_CONFIG = "_dtype_policies_own_config"


def _own_config(model: Any) -> None:
    """Gives `model` (and its submodules that share it) a config object of its
    own before its quantization config is written: models built from one
    config object share it, and another model's `save_pretrained` would
    record this model's policies."""
    shared = model.config
    if model.__dict__.get(_OWN_CONFIG) is shared:
        return
    own = copy.deepcopy(shared)
    for module in model.modules():
        if module.__dict__.get("config") is shared:
            module.config = own
    model.__dict__[_OWN_CONFIG] = own


def _integer_records(manifest: Manifest):
    """(name, record) of the quantized weights whose float weight is gone."""
    for name, record in manifest.quantized.items():
        if not scheme_for(record.mode).keeps_float_weight:
            yield name, record


def _sentinel_key(name: str, record: Any) -> str:
    return f"{name}.{record.weight}" if name else record.weight


def _set_flags(model: Any, manifest: Manifest) -> None:
    """`is_quantized` (and transformers' `config._is_quantized`) only when a
    float weight was replaced by integers."""
    integer = any(True for _ in _integer_records(manifest))
    model.is_quantized = integer
    from transformers.modeling_utils import PreTrainedModel

    for submodule in model.modules():
        if isinstance(submodule, PreTrainedModel):
            if integer:
                submodule.config._is_quantized = True
            else:
                submodule.config.__dict__.pop("_is_quantized", None)


def _empty_on_meta(key: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _read_headers(files: Any) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """`{key: (shape, dtype code)}` of the checkpoint's safetensors files (only
    their headers are read), or `None` if it has none."""
    files = [str(f) for f in (files or [])]
    if not files or not all(f.endswith(".safetensors") for f in files):
        return None
    return shard_headers(files)


def _target_names(model: Any, manifest: Manifest, saved_as: list[str]) -> Any:
    """How the manifest's paths name the modules of the target, as
    transformers maps the checkpoint's keys: a checkpoint of a task model
    (`BertForMaskedLM`, its base model under `base_model_prefix`, `bert`)
    loads into the base model (`BertModel`: the prefix is dropped) or another
    task model (`BertForSequenceClassification`), and a base model's into a
    task model (the prefix is added). The saved model's head (the paths
    outside its base model that the target does not have) leaves with its
    entries, as transformers leaves its tensors unused; the target's own head
    is not in the checkpoint and is initialized by transformers. So does a
    whole part of the base model the target was built without (a pooler:
    `add_pooling_layer=False`), for any class. Any other path inside the
    base model that the target does not have still fails to fit (a
    CheckpointError names it), and so does a checkpoint none of whose
    modules has a counterpart in the target. `None` when the model has no
    base model prefix: every path must fit."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return None
    named = dict(model.named_modules())
    modules = set(named)
    inside = f"{prefix}."
    has_base = prefix in modules
    saved_with_base = any(p == prefix or p.startswith(inside) for p in manifest.classes)
    same_class = not saved_as or type(model).__name__ in saved_as

    def kept(name: str) -> str | None:  # the same class, or task model to task model
        owner = name.rpartition(".")[0]
        owned = name in modules or (owner != "" and owner in modules)
        return name if same_class or name == prefix or name.startswith(inside) or owned else None

    def prefixed(name: str) -> str | None:  # saved from the base model
        return f"{inside}{name}" if name else prefix

    def stripped(name: str) -> str | None:  # loaded into the base model
        if name == prefix:
            return ""
        return name[len(inside) :] if name.startswith(inside) else None

    rename = kept
    if not same_class and has_base and not saved_with_base:
        rename = prefixed
    elif not same_class and not has_base and saved_with_base:
        rename = stripped
    base = prefix if has_base else ""
    resized = _resized_heads(named, manifest, rename, inside) if has_base else {}

    def target_name(name: str) -> str | None:  # a module path or a tensor key
        new = rename(name)
        if new is not None and any(new == r or new.startswith(f"{r}.") for r in resized):
            return None  # initialized by transformers, as a new head
        if new is None or new in modules:
            return new
        ancestor = new
        while ancestor and ancestor not in modules:
            ancestor = ancestor.rpartition(".")[0]
        # a whole part of the base model the target lacks, as transformers
        # leaves its tensors unused
        return None if ancestor == base and (not base or new.startswith(inside)) else new

    saved_paths = [path for path in manifest.classes if path]
    if saved_paths and all(target_name(path) is None for path in saved_paths):
        raise CheckpointError(
            f"none of the checkpoint's {len(saved_paths)} modules (saved from "
            f"{saved_as[0] if saved_as else 'another class'}, its paths starting "
            f"{sorted({p.split('.')[0] for p in saved_paths})[:3]}) has a counterpart in "
            f"{type(model).__name__} (base_model_prefix '{prefix}'): the saved class keeps its "
            "base model under another name, and transformers would load none of its weights."
        )
    return target_name


def _resized_heads(
    modules: dict[str, torch.nn.Module], manifest: Manifest, rename: Any, inside: str
) -> dict[str, str]:
    """`{path: why}` of the target's head modules (outside its base model)
    whose quantized weight was saved with another
    shape (a classifier of another `num_labels`): their saved entries leave,
    transformers initializes them (as `ignore_mismatched_sizes=True` does
    for a float checkpoint; transformers does not tell a quantizer whether
    it was passed), with a warning naming them."""
    resized = {}
    for path, record in manifest.quantized.items():
        new = rename(path)
        if new is None or new.startswith(inside) or new not in modules:
            continue
        weight = getattr(modules[new], record.weight, None)
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        if shape is not None and shape != tuple(record.float_shape):
            saved = tuple(record.float_shape)
            resized[new] = f"'{new}' ({record.mode}, saved {saved}, now {shape})"
    if resized:
        warnings.warn(
            f"The checkpoint's head {', '.join(resized.values())} has another shape in the "
            "target: its saved tensors are left out and transformers initializes it (as "
            "ignore_mismatched_sizes=True does); it computes with the policy of the modules "
            "around it, unquantized.",
            UserWarning,
            stacklevel=2,
        )
    return resized


def _steps_for_undescribed(model: Any, manifest: Manifest, prefix: str) -> list:
    """Policies for the modules of a target of another class that the
    checkpoint does not describe (a head the saved model did not have, a
    task model's root): the policy of the nearest ancestor it describes (the
    base model's, for a root), as `apply_policy` gives it (normalization
    layers in float32; a quantized policy's float source), so that they take
    the outputs of the modules around them; none where it saved none."""
    modules = dict(model.named_modules())
    described = {id(modules[path]) for path in manifest.classes if path in modules}
    fallback = manifest.modules.get("") or manifest.modules.get(prefix)
    steps = []
    for name, module in modules.items():
        if id(module) in described:
            continue
        parent = name.rpartition(".")[0]
        if name and id(modules[parent]) not in described:
            continue  # planned with the subtree it is in
        record = fallback  # a task model's root
        if name:
            ancestors = [parent]  # the nearest first, the root last
            while ancestors[-1]:
                ancestors.append(ancestors[-1].rpartition(".")[0])
            recorded = (manifest.modules[p] for p in ancestors if p in manifest.modules)
            record = next(recorded, fallback)
        if record is None:
            continue
        planned = steps_under(
            module,
            record.options().policy,
            name.replace(".", "/"),
            cast_buffers=record.cast_buffers,
            weight_cache=record.weight_cache,
        )
        steps += [step for step in planned if id(step.module) not in described]
    return steps


def _as_model_keys(model: Any, header: dict) -> dict:
    """The checkpoint's keys as the model names them: `save_pretrained` writes
    some models' tensors under their legacy names (GPT-NeoX's `embed_out`,
    ViT's `attention.attention.query`) and `from_pretrained` renames them back
    with the model's conversion mapping, as here."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:  # a transformers without conversion mappings renames nothing
        return header
    renamings = [
        transform
        for transform in get_model_conversion_mapping(model)
        if isinstance(transform, WeightRenaming)
    ]
    if not renamings:
        return header
    return {apply_renamings(key, renamings): value for key, value in header.items()}


def _keep_stored_names(model: Any, manifest: Manifest, state: dict) -> None:
    """`save_pretrained` writes a model's weights in its original checkpoint
    format by reversing its conversion mapping: converters that fuse or split
    tensors (Mixtral's experts into per-expert ones, a gated delta net's
    projections into one `in_proj`) would do so to this library's stored
    tensors (int8 data beside its scales) and to the experts it expanded into
    one linear per expert (`quantization.experts`). The converters that would
    touch them are dropped from the model's `_weight_conversions`, so that
    they are saved under the names the model has (renamings still apply), as
    its manifest describes them."""
    prefixes = tuple(f"{path}." for path in [*manifest.quantized, *manifest.experts] if path)
    keys = [key for key in state if key.startswith(prefixes)]
    if not keys:
        return
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter
    except ImportError:  # a transformers without conversion mappings converts nothing
        return
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # what save_pretrained would use for a model built here
        conversions = [
            transform
            for transform in get_model_conversion_mapping(model, add_legacy=False)
            if not isinstance(transform, PrefixChange)
        ]

    def touches_stored(transform: Any) -> bool:
        if not isinstance(transform, WeightConverter):
            return False
        reverse = transform.reverse_transform()
        return any(reverse.rename_source_key(key)[1] is not None for key in keys)

    model._weight_conversions = [t for t in conversions if not touches_stored(t)]


def _check_headers(model: Any, manifest: Manifest, plans: list, header: dict) -> None:
    """Every stored tensor the plans expect is in the checkpoint with its shape
    and dtype, and the float weight of a mode that keeps one (float8), itself
    or by a tie: otherwise transformers would leave it uninitialized (a
    random weight, reported only in its load report)."""
    problems = []
    tied = _tied_keys(model)
    for plan in plans:
        prefix = f"{plan.path}." if plan.path else ""
        if plan.scheme.keeps_float_weight:
            key = prefix + plan.spec.weight
            found = key if key in header else manifest.aliases.get(key, tied.get(key))
            expected_shape = tuple(plan.spec.float_shape)
            if found not in header:
                problems.append(f"'{key}' (the float weight {plan.mode} keeps) is missing")
            elif expected_shape and tuple(header[found][0]) != expected_shape:
                problems.append(
                    f"'{found}' (the float weight {plan.mode} keeps): checkpoint shape "
                    f"{tuple(header[found][0])}, expected {expected_shape}"
                )
        for buffer, tensor in plan.tensors.items():
            key = prefix + buffer
            if key in manifest.aliases:
                key = manifest.aliases[key]
            expected = (tuple(tensor.shape), dtype_code(tensor.dtype))
            if key not in header:
                problems.append(f"'{key}' is missing from the checkpoint")
            elif header[key] != expected:
                problems.append(f"'{key}': checkpoint {header[key]}, expected {expected}")
    if problems:
        raise CheckpointError(
            "The checkpoint does not match its dtype_policies quantization_config:\n  "
            + "\n  ".join(problems[:25])
            + _old_transformers_note()
        )


TESTED_TRANSFORMERS = (5, 23)
"""The oldest transformers this library's checkpoints were tested with
(5.20 saves GPT-NeoX's, ViT's and Mixtral's quantized heads under names of
its own, so they do not reload: measured 2026-12-06 on Python 3.10, whose
newest transformers that is)."""


def _old_transformers_note() -> str:
    import transformers

    version = transformers.__version__
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return ""
    if (major, minor) >= TESTED_TRANSFORMERS:
        return ""
    return (
        f"\n(transformers {version}: dtype_policies' Hugging Face checkpoints are tested "
        f"with transformers >= {TESTED_TRANSFORMERS[0]}.{TESTED_TRANSFORMERS[1]}; older "
        "releases save some models' tensors under other names. Upgrade transformers.)"
    )


def _all_keys_saved(plan: attach.Plan, header: dict, aliases: dict, tied: dict) -> bool:
    """Whether every tensor of the plan's module comes from the file, itself
    or through a tied module's: an alias of its stored tensors (shared again
    after loading), or a parameter transformers ties by name (`tied`, such
    as BERT's `cls.predictions.decoder.bias` to `cls.predictions.bias`).
    Otherwise transformers initializes the module, which reads its weight,
    dequantized from stored tensors not loaded yet."""
    prefix = f"{plan.path}." if plan.path else ""
    return all(
        prefix + key in header
        or aliases.get(prefix + key) in header
        or tied.get(prefix + key) in header
        for key in plan.module.state_dict()
    )


def _tie_weights_but_quantized(
    model: Any, missing_keys: set[str] | None = None, recompute_mapping: bool = True
) -> None:
    """transformers' `tie_weights` for a model with quantized weights (its
    instance's, set by `sync`): a weight stored as integers has no parameter
    to tie by name (transformers raised "is neither a parameter, buffer, nor
    extra state"; Trainer, accelerate and DeepSpeed call it), and its
    quantized tensors are shared already, so its pairs leave the mapping;
    the others are tied as transformers ties them."""
    mapping = (
        model.get_expanded_tied_weights_keys(all_submodels=True)
        if recompute_mapping
        else dict(getattr(model, "all_tied_weights_keys", None) or {})
    )
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    model.all_tied_weights_keys = {
        target: source
        for target, source in mapping.items()
        if (target in names or (missing_keys is not None and target in missing_keys))
        and (source in names or (missing_keys is not None and source in missing_keys))
    }
    type(model).tie_weights(model, missing_keys=missing_keys, recompute_mapping=False)


def _tied_keys(model: Any) -> dict[str, str]:
    """transformers' `{tied parameter: the parameter it is tied to}`."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def _untie_quantized(model: Any, gone: set[str]) -> list[tuple[str, str]]:
    """transformers ties `lm_head.weight` to the embedding's weight by name; a
    weight stored as integers (its name in `gone`) has no such parameter, so
    such pairs leave its mapping (the stored tensors are shared again after
    loading). Returns the pairs taken out."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if not tied:
        return []
    untied = [(t, s) for t, s in tied.items() if t in gone or s in gone]
    for target, _ in untied:
        del tied[target]
    return untied


def _integer_weights(manifest: Manifest) -> set[str]:
    """The float weight names of the weights stored as integers."""
    return {_sentinel_key(name, record) for name, record in _integer_records(manifest)}


def _defer_ties_reading_aliases(model: Any, manifest: Manifest) -> dict[str, str]:
    """Takes out of transformers' tied keys (and returns) the pairs whose
    target is a parameter of a module whose stored tensors are aliases:
    tying reads the module's weight (`_adjust_bias`, for BERT's decoder bias),
    dequantized from tensors that are shared only once the loading is over
    (uninitialized memory before; int4's group indices out of range). They
    are tied after the aliases are shared."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if not tied:
        return {}
    aliased = {alias.rpartition(".")[0] for alias in manifest.aliases}
    deferred = {
        target: source for target, source in tied.items() if target.rpartition(".")[0] in aliased
    }
    for target in deferred:
        del tied[target]
    return deferred


def _ignore_keys(model: Any, attribute: str, keys: list[str]) -> None:
    if not keys:
        return
    patterns = set(getattr(model, attribute, None) or ())
    patterns.update(f"^{re.escape(key)}$" for key in keys)
    setattr(model, attribute, patterns)


register()
