"""Contract (public API): the package and each of its public namespaces declare
`__all__`, which lists exactly the names they define or re-export (submodules,
which are implementation files, and names from outside the package aside),
`import *` gives exactly those names, and every name a namespace shares with
its Keras 3 counterpart is listed. Every public object shows itself in a
runnable example that the doctest collection runs."""

from __future__ import annotations

import doctest
import importlib
import inspect
import os
import subprocess
import sys
import types

import pytest

import dtype_policies

# The public namespaces, each with its Keras 3 counterpart (None: no counterpart).
NAMESPACES = {
    "activations": "activations",
    "config": "config",
    "constraints": "constraints",
    "distributed": None,
    "initializers": "initializers",
    "layers": "layers",
    "mixed_precision": "mixed_precision",
    "optimizers": "optimizers",
    "policies": "dtype_policies",
    "quantization": None,
    "quantizers": "quantizers",
    "regularizers": "regularizers",
    "saving": None,  # keras.saving is Keras's model files: no name in common
}
# Tables the namespaces' own functions read (`get`, deserialization): public
# spellings, not API (Keras does not export its ALL_OBJECTS_DICT either).
TABLES = {"ACTIVATIONS", "BUILTIN_LAYERS", "CONSTRAINTS", "INITIALIZERS", "REGULARIZERS"}
# Submodules the package itself re-exports their functions from.
IMPLEMENTATION_MODULES = {"advisor", "apply", "default_policy", "generation", "inference"}


def _module(name: str) -> types.ModuleType:
    return dtype_policies if name == "" else importlib.import_module(f"dtype_policies.{name}")


def _defined_or_reexported(module: types.ModuleType) -> set[str]:
    """Every public spelling bound in `module` that this package made: not a
    submodule, not an import from elsewhere (typing's `Any`, `torch`,
    `from __future__ import annotations`)."""
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_") or name in TABLES:
            continue
        if isinstance(value, types.ModuleType):
            continue
        origin = getattr(value, "__module__", None)
        if isinstance(value, type) or callable(value):
            if not (origin or "").startswith("dtype_policies"):
                continue
        elif type(value).__module__ == "__future__":
            continue
        names.add(name)
    if "__getattr__" in vars(module):  # names served at access (QUANTIZATION_MODES)
        names |= {name for name in module.__all__ if name not in vars(module)}
        assert all(hasattr(module, name) for name in module.__all__)
    return names


def test_the_package_lists_its_namespaces_and_names():
    listed = set(dtype_policies.__all__)
    namespaces = {n for n in listed if isinstance(getattr(dtype_policies, n), types.ModuleType)}
    assert namespaces == set(NAMESPACES)
    assert listed - namespaces == _defined_or_reexported(dtype_policies) | {"__version__"}
    # what `import dtype_policies` alone loads: other tests import more (bench, cli)
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import types, dtype_policies; print(' '.join(n for n, v in vars(dtype_policies)"
            ".items() if isinstance(v, types.ModuleType) and not n.startswith('_')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert set(loaded.stdout.split()) - namespaces == IMPLEMENTATION_MODULES


@pytest.mark.parametrize("name", sorted(NAMESPACES))
def test_namespace_all_lists_exactly_its_public_names(name):
    module = _module(name)
    assert "__all__" in vars(module), f"dtype_policies.{name} has no __all__"
    assert len(module.__all__) == len(set(module.__all__)), "a name listed twice"
    assert set(module.__all__) == _defined_or_reexported(module)


@pytest.mark.parametrize("name", ["", *sorted(NAMESPACES)])
def test_star_import_gives_exactly_all(name):
    module_name = "dtype_policies" + (f".{name}" if name else "")
    namespace: dict = {}
    exec(f"from {module_name} import *", namespace)
    namespace.pop("__builtins__")
    assert set(namespace) == set(_module(name).__all__)


@pytest.mark.parametrize("name", sorted(n for n, keras_name in NAMESPACES.items() if keras_name))
def test_names_shared_with_keras_are_listed(name):
    os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    theirs = getattr(keras, NAMESPACES[name])
    module = _module(name)
    shared = {
        n
        for n in dir(theirs)
        if not n.startswith("_")
        and not isinstance(getattr(theirs, n), types.ModuleType)
        and hasattr(module, n)
    }
    assert shared, f"dtype_policies.{name} shares no name with keras.{NAMESPACES[name]}"
    assert shared <= set(module.__all__)
    if name == "policies":  # the top level mirrors keras.dtype_policies too
        assert shared <= set(dtype_policies.__all__)


# Namespaces that mirror Keras's whole: every public name of their Keras
# counterpart exists here too, with Keras's meaning (tests/test_keras_namespaces.py
# checks the numerics and serialized forms).
WHOLE_MIRRORS = ["activations", "constraints", "initializers", "quantizers", "regularizers"]
# Keras names these mirrors leave out on purpose, each with its reason. None today.
LEFT_OUT: dict[str, set[str]] = {name: set() for name in WHOLE_MIRRORS}


@pytest.mark.parametrize("name", WHOLE_MIRRORS)
def test_mirrors_have_every_keras_name(name):
    os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    theirs = getattr(keras, NAMESPACES[name])
    keras_names = {
        n
        for n in dir(theirs)
        if not n.startswith("_") and not isinstance(getattr(theirs, n), types.ModuleType)
    }
    missing = keras_names - set(_module(name).__all__) - LEFT_OUT[name]
    assert not missing, f"dtype_policies.{name} lacks keras.{NAMESPACES[name]}'s {sorted(missing)}"
    assert LEFT_OUT[name] <= keras_names, "a name left out that Keras no longer has"


def _public_objects() -> list[tuple[str, str]]:
    return [
        (namespace, name)
        for namespace in ["", *sorted(NAMESPACES)]
        for name in _module(namespace).__all__
    ]


def _collected_examples(module_name: str) -> dict[str, int]:
    """The doctests `--doctest-modules` collects from a module: name -> examples."""
    finder = doctest.DocTestFinder()
    module = importlib.import_module(module_name)
    return {test.name: len(test.examples) for test in finder.find(module)}


@pytest.mark.parametrize(
    ("namespace", "name"), _public_objects(), ids=lambda value: value or "dtype_policies"
)
def test_every_public_object_has_a_collected_example(namespace, name):
    module = _module(namespace)
    value = getattr(module, name)
    if inspect.ismodule(value):
        owner, qualified = value.__name__, value.__name__
    elif inspect.isclass(value) or inspect.isroutine(value):
        owner = value.__module__
        qualified = f"{owner}.{value.__qualname__}"
    else:  # a constant has no docstring of its own: its namespace's shows it
        lines = (module.__doc__ or "").splitlines()
        shown = [line for line in lines if line.lstrip().startswith(">>>") and name in line]
        assert shown, f"{module.__name__}.{name} appears in no example of the module docstring"
        return
    assert _collected_examples(owner).get(qualified, 0) > 0, (
        f"{module.__name__}.{name} ({qualified}) has no runnable >>> example in its docstring"
    )
