"""One peer calibration for `benchmarks.calibration`: llm-compressor's GPTQ or
AWQ on the same model, windows and evaluation text as this library's run.

Runs in the peer's own Python environment (llm-compressor pins its own
transformers), so it imports neither `dtype_policies` nor anything of this
repository but `process_memory` (standard library only), found next to it:
`python benchmarks/calibration_peer.py WORK OUT`, where WORK is
the `torch.save`d job `benchmarks.calibration` writes (model directory,
calibration windows, evaluation windows, float32's top token ids, the
algorithm, bits, group size, threads) and OUT receives the figures: the
calibration's wall and CPU seconds, its peak RSS above the RSS with the model
loaded, and per evaluation window what the LM scores need (the log-probability
of each next token, the argmax, the log-probabilities of float32's top tokens).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from process_memory import peak_since, reset_peak, touch


def _recipe(job: dict):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=job["bits"],
        type="int",
        symmetric=False,
        strategy="group" if job["group"] > 0 else "channel",
        group_size=job["group"] if job["group"] > 0 else None,
        # "weight": the columns ordered by the Hessian's diagonal, the groups kept
        # natural, as this library's activation order on its grids
        actorder="weight" if job.get("activation_order") else None,
    )
    scheme = {"group": QuantizationScheme(targets=["Linear"], weights=weights)}
    if job["algorithm"] == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        return GPTQModifier(
            config_groups=scheme,
            ignore=["lm_head"],
            dampening_frac=job["damping"],
            block_size=128,
        )
    from llmcompressor.modifiers.awq import AWQModifier

    return AWQModifier(config_groups=scheme, ignore=["lm_head"])


def main(work: str, out: str) -> None:
    import torch

    job = torch.load(work)
    torch.set_num_threads(job["threads"])
    import llmcompressor
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    windows = job["windows"]
    dataset = Dataset.from_dict(
        {"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()}
    )
    recipe = _recipe(job)
    touch(model)
    base = reset_peak()
    wall, cpu = time.perf_counter(), time.process_time()
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=windows.shape[1],
        num_calibration_samples=windows.shape[0],
        batch_size=1,
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = peak_since(base)
    rows = []
    with torch.inference_mode():
        for window, top_ids in zip(job["eval_windows"], job["top_ids"]):
            logits = model(input_ids=window[None], use_cache=False).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            rows.append(
                {
                    "target_logp": logp.gather(1, window[1:, None])[:, 0],
                    "argmax": logp.argmax(-1),
                    "top_logp": logp.gather(1, top_ids.long()),
                }
            )
    torch.save(
        {
            "wall_s": wall,
            "cpu_s": cpu,
            "peak_mb": peak,
            "rows": rows,
            "version": f"llm-compressor {llmcompressor.__version__}",
        },
        out,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
