"""The package's type information (py.typed, the extension's stubs in python/handoff/_handoff/): mypy
checks typing_usage.py and the package against them, and stubtest checks them against the extension
that the other tests import (those tests skip without mypy, which is in the `test` extra). stubtest
cannot read the signatures of pybind11's functions; they are compared with the stubs' here."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import handoff
import handoff._handoff as extension

needs_mypy = pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is not installed (it is in handoff's `test` extra)"
)

HERE = Path(__file__).resolve().parent


def run(tool: list[str], cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Runs a mypy tool on the handoff package imported here (an installed one or build/devpkg)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(handoff.__file__).parent.parent), env.get("PYTHONPATH")])
    )
    env.pop("MYPYPATH", None)
    cache_args = ["--cache-dir", str(cache)] if cache is not None else []
    # tests/python holds no handoff package, so the one on PYTHONPATH is the one checked.
    return subprocess.run(
        [sys.executable, "-m", *tool, *cache_args],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def mypy_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Kept between runs (.pytest_cache), so that only the first run of a suite checks NumPy's stubs.
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir("mypy")) if cache is not None else tmp_path_factory.mktemp("mypy")


def test_the_package_is_typed():
    package = Path(handoff.__file__).parent
    assert (package / "py.typed").is_file()
    assert (package / "_handoff" / "__init__.pyi").is_file()
    assert (package / "_handoff" / "_sim.pyi").is_file()
    # The stubs are a package beside the extension module, which is still what is imported.
    assert handoff._handoff.__file__.endswith((".so", ".pyd"))


@needs_mypy
def test_typed_uses_check(mypy_cache: Path):
    result = run(["mypy", "--strict", "--warn-unused-ignores", "typing_usage.py"], mypy_cache)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_mypy
def test_the_package_checks_strictly(mypy_cache: Path):
    result = run(["mypy", "--strict", "-p", "handoff"], mypy_cache)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_mypy
def test_the_stubs_match_the_extension():
    result = run(["mypy.stubtest", "handoff", "--allowlist", "stubtest_allowlist.txt"])
    assert result.returncode == 0, result.stdout + result.stderr


# --- pybind11's signatures -------------------------------------------------------------------


def parameters(function: ast.FunctionDef) -> list[tuple[str, str, object]]:
    """(name, kind, default) of each parameter but self; the default is a literal, or None when absent."""
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [(a.arg, "positional", d) for a, d in zip(positional, defaults)]
    out += [(a.arg, "keyword", d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return [(name, kind, None if d is None else ast.literal_eval(d)) for name, kind, d in out if name != "self"]


def stub_functions() -> dict[str, ast.FunctionDef]:
    """The functions and methods of the extension's stubs by qualified name ('_sim.Stream.__init__')."""
    out = {}
    for prefix, path in (("", "__init__.pyi"), ("_sim.", "_sim.pyi")):
        tree = ast.parse((Path(handoff.__file__).parent / "_handoff" / path).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                out[prefix + node.name] = node
            elif isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, ast.FunctionDef):
                        out[f"{prefix}{node.name}.{member.name}"] = member
    return out


def pybind11_functions() -> dict[str, ast.FunctionDef]:
    """The extension's pybind11 functions and methods, from the signature leading each docstring."""
    out = {}
    namespaces = {
        "": extension,
        "_sim.": extension._sim,
        "_sim.Stream.": extension._sim.Stream,
        "_sim.Graph.": extension._sim.Graph,
    }
    for prefix, namespace in namespaces.items():
        for name, value in vars(namespace).items():
            first_line = (getattr(value, "__doc__", None) or "").partition("\n")[0]
            if not callable(value) or isinstance(value, type) or not first_line.startswith(f"{name}("):
                continue
            if getattr(value, "__text_signature__", None) is not None:
                continue  # a CPython signature: stubtest reads it
            head = first_line.rpartition(" -> ")[0]
            out[prefix + name] = ast.parse(f"def {head}: pass").body[0]
    return out


def test_pybind11_signatures_match_the_stubs():
    stubs = stub_functions()
    bound = pybind11_functions()
    assert len(bound) > 20
    for name, function in bound.items():
        if name.endswith("__repr__"):
            continue
        assert name in stubs, f"{name} has no stub"
        assert parameters(stubs[name]) == parameters(function), name
