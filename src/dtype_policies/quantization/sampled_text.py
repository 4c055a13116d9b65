"""Calibration text without a dataset: token ids sampled from the model itself.

GPTQ and AWQ need activations of text the model reads. When no text is at
hand, text the model writes serves nearly as well: on SmolLM2-135M,
awq/4/128 calibrated on 16 x 512 tokens the model sampled from its
start-of-sequence token gave perplexity 28.14 and KL 0.151, against 27.49 and
0.162 on 16 x 512 tokens of real text and 31.68 and 0.347 for data-free
round to nearest (docs/quantization.md). Uniformly random ids are no
substitute (29.78): the text must be fluent, not real.
"""

from __future__ import annotations

from typing import Any

import torch

from dtype_policies._model_tables import declared_table
from dtype_policies.quantizers.calibration_data import is_huggingface_model

_CHUNK = 32
"""Sequences generated together (one batched `generate` each)."""


def sampled_token_ids(
    model: torch.nn.Module,
    num_samples: int = 16,
    sequence_length: int = 512,
    *,
    seed: int = 0,
    temperature: float = 1.0,
    top_p: float = 0.95,
) -> torch.Tensor:
    """`num_samples` sequences of `sequence_length` token ids sampled from
    `model` (a Hugging Face model that generates), each from its
    start-of-sequence token: calibration data for `GPTQConfig` and
    `AWQConfig` (`dataset=ids`) when no text is at hand.

    The sampling is reproducible (`seed`; the global random state is left as
    it was) and the model is left as it was (its training flag included).
    Generation runs in the model's current precision, batched, under
    `torch.inference_mode()`; on a 135M model, 16 x 512 tokens take seconds
    to a minute on 2 cores.

    Args:
        model: A transformers model with `generate` (a causal LM).
        num_samples: Sequences to sample, a positive int.
        sequence_length: Tokens per sequence (the start token included),
            an int of at least 2.
        seed: The sampling's seed.
        temperature: The sampling temperature, > 0.
        top_p: Nucleus sampling's probability mass, in (0, 1].

    Raises:
        TypeError: `model` cannot generate, or an argument of the wrong type.
        ValueError: An argument out of range, or a model without a start
            (or end) token to begin from.

    >>> import transformers
    >>> config = transformers.LlamaConfig(
    ...     hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...     num_attention_heads=2, vocab_size=100, bos_token_id=1)
    >>> model = transformers.LlamaForCausalLM(config)
    >>> ids = sampled_token_ids(model, num_samples=2, sequence_length=8)
    >>> ids.shape, ids.dtype, bool((ids[:, 0] == 1).all())
    (torch.Size([2, 8]), torch.int64, True)
    >>> torch.equal(ids, sampled_token_ids(model, num_samples=2, sequence_length=8))
    True
    """
    _check_arguments(num_samples, sequence_length, seed, temperature, top_p)
    generate: Any = getattr(model, "generate", None)
    if not (is_huggingface_model(model) and callable(generate)):
        raise TypeError(
            "sampled_token_ids() needs a transformers model that generates (a causal LM "
            f"with `generate`). Received: {type(model).__name__}"
        )
    start = _start_token(model)
    was_training = model.training
    chunks = []
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(seed)
        model.eval()
        try:
            for first in range(0, num_samples, _CHUNK):
                rows = min(_CHUNK, num_samples - first)
                prompt = torch.full((rows, 1), start, dtype=torch.long, device=_device(model))
                out = generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    do_sample=True,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=0,
                    max_new_tokens=sequence_length - 1,
                    min_new_tokens=sequence_length - 1,
                    pad_token_id=start,
                )
                chunks.append(out[:, :sequence_length].to("cpu", torch.long))
        finally:
            model.train(was_training)
    return torch.cat(chunks)


def _check_arguments(
    num_samples: Any, sequence_length: Any, seed: Any, temperature: Any, top_p: Any
) -> None:
    for name, value, least in (
        ("num_samples", num_samples, 1),
        ("sequence_length", sequence_length, 2),
        ("seed", seed, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(
                f"sampled_token_ids(): `{name}` must be an int. Received: {name}={value!r}"
            )
        if value < least:
            raise ValueError(
                f"sampled_token_ids(): `{name}` must be >= {least}. Received: {name}={value!r}"
            )
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(
                f"sampled_token_ids(): `{name}` must be a number. Received: {name}={value!r}"
            )
    if not temperature > 0 or temperature == float("inf"):
        raise ValueError(
            f"sampled_token_ids(): `temperature` must be > 0 and finite. Received: {temperature!r}"
        )
    if not 0 < top_p <= 1:
        raise ValueError(f"sampled_token_ids(): `top_p` must be in (0, 1]. Received: {top_p!r}")


def _start_token(model: torch.nn.Module) -> int:
    """The token each sequence starts from: the model's start-of-sequence
    token, else its end-of-sequence one (text after a document's end)."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        for name in ("bos_token_id", "eos_token_id"):
            token = getattr(source, name, None)
            if isinstance(token, (list, tuple)):
                token = token[0] if token else None
            if isinstance(token, int) and not isinstance(token, bool) and token >= 0:
                _check_in_vocabulary(model, token, name)
                return token
    raise ValueError(
        f"sampled_token_ids(): {type(model).__name__} names no start-of-sequence or "
        "end-of-sequence token (bos_token_id, eos_token_id) to start the samples from."
    )


def _check_in_vocabulary(model: torch.nn.Module, token: int, name: str) -> None:
    embeddings = declared_table(model, "get_input_embeddings")
    size = getattr(embeddings, "num_embeddings", None)
    if isinstance(size, int) and token >= size:
        raise ValueError(
            f"sampled_token_ids(): the start token {token} (the model's {name}) is outside "
            f"{type(model).__name__}'s vocabulary of {size} ids. Set "
            "model.generation_config.bos_token_id to an id of the vocabulary."
        )


def _device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device
