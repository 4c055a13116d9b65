"""`dtype-policies inspect TARGET`: the per-layer table of a model or a checkpoint."""

from __future__ import annotations

import argparse
from typing import Any

from dtype_policies.apply import apply_policy, module_summaries
from dtype_policies.apply.summary import COLUMNS
from dtype_policies.cli import output
from dtype_policies.cli.targets import CLIError, build_model, is_checkpoint
from dtype_policies.policies import deserialize, policy_for_config
from dtype_policies.quantization import quantize
from dtype_policies.saving import load_policy
from dtype_policies.saving.checkpoint import _model_file, _read_header

_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I8": "int8"}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="print the per-layer table of a model or a checkpoint",
        description="Prints every module's path, class, policy, compute and variable "
        "dtypes, quantization, parameters and bytes, with totals.",
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
        "--quantize", metavar="MODE", choices=("int8", "int4", "float8"), help="then quantize"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if is_checkpoint(args.target):
        if args.policy or args.policy_map or args.quantize:
            raise CLIError("--policy, --policy-map and --quantize apply to a factory TARGET only")
        rows = _checkpoint_rows(args.target)
    else:
        model = build_model(args.target)
        if args.policy or args.policy_map:
            policy = load_policy(args.policy_map) if args.policy_map else args.policy
            apply_policy(model, policy)
        if args.quantize:
            quantize(model, args.quantize)
        rows = [row.as_dict() for row in module_summaries(model)]
    if args.json:
        output.print_json(
            {
                "target": args.target,
                "modules": rows,
                "total_parameters": sum(r["parameters"] for r in rows),
                "total_bytes": sum(r["bytes"] for r in rows),
            }
        )
        return 0
    output.print_table(
        f"{args.target}",
        [name for name, _ in COLUMNS],
        [[row[field] for _, field in COLUMNS] for row in rows],
        numeric=2,
        footer=f"Total: {sum(r['parameters'] for r in rows):,} parameters, "
        f"{sum(r['bytes'] for r in rows):,} bytes",
    )
    return 0


def _checkpoint_rows(target: str) -> list[dict[str, Any]]:
    """The table of a checkpoint, from its manifest and tensor header alone."""
    file = _model_file(target)
    if not file.is_file():
        raise CLIError(f"no checkpoint at '{file}'")
    manifest, header = _read_header(file)
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
        parameters = sum(
            _numel(shape) for tensor, (shape, code) in own.items() if tensor not in stored
        )
        if quantized is not None:
            if policy is not None and policy.quantization_mode is None:
                policy = policy_for_config(quantized.quantization_config, policy.name)
            if quantized.mode != "float8":
                parameters += _numel(quantized.float_shape)
        rows.append(
            {
                "path": name.replace(".", "/") or "(root)",
                "class_name": manifest.classes.get(name, "?"),
                "policy": policy.name if policy is not None else "-",
                "compute_dtype": policy.compute_dtype if policy is not None else "-",
                "variable_dtype": ",".join(
                    sorted({_DTYPE_NAMES.get(code, code.lower()) for _, code in own.values()})
                )
                or "-",
                "quantization": _label(quantized),
                "parameters": parameters,
                "bytes": sum(
                    _numel(shape) * _DTYPE_BYTES.get(code, 1) for shape, code in own.values()
                ),
            }
        )
    return rows


def _numel(shape: Any) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _label(quantized: Any) -> str:
    if quantized is None:
        return "-"
    config = quantized.quantization_config
    if quantized.mode == "int4":
        return f"int4/{config.group_size}"
    if quantized.mode == "int8" and config.weight_only:
        return "int8 weight-only"
    return quantized.mode
