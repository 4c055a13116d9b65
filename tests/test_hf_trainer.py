"""Hugging Face's `Trainer` fine-tunes policied and quantized models as it
does float ones: the loss goes down, the float32 masters (or the adapters)
change, the policies stay, and its checkpoints reload to the same model."""

from pathlib import Path

import pytest
import torch

from dtype_policies import apply_policy, quantize

transformers = pytest.importorskip("transformers")
tiny_models = pytest.importorskip("tiny_models")


class Repeated(torch.utils.data.Dataset):
    """One fixed sequence, many times: a model can learn it in a few steps."""

    def __init__(self, count: int) -> None:
        self.ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(1))
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids, "labels": self.ids}


def _arguments(tmp_path, learning_rate=3e-3, **settings):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_train_epochs=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        learning_rate=learning_rate,
        **settings,
    )


def _trained_loss(model, tmp_path, data, **settings) -> float:
    transformers.Trainer(
        model=model, args=_arguments(tmp_path, **settings), train_dataset=data
    ).train()
    return _loss(model, data)


def _loss(model, data) -> float:
    with torch.no_grad():
        batch = data[0]
        return model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.item()


def test_trainer_fine_tunes_a_mixed_bfloat16_model_and_reloads_its_best_checkpoint(tmp_path):
    model = tiny_models.tiny_decoder()
    apply_policy(model, "mixed_bfloat16")
    data = Repeated(16)
    before = _loss(model, data)
    weight = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    arguments = _arguments(
        tmp_path, save_strategy="epoch", eval_strategy="epoch", load_best_model_at_end=True
    )
    trainer = transformers.Trainer(
        model=model, args=arguments, train_dataset=data, eval_dataset=data
    )
    trainer.train()
    reference = _trained_loss(tiny_models.tiny_decoder(), tmp_path / "float32", data)
    assert _loss(model, data) < 0.75 * before
    assert _loss(model, data) == pytest.approx(reference, rel=0.02)  # as float32 learns
    up = model.model.layers[0].mlp.up_proj
    assert up.weight.dtype == torch.float32 and not torch.equal(up.weight, weight)
    assert up.dtype_policy.name == "mixed_bfloat16"
    assert model.model.norm.dtype_policy.name == "float32"
    checkpoint = sorted(tmp_path.glob("checkpoint-*"))[-1]
    reloaded = type(model).from_pretrained(checkpoint).eval()
    model.eval()
    prompt = data[0]["input_ids"][None]
    with torch.no_grad():
        assert torch.equal(reloaded(prompt).logits, model(prompt).logits)
    assert reloaded.model.layers[0].mlp.up_proj.dtype_policy.name == "mixed_bfloat16"


@pytest.mark.slow
def test_trainer_trains_lora_adapters_on_an_int4_base(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_models.tiny_decoder()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    tuned = peft.get_peft_model(model, config)
    data = Repeated(16)
    before = _loss(tuned, data)
    trainable = {n: p.detach().clone() for n, p in tuned.named_parameters() if p.requires_grad}
    assert trainable and all(p.dtype == torch.float32 for p in trainable.values())
    after = _trained_loss(tuned, tmp_path, data, learning_rate=1e-2)
    float_model = peft.get_peft_model(tiny_models.tiny_decoder(), config)
    reference = _trained_loss(float_model, tmp_path / "float32", data, learning_rate=1e-2)
    assert after < 0.97 * before
    assert after == pytest.approx(reference, rel=0.02)  # as LoRA on the float model learns
    current = dict(tuned.named_parameters())
    assert all(not torch.equal(current[n], p) for n, p in trainable.items())
    base = tuned.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert base.dtype_policy.name == "int4/128_from_mixed_bfloat16"


def test_trainer_refuses_a_model_with_nothing_float_to_train_as_transformers_does(tmp_path):
    """Every linear and embedding int8: transformers' own guard against
    fine-tuning a purely quantized model (attach adapters) holds; with a
    head left float, the head trains."""
    data = Repeated(8)
    model = tiny_models.tiny_decoder()
    quantize(model, "int8")
    with pytest.raises(ValueError, match="purely quantized"):
        transformers.Trainer(model=model, args=_arguments(tmp_path), train_dataset=data)
    model = tiny_models.tiny_decoder()
    quantize(model, "int8", filters=lambda path, module: path != "lm_head")
    head = model.lm_head.weight.detach().clone()
    transformers.Trainer(model=model, args=_arguments(tmp_path), train_dataset=data).train()
    assert not torch.equal(model.lm_head.weight, head)


def scaled_training_step(trainer, model, inputs, num_items_in_batch=None):
    """docs/training_loops.md's recipe, as written there."""
    model.train()
    loss = trainer.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
    # as Trainer's own step: a loss not yet averaged over the accumulated batches is here
    averaged = getattr(trainer, "loss_is_scaled_for_ga", None)
    if averaged is None:
        averaged = (
            trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
        ) or trainer.compute_loss_func is not None
    if not averaged:
        loss = loss / trainer.current_gradient_accumulation_steps
    scaler = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    scaler.scale_loss(loss.float()).backward()
    if trainer.accelerator.sync_gradients:  # the step's last backward: Trainer clips next
        scaler.unscale_()
    return loss.detach()


def test_the_docs_recipe_is_the_one_tested():
    import inspect

    text = (Path(__file__).parents[1] / "docs" / "training_loops.md").read_text()
    body = inspect.getsource(scaled_training_step).split('"""', 2)[2]
    assert body in text


def _sgd_runs(tmp_path, loss_is_scaled_for_ga=None, **settings) -> tuple[list, list]:
    """The recipe on a mixed_float16 model and Trainer's own step on a float32
    one, SGD, accumulating 2 batches over 2 steps: `(moved, norms)`, each the
    mixed_float16 run's then the float32 run's (how far the head moved; the
    logged gradient norms)."""
    from dtype_policies.optimizers import LossScaleOptimizer

    extra = (
        {} if loss_is_scaled_for_ga is None else {"loss_is_scaled_for_ga": loss_is_scaled_for_ga}
    )
    scaled = type(
        "ScaledTrainer", (transformers.Trainer,), {"training_step": scaled_training_step, **extra}
    )
    plain = type("FloatTrainer", (transformers.Trainer,), extra)
    data = Repeated(16)
    moved, norms = [], []
    for trainer_class, policy in ((scaled, "mixed_float16"), (plain, None)):
        model = tiny_models.tiny_decoder()
        if policy:
            apply_policy(model, policy)
        before = model.lm_head.weight.detach().clone()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        optimizer = LossScaleOptimizer(sgd) if policy else sgd
        arguments = _arguments(
            tmp_path / str(policy), gradient_accumulation_steps=2, max_steps=2, **settings
        )
        trainer = trainer_class(
            model=model, args=arguments, train_dataset=data, optimizers=(optimizer, None)
        )
        trainer.train()
        moved.append(float((model.lm_head.weight.detach() - before).norm()))
        norms.append([log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log])
    return moved, norms


@pytest.mark.parametrize("averaged_by_the_model", [True, False])
def test_the_scaled_training_step_accumulates_as_trainer_s_own(tmp_path, averaged_by_the_model):
    """With gradient accumulation, a mixed_float16 model trained through the
    recipe moves its weights as the float32 model under Trainer's own step
    (SGD: a gradient twice too large moves them twice as far)."""
    moved, _ = _sgd_runs(tmp_path, averaged_by_the_model, max_grad_norm=0)
    assert moved[0] == pytest.approx(moved[1], rel=0.05)


def test_the_recipe_lets_trainer_clip_and_log_the_real_gradients(tmp_path):
    """With Trainer's default `max_grad_norm=1.0`, Trainer clipped the scaled
    gradients to 1 before the scaler divided them by 2**15 again: the model
    all but stopped training (6e-6 against 0.2 of weight change), silently."""
    assert _arguments(tmp_path).max_grad_norm == 1.0
    moved, norms = _sgd_runs(tmp_path)
    assert moved[0] == pytest.approx(moved[1], rel=0.05)
    assert norms[0] == pytest.approx(norms[1], rel=0.05)
    assert min(norms[1]) > 1.0  # Trainer clipped every step


def test_trainer_with_mixed_float16_and_the_loss_scaler_through_training_step(tmp_path):
    """docs/training_loops.md's recipe: a training_step that back-propagates
    the scaled loss; the model learns as the float32 one does."""
    from dtype_policies.optimizers import LossScaleOptimizer

    class ScaledTrainer(transformers.Trainer):
        training_step = scaled_training_step

    data = Repeated(16)
    model = tiny_models.tiny_decoder()
    apply_policy(model, "mixed_float16")
    before = _loss(model, data)
    optimizer = LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    arguments = _arguments(tmp_path, max_grad_norm=0)
    ScaledTrainer(
        model=model, args=arguments, train_dataset=data, optimizers=(optimizer, None)
    ).train()
    reference = tiny_models.tiny_decoder()
    float_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    transformers.Trainer(
        model=reference,
        args=_arguments(tmp_path / "float32", max_grad_norm=0),
        train_dataset=data,
        optimizers=(float_optimizer, None),
    ).train()
    after = _loss(model, data)
    assert after < 0.75 * before
    assert after == pytest.approx(_loss(reference, data), rel=0.03)
    assert optimizer.iterations == 8
