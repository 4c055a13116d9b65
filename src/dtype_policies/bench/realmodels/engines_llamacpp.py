"""llama.cpp (through `llama-cpp-python`, the optional `bench-llamacpp` extra)
on GGUFs of the same SmolLM2.

The package ships the model as Q4_1. The other files are made at run time
into `cache_dir()` with llama.cpp's own quantizer (`llama_model_quantize`,
built with the package): F32 by dequantizing the Q4_1 file, then BF16, Q8_0
and Q4_0 from F32 with llama.cpp's default choices for each file type. They
are never committed.

Build: `benchmarks/install_llamacpp.sh` builds `llama-cpp-python` from source
for the CPU it runs on (GGML_NATIVE: llama.cpp picks its kernels at build
time), with AMX off on CPUs that have it (see `amx_build`). Every row records
what the build uses (`build_features`).

What is timed matches `engines.TorchLM` (`decode`, `prefill`); the
differences that remain are llama.cpp's: its KV cache is float16 (ours is
the compute dtype) and attention is its flash-attention kernel. A file type
keeps some tensors wider than its name: the tied embedding/output matrix of
the Q4_1 and Q4_0 files is Q8_0 (`tensor_types`), as our int4 keeps it int8.
"""

from __future__ import annotations

import ctypes
import logging
import time
from functools import cache
from pathlib import Path

import numpy as np
import torch

from dtype_policies.bench.harness import Timed
from dtype_policies.bench.realmodels import models
from dtype_policies.bench.realmodels.engines import run_threads
from dtype_policies.bench.realmodels.variants import LM, Calibration, Variant

FILE_TYPES = ("F32", "BF16", "Q8_0", "Q4_1", "Q4_0")
_FTYPE_NAMES = {
    "F32": "LLAMA_FTYPE_ALL_F32",
    "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
}


def _quantize(source: Path, target: Path, file_type: str) -> None:
    import llama_cpp

    # llama.cpp logs a line per tensor through llama-cpp-python's logger
    # until a `Llama(verbose=False)` quiets it; errors still print.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, _FTYPE_NAMES[file_type])
    params.allow_requantize = True
    params.nthread = run_threads()

    def write(partial: Path) -> None:
        code = llama_cpp.llama_model_quantize(
            str(source).encode(), str(partial).encode(), ctypes.byref(params)
        )
        if code != 0:
            raise RuntimeError(f"llama_model_quantize to {file_type} returned {code}")

    models.publish(target, write)


@cache
def gguf_file(file_type: str) -> Path:
    """The SmolLM2 GGUF of `file_type` (one of `FILE_TYPES`), made once."""
    original = models.smollm2_gguf()
    if file_type == "Q4_1":
        return original
    key = models.file_sha256(original)[:16]
    target = models.cache_dir() / f"smollm2-{key}-{file_type}.gguf"
    if not target.is_file():
        source = original if file_type == "F32" else gguf_file("F32")
        _quantize(source, target, file_type)
    return target


def enabled_features(system_info: str) -> str:
    """The features set to 1 in llama.cpp's system info, in its order.

    >>> enabled_features("CPU : SSE3 = 1 | AVX512_VNNI = 0 | AVX512 = 1 | REPACK = 1 | ")
    'SSE3 AVX512 REPACK'
    """
    enabled: list[str] = []
    for part in system_info.replace("CPU :", "|").split("|"):
        name, _, value = part.partition("=")
        if value.strip() == "1" and name.strip() not in enabled:
            enabled.append(name.strip())
    return " ".join(enabled)


def build_features() -> str:
    """The CPU features the installed llama.cpp was built with (`"AVX2
    AVX512 ... REPACK"`)."""
    import llama_cpp

    return enabled_features(llama_cpp.llama_print_system_info().decode(errors="replace"))


def amx_build() -> bool:
    """Whether the installed llama.cpp was built with its AMX matrix kernels.

    Those crash (SIGSEGV in `ggml_backend_amx_mul_mat`, llama.cpp issue
    20824, machine-dependent) on the AMX machine these benchmarks were first
    run on, killing the whole process. `benchmarks/install_llamacpp.sh`
    builds without them on AMX CPUs (GGML_NATIVE with `-mno-amx-*`), which
    keeps the repacked AVX-512 kernels; a build that has them anyway runs
    here without its extra buffer types (no AMX, no weight repacking) and its
    rows say so."""
    return "AMX_INT8" in build_features().split()


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type a GGUF holds (`{"Q4_0": 180, ...}`)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        name = tensor.tensor_type.name
        counts[name] = counts.get(name, 0) + 1
    return counts


def _llama(extra_buffer_types: bool, **options):
    """A `llama_cpp.Llama`, with the model's extra buffer types on or off
    (llama-cpp-python has no argument for it: its default params are
    swapped for the one constructor call)."""
    import llama_cpp.llama_cpp as api
    from llama_cpp import Llama

    if extra_buffer_types:
        return Llama(**options)
    default = api.llama_model_default_params

    def without_extra_buffer_types():
        params = default()
        params.use_extra_bufts = False
        return params

    api.llama_model_default_params = without_extra_buffer_types
    try:
        return Llama(**options)
    finally:
        api.llama_model_default_params = default


class LlamaCppLM:
    """An LM engine on one GGUF, on the run's thread count for decode and for
    batches, flash attention on (llama.cpp's own default on CPU)."""

    def __init__(self, path: Path) -> None:
        extra = not amx_build()
        self.note = "" if extra else "AMX build: run without extra buffer types"
        self.threads = run_threads()
        self.build = build_features()
        common = dict(model_path=str(path), n_threads=self.threads, n_threads_batch=self.threads)
        common.update(verbose=False, n_batch=512, n_ubatch=512, flash_attn=True)
        # One context that returns every position's logits (quality), one that
        # returns the last one only (speed, as a user would run it).
        self._all = _llama(extra, **common, n_ctx=512, logits_all=True)
        self._last = _llama(extra, **common, n_ctx=1024, logits_all=False)
        self._vocab = self._last.n_vocab()

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        self._all.reset()
        tokens = ids[0].tolist()
        self._all.eval(tokens)
        return torch.from_numpy(np.array(self._all.scores[: len(tokens)], dtype=np.float32))

    def _last_logits(self) -> np.ndarray:
        pointer = self._last._ctx.get_logits()
        return np.ctypeslib.as_array(pointer, shape=(self._vocab,))

    def decode(self, prompt: torch.Tensor, new_tokens: int) -> Timed:
        """Greedy: the prompt, then one token at a time; the time per token
        after the first (as `engines.TorchLM.decode`)."""

        self._last.reset()
        self._last.eval(prompt[0].tolist())
        token = int(self._last_logits().argmax())
        start = time.perf_counter()  # the first new token is out
        for _ in range(new_tokens - 1):
            self._last.eval([token])
            token = int(self._last_logits().argmax())
        return Timed((time.perf_counter() - start) / (new_tokens - 1))

    def prefill(self, ids: torch.Tensor) -> object:
        self._last.reset()
        self._last.eval(ids[0].tolist())
        return self._last_logits()


def _prepare(file_type: str):
    def prepare(model: torch.nn.Module, calibration: Calibration) -> LlamaCppLM:
        return LlamaCppLM(gguf_file(file_type))

    return prepare


VARIANTS: list[Variant] = [
    Variant(
        f"llama.cpp {file_type}",
        _prepare(file_type),
        models=(LM,),
        requires=("llama_cpp",),
        family="llama.cpp",
        note="the shipped file" if file_type == "Q4_1" else "",
    )
    for file_type in FILE_TYPES
]
"""One variant per GGUF file type."""
