"""Contract: through int8 (W8A8 and weight-only) and int4 layers, d(out)/d(input)
is the straight-through gradient through the dequantized weight,
`grad_x = grad_y @ W_deq` (cosine > 0.999), in forward mode too
(`t_y = t_x @ W_deq.T`). Bias gradients flow; the quantized
weight gets none; an embedding table gets none; an adapter trained in front of
a frozen int8 layer learns."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn

from dtype_policies import apply_policy, quantize

from .helpers import (
    EMBEDDING_KINDS,
    IN_FEATURES,
    INTEGER_MODES,
    LINEAR_KINDS,
    OUT_FEATURES,
    QUANTIZE_ARGS,
    VOCAB,
    cosine,
    dequantized_nk,
    make_embedding,
    make_linear,
    quantize_with,
    relative_error,
    snapshot,
)


def _forward_backward(model, shape, seed=7):
    torch.manual_seed(seed)
    x = torch.randn(*shape, requires_grad=True)
    y = model(x)
    g = torch.randn(y.shape)
    (y.float() * g).sum().backward()
    return x, y, g


@pytest.mark.parametrize("rows", [6, 20])
@pytest.mark.parametrize("source", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_input_gradient_is_straight_through(mode, kind, source, rows):
    model, leaf, reference = make_linear(kind, source)
    quantize_with(model, mode)
    x, _y, g = _forward_backward(model, (rows, IN_FEATURES))
    assert x.grad is not None
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    # Against the float weight first (independent of the stored names): the
    # quantized weight is within a few percent of it.
    with_float_weight = g.float() @ reference.weight_nk
    assert cosine(x.grad, with_float_weight) > 0.97
    # The contract: exactly the straight-through gradient of W_deq.
    with_dequantized = g.float() @ dequantized_nk(leaf, kind, mode)
    assert cosine(x.grad, with_dequantized) > 0.999


@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_input_gradient_3d_inputs(mode):
    model, leaf, reference = make_linear("linear", "mixed_bfloat16")
    quantize_with(model, mode)
    x, y, g = _forward_backward(model, (2, 9, IN_FEATURES))
    assert y.shape == (2, 9, OUT_FEATURES)
    assert cosine(x.grad, g.float() @ reference.weight_nk) > 0.97
    assert cosine(x.grad, g.float() @ dequantized_nk(leaf, "linear", mode)) > 0.999


def test_float8_input_gradient_close_to_float():
    model, leaf, reference = make_linear("linear", "mixed_bfloat16")
    quantize_with(model, "float8")
    x, _y, g = _forward_backward(model, (6, IN_FEATURES))
    assert cosine(x.grad, g.float() @ reference.weight_nk) > 0.99
    assert leaf.weight.grad is not None  # float8 keeps training its float weight


@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_bias_gradient_flows_weight_gets_none(mode, kind):
    model, leaf, _ = make_linear(kind, "float32")
    quantize_with(model, mode)
    before = snapshot(model)
    names = [name for name, _ in model.named_parameters()]
    assert all(not name.endswith(("weight", "kernel")) for name in names), names
    _x, _y, g = _forward_backward(model, (6, IN_FEATURES))
    bias = leaf.bias
    assert bias.grad is not None
    torch.testing.assert_close(bias.grad, g.sum(0), rtol=1e-4, atol=1e-4)
    for name, buffer in leaf.named_buffers():
        assert not buffer.requires_grad, name
        assert buffer.grad is None, name
    state = model.state_dict()
    for key, value in before["state"].items():  # backward wrote nothing stored
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
@pytest.mark.parametrize("mode", ["int8", "int4_128", "int4_pc"])
def test_quantized_embedding_table_gets_no_gradient(mode, kind):
    embedding_model, leaf, _ = make_embedding(kind, "mixed_bfloat16")
    quantize_with(embedding_model, mode)
    assert list(leaf.parameters()) == []
    head = nn.Linear(leaf_dim(leaf), 4)
    ids = torch.tensor([[1, 2, VOCAB - 1]])
    out = head(embedding_model(ids).float())
    out.sum().backward()
    assert head.weight.grad is not None
    for name, buffer in leaf.named_buffers():
        assert buffer.grad is None and not buffer.requires_grad, name


def leaf_dim(leaf):
    return getattr(leaf, "embedding_dim", None) or leaf.output_dim


@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_torch_module_weight_is_dequantized_float(mode):
    """`module.weight` of a quantized torch module is the dequantized float
    weight in the variable dtype (so parents reading it keep working)."""
    model, leaf, reference = make_linear("linear", "mixed_bfloat16")
    quantize_with(model, mode)
    weight = leaf.weight
    assert weight.dtype == torch.float32
    assert weight.shape == (OUT_FEATURES, IN_FEATURES)
    torch.testing.assert_close(weight, dequantized_nk(leaf, "linear", mode), rtol=1e-5, atol=1e-6)
    error = (weight - reference.weight_nk).norm() / reference.weight_nk.norm()
    assert error < (0.02 if mode.startswith("int8") else 0.2)


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("mode", ["int8", "int8_weight_only", "int4", "int4_per_channel"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_input_gradient_is_the_straight_through_one(mode, policy):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    apply_policy(linear, policy)
    quantize(linear, *QUANTIZE_ARGS[mode])
    x = torch.randn(8, 64, requires_grad=True)
    linear(x).float().square().sum().backward()
    dequantized = linear.weight.detach().float()  # reads as the dequantized weight
    reference_x = x.detach().clone().requires_grad_(True)
    y = torch.nn.functional.linear(reference_x, dequantized, linear.bias.detach())
    y.square().sum().backward()
    cosine = torch.nn.functional.cosine_similarity(
        x.grad.flatten(), reference_x.grad.flatten(), dim=0
    )
    assert cosine > (0.999 if policy == "float32" else 0.99)
    assert linear.bias.grad is not None and linear.bias.grad.dtype == torch.float32
    assert all(not t.requires_grad for t in linear.buffers())


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("mode", ["int8", "int8_weight_only", "int4", "int4_per_channel"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_forward_mode_tangent_is_the_straight_through_one(mode, policy):
    """`torch.func.jvp` and `torch.autograd.forward_ad` (with gradients off,
    on, and a reverse graph recorded at once) give `t @ W_deq.T`: no tangent
    through the activations' rounding, none lost in a kernel."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    apply_policy(linear, policy)
    quantize(linear, *QUANTIZE_ARGS[mode])
    x, t = torch.randn(4, 64), torch.randn(4, 64)
    expected = t @ linear.weight.detach().float().t()  # reads as the dequantized weight
    # the int4 kernel's bfloat16 weight under torch.func (plain ops), and
    # bfloat16 tangents under mixed_bfloat16
    tolerance = 1e-2

    def forward_ad(x, grad_enabled):
        with torch.set_grad_enabled(grad_enabled), fwAD.dual_level():
            return fwAD.unpack_dual(linear(fwAD.make_dual(x, t))).tangent.float()

    tangents = {
        "func.jvp": torch.func.jvp(lambda a: linear(a).float(), (x,), (t,))[1],
        "forward_ad": forward_ad(x, True),
        "forward_ad, no_grad": forward_ad(x, False),
        "forward_ad and backward": forward_ad(x.clone().requires_grad_(True), True),
    }
    for name, tangent in tangents.items():
        assert relative_error(tangent, expected) < tolerance, name
    bias, bias_tangent = linear.bias.detach(), torch.randn(32)
    with fwAD.dual_level():
        dual_bias = {"bias": fwAD.make_dual(bias, bias_tangent)}
        out = torch.func.functional_call(linear, dual_bias, (x,))
        tangent = fwAD.unpack_dual(out).tangent
    assert relative_error(tangent, bias_tangent.expand(4, -1)) < tolerance


@pytest.mark.usefixtures("quiet")
def test_adapter_before_a_quantized_layer_learns():
    torch.manual_seed(0)
    frozen = nn.Linear(32, 16)
    target = torch.randn(64, 16)
    x = torch.randn(64, 32)
    quantize(frozen, "int8")
    adapter = nn.Linear(32, 32)
    optimizer = torch.optim.Adam(adapter.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss = (frozen(adapter(x)) - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("mode", [*INTEGER_MODES, "float8"])
def test_activation_checkpointing_through_a_quantized_layer(mode, use_reentrant):
    """Checkpointing a segment that holds a quantized layer (a LoRA-style
    adapter trained in front of it, with gradient checkpointing) gives the
    gradients of the run without it; non-reentrant checkpointing allows each
    saved tensor to be unpacked once."""
    model, _, _ = make_linear("linear", "mixed_bfloat16")
    quantize_with(model, mode)
    adapter = nn.Linear(IN_FEATURES, IN_FEATURES)
    x = torch.randn(5, IN_FEATURES, generator=torch.Generator().manual_seed(3))
    x.requires_grad_(use_reentrant)  # reentrant checkpointing needs an input that does

    def segment(inputs):
        return model(adapter(inputs))

    grads = []
    for checkpointed in (False, True):
        adapter.zero_grad()
        if checkpointed:
            y = torch.utils.checkpoint.checkpoint(segment, x, use_reentrant=use_reentrant)
        else:
            y = segment(x)
        y.float().square().sum().backward()
        grads.append(adapter.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    assert torch.equal(grads[0], grads[1])


class _GatedMLP(nn.Module):
    """Llama's MLP: `down(silu(gate(x)) * up(x))`, at widths of no power of two."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(72, 200, bias=False)
        self.up = nn.Linear(72, 200, bias=False)
        self.down = nn.Linear(200, 72, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.slow  # Inductor compiles
@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_compiled_training_gradients_through_a_quantized_layer_are_eager_ones(mode):
    """Under `torch.compile`, the gradients of the float layers before a
    quantized one are eager's (they were all NaN through int8's activation
    blocks: the derivative reached the blocks' scales)."""
    torch.manual_seed(0)
    model = _GatedMLP()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, mode, filters=lambda path, module: path == "down")
    x = torch.randn(4, 24, 72)
    grads = []
    for run in (model, torch.compile(model)):
        model.zero_grad()
        run(x).float().square().sum().backward()
        grads.append(model.gate.weight.grad.clone())
    eager, compiled = grads
    assert torch.isfinite(compiled).all()
    assert relative_error(compiled, eager) < 2e-2
