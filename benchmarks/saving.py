"""Saving and loading a Llama-shaped model: time and peak memory per route.

`python -m benchmarks.saving [--variants float32,int8] [--keep DIR]` builds the
benchmark Llama (hidden 1024, 8 layers, intermediate 2816, 16 heads, vocab
32000: 168M parameters, random weights) under each variant (float32,
mixed_bfloat16, int8 and int4/128 from mixed_bfloat16), saves it with
`saving.save` and with `save_pretrained`, and loads it back three ways:
`saving.load` onto a model built on the CPU (random init, then replaced),
`saving.load` onto a model built on the meta device, and `from_pretrained`
(the `dtype_policies` quantizer). Every save and every load runs in a fresh
process; its peak RSS is `VmHWM` from `/proc/self/status`, reset after the
imports (the model's code included; `/proc/self/clear_refs`), minus the RSS
at that point. Each load is
then checked bit for bit against the saved model's logits; that first forward
touches every weight (memory-mapped pages of the file count once touched), so
the peak up to the end of it is reported too. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.process_memory import peak_since, reset_peak
from dtype_policies.bench.workloads.llm import llama_config

# The benchmark Llama of `llm_decode` / `llm_prefill`, one definition.
CONFIG = {
    key: getattr(llama_config(), key)
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    )
}
VARIANTS = ("float32", "mixed_bfloat16", "int8", "int4/128")
LOADS = {
    "load_cpu": "saving.load, CPU-built target",
    "load_meta": "saving.load, meta-built target",
    "from_pretrained": "from_pretrained",
}


def _prepare(model, variant: str):
    from dtype_policies import apply_policy, quantize
    from dtype_policies.quantization import Int4QuantizationConfig

    if variant != "float32":
        apply_policy(model, "mixed_bfloat16")
    if variant == "int8":
        quantize(model, "int8")
    elif variant == "int4/128":
        quantize(model, "int4", Int4QuantizationConfig(block_size=128))
    return model


def _ids():
    import torch

    return torch.randint(
        0, CONFIG["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0)
    )


def _logits(model):
    import torch

    with torch.no_grad():
        return model(_ids()).logits


def worker(action: str, variant: str, directory: str) -> dict:
    """One measurement, in this (fresh) process."""
    import warnings

    import torch
    import transformers

    from dtype_policies import saving

    warnings.simplefilter("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    config = transformers.LlamaConfig(**CONFIG)
    _ = transformers.LlamaForCausalLM  # import the modeling code (lazy) before any timer
    root = Path(directory)
    result: dict = {"action": action, "variant": variant}
    if action == "save":
        torch.manual_seed(0)
        model = _prepare(transformers.LlamaForCausalLM(config).eval(), variant)
        torch.save(_logits(model), root / "reference.pt")
        for name, save in (
            ("own", lambda: saving.save(model, root / "own")),
            ("hf", lambda: model.save_pretrained(root / "hf")),
        ):
            base = reset_peak()
            start = time.perf_counter()
            save()
            result[f"{name}_seconds"] = time.perf_counter() - start
            result[f"{name}_peak_mb"] = peak_since(base)
        result["own_mb"] = (root / "own" / "model.safetensors").stat().st_size / 2**20
        result["hf_mb"] = sum(f.stat().st_size for f in (root / "hf").glob("*.safetensors")) / 2**20
        return result
    base = reset_peak()
    start = time.perf_counter()
    if action == "load_cpu":
        model = transformers.AutoModelForCausalLM.from_config(config)
        built = time.perf_counter()
        saving.load(model, root / "own")
    elif action == "load_meta":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        built = time.perf_counter()
        saving.load(model, root / "own")
    elif action == "from_pretrained":
        built = start
        model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf")
    else:
        raise ValueError(f"Unknown action {action!r}")
    end = time.perf_counter()
    result["build_seconds"] = built - start
    result["load_seconds"] = end - built
    result["peak_mb"] = peak_since(base)
    result["model_mb"] = (
        sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20
    )
    model.eval()
    result["bit_exact"] = bool(torch.equal(_logits(model), torch.load(root / "reference.pt")))
    result["forward_peak_mb"] = peak_since(base)  # the first forward touches every weight
    return result


def _run(action: str, variant: str, directory: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "benchmarks.saving",
        "--worker",
        action,
        variant,
        str(directory),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{action} {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = [
        "| variant | route | file MB | save s | save peak MB | build s | load s | "
        "load peak MB | + 1st forward MB | model MB | bit-exact |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['variant']} | {row['route']} | {row['file_mb']:.0f} | "
            f"{row['save_seconds']:.2f} | {row['save_peak_mb']:.0f} | "
            f"{row['build_seconds']:.2f} | {row['load_seconds']:.2f} | {row['peak_mb']:.0f} | "
            f"{row['forward_peak_mb']:.0f} | {row['model_mb']:.0f} | "
            f"{'yes' if row['bit_exact'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--keep", default=None, help="keep the checkpoints in this directory")
    parser.add_argument(
        "--worker", nargs=3, metavar=("ACTION", "VARIANT", "DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"Unknown variants {unknown}; expected some of {list(VARIANTS)}")
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="saving_bench_"))
    rows = []
    try:
        for variant in variants:
            directory = base / variant.replace("/", "_")
            directory.mkdir(parents=True, exist_ok=True)
            saved = _run("save", variant, directory)
            for action, route in LOADS.items():
                fmt = "hf" if action == "from_pretrained" else "own"
                loaded = _run(action, variant, directory)
                rows.append(
                    {
                        **loaded,
                        "route": route,
                        "file_mb": saved[f"{fmt}_mb"],
                        "save_seconds": saved[f"{fmt}_seconds"],
                        "save_peak_mb": saved[f"{fmt}_peak_mb"],
                    }
                )
                print(f"{variant:>15} {route:32} done", file=sys.stderr)
            if not args.keep:
                shutil.rmtree(directory)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(
        f"Llama {CONFIG} (random weights), torch {_torch_version()}, "
        f"{os.cpu_count()} CPUs; peak = VmHWM over the RSS after imports, per process.\n"
    )
    print(table(rows))


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
