"""The Hugging Face integration's hooks, which import nothing from transformers.

`import dtype_policies` installs two of them (see `huggingface.py` for why):

* a listener (`dtype_policies._core.listeners`): when `apply_policy`,
  `quantize()`, `PolicyHandle.remove()` or `saving.load` change a
  `transformers.PreTrainedModel`, the model gets (or, once nothing is left to
  describe, loses) its `quantization_config` and `hf_quantizer`, so that a
  plain `model.save_pretrained(dir)` writes a checkpoint that reloads right
  (and `save_pretrained` describes a model first when only a part of it was
  changed: `huggingface.describe_when_saving`);
* a post-import hook on `transformers.quantizers.auto`, transformers' registry
  of quantization methods: once transformers loads it (every `from_pretrained`
  needs it), the `dtype_policies` method is registered in it, so that
  `from_pretrained` of a checkpoint saved that way works in any process that
  imported `dtype_policies` - without `import dtype_policies` paying for
  importing transformers. The same hook, once `transformers.modeling_utils`
  is loaded, makes `save_pretrained` describe a model first where needed,
  also a model that never had policies in this process but was built from a
  config that describes some (`from_config(AutoConfig.from_pretrained(dir))`).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from typing import Any

from dtype_policies._core.listeners import add_listener
from dtype_policies._core.module_state import state_of

REGISTRY_MODULE = "transformers.quantizers.auto"
MODELING_MODULE = "transformers.modeling_utils"
INTEGRATION_MODULE = "dtype_policies.saving.huggingface"


def _integration() -> Any:
    return importlib.import_module(INTEGRATION_MODULE)


def on_model_changed(module: Any, minor: bool = False) -> None:
    """The listener: keeps a `PreTrainedModel`'s quantizer in step with it
    (after a minor change, when it is next read)."""
    if "transformers" not in sys.modules:  # then `module` cannot be a PreTrainedModel
        return
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(modeling_utils, "PreTrainedModel", None)
    if pretrained is None:
        return
    if isinstance(module, pretrained):
        integration = _integration()
        if not (minor and integration.defer_sync(module)):
            integration.sync(module)
        return
    if minor or not hasattr(module, "modules"):
        return  # save_pretrained describes a model again anyway
    inner = _outermost(module, pretrained)
    if inner:  # a model of the user's own, peft's PeftModel, around transformers models
        for model in inner:
            _integration().sync(model)
    elif _holds_transformers_modules(module) and has_policies(module):
        # a part of a model (its layers): the model's `save_pretrained`
        # describes it before saving
        _integration().describe_when_saving()


def _outermost(module: Any, pretrained: Any) -> list[Any]:
    """The transformers models inside `module` that no other one holds."""
    found: list[Any] = []
    inside: set[int] = set()
    modules: Any = module.modules()
    for submodule in modules:  # parents before their children
        if id(submodule) not in inside and isinstance(submodule, pretrained):
            found.append(submodule)
            inside.update(id(m) for m in submodule.modules())
    return found


def _holds_transformers_modules(module: Any) -> bool:
    """Whether `module`, holding no whole transformers model (`_outermost`
    found none), holds modules of transformers' classes: a part of a model
    (a `ModuleList` of its layers)."""
    return any(type(m).__module__.startswith("transformers.") for m in module.modules())


def has_policies(module: Any) -> bool:
    """Whether any module of `module`'s tree has dtype policies or quantization."""
    return any(state_of(submodule) is not None for submodule in module.modules())


def _guarded(action: Callable[[Any], None], what: str) -> Callable[[], None]:
    """`action(integration module)`, which must never break transformers' own
    import: an error becomes a warning naming `what` failed."""

    def run() -> None:
        try:
            action(_integration())
        except Exception as e:  # pragma: no cover - a broken transformers install
            warnings.warn(
                f"dtype_policies could not {what} ({type(e).__name__}: {e}); import "
                "dtype_policies.saving.huggingface to see why.",
                RuntimeWarning,
                stacklevel=2,
            )

    return run


# Once transformers' quantizer registry exists, importing the integration
# registers it; once its modeling module exists, `save_pretrained` is hooked.
_register = _guarded(lambda integration: None, "register its Hugging Face quantizer")
_describe_when_saving = _guarded(
    lambda integration: integration.describe_when_saving(), "hook save_pretrained"
)


# What runs right after each module executes, until it has run.
_PENDING: dict[str, Any] = {}


class _RegistryImportHook(MetaPathFinder):
    """Runs `_register` right after `transformers.quantizers.auto` executes,
    and `_describe_when_saving` after `transformers.modeling_utils` does."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        action = _PENDING.get(fullname)
        if action is None:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            if _PENDING.pop(fullname, None) is not None and not _PENDING:
                _uninstall_import_hook()
            action()

        # The loader instance belongs to this one import: wrapping its method
        # leaves every other import alone.
        loader.exec_module = exec_then_register
        return spec


_HOOK = _RegistryImportHook()


def _uninstall_import_hook() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def install() -> None:
    """Installs the listener, and registers the quantizer with transformers
    (and hooks `save_pretrained`) now if transformers' registry (modeling
    module) is loaded, else when it is (idempotent)."""
    add_listener(on_model_changed)
    for name, action in ((REGISTRY_MODULE, _register), (MODELING_MODULE, _describe_when_saving)):
        if name in sys.modules:
            _PENDING.pop(name, None)
            action()
        else:
            _PENDING[name] = action
    if _PENDING and _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
