"""The speed workloads on the real models, timed by the suite's one timer
(`harness.measure_interleaved`, ratios by `harness.paired_ratio` against
float32), on the same prepared variants as the quality table.

* SmolLM2 `decode`: greedy decoding at batch 1 under `torch.inference_mode()`
  after a 32-token prompt (the text's first 32 tokens), ms per new token after
  the first (`DECODE_TOKENS` tokens; variants whose first call is more than
  `SLOW` times float32's per token decode `SLOW_TOKENS` instead, so that a
  cliff costs seconds, not minutes). `prefill`: one forward of the first
  512-token window, last-token logits only (as llama.cpp computes them).
* MiniLM `b1x32`: one call on 1 x 32 tokens; `b32x128`: 32 x 128 tokens
  (consecutive chunks of the text, [CLS] ... [SEP], no padding).
  For these one-call workloads (and prefill) a variant more than `SLOW`
  times float32 is timed by its first call alone (`table._timed_calls`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from dtype_policies.bench.realmodels import quality, text
from dtype_policies.bench.realmodels.variants import LM

DECODE_TOKENS = 64
DECODE_PROMPT = 32
SLOW = 5.0
SLOW_TOKENS = 8

WORKLOADS = {
    LM: {"decode": "ms/token", "prefill": "ms"},
    "minilm": {"b1x32": "ms", "b32x128": "ms"},
}


@cache
def encoder_inputs(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = quality.encoder_tokenizer()
    body = length - 2
    ids = tokenizer(text.evaluation_text(), add_special_tokens=False)["input_ids"]
    rows = [
        [tokenizer.cls_token_id, *ids[i * body : (i + 1) * body], tokenizer.sep_token_id]
        for i in range(batch)
    ]
    input_ids = torch.tensor(rows)
    return input_ids, torch.ones_like(input_ids)


def call_of(engine: Any, workload: str, new_tokens: int = DECODE_TOKENS) -> Callable[[], object]:
    """The timed call of `workload` on a prepared engine."""
    if workload == "decode":
        prompt = quality.lm_windows()[0, :DECODE_PROMPT][None]
        return lambda: engine.decode(prompt, new_tokens)
    if workload == "prefill":
        window = quality.lm_windows()[0][None]
        return lambda: engine.prefill(window)
    batch, length = (int(n) for n in workload[1:].split("x"))
    inputs = encoder_inputs(batch, length)
    return lambda: engine.hidden(*inputs)
