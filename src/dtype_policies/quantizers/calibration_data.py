"""Calibration data for GPTQ and AWQ: text or token ids turned into
`num_samples` windows of `sequence_length` tokens (Keras's `get_dataloader`),
and those windows turned into model inputs.

The dataset is an iterable (a list, a generator, a tensor or array whose
first axis is iterated) of

* strings, tokenized with the config's tokenizer: a Hugging Face tokenizer
  (called without special tokens), a Keras-style object with `tokenize`, or
  any callable from text to ids (a list, a tensor, an array, or a dict with
  `"input_ids"`);
* integer tensors, arrays or lists (pre-tokenized ids, any shape);
* dicts with `"input_ids"` (a tokenizer's output, such as a Hugging Face
  `BatchEncoding`): their ids without the positions `"attention_mask"`
  leaves out, so padding never reaches the statistics;

all concatenated into one stream of ids, repeated if shorter than
`num_samples * sequence_length`, and cut into `num_samples` windows at
evenly strided starts from token 0 (Keras's "strided" rule; Keras starts at
an offset taken from Python's per-process string hash, so its windows change
from run to run, ours do not).

Floating-point tensors (or tuples and dicts of tensors) are taken as ready
model inputs, one batch each, for models that do not read token ids (a
Hugging Face model reads them when its `main_input_name` is `"input_ids"`:
Whisper reads `"input_features"`, and refuses ids naming them).

>>> import torch
>>> windows = token_windows([torch.arange(12)], None, num_samples=3, sequence_length=4)
>>> windows
tensor([[0, 1, 2, 3],
        [3, 4, 5, 6],
        [6, 7, 8, 9]])
>>> token_windows(["abcd"], lambda text: [ord(c) for c in text], 2, 3).tolist()  # repeated
[[97, 98, 99], [100, 97, 98]]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from dtype_policies._model_tables import declared_table


def _is_text(item: Any) -> bool:
    return isinstance(item, (str, bytes))


def _is_model_input(item: Any) -> bool:
    """A floating tensor, or a tuple/dict holding one: a ready model input."""
    if isinstance(item, torch.Tensor):
        return item.is_floating_point()
    if isinstance(item, np.ndarray):
        return np.issubdtype(item.dtype, np.floating)
    if isinstance(item, Mapping):  # a tokenizer's output whatever its mask's dtype
        return "input_ids" not in item and any(_is_model_input(v) for v in item.values())
    if isinstance(item, tuple):
        return any(_is_model_input(v) for v in item)
    return False


def _floating_tensors(item: Any) -> list[Any]:
    """The floating-point tensors and arrays of a ready model input."""
    if isinstance(item, (torch.Tensor, np.ndarray)):
        return [item] if _is_model_input(item) else []
    values = item.values() if isinstance(item, Mapping) else item if isinstance(item, tuple) else ()
    return [t for v in values for t in _floating_tensors(v)]


def _holds_rows(item: Any) -> bool:
    """Whether a batch-carrying tensor of `item` holds rows (a 0-d argument,
    a timestep or a temperature, carries none)."""
    return any(
        len(t.shape) >= 1 and (t.size if isinstance(t, np.ndarray) else t.numel()) != 0
        for t in _floating_tensors(item)
    )


def _shapes(inputs: list[Any]) -> str:
    shapes = [tuple(t.shape) for item in inputs[:3] for t in _floating_tensors(item)]
    return "shapes " + ", ".join(map(str, shapes)) + (", ..." if len(inputs) > 3 else "")


def _items(dataset: Any) -> list[Any]:
    if dataset is None:
        raise ValueError("The calibration `dataset` is None: pass text or token ids.")
    if _is_text(dataset) or not hasattr(dataset, "__iter__"):
        raise TypeError(
            "The `dataset` argument must be an iterable (e.g., a list of strings, a generator, "
            f"or a NumPy array). Got type: {type(dataset).__name__}. Please pass the loaded "
            "dataset directly."
        )
    if isinstance(dataset, np.ndarray) and dataset.dtype.kind in "USO":
        dataset = dataset.reshape(-1).tolist()  # texts
    elif isinstance(dataset, (Mapping, torch.Tensor, np.ndarray)):
        return [dataset]  # one batch of inputs, or one stream of ids
    items = list(dataset)
    if not items:
        raise ValueError("Provided dataset is empty.")
    return items


def _is_hf_tokenizer(tokenizer: Any) -> bool:
    return any(
        cls.__name__ == "PreTrainedTokenizerBase" and cls.__module__.startswith("transformers")
        for cls in type(tokenizer).__mro__
    )


def tokenize(tokenizer: Any, text: str | bytes) -> np.ndarray:
    """The ids of `text` (1-D int64; bytes are decoded as UTF-8) from a
    Hugging Face tokenizer (without special tokens), a Keras-style
    `tokenize`, or a callable."""
    if tokenizer is None:
        raise ValueError(
            "The calibration dataset holds text but no `tokenizer` was given: pass a Hugging "
            "Face tokenizer or any callable from text to token ids, or pre-tokenized ids."
        )
    if isinstance(text, bytes):  # text as TensorFlow datasets give it
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"A calibration item of bytes is not UTF-8 text ({e}). Received: {text[:40]!r}"
            ) from None
    if _is_hf_tokenizer(tokenizer):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif callable(tokenizer):
        ids = tokenizer(text)
    elif hasattr(tokenizer, "tokenize"):
        ids = tokenizer.tokenize(text)
    else:
        raise TypeError(
            f"The tokenizer must be callable (text -> ids) or have `tokenize`. "
            f"Received: {type(tokenizer).__name__}"
        )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return _as_ids(ids)


def _rows(value: Any) -> list[Any] | None:
    """The rows of a list or tuple of sequences (a tokenizer's unpadded
    `input_ids` have rows of different lengths), else None."""
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(row, (list, tuple, np.ndarray, torch.Tensor)) for row in value)
    ):
        return list(value)
    return None


def _as_ids(value: Any) -> np.ndarray:
    if isinstance(value, Mapping):
        return _encoding_ids(value)
    rows = _rows(value)
    if rows is not None:
        return np.concatenate([_as_ids(row) for row in rows])
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype == object or not (
        np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    ):
        raise TypeError(
            f"Token ids must be integers. Received: {array.dtype} values "
            f"(from a {type(value).__name__})"
        )
    if np.issubdtype(array.dtype, np.floating) and (
        not np.all(np.isfinite(array)) or np.any(array != np.round(array))
    ):
        raise TypeError("Token ids must be integers. Received: non-integral floats")
    return array.reshape(-1).astype(np.int64, copy=False)


def _encoding_ids(encoding: Mapping) -> np.ndarray:
    """The ids of a tokenizer's output (`{"input_ids": ..., "attention_mask": ...}`),
    row after row, without the positions its mask leaves out (padding)."""
    if "input_ids" not in encoding:
        raise TypeError(
            "A dict in the calibration dataset is read as a tokenizer's output and needs "
            f"'input_ids' (or floating-point model inputs). Received keys: {sorted(encoding)}"
        )
    ids = _as_ids(encoding["input_ids"])
    mask = encoding.get("attention_mask")
    if mask is None:
        return ids
    id_rows, mask_rows = _rows(encoding["input_ids"]), _rows(mask)
    if id_rows is not None and mask_rows is not None and len(id_rows) == len(mask_rows):
        return np.concatenate(
            [
                _encoding_ids({"input_ids": i, "attention_mask": m})
                for i, m in zip(id_rows, mask_rows)
            ]
        )
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.size != ids.size:
        raise ValueError(
            f"The calibration dict's attention_mask has {mask.size} entries for "
            f"{ids.size} input_ids (shapes {tuple(mask.shape)} and "
            f"{tuple(np.shape(encoding['input_ids']))})."
        )
    return ids[mask.reshape(-1) != 0]


def token_windows(
    dataset: Iterable[Any], tokenizer: Any, num_samples: int, sequence_length: int
) -> torch.Tensor:
    """`(num_samples, sequence_length)` int64 token windows (see the module docstring)."""
    items = _items(dataset)
    pieces = [tokenize(tokenizer, item) if _is_text(item) else _as_ids(item) for item in items]
    stream = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    required = num_samples * sequence_length
    if 0 < stream.size < required:
        warnings.warn(
            f"The calibration data holds {stream.size} tokens, fewer than the "
            f"num_samples x sequence_length = {num_samples} x {sequence_length} = {required} "
            "asked: it is repeated to fill them (as Keras does), so the calibration sees "
            f"{stream.size} distinct tokens. Pass more text for a calibration that generalizes.",
            UserWarning,
            stacklevel=4,
        )
        stream = np.tile(stream, math.ceil(required / stream.size))
    max_start = stream.size - sequence_length
    if max_start < 0:
        raise ValueError(
            f"Not enough tokens to form one sample of length {sequence_length} "
            f"(have {stream.size})."
        )
    stride = max(1, (max_start + 1) // num_samples)
    starts = (np.arange(num_samples, dtype=np.int64) * stride) % (max_start + 1)
    windows = np.lib.stride_tricks.sliding_window_view(stream, sequence_length)[starts]
    return torch.from_numpy(np.ascontiguousarray(windows))


def is_huggingface_model(model: torch.nn.Module) -> bool:
    """A transformers `PreTrainedModel` (checked without importing transformers)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for cls in type(model).__mro__
    )


def _vocabulary_size(model: torch.nn.Module) -> int | None:
    """The rows of the model's input embedding table when it exposes one
    (`get_input_embeddings()`, as Hugging Face models do) or its first leaf
    module is an `nn.Embedding` (an `nn.Sequential` starting with one), else
    None."""
    if callable(getattr(model, "get_input_embeddings", None)):
        table = declared_table(model, "get_input_embeddings")  # None: a model without one
    else:
        table = next((m for m in model.modules() if not next(m.children(), None)), None)
    return table.num_embeddings if isinstance(table, torch.nn.Embedding) else None


def position_limits(model: torch.nn.Module) -> dict[str, int]:
    """The most tokens a model's config says it takes (`n_positions`,
    `max_position_embeddings`), by name; empty for a model with no config."""
    config = getattr(model, "config", None)
    return {
        name: value
        for name in ("n_positions", "max_position_embeddings")
        if isinstance(value := getattr(config, name, None), int) and value > 0
    }


def _learned_positions(model: torch.nn.Module, limits: dict[str, int]) -> int | None:
    """The positions a model's learned table of positions holds, or None:
    rotary and relative positions (Llama, T5) run past the config's limit.
    Such a table is an `nn.Embedding` other than the token table, of the
    limit's rows (GPT-2's `wpe`, BERT's; RoBERTa's starts past its padding
    index) or up to 2 more (BART's and OPT's start at 2); it holds the
    limit's positions at most."""
    tokens = declared_table(model, "get_input_embeddings")
    usable = [
        min(
            limit,
            module.num_embeddings - (0 if module.padding_idx is None else module.padding_idx + 1),
        )
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and module is not tokens
        for limit in limits.values()
        if limit <= module.num_embeddings <= limit + 2
    ]
    return min(usable) if usable else None


def _main_input(model: torch.nn.Module) -> str | None:
    """A Hugging Face model's main input (its `main_input_name`: `"input_ids"`,
    Whisper's `"input_features"`, ViT's `"pixel_values"`), else None."""
    name = getattr(model, "main_input_name", None) if is_huggingface_model(model) else None
    return name if isinstance(name, str) else None


def calibration_inputs(
    dataset: Any,
    tokenizer: Any,
    num_samples: int,
    sequence_length: int,
    model: torch.nn.Module,
    batch_size: int = 1,
) -> list[Any]:
    """The model inputs to calibrate on: the windows of ids in batches of
    `batch_size` (`(B, sequence_length)`; `{"input_ids": ..., "use_cache":
    False}` for Hugging Face models, so that no cache is shared across block
    calls), or the dataset's own floating-point model inputs (at most
    `num_samples` of them, as they are)."""
    items = _items(dataset)
    vocabulary = _vocabulary_size(model)
    main = _main_input(model)
    # an encoder-decoder's input table is its decoder's: its main input says what it reads
    reads_ids = vocabulary is not None if main is None else main == "input_ids"
    if all(_is_model_input(item) for item in items):
        inputs = [torch.as_tensor(i) if isinstance(i, np.ndarray) else i for i in items]
        if reads_ids and isinstance(inputs[0], torch.Tensor):
            raise TypeError(
                f"The calibration dataset holds floating-point tensors ({inputs[0].dtype}, "
                f"shape {tuple(inputs[0].shape)}), taken as ready model inputs, but this model "
                "reads token ids: pass text with a tokenizer, integer token ids, or dicts of "
                "model inputs (such as {'inputs_embeds': ...})."
            )
        inputs = inputs[:num_samples]
        if not any(_holds_rows(item) for item in inputs):
            raise ValueError(
                f"The calibration dataset's inputs hold no rows ({_shapes(inputs)}): "
                "nothing to calibrate on."
            )
        return inputs
    if not reads_ids and main is not None:
        raise TypeError(
            f"The calibration dataset holds text or token ids, but {type(model).__name__} "
            f"reads '{main}' (its main_input_name), not token ids: pass its inputs, "
            f"floating-point tensors or dicts of model inputs such as {{'{main}': ...}}."
        )
    windows = token_windows(items, tokenizer, num_samples, sequence_length)
    if vocabulary is not None and windows.numel():
        low, high = int(windows.min()), int(windows.max())
        if low < 0 or high >= vocabulary:
            raise ValueError(
                f"Calibration token id {low if low < 0 else high} is outside the model's "
                f"vocabulary (ids 0 to {vocabulary - 1}): was the dataset tokenized for "
                "another model?"
            )
    limits = position_limits(model)
    usable = _learned_positions(model, limits)
    if usable is not None and sequence_length > usable:
        raise ValueError(
            f"The calibration windows of {sequence_length} tokens are longer than "
            f"{type(model).__name__} takes (its config: {limits}; its table of positions "
            f"holds {usable}): lower `sequence_length` to {usable} or less (Keras's default "
            "is 512)."
        )
    batches = [windows[i : i + batch_size] for i in range(0, num_samples, batch_size)]
    if is_huggingface_model(model):
        return [{"input_ids": batch, "use_cache": False} for batch in batches]
    return batches
