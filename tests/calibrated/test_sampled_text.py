"""`quantization.sampled_token_ids`: calibration text sampled from the model
itself, for GPTQ and AWQ without a dataset."""

import warnings

import pytest
import torch

from dtype_policies import apply_policy, quantize
from dtype_policies.quantization import AWQConfig, GPTQConfig, sampled_token_ids

transformers = pytest.importorskip("transformers")


def llama(bos=1, eos=2, vocab=96):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=vocab, bos_token_id=bos, eos_token_id=eos,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_samples_are_reproducible_and_leave_the_model_and_random_state_alone():
    model = llama()
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    ids = sampled_token_ids(model, num_samples=10, sequence_length=12, seed=4)
    assert torch.equal(torch.rand(3), expected_next)  # the global generator was not moved
    assert ids.shape == (10, 12) and ids.dtype == torch.long
    assert (ids[:, 0] == 1).all() and ((ids >= 0) & (ids < 96)).all()
    assert model.training  # given back in its mode
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(ids, sampled_token_ids(model, num_samples=10, sequence_length=12, seed=4))
    other = sampled_token_ids(model, num_samples=10, sequence_length=12, seed=5)
    assert not torch.equal(ids, other)
    assert len({tuple(row) for row in ids.tolist()}) == 10  # sampled, not greedy


def test_a_model_without_a_start_token_starts_from_its_end_token():
    model = llama(bos=None, eos=7)
    ids = sampled_token_ids(model, num_samples=2, sequence_length=5)
    assert (ids[:, 0] == 7).all()
    with pytest.raises(ValueError, match="names no start-of-sequence"):
        sampled_token_ids(llama(bos=None, eos=None), num_samples=1, sequence_length=4)


def test_a_start_token_outside_the_vocabulary_is_named():
    """GPT-2 built from a small config keeps bos 50256: `generate` raised a
    bare IndexError."""
    with pytest.raises(ValueError, match=r"start token 500 .*bos_token_id.* vocabulary of 96"):
        sampled_token_ids(llama(bos=500), num_samples=1, sequence_length=4)


def test_calibration_text_given_as_bytes_is_decoded():
    from dtype_policies.quantizers.calibration_data import tokenize

    def characters(text):
        assert isinstance(text, str)
        return [ord(c) for c in text]

    assert tokenize(characters, "é a".encode()).tolist() == [233, 32, 97]
    with pytest.raises(ValueError, match="bytes is not UTF-8 text"):
        tokenize(characters, b"\xff\xfe")


@pytest.mark.parametrize("config_class", [GPTQConfig, AWQConfig])
def test_sampled_ids_calibrate_gptq_and_awq(config_class):
    model = llama()
    apply_policy(model, "mixed_bfloat16")
    ids = sampled_token_ids(model, num_samples=4, sequence_length=16)
    config = config_class(
        ids, None, weight_bits=4, group_size=32, num_samples=4, sequence_length=16
    )
    report = quantize(model, config=config, progress=False)
    assert report.num_quantized > 0 and not report.errors
    with torch.no_grad():
        logits = model(ids[:1]).logits
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_samples": 0}, ValueError, "num_samples"),
        ({"num_samples": 2.0}, TypeError, "num_samples"),
        ({"sequence_length": 1}, ValueError, "sequence_length"),
        ({"seed": -1}, ValueError, "seed"),
        ({"temperature": 0}, ValueError, "temperature"),
        ({"temperature": "1"}, TypeError, "temperature"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_p": 0.0}, ValueError, "top_p"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    model = llama()
    with pytest.raises(error, match=match):
        sampled_token_ids(model, **kwargs)


def test_a_model_that_cannot_generate_is_refused_by_type():
    with pytest.raises(TypeError, match="Received: Linear"):
        sampled_token_ids(torch.nn.Linear(4, 4))
