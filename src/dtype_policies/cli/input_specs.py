"""`--inputs` of `dtype-policies advise`: random tensors from shape specs, or
the batches a `package.module:callable` returns.

A spec is `[NAME=]SHAPE[:DTYPE[:HIGH]]`:

- `32x64`: a float32 tensor of shape (32, 64) from `torch.randn`;
- `1x16:int64`: token ids of shape (1, 16), uniform in `[0, HIGH)`; `HIGH`
  defaults to the model's `config.vocab_size`, else the smallest
  `num_embeddings` of its `nn.Embedding`s (`1x16:int64:1000` sets it);
- `input_ids=1x16:int64`: passed as a keyword argument (unnamed specs are
  positional, in order).

Or a single `package.module:callable`: called without arguments, it returns
what `advise` takes (a tensor, a tuple of arguments, a dict of keyword
arguments, or a list of those).

>>> import torch
>>> from dtype_policies.cli.input_specs import random_batches
>>> model = torch.nn.Embedding(100, 8)
>>> [batch] = random_batches(["input=2x5:int64"], model, count=1, seed=0)
>>> batch["input"].shape, batch["input"].dtype, int(batch["input"].max()) < 100
(torch.Size([2, 5]), torch.int64, True)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from dtype_policies.cli.targets import CLIError, load_callable

SPEC = re.compile(r"(?:(?P<name>[A-Za-z_]\w*)=)?(?P<shape>\d+(?:x\d+)*)(?::(?P<rest>.*))?")
FLOAT_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
INT_DTYPES = {"int64": torch.int64, "int32": torch.int32, "long": torch.int64}
MAX_BYTES = 2**63 - 1  # torch's storage sizes are int64
HELP = (
    "the batch: one or more SPECs '[NAME=]SHAPE[:DTYPE[:HIGH]]', e.g. '32x64' (float32 "
    "randn), '1x16:int64' (token ids in [0, HIGH); HIGH defaults to the model's "
    "config.vocab_size or its smallest nn.Embedding), 'input_ids=1x16:int64' (a keyword "
    "argument; unnamed SPECs are positional); or one 'package.module:callable' returning "
    "the batch (a tensor, a tuple, a dict, or a list of batches)"
)


@dataclass(frozen=True)
class TensorSpec:
    name: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    high: int | None

    def make(self, generator: torch.Generator, default_high: int | None) -> torch.Tensor:
        if self.dtype.is_floating_point:
            return torch.randn(self.shape, generator=generator).to(self.dtype)
        high = self.high or default_high
        if high is None:
            raise CLIError(
                f"--inputs: cannot tell the range of {self.dtype} values for a model without "
                "config.vocab_size or nn.Embedding; give it as SHAPE:DTYPE:HIGH "
                "(e.g. 1x16:int64:1000)"
            )
        if high > max_high(self.dtype):  # a model's vocabulary beyond int32 ids
            raise CLIError(
                f"--inputs: the model's {high} token ids do not fit {self.dtype}; give "
                f"SHAPE:int64, or HIGH from 1 to {max_high(self.dtype)}"
            )
        return torch.randint(0, high, self.shape, generator=generator, dtype=self.dtype)


def max_high(dtype: torch.dtype) -> int:
    """The largest HIGH `torch.randint` takes for `dtype` (values below it)."""
    return min(torch.iinfo(dtype).max + 1, 2**63 - 1)


def is_shape_spec(spec: str) -> bool:
    return re.match(r"([A-Za-z_]\w*=)?\d", spec) is not None


def parse_spec(spec: str) -> TensorSpec:
    """One `[NAME=]SHAPE[:DTYPE[:HIGH]]` spec."""
    match = SPEC.fullmatch(spec)
    if match is None:
        raise CLIError(f"--inputs: cannot read {spec!r}; expected [NAME=]SHAPE[:DTYPE[:HIGH]]")
    shape = tuple(int(size) for size in match["shape"].split("x"))
    if any(size == 0 for size in shape):
        raise CLIError(f"--inputs: {spec!r} has a zero dimension")
    rest = match["rest"]
    if rest == "" or (rest and rest.endswith(":")):
        raise CLIError(f"--inputs: {spec!r} ends with ':'; expected [NAME=]SHAPE[:DTYPE[:HIGH]]")
    dtype_name, _, high_text = (rest or "float32").partition(":")
    dtype = FLOAT_DTYPES.get(dtype_name) or INT_DTYPES.get(dtype_name)
    if dtype is None:
        accepted = ", ".join([*FLOAT_DTYPES, *INT_DTYPES])
        raise CLIError(f"--inputs: unknown dtype {dtype_name!r} in {spec!r}; accepted: {accepted}")
    size = math.prod(shape) * dtype.itemsize
    if size > MAX_BYTES:
        raise CLIError(
            f"--inputs: {spec!r} is {size:,} bytes; a tensor holds at most {MAX_BYTES:,} bytes"
        )
    high = None
    if high_text:
        if dtype.is_floating_point or not (high_text.isascii() and high_text.isdigit()):
            high_text = "0"  # (superscript digits are `isdigit()` too, and no int)
        if dtype.is_floating_point or int(high_text) < 1:
            raise CLIError(
                f"--inputs: {spec!r}: HIGH must be a positive integer after an integer dtype"
            )
        high = int(high_text)
        if high > max_high(dtype):
            raise CLIError(
                f"--inputs: {spec!r}: HIGH must be from 1 to {max_high(dtype)} for "
                f"{dtype_name}. Received: {high}"
            )
    return TensorSpec(match["name"], shape, dtype, high)


def default_high(model: torch.nn.Module) -> int | None:
    """The range of token ids the model takes: `config.vocab_size`, else the
    smallest `nn.Embedding`."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return min(sizes) if sizes else None


def random_batches(specs: list[str], model: torch.nn.Module, count: int, seed: int) -> list[Any]:
    """`count` batches from shape specs (seeded); a batch is a tensor (one
    unnamed spec), a tuple (several) or a dict (named ones, with no unnamed)."""
    parsed = [parse_spec(spec) for spec in specs]
    named = [spec for spec in parsed if spec.name]
    if named and len(named) != len(parsed):
        raise CLIError("--inputs: name every SPEC (NAME=SHAPE) or none")
    names = [spec.name for spec in named]
    if len(set(names)) != len(names):
        raise CLIError(f"--inputs: a keyword is given twice: {names}")
    high = default_high(model)
    generator = torch.Generator().manual_seed(seed)
    batches: list[Any] = []
    for _ in range(count):
        tensors = [spec.make(generator, high) for spec in parsed]
        if named:
            batches.append(dict(zip(names, tensors)))
        else:
            batches.append(tensors[0] if len(tensors) == 1 else tuple(tensors))
    return batches


def load_inputs(specs: list[str], model: torch.nn.Module, count: int, seed: int) -> Any:
    """What `--inputs` asks for: random batches from shape specs, or what a
    `package.module:callable` returns."""
    if not specs:
        raise CLIError("--inputs: give at least one SPEC")
    callables = [spec for spec in specs if not is_shape_spec(spec)]
    if not callables:
        return random_batches(specs, model, count, seed)
    if len(specs) > 1:
        raise CLIError(
            f"--inputs: {callables[0]!r} is not a shape SPEC; a 'package.module:callable' "
            "must be the only --inputs value"
        )
    if ":" not in specs[0]:
        raise CLIError(
            f"--inputs: cannot read {specs[0]!r}; expected [NAME=]SHAPE[:DTYPE[:HIGH]] "
            "(e.g. 32x64, input_ids=1x16:int64) or 'package.module:callable'"
        )
    function = load_callable(specs[0], "--inputs")
    try:
        return function()
    except Exception as e:
        raise CLIError(f"calling --inputs {specs[0]!r} failed: {type(e).__name__}: {e}") from e
