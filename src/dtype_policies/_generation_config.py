"""The generation config `compile_for_generation` gives a model: in force,
a static cache and the compiled decode step; saved, what the model had.

`save_pretrained` writes `generation_config.json` from the model's
generation config; a checkpoint of a compiled model would otherwise make
every later load decode eagerly on a static cache, in any process.

>>> from transformers import GenerationConfig
>>> config = GenerationConfig(max_new_tokens=8)
>>> compiled_generation_config(config, cache_implementation="static")
>>> config.cache_implementation, "cache_implementation" in config.to_json_string()
('static', False)
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

_SAVED = "_dtype_policies_saved"  # the values it had, restored in what is written


class CompiledGenerationConfig(GenerationConfig):
    """A `GenerationConfig` whose written form keeps the values it had
    before `compiled_generation_config` set others."""

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output.pop(_SAVED, None)
        return output

    def to_json_string(
        self, use_diff: bool = True, ignore_metadata: bool = False, keys_to_pop: Any = None
    ) -> str:
        written = GenerationConfig.__new__(GenerationConfig)
        state = {key: value for key, value in self.__dict__.items() if key != _SAVED}
        written.__dict__.update({**state, **self.__dict__.get(_SAVED, {})})
        return written.to_json_string(use_diff, ignore_metadata, keys_to_pop)


def compiled_generation_config(config: GenerationConfig, **values: Any) -> None:
    """Sets `values` on `config` (in place: the model's own object) for the
    generations, keeping its earlier values for what is written."""
    saved = dict(config.__dict__.get(_SAVED, {}))
    for key, value in values.items():
        saved.setdefault(key, getattr(config, key, None))
        setattr(config, key, value)
    config.__dict__[_SAVED] = saved
    if not isinstance(config, CompiledGenerationConfig):
        config.__class__ = CompiledGenerationConfig
