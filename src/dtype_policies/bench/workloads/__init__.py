"""The benchmark workloads: each builds its variants on the same model and
inputs and returns `{variant: callable}` plus notes."""

from dtype_policies.bench.workloads import cpu_mlp, shape_sweep
from dtype_policies.bench.workloads.llm import LLM_PREFILL, LLM_PROMPT, llm_workload
from dtype_policies.bench.workloads.mlp import mlp_decode, mlp_inference, mlp_train
from dtype_policies.bench.workloads.small import call_overhead, transformer_train

WORKLOADS = {
    "mlp_train": ("MLP train step (batch 256, SGD)", lambda: mlp_train()),
    "mlp_inference": ("MLP inference (batch 256)", lambda: mlp_inference()),
    "mlp_decode": ("MLP inference at batch 1 (decoding)", lambda: mlp_decode()),
    "transformer_train": ("Transformer encoder train step (AdamW)", lambda: transformer_train()),
    "overhead_no_grad": (
        "Per-call overhead, 64x64 layer, (1, 64), no_grad",
        lambda: call_overhead(False),
    ),
    "overhead_grad": (
        "Per-call overhead, 64x64 layer, (1, 64), grad enabled",
        lambda: call_overhead(True),
    ),
    "llm_decode": (
        f"Llama-style LM decode (batch 1, prompt {LLM_PROMPT}, greedy), ms per new token",
        lambda: llm_workload("decode"),
    ),
    "llm_prefill": (
        f"Llama-style LM prefill ({LLM_PREFILL[0]} x {LLM_PREFILL[1]} tokens), ms per forward",
        lambda: llm_workload("prefill"),
    ),
}
WORKLOADS.update(cpu_mlp.WORKLOADS)
# Workloads that time and report themselves: key -> run(quick) -> (markdown, targets, results).
SELF_TIMED = {"shape_sweep": shape_sweep.sweep}
WORKLOADS["shape_sweep"] = (shape_sweep.TITLE, lambda: ({}, {}))
