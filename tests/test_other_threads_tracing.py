"""Another thread compiling or tracing changes nothing in this thread's calls.

torch's signs that a tracer records the running code are process-wide: from
torch 2.13 `torch.compiler.is_compiling()` holds in every thread for the whole
of any thread's compilation, and torch.fx's tracing flag for any thread's
`make_fx` (every compilation's AOTAutograd) or `symbolic_trace`. Read as they
were, eager calls of a quantized model took the traced paths while another
thread compiled (int4 products 10-90x slower, other values), and a compiled
graph that had read the fx flag failed its guard and compiled again. The
other threads here hold those states through public APIs: a compiler back end
that waits, a traced function that waits.
"""

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from dtype_policies import apply_policy, compile_for_inference, quantize
from dtype_policies._compat import compiling, fx_tracing, is_exporting
from dtype_policies._core.casting import exporting, tracing
from dtype_policies._derivatives import derivative_free, transform_active
from dtype_policies.quantizers import Int4QuantizationConfig


@contextmanager
def held_in_another_thread(hold: Callable[[Callable[[], None]], object]) -> Iterator[None]:
    """Runs `hold(wait)` in another thread, where `wait()` blocks until the
    block ends; the block runs while the other thread is inside `wait`."""
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def wait() -> None:
        inside.set()
        assert release.wait(60)

    def run() -> None:
        try:
            hold(wait)
        except BaseException as error:  # reported by the main thread
            errors.append(error)
            inside.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(60)
    try:
        yield
    finally:
        release.set()
        thread.join(60)
    assert not errors, errors


def compiling_elsewhere(wait: Callable[[], None]) -> None:
    """A `torch.compile` whose back end waits: the compilation session of
    this thread is open meanwhile (torch 2.13 sets `is_compiling` for it)."""

    def waiting_backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        wait()
        return graph.forward

    torch.compile(lambda x: x * 2 + 1, backend=waiting_backend)(torch.ones(3))


def tracing_elsewhere_within_a_compilation(wait: Callable[[], None]) -> None:
    """A back end that traces with `make_fx` and waits inside the trace:
    AOTAutograd's state (the compilation session and torch.fx's flag)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def waiting_backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        def traced(*args: torch.Tensor) -> object:
            wait()
            return graph(*args)

        make_fx(traced)(*example_inputs)
        return graph.forward

    torch.compile(lambda x: x - 1, backend=waiting_backend)(torch.ones(3))


def symbolic_tracing_elsewhere(wait: Callable[[], None]) -> None:
    class Waiting(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            wait()
            return x + 1

    torch.fx.symbolic_trace(Waiting())


OTHER_THREAD = {
    "compiling": compiling_elsewhere,
    "make_fx within a compilation": tracing_elsewhere_within_a_compilation,
    "symbolic_trace": symbolic_tracing_elsewhere,
}

CONFIGS = {
    "int8": ("int8", None),
    "int4/32": ("int4", Int4QuantizationConfig(block_size=32)),
    "int4/128": ("int4", Int4QuantizationConfig(block_size=128)),
}


def quantized_mlp(name: str) -> nn.Module:
    mode, config = CONFIGS[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 384), nn.GELU(), nn.Linear(384, 256)).eval()
    apply_policy(model, "mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(model, mode, config)
    return model


@pytest.mark.parametrize("other", list(OTHER_THREAD))
def test_this_threads_signs_of_tracing_stay_false(other):
    with held_in_another_thread(OTHER_THREAD[other]):
        assert (compiling(), fx_tracing(), is_exporting()) == (False, False, False)
        assert (tracing(), exporting(), transform_active()) == (False, False, False)
        x = torch.ones(2, requires_grad=True)
        assert derivative_free(x.detach()) and not derivative_free(x)
        # a torch.func transform of this thread is still seen
        seen = torch.func.vmap(lambda row: torch.tensor(derivative_free(row)))(torch.ones(3, 2))
        assert seen.tolist() == [False, False, False]


@pytest.mark.parametrize("other", ["compiling", "make_fx within a compilation"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_eager_calls_keep_their_values_while_another_thread_compiles(name, other):
    model = quantized_mlp(name)
    inputs = [
        torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        for rows in (1, 8, 200)
    ]
    with torch.inference_mode():
        expected = [model(x) for x in inputs]
        with held_in_another_thread(OTHER_THREAD[other]):
            got = [model(x) for x in inputs]
    for x, want, have in zip(inputs, expected, got, strict=True):
        assert have.dtype == want.dtype == torch.bfloat16
        assert torch.equal(have, want), x.shape[0]


@pytest.mark.slow
def test_a_compiled_model_called_while_another_thread_traces_compiles_nothing_new():
    """The graphs read no process-wide tracing flag: before, each held a guard
    on torch.fx's flag, which another thread's AOTAutograd sets."""
    from torch._dynamo.utils import counters

    model = quantized_mlp("int8")
    fast = compile_for_inference(model, autotune=False)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = model(x)
        fast(x)
        graphs = counters["stats"]["unique_graphs"]
        with held_in_another_thread(tracing_elsewhere_within_a_compilation):
            try:
                got = fast(x)
            except RuntimeError as error:  # torch's own check, before this library's code
                if "symbolically trace a dynamo-optimized function" not in str(error):
                    raise
                pytest.skip(f"torch {torch.__version__} refuses any compiled call meanwhile")
        # the other thread's own graph is counted when its compilation ends
        assert counters["stats"]["unique_graphs"] - graphs == 1
    assert torch.equal(got, expected)
