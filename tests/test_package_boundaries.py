"""Contract (package boundaries): the tools (`advisor`, `saving`, `cli`) reach
the rest of the library, and torch, through named entry points only: they
import no leading-underscore name from another package and read or write no
leading-underscore attribute that their own package does not define (torch's
`_parameters`, `_buffers` and `_modules` go through `_core.slots`). The one
exception is the protocol transformers defines for quantizer plugins."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dtype_policies

PACKAGE_ROOT = Path(dtype_policies.__file__).parent
TOOLS = ("advisor", "saving", "cli")
# Attributes transformers reads on models and configs loaded by a quantizer
# plugin (`HfQuantizer`): no public spelling exists.
# attributes transformers reads on a model (the last: the conversions save_pretrained reverses)
TRANSFORMERS_PROTOCOL = {"_is_hf_initialized", "_is_quantized", "_weight_conversions"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _trees(tool: str) -> dict[Path, ast.Module]:
    return {
        path: ast.parse(path.read_text(), filename=str(path))
        for path in sorted((PACKAGE_ROOT / tool).rglob("*.py"))
    }


def _defined_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name the package itself binds: functions, classes, assignments and
    attributes it assigns."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return names


def crossings(tool: str) -> list[str]:
    """Where `tool` uses a private name it does not own."""
    trees = _trees(tool)
    own = _defined_names(trees)
    found = []
    for path, tree in trees.items():
        where = path.relative_to(PACKAGE_ROOT.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                inside = node.module == f"dtype_policies.{tool}" or node.module.startswith(
                    f"dtype_policies.{tool}."
                )
                for alias in node.names:
                    if _private(alias.name) and not inside:
                        found.append(f"{where}:{node.lineno}: imports {node.module}.{alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr not in own and node.attr not in TRANSFORMERS_PROTOCOL:
                    found.append(f"{where}:{node.lineno}: .{node.attr}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
                and node.args[1].value not in own | TRANSFORMERS_PROTOCOL
            ):
                found.append(f"{where}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


@pytest.mark.parametrize("tool", TOOLS)
def test_tools_use_no_private_name_of_another_package(tool):
    assert crossings(tool) == []


def test_the_check_sees_each_kind_of_crossing(tmp_path, monkeypatch):
    tool = tmp_path / "tool"
    tool.mkdir()
    (tool / "module.py").write_text(
        "from dtype_policies.layers.layer import _hidden\n"
        "from dtype_policies.tool.other import _mine\n"
        "def _helper(module, parent):\n"
        "    module._helper(parent._modules['x'], getattr(module, '_dp_stack'))\n"
        "    self._anything = module.__class__\n"
    )
    monkeypatch.setattr(f"{__name__}.PACKAGE_ROOT", tmp_path)
    assert sorted(line.split(": ", 1)[1] for line in crossings("tool")) == [
        "._modules",
        "getattr(..., '_dp_stack')",
        "imports dtype_policies.layers.layer._hidden",
    ]
