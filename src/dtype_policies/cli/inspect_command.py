"""`dtype-policies inspect TARGET`: the per-layer table of a model or a checkpoint."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from dtype_policies._cpu import processor
from dtype_policies._modes import mode_record, registered_modes
from dtype_policies._paths import named_module_paths, root_path_of
from dtype_policies.apply import apply_policy, model_totals, module_summaries
from dtype_policies.apply.kernel_report import kernel_of
from dtype_policies.apply.summary import COLUMNS, label_of
from dtype_policies.cli import output
from dtype_policies.cli.options import common_options
from dtype_policies.cli.targets import CLIError, build_model, is_checkpoint
from dtype_policies.policies import QuantizedDTypePolicy, deserialize, policy_for_config
from dtype_policies.policies.quantized import parse_int4_mode
from dtype_policies.quantization import Int4QuantizationConfig, quantize
from dtype_policies.saving import load_policy
from dtype_policies.saving.checkpoint import (
    dtype_of_code,
    model_file,
    read_header,
    read_pretrained_header,
)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        parents=[common_options()],
        help="print the per-layer table of a model or a checkpoint",
        description="Prints every module's path, class, policy, compute and variable "
        "dtypes, quantization, parameters and bytes, with totals: the rows of "
        "dtype_policies.summary(model); of a checkpoint, its bytes are those it holds "
        "(non-persistent buffers, such as rotary frequencies, are not saved).",
    )
    parser.add_argument(
        "target",
        metavar="TARGET",
        help="'package.module:factory' (a callable returning a model) or a checkpoint "
        "written by dtype_policies.saving.save",
    )
    policy = parser.add_mutually_exclusive_group()
    policy.add_argument("--policy", help="apply this policy first (e.g. mixed_bfloat16)")
    policy.add_argument("--policy-map", metavar="FILE", help="apply a policy file (JSON) first")
    parser.add_argument(
        "--quantize",
        metavar="MODE",
        type=quantize_mode,
        choices=_QuantizeChoices(quantize_choices()),
        help=f"then quantize: {', '.join(quantize_choices())}, or int4/<block size> "
        "(int4/32, int4/-1: per channel)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def quantize_choices() -> tuple[str, ...]:
    """The modes `--quantize` offers: those that quantize without calibration data."""
    return tuple(record.name for record in registered_modes() if not record.calibrated)


class _QuantizeChoices(tuple):
    """The modes (what listing `--quantize`'s choices shows), holding
    `int4/<block>` too (what `quantize_mode` let through)."""

    def __contains__(self, value: object) -> bool:
        return tuple.__contains__(self, value) or (
            isinstance(value, str) and value.startswith("int4/")
        )


def quantize_mode(text: str) -> str:
    """`--quantize`'s value: a mode of `quantize_choices()` or `int4/<block>`."""
    if text in quantize_choices():
        return text
    if text.startswith("int4/"):
        try:
            parse_int4_mode(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text
    raise argparse.ArgumentTypeError(
        f"invalid MODE {text!r}: choose from {', '.join(quantize_choices())} or "
        "int4/<block size> (int4/32, int4/-1)"
    )


def run(args: argparse.Namespace) -> int:
    if is_checkpoint(args.target):
        if args.policy is not None or args.policy_map is not None or args.quantize:
            raise CLIError("--policy, --policy-map and --quantize apply to a factory TARGET only")
        rows = _checkpoint_rows(args.target)
        totals = (sum(r["parameters"] for r in rows), sum(r["bytes"] for r in rows))
    else:
        model = build_model(args.target)
        if args.policy is not None or args.policy_map is not None:
            policy = load_policy(args.policy_map) if args.policy_map is not None else args.policy
            apply_policy(model, policy)
        if args.quantize:
            mode, _, block = args.quantize.partition("/")
            config = Int4QuantizationConfig(block_size=int(block)) if block else None
            quantize(model, mode, config)
        rows = [row.as_dict() for row in module_summaries(model)]
        for row, (_, module) in zip(rows, named_module_paths(model, root_path_of(model))):
            row["kernel"] = kernel_of(module)
        totals = model_totals(model)  # a table shared by two modules, once
    cpu = processor().describe()
    if args.json:
        output.print_json(
            {
                "target": args.target,
                "cpu": cpu,
                "modules": rows,
                "total_parameters": totals[0],
                "total_bytes": totals[1],
            }
        )
        return 0
    output.print_table(
        f"{args.target}",
        [name for name, _ in COLUMNS],
        [[row[field] for _, field in COLUMNS] for row in rows],
        numeric=2,
        footer=f"Total: {totals[0]:,} parameters, {totals[1]:,} bytes",
    )
    kernels = [(row["path"], row["kernel"]) for row in rows if row.get("kernel", "-") != "-"]
    print(f"CPU class: {cpu}")
    if kernels:
        print("Kernels on this CPU:")
        for path, kernel in kernels:
            print(f"  {path}: {kernel}")
    return 0


def _checkpoint_rows(target: str) -> list[dict[str, Any]]:
    """The table of a checkpoint, from its manifest and tensor header alone
    (`saving.save`'s, or a Hugging Face model's `save_pretrained`)."""
    pretrained = read_pretrained_header(Path(target)) if Path(target).is_dir() else None
    if pretrained is not None:
        manifest, header = pretrained
    else:
        file = model_file(target)
        if not file.is_file():
            raise CLIError(f"no checkpoint at '{file}'")
        manifest, header = read_header(file)
    buffers = set(manifest.buffers or ())  # none known in checkpoints before 2026-12-03
    names = set(manifest.classes) | set(manifest.modules) | set(manifest.layers)
    rows = []
    for name in sorted(names | set(manifest.quantized), key=lambda n: (n != "", n)):
        own = {
            key.rpartition(".")[2]: value
            for key, value in header.items()
            if key.rpartition(".")[0] == name and key not in manifest.non_persistent
        }
        policy = None
        if name in manifest.modules:
            policy = deserialize(manifest.modules[name].policy)
        elif name in manifest.layers:
            policy = deserialize(manifest.layers[name])
        quantized = manifest.quantized.get(name)
        stored = set(quantized.stored) if quantized is not None else set()
        prefix = f"{name}." if name else ""
        own_parameters = {
            tensor: code
            for tensor, (_, code) in own.items()
            if tensor not in stored and prefix + tensor not in buffers
        }
        parameters = sum(math.prod(own[tensor][0]) for tensor in own_parameters)
        variables = set(own_parameters.values())  # as `summary`: parameters and the weight
        if quantized is not None:
            record = mode_record(quantized.mode)
            suffix = record.scheme.data_suffix(quantized.quantization_config)
            weight = [] if suffix is None else [quantized.weight + suffix]
            kept = stored if record.keeps_float_weight else set(weight) & set(own)
            variables |= {own[tensor][1] for tensor in kept if tensor in own}
        if quantized is not None:  # the policy it computes by, as `summary` shows it
            if isinstance(policy, QuantizedDTypePolicy):
                policy = policy.source_policy
            source = quantized.float_dtype if policy is None else policy.name
            policy = policy_for_config(quantized.quantization_config, source)
            shared = any(prefix + tensor in manifest.aliases for tensor in quantized.stored)
            if not mode_record(quantized.mode).keeps_float_weight and not shared:
                parameters += math.prod(quantized.float_shape)  # a tied table: once
        elif isinstance(policy, QuantizedDTypePolicy):
            policy = policy.source_policy  # a module its quantized policy left float
        rows.append(
            {
                "path": name.replace(".", "/") or "(root)",
                "class_name": manifest.classes.get(name, "?"),
                "policy": policy.name if policy is not None else "-",
                "compute_dtype": policy.compute_dtype
                if policy is not None
                else _dtype_names(set(own_parameters.values())),
                "variable_dtype": _dtype_names(variables),
                "quantization": "-"
                if quantized is None
                else label_of(quantized.mode, quantized.quantization_config),
                "parameters": parameters,
                "bytes": sum(math.prod(shape) * _itemsize(code) for shape, code in own.values()),
            }
        )
    return rows


def _dtype_names(codes: set[str]) -> str:
    """The dtypes of tensors by their header codes, as `summary` names them."""
    return ",".join(sorted({_dtype_name(code) for code in codes})) or "-"


def _dtype_name(code: str) -> str:
    dtype = dtype_of_code(code)
    return code.lower() if dtype is None else str(dtype).removeprefix("torch.")


def _itemsize(code: str) -> int:
    dtype = dtype_of_code(code)
    return 1 if dtype is None else dtype.itemsize
