"""What the tables measure, behind one interface per model kind.

An LM engine has `logits(ids (1, T)) -> (T, vocab)` (quality),
`decode(prompt, new_tokens) -> Timed` (seconds per generated token, batch 1,
greedy) and `prefill(ids)` (one forward, last token's logits). An encoder
engine has `hidden(input_ids, attention_mask) -> (B, T, H)`. Torch modules
are wrapped here; the non-torch peers (`peers`) implement the same methods.

Every engine runs on the run's thread count (`run_threads`) and says so in
its `threads` attribute, which each row records.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from dtype_policies.bench.harness import Timed, TokenClock


def run_threads() -> int:
    """The run's thread count: torch's intra-op threads, which the runner sets
    from `--threads` before any engine is built; the other engines (llama.cpp,
    ONNX Runtime, OpenVINO) are given the same number."""
    return torch.get_num_threads()


class LMEngine(Protocol):
    threads: int

    def logits(self, ids: torch.Tensor) -> torch.Tensor: ...
    def decode(self, prompt: torch.Tensor, new_tokens: int) -> Timed: ...
    def prefill(self, ids: torch.Tensor) -> object: ...


class EncoderEngine(Protocol):
    threads: int

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...


class TorchLM:
    """A transformers causal LM (a module, or one compiled by
    `compile_for_inference`), run under `torch.inference_mode()`."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.threads = run_threads()

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.module(input_ids=ids, use_cache=False).logits[0].float()

    def decode(self, prompt: torch.Tensor, new_tokens: int) -> Timed:
        """Greedy `generate`; the time per token after the first (the prompt's
        forward and the first token are excluded). The end-of-text token is
        unset for the call, so that exactly `new_tokens` come without a
        minimum-length processor (which scans the vocabulary on every step:
        5 ms of a 40 ms step on SmolLM2, measured), as llama.cpp's loop."""
        clock = TokenClock()
        config = self.module.generation_config
        eos = config.eos_token_id
        config.eos_token_id = None
        try:
            with torch.inference_mode():
                out = self.module.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                    streamer=clock,
                )
        finally:
            config.eos_token_id = eos
        if out.shape[1] != prompt.shape[1] + new_tokens:
            raise RuntimeError(f"generated {out.shape[1] - prompt.shape[1]} of {new_tokens} tokens")
        times = clock.times
        return Timed((times[-1] - times[0]) / (len(times) - 1))

    def prefill(self, ids: torch.Tensor) -> object:
        """One forward of `ids` without a cache, computing the last token's logits
        only (as llama.cpp does)."""
        with torch.inference_mode():
            return self.module(input_ids=ids, use_cache=False, logits_to_keep=1).logits


class TorchEncoder:
    """A transformers encoder (a module, or one compiled by
    `compile_for_inference`), run under `torch.inference_mode()`."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.threads = run_threads()

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = self.module(input_ids=input_ids, attention_mask=attention_mask)
            return out.last_hidden_state


def as_engine(prepared: Any, model: str) -> Any:
    """A prepared variant as an engine (torch modules and compiled ones are
    wrapped)."""
    from dtype_policies import CompiledInference

    if not isinstance(prepared, (torch.nn.Module, CompiledInference)):
        return prepared
    return TorchLM(prepared) if model == "smollm2" else TorchEncoder(prepared)
