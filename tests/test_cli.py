"""The command line, run as users run it: in a subprocess for each kind of
outcome (help, a result, an error, a usage error), and in-process through
`cli.main` (the same code after the interpreter starts) for the variations of
each, so that the suite does not pay an interpreter and torch import per case."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from dtype_policies import DTypePolicyMap, apply_policy, quantize, saving
from dtype_policies.apply import model_totals
from dtype_policies.apply.summary import module_summaries
from dtype_policies.cli import main
from dtype_policies.quantizers import Int4QuantizationConfig

FACTORY = textwrap.dedent(
    """
    import torch

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
        )

    def not_a_model():
        return 42

    ready = mlp()  # a model, not a factory

    def broken():
        raise RuntimeError("factory exploded")

    def many():
        return torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(3000)])

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(32, 8)

        def forward(self, x):
            return torch.nn.functional.dropout(self.linear(x), 0.5, training=True)

    def noisy():
        torch.manual_seed(0)
        return Noisy()
    """
)


def cli(*args, cwd=None, env_path=None):
    env = dict(os.environ)
    if env_path:
        env["PYTHONPATH"] = os.pathsep.join([str(env_path), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "dtype_policies", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


@pytest.fixture
def factory(tmp_path):
    (tmp_path / "cli_models.py").write_text(FACTORY)
    return tmp_path


@pytest.fixture
def in_process(factory, monkeypatch, capsys):
    """`cli.main` in this process with the factory module importable, as the
    console script finds it: `(code, stdout, stderr)`."""
    monkeypatch.chdir(factory)
    monkeypatch.syspath_prepend(str(factory))
    monkeypatch.delitem(sys.modules, "cli_models", raising=False)

    def run(*args):
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_help_and_version(in_process):
    result = cli("--help")
    assert result.returncode == 0
    for command in ("demo", "inspect", "bench"):
        assert command in result.stdout
    code, out, _ = in_process("inspect", "--help")
    assert code == 0 and "--policy" in out
    for command in ("demo", "inspect", "advise", "bench"):
        code, out, _ = in_process(command, "--help")
        assert code == 0 and "--verbose" in out, command
    code, out, _ = in_process("--version")
    assert code == 0 and out.startswith("dtype-policies ")
    assert in_process()[0] == 2


@pytest.mark.slow  # a whole run in a fresh process: kept out of the default suite for its time
def test_demo_reduced_run_reports_every_variant():
    result = cli("demo", "--quick", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    variants = [r["variant"] for r in data["results"]]
    assert variants == [
        "float32",
        "mixed_bfloat16",
        "int8 (from mixed_bfloat16)",
        "int4 (from mixed_bfloat16)",
    ]
    for row in data["results"]:
        assert 0.5 < row["accuracy"] <= 1.0 and row["inference_ms"] > 0 and row["weight_mb"] > 0
    by_name = {r["variant"]: r for r in data["results"]}
    assert by_name["int4 (from mixed_bfloat16)"]["weight_mb"] < by_name["float32"]["weight_mb"] / 3
    assert by_name["float32"]["speed_vs_float32"] == 1.0
    plain = cli("demo", "--quick")
    assert plain.returncode == 0 and "variant" in plain.stdout and "int4" in plain.stdout
    assert "epoch" in plain.stderr  # progress


@pytest.mark.parametrize("quick", [(), ("--quick",)])
def test_demo_refuses_bad_sizes_with_or_without_quick(in_process, quick):
    code, _, err = in_process("demo", *quick, "--epochs", "-1", "--hidden", "0")
    assert code != 0 and "--epochs and --hidden must be positive (got -1, 0)" in err


def test_inspect_a_factory_with_policy_and_quantization(factory):
    result = cli(
        "inspect", "cli_models:mlp", "--policy", "mixed_bfloat16", "--quantize", "int8", "--json",
        env_path=factory,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    rows = {row["path"]: row for row in data["modules"]}
    assert (
        rows["0"]["policy"] == "int8_from_mixed_bfloat16"
        and rows["0"]["quantization"] == "int8/32 W8A8"
    )
    assert rows["2"]["policy"] == "float32"  # the norm island
    assert data["total_parameters"] == 32 * 64 + 64 + 128 + 64 * 8 + 8
    text = cli("inspect", "cli_models:mlp", env_path=factory)
    assert text.returncode == 0 and "Total: " in text.stdout and "LayerNorm" in text.stdout


def test_inspect_quantizes_int4_with_a_block_size_and_takes_a_model_as_target(in_process):
    """`--quantize` took the mode names alone ("int4/32" was an invalid
    choice, while `advise --candidates int4/32` took it), and a TARGET naming
    a model rather than a factory was called, failing inside its forward."""
    code, out, err = in_process("inspect", "cli_models:ready", "--quantize", "int4/32", "--json")
    assert code == 0, err
    rows = {row["path"]: row for row in json.loads(out)["modules"]}
    assert rows["0"]["quantization"].startswith("int4/32")
    code, out, err = in_process("inspect", "cli_models:mlp", "--quantize", "int4/-1", "--json")
    assert code == 0, err
    assert json.loads(out)["modules"][1]["quantization"].startswith("int4/-1")
    code, _, err = in_process("inspect", "cli_models:mlp", "--quantize", "int4/0")
    assert code == 2 and "Invalid block_size" in err


def test_inspect_a_save_pretrained_directory_in_shards(in_process, tmp_path):
    """The README recommends `save_pretrained` for sharing, and `inspect`
    refused its directories ("without a dtype_policies manifest": it is in
    config.json there)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    directory = tmp_path / "pretrained"
    model.save_pretrained(directory, max_shard_size="20KB")
    assert len(list(directory.glob("*.safetensors"))) > 1
    code, out, err = in_process("inspect", str(directory), "--json")
    assert code == 0, err
    rows = {row["path"]: row for row in json.loads(out)["modules"]}
    up = rows["model/layers/0/mlp/up_proj"]
    assert up["policy"] == "int8_from_mixed_bfloat16" and up["quantization"].startswith("int8")
    assert rows["model/norm"]["policy"] == "float32"


def test_inspect_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
    )
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4", filters="^0$")
    saving.save(model, tmp_path / "ckpt")
    result = cli("inspect", str(tmp_path / "ckpt"), "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["path"]: row for row in json.loads(result.stdout)["modules"]}
    assert rows["0"]["quantization"] == "int4/128"
    assert rows["0"]["policy"] == "int4/128_from_mixed_bfloat16"
    assert rows["0"]["parameters"] == 32 * 64 + 64 and rows["0"]["class_name"] == "Linear"
    assert rows["1"]["policy"] == "float32" and rows["2"]["variable_dtype"] == "float32"


@pytest.mark.parametrize(("columns", "drawn"), [(40, False), (200, True)])
def test_a_table_in_a_terminal_never_cuts_a_path(monkeypatch, capsys, columns, drawn):
    pytest.importorskip("rich")
    from dtype_policies.cli import output

    monkeypatch.setattr(output, "fancy", lambda: True)  # as in a terminal
    monkeypatch.setenv("COLUMNS", str(columns))
    paths = ["model/layers/0/self_attn/q_proj", "model/layers/11/mlp/down_proj"]
    rows = [[path, "Linear", "int8_from_mixed_bfloat16", 4096] for path in paths]
    output.print_table("title", ["path", "class", "policy", "bytes"], rows, numeric=1)
    out = capsys.readouterr().out
    assert "…" not in out
    lines = out.splitlines()
    assert any("┃" in line for line in lines) == drawn  # by rich where it fits, else plain
    assert not drawn or all(len(line) <= columns for line in lines)
    for path in paths:  # whole, on one row
        line = next(line for line in lines if path in line)
        assert "int8_from_mixed_bfloat16" in line and "4096" in line


class _TiedWithStatistics(torch.nn.Module):
    """A table tied to its head, a norm with running statistics, a block
    given a quantized policy it has no weight of its own for."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def test_inspect_a_checkpoint_counts_parameters_as_summary_does(tmp_path):
    """Not the norm's running statistics (buffers), a quantized tied table
    once, and each module's policy as it computes by (a container given a
    quantized policy computes with its float source)."""
    torch.manual_seed(0)
    model = _TiedWithStatistics()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"block": "int8_from_mixed_bfloat16"}))
    quantize(model, "int8")
    saving.save(model, tmp_path / "ckpt")
    result = cli("inspect", str(tmp_path / "ckpt"), "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    floats = sum(p.numel() for p in _TiedWithStatistics().parameters())
    assert listed["total_parameters"] == model_totals(model)[0] == floats
    rows = {row["path"]: row for row in listed["modules"]}
    assert rows["block/1"]["parameters"] == 32  # weight and bias, not its statistics
    live = {path.replace(".", "/") or "(root)": m for path, m in model.named_modules()}
    for path, row in rows.items():
        if hasattr(live[path], "dtype_policy"):
            assert row["policy"] == live[path].dtype_policy.name, path


SUMMARIZED = {
    "float32": lambda m: None,
    "mixed_bfloat16": lambda m: apply_policy(m, "mixed_bfloat16"),
    "int8": lambda m: quantize(m, "int8"),
    "int4/32": lambda m: quantize(m, "int4", Int4QuantizationConfig(block_size=32)),
    "float8": lambda m: quantize(m, "float8"),
    "mixed_bfloat16 + int8": lambda m: (apply_policy(m, "mixed_bfloat16"), quantize(m, "int8")),
}


@pytest.mark.parametrize("how", SUMMARIZED)
def test_inspect_a_checkpoint_gives_summarys_rows(how, tmp_path, capsys):
    """Compute and variable dtypes as `summary` names them: a float module
    without a policy computes in its parameters' dtype; variables are the
    parameters and the quantized weight, not scales or statistics. Bytes are
    the file's: a non-persistent buffer is not saved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 64),
        torch.nn.Linear(64, 64),
        torch.nn.Linear(64, 32, bias=False),
        torch.nn.LayerNorm(32),
        torch.nn.BatchNorm1d(32),
    ).eval()
    model.register_buffer("frequencies", torch.zeros(3), persistent=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SUMMARIZED[how](model)
    saving.save(model, tmp_path / "ckpt")
    assert main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    rows = {row["path"]: row for row in json.loads(capsys.readouterr().out)["modules"]}
    live = module_summaries(model)
    assert set(rows) == {row.path for row in live}
    for row in live:
        listed = rows[row.path]
        for column in ("class_name", "policy", "compute_dtype", "variable_dtype", "quantization"):
            assert listed[column] == str(getattr(row, column)), (row.path, column)
        assert listed["parameters"] == row.parameters, row.path
        assert listed["bytes"] == row.bytes - (12 if row.path == "(root)" else 0), row.path


ADVISE = ("advise", "cli_models:mlp", "--inputs", "4x32")
BAD_INPUTS = [
    (("inspect", "no_such_module_xyz:factory"), "cannot import 'no_such_module_xyz'"),
    (("inspect", "cli_models:missing"), "has no attribute 'missing'"),
    (("inspect", "cli_models:not_a_model"), "returned a int, not a torch.nn.Module"),
    (("inspect", "cli_models:broken"), "factory exploded"),
    (("inspect", "not-a-target"), "neither 'package.module:factory' nor a checkpoint"),
    (("inspect", "cli_models:mlp", "--policy", "mixed_float15"), "mixed_float15"),
    (("inspect", "cli_models:mlp", "--policy", ""), "invalid policy ''"),  # was no policy
    (("inspect", "missing.safetensors"), "missing.safetensors"),
    (("bench", "--threads", "0"), "--threads must be an integer from 1 to 2147483647. Received: 0"),
    # a bad --output is refused before measuring (it failed after the run, naming a temp file)
    ((*ADVISE, "--output", "."), "--output '.' is a directory"),
    ((*ADVISE, "--output", "cli_models.py/map.json"), "--output 'cli_models.py/map.json': '"),
    ((*ADVISE, "--output", ""), "--output is empty"),
    # numbers torch overflows on, named (were "ValueError: Overflow when unpacking long long")
    (("demo", "--seed", str(2**64)), f"--seed must be an integer from 0 to {2**64 - 1}. Received"),
    (("bench", "--threads", str(2**40)), "--threads must be an integer from 1 to 2147483647."),
    (("bench", "--contended-retries", "-1"), "--contended-retries must be an integer from 0 to"),
    # a trailing ':' was read as float32; superscript digits are isdigit() but no int
    (("advise", "cli_models:mlp", "--inputs", "4x32:"), "'4x32:' ends with ':'"),
    (("advise", "cli_models:mlp", "--inputs", "4x32:int64:\u00b2"), "HIGH must be a positive"),
]


def test_a_bad_input_exits_1_with_one_line_from_the_interpreter(factory):
    args, message = BAD_INPUTS[3]
    result = cli(*args, env_path=factory, cwd=factory)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "message"), BAD_INPUTS)
def test_bad_inputs_exit_1_with_one_line(in_process, args, message):
    code, _, err = in_process(*args)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in err
    code, _, err = in_process("--verbose", *args)
    assert code == 1 and "Traceback" in err
    code, _, err = in_process(*args, "--verbose")  # after the command too, as documented
    assert code == 1 and "Traceback" in err


def test_a_bad_output_path_is_refused_before_measuring(in_process):
    code, out, err = in_process(*ADVISE, "--output", "cli_models.py/map.json")
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [  # one line, no progress: nothing was measured
        "dtype-policies advise: error: --output 'cli_models.py/map.json': "
        f"'{os.path.join(os.getcwd(), 'cli_models.py')}' is not a directory"
    ]


def test_a_failed_write_prints_the_results_first(in_process, monkeypatch):
    from dtype_policies.advisor.advice import Advice

    def full_disk(self, path):
        raise OSError(28, "No space left on device", f".{path}.x1y2.partial")

    monkeypatch.setattr(Advice, "save", full_disk)
    code, out, err = in_process(*ADVISE, "--quiet", "--output", "new/map.json")
    assert code == 1
    assert out.startswith("path") and "sensitivity int8" in out  # the table, not lost
    assert "map written" not in out
    assert err.strip().splitlines() == [
        "dtype-policies advise: error: --output 'new/map.json': cannot write the map: "
        "No space left on device"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--output", "cli_models.py"), "--output 'cli_models.py' is not a directory"),
        (("--output", "cli_models.py/results"), "--output 'cli_models.py/results': '"),
        (("--output", ""), "--output is empty"),
        (("--charts", "cli_models.py"), "--charts 'cli_models.py' is not a directory"),
    ],
)
def test_bench_refuses_a_bad_directory_before_running(in_process, monkeypatch, args, message):
    from dtype_policies.bench import runner

    monkeypatch.setattr(runner, "main", lambda argv: pytest.fail(f"the suite ran: {argv}"))
    code, _, err = in_process("bench", "--workloads", "overhead_grad", *args)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and message in lines[0], err


def test_a_closed_stdout_ends_the_command_quietly(factory):
    """`dtype-policies inspect ... | head -1` printed "error: BrokenPipeError"
    and exited 1; it ends as a process killed by SIGPIPE reports (141)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(factory), os.environ.get("PYTHONPATH", "")])
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "dtype_policies", "inspect", "cli_models:many"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=factory, env=env,
    )  # fmt: skip
    first = process.stdout.readline()  # its 3,000 rows overflow the pipe: it waits on us
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=300) == 141
    assert first == "cli_models:many\n"
    assert "error" not in err and "BrokenPipe" not in err, err


def test_the_map_is_written_when_stdout_was_closed_before_the_table(factory, tmp_path):
    """`advise ... --output map.json | true`: the table's write raised before
    the map was saved: minutes of measuring lost, exit 141 the only sign."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(factory), os.environ.get("PYTHONPATH", "")])
    )
    target = tmp_path / "map.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "dtype_policies", *ADVISE, "--quiet", "--output", str(target)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=factory, env=env,
    )  # fmt: skip
    process.stdout.close()  # the reader is gone before anything is printed
    err = process.stderr.read()
    assert process.wait(timeout=300) == 141, err
    assert isinstance(saving.load_policy(target), DTypePolicyMap)


def test_a_missed_budget_exits_3_after_printing_and_writing_the_map(in_process):
    """A model whose float32 outputs differ from call to call cannot meet any
    budget: the command exited 0, so a script took the advice for met."""
    with pytest.warns(UserWarning, match="even float32 everywhere"):
        code, out, err = in_process(
            "advise", "cli_models:noisy", "--inputs", "4x32", "--quiet", "--output", "map.json"
        )
    assert code == 3, err
    assert "the budget is not met" in err and "> --max-error 0.02" in err
    assert "sensitivity" in out and "map written to map.json" in out
    assert isinstance(saving.load_policy("map.json"), DTypePolicyMap)
    code, _, err = in_process(*ADVISE, "--quiet")
    assert code == 0 and "budget" not in err


def test_usage_errors_exit_2(in_process):
    assert cli("no-such-command").returncode == 2
    assert in_process("inspect")[0] == 2
    assert in_process("inspect", "x:y", "--quantize", "int3")[0] == 2
    assert in_process("demo", "--epochs", "zero")[0] == 2


@pytest.mark.slow  # a whole run in a fresh process: kept out of the default suite for its time
def test_bench_runs_a_workload_and_writes_json(tmp_path):
    result = cli(
        "bench", "--quick", "--workloads", "overhead_grad", "--output", str(tmp_path), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    variants = {r["variant"] for r in data["results"]}
    assert {"nn.Linear float32", "nn.Linear + apply_policy mixed_bfloat16"} <= variants
    assert (tmp_path / "latest.md").is_file()
    assert "Targets" in result.stderr  # the tables
    bad = cli("bench", "--workloads", "nope")
    assert bad.returncode == 1 and "unknown workloads ['nope']" in bad.stderr


def test_console_script_finds_a_factory_in_the_working_directory(factory):
    script = os.path.join(os.path.dirname(sys.executable), "dtype-policies")
    if not os.path.exists(script):
        pytest.skip("the console script is not installed in this environment")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [script, "inspect", "cli_models:mlp", "--json"],
        capture_output=True, text=True, timeout=300, cwd=factory, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["total_parameters"] == 32 * 64 + 64 + 128 + 64 * 8 + 8


def test_installed_version_is_the_package_version():
    from importlib.metadata import version

    import dtype_policies

    assert version("dtype-policies") == dtype_policies.__version__
    assert main(["--version"]) == 0
