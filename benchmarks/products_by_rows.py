"""One quantized product against the library's own bfloat16 one, by rows.

`python -m benchmarks.products_by_rows [--rows 1,8,38,128,512] [--shapes 2048x1536,...]`

For each (K, N) an `nn.Linear` under `mixed_bfloat16` (its cached bfloat16
weight), and the same weight quantized to the default int8 and int4 from it;
for each row count the three are called in turn, 20 calls after 3 warm-ups,
and the milliseconds per call printed with the ratio to bfloat16. It shows
where a quantized product pays (few rows: the weights' bytes) and where it
does not (many rows: the arithmetic), on this machine.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

import dtype_policies


def _milliseconds(call, repeats: int = 20) -> float:
    for _ in range(3):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,38,128,512")
    parser.add_argument("--shapes", default="2048x1536,768x2048,576x1536,2048x8192")
    parser.add_argument("--threads", type=int, default=2)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    torch.manual_seed(0)
    for shape in arguments.shapes.split(","):
        k, n = (int(size) for size in shape.split("x"))
        base = torch.nn.Linear(k, n, bias=False)
        variants = {}
        for mode in ("bfloat16", "int8", "int4"):
            module = copy.deepcopy(base)
            dtype_policies.apply_policy(module, "mixed_bfloat16")
            if mode != "bfloat16":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dtype_policies.quantize(module, mode)
            variants[mode] = module
        for rows in (int(r) for r in arguments.rows.split(",")):
            x = torch.randn(rows, k)
            with torch.inference_mode():
                times = {
                    mode: _milliseconds(lambda module=module, x=x: module(x))
                    for mode, module in variants.items()
                }
            cells = [
                f"{mode} {ms:.3f} ms ({times['bfloat16'] / ms:.2f}x)" for mode, ms in times.items()
            ]
            print(f"K={k} N={n} rows={rows}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
