"""The variants of the real-model tables, as data.

A variant is a name, the models it applies to, the packages it needs, and a
`prepare(model, calibration)` that turns a fresh float32 copy of the model
into what is measured (a module, or an engine from `engines`). This
library's variants are one `ours(...)` line each: a policy, then optionally
a quantization mode with its config's options (or a `config` function that
receives the `Calibration`, for modes that take data):

    ours("int4/64", mode="int4", block_size=64)
    ours("gptq/4/128", mode="gptq", config=lambda calibration: GPTQConfig(...))

The peers (`peers.PEERS`) use the same `Variant` with their own `prepare`;
`catalogue` lists both and selects a run's variants.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtype_policies.bench.realmodels import text

LM, ENCODER = "smollm2", "minilm"
BOTH = (LM, ENCODER)


@dataclass
class Calibration:
    """Data for variants that calibrate, from the calibration text (never the
    evaluated text): `lm_batches` are (1, 256) token windows, `encoder_batches`
    (input_ids, attention_mask) batches of 16 sentences."""

    model: str
    tokenizer: Any
    steps: int = 2

    def batches(self) -> list[dict[str, torch.Tensor]]:
        """Keyword inputs of the model, `steps` of them."""
        if self.model == LM:
            ids = self.tokenizer(text.calibration_text(), add_special_tokens=False)["input_ids"]
            return [
                {"input_ids": torch.tensor(ids[i * 256 : (i + 1) * 256])[None]}
                for i in range(self.steps)
            ]
        sentences = list(text.calibration_sentences())
        return [
            dict(
                self.tokenizer(
                    sentences[i * 16 : (i + 1) * 16],
                    padding=True,
                    truncation=True,
                    max_length=128,
                    return_tensors="pt",
                )
            )
            for i in range(self.steps)
        ]

    def lm_token_ids(self) -> torch.Tensor:
        """The token ids of the LM calibration text (GPTQ, AWQ), one 1-D tensor."""
        ids = self.tokenizer(text.lm_calibration_text(), add_special_tokens=False)["input_ids"]
        return torch.tensor(ids)

    def encoder_token_ids(self) -> torch.Tensor:
        """The token ids of the encoder calibration text (GPTQ, AWQ), one 1-D tensor."""
        ids = self.tokenizer(text.calibration_text(), add_special_tokens=False)["input_ids"]
        return torch.tensor(ids)

    def train_steps(self, model: torch.nn.Module) -> None:
        """Forward in training mode and backward, `steps` times (fills float8
        delayed scaling's amax histories); gradients are dropped after."""
        model.train()
        for inputs in self.batches():
            out = model(**inputs, use_cache=False) if self.model == LM else model(**inputs)
            values = out.logits if self.model == LM else out.last_hidden_state
            values.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        model.eval()


Prepare = Callable[[torch.nn.Module, Calibration], Any]


@dataclass(frozen=True)
class Variant:
    name: str
    prepare: Prepare
    models: tuple[str, ...] = BOTH
    requires: tuple[str, ...] = ()
    family: str = "dtype-policies"
    note: str = ""


def ours(
    name: str,
    policy: str | None = "mixed_bfloat16",
    mode: str | None = None,
    *,
    config: Callable[[Calibration], Any] | None = None,
    filters: Any = None,
    calibrate: bool = False,
    models: tuple[str, ...] = BOTH,
    note: str = "",
    **options: Any,
) -> Variant:
    """A variant of this library: `apply_policy(policy)` (none for float32),
    then `quantize(mode, config)` with `config` built from `options` (the
    mode's config class) or by `config(calibration)`; `calibrate` runs
    `Calibration.train_steps` after quantizing (float8 delayed scaling)."""

    def prepare(model: torch.nn.Module, calibration: Calibration) -> torch.nn.Module:
        from dtype_policies import apply_policy, quantize
        from dtype_policies._modes import mode_record

        if policy is not None:
            apply_policy(model, policy)
        if mode is not None:
            if config is not None:
                resolved = config(calibration)
            elif options:
                resolved = mode_record(mode).config_class(**options)
            else:
                resolved = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize(model, mode, resolved, filters)
        if calibrate:
            calibration.train_steps(model)
        return model.eval()

    return Variant(name, prepare, models=models, note=note)


def _int8_w8a8() -> Any:
    from dtype_policies.quantizers import Int8QuantizationConfig

    return Int8QuantizationConfig()  # Keras's int8: per-token activation quantizer


def compiled(
    variant: Variant,
    *,
    autotune: bool = True,
    cpp_wrapper: bool | None = None,
    models: tuple[str, ...] | None = None,
) -> Variant:
    """`variant` compiled: SmolLM2 with `compile_for_generation` (decode
    compiled on a static KV cache; prefill and quality stay eager), MiniLM
    with `compile_for_inference` (every call); without Inductor's GEMM
    autotuning when `autotune` is off (named "... compiled (no autotune)").
    `cpp_wrapper`: `None` for the default (the C++ wrapper from torch
    2.13), else named "... compiled (C++ wrapper)" or "(Python wrapper)".
    `models`: those of `variant` by default."""

    def prepare(model: torch.nn.Module, calibration: Calibration) -> Any:
        from dtype_policies import compile_for_generation, compile_for_inference

        prepared = variant.prepare(model, calibration)
        wrapper = {} if cpp_wrapper is None else {"cpp_wrapper": cpp_wrapper}
        if calibration.model == LM:
            return compile_for_generation(prepared, autotune=autotune, **wrapper)
        return compile_for_inference(prepared, autotune=autotune, **wrapper)

    suffix = "" if autotune else " (no autotune)"
    if cpp_wrapper is not None:
        suffix += " (C++ wrapper)" if cpp_wrapper else " (Python wrapper)"
    return Variant(
        f"{variant.name} compiled" + suffix,
        prepare,
        models=variant.models if models is None else models,
        note="compiled with frozen weights (the first call of each shape compiles)",
    )


CALIBRATION_SAMPLES, CALIBRATION_LENGTH = 128, 512
ENCODER_CALIBRATION_SAMPLES, ENCODER_CALIBRATION_LENGTH = 64, 128


def calibrated(
    mode: str,
    bits: int,
    group: int,
    models: tuple[str, ...] = (LM,),
    suffix: str = "",
    **options: Any,
) -> Variant:
    """`<mode>/<bits>/<group>` under mixed_bfloat16, calibrated on the LM
    calibration text (`text.lm_calibration_text`, 128 windows of 512 tokens)
    for the LM, and on the encoder's calibration text (`text.calibration_text`,
    64 windows of 128 tokens, overlapping: the text has about 2,000) for the
    encoder; `options` are further config arguments, named by `suffix`."""

    def config(calibration: Calibration) -> Any:
        from dtype_policies._modes import mode_record

        lm = calibration.model == LM
        return mode_record(mode).config_class(
            calibration.lm_token_ids() if lm else calibration.encoder_token_ids(),
            None,
            weight_bits=bits,
            group_size=group,
            num_samples=CALIBRATION_SAMPLES if lm else ENCODER_CALIBRATION_SAMPLES,
            sequence_length=CALIBRATION_LENGTH if lm else ENCODER_CALIBRATION_LENGTH,
            **options,
        )

    return ours(
        f"{mode}/{bits}/{group}{suffix}",
        mode=mode,
        config=config,
        models=models,
        note="calibrated on the calibration text",
    )


def whole_model(dtype: torch.dtype) -> Prepare:
    def prepare(model: torch.nn.Module, calibration: Calibration) -> torch.nn.Module:
        return model.to(dtype).eval()

    return prepare


OURS: list[Variant] = [
    ours("float32", policy=None),
    Variant("torch bfloat16 (whole model)", whole_model(torch.bfloat16), family="torch"),
    ours("mixed_bfloat16"),
    ours(
        "int8",
        mode="int8",
        note="the default int8: inputs and weights rounded to int8 per 32 (Q8_0 x Q8_0)",
    ),
    ours(
        "int8 from float32",
        policy=None,
        mode="int8",
        note="the default int8 on a float32 model (`int8_from_float32`)",
    ),
    ours(
        "int8 W8A8/32",
        mode="int8",
        activation_block_size=32,
        note="inputs per 32, weights per channel (the default int8 of 2026-11-28)",
    ),
    ours("int8 weight-only", mode="int8", activation_quantizer=None),
    ours(
        "int8 weight-only from float32",
        policy=None,
        mode="int8",
        activation_quantizer=None,
        note="inputs rounded to bfloat16 where bfloat16 products are native",
    ),
    ours("int8 W8A8", mode="int8", config=lambda _: _int8_w8a8(), note="per-token activations"),
    ours("int4/32", mode="int4", block_size=32),
    ours("int4/64", mode="int4", block_size=64),
    ours("int4/128", mode="int4", block_size=128),
    ours("int4/-1", mode="int4", block_size=-1),
    ours(
        "int4/32 W4A8",
        mode="int4",
        block_size=32,
        activation_block_size=32,
        note="inputs rounded to int8 per 32 (llama.cpp's Q8_0 rule), integer products",
    ),
    ours(
        "int4/64 W4A8",
        mode="int4",
        block_size=64,
        activation_block_size=32,
        note="inputs rounded to int8 per 32 (llama.cpp's Q8_0 rule), integer products",
    ),
    ours("int4/64 min/max zeros", mode="int4", block_size=64, refine_zero_points=False),
    ours("int4/128 min/max zeros", mode="int4", block_size=128, refine_zero_points=False),
    ours("int4/32 scale_search", mode="int4", block_size=32, scale_search=True),
    ours("int4/128 scale_search", mode="int4", block_size=128, scale_search=True),
    ours("int4/-1 scale_search", mode="int4", block_size=-1, scale_search=True),
    ours(
        "int4 one group per row",
        mode="int4",
        block_size=1 << 20,
        note="a block as wide as the input: per channel with a zero point",
    ),
    calibrated("gptq", 4, 128, models=BOTH),
    calibrated("gptq", 4, 128, models=BOTH, suffix=" act-order", activation_order=True),
    calibrated("gptq", 4, 128, suffix=" Keras grids", grid="keras"),
    calibrated("gptq", 4, 32, models=BOTH),
    calibrated("gptq", 3, 128),
    calibrated("gptq", 8, -1),
    calibrated("awq", 4, 128, models=BOTH),
    calibrated("awq", 4, 32, models=BOTH),
    ours("float8 delayed", mode="float8", calibrate=True, note="2 calibration train steps"),
    ours("float8 dynamic", mode="float8", scaling="dynamic"),
    ours("float8 weight-only", mode="float8", scaling="weight_only"),
]
OURS += [
    compiled(v)
    for v in OURS
    if v.name
    in (
        "float32",
        "mixed_bfloat16",
        "int8",
        "int8 W8A8/32",
        "int8 weight-only",
        "int8 W8A8",
        "int4/32",
        "int4/128",
        "int4/32 W4A8",
        "float8 dynamic",
        "float8 weight-only",
    )
]
OURS += [
    compiled(v, autotune=False) for v in OURS if v.name in ("mixed_bfloat16", "int8", "int4/32")
]
_WRAPPED = ("mixed_bfloat16", "int8", "int8 weight-only", "int4/32 W4A8")
OURS += [compiled(v, cpp_wrapper=False) for v in OURS if v.name in _WRAPPED]
"""This library's variants, in table order (the reference is `float32`)."""


def prepared(variant: Variant, base: torch.nn.Module, calibration: Calibration) -> Any:
    """`variant` prepared on a deep copy of `base` (the float32 model)."""
    return variant.prepare(copy.deepcopy(base), calibration)
