"""The benchmark suite (speed as ratios measured in one run, against float32,
whole-model bfloat16, torch.autocast, torchao and Keras where installed).

Run it with `dtype-policies bench`; `--quick` is a smoke run.
"""

from dtype_policies.bench.runner import main

__all__ = ["main"]
