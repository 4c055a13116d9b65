"""Real trained models in the benchmark loop: SmolLM2-135M-Instruct and
all-MiniLM-L6-v2, installed from PyPI, evaluated on real English read at run
time (`text`), with this library's variants and the peers (`variants`,
`peers`).

For quick iteration on a quantizer:

    from dtype_policies.bench.realmodels import evaluate_lm, load_smollm2
    model, _ = load_smollm2()
    ...  # apply_policy / quantize
    evaluate_lm(model)  # {"perplexity": ..., "top1": ..., "kl": ...}

or `python -m benchmarks quality --model smollm2 --variants int4/32,int4/128`.
"""

from dtype_policies.bench.realmodels.models import (
    ModelUnavailable,
    load_minilm,
    load_smollm2,
)
from dtype_policies.bench.realmodels.quality import evaluate_encoder, evaluate_lm

__all__ = [
    "ModelUnavailable",
    "evaluate_encoder",
    "evaluate_lm",
    "load_minilm",
    "load_smollm2",
]
