"""Every public name of handoff and handoff.sim has a docstring that says more than a signature, and
so does each public attribute of their classes (properties, methods and the array protocols)."""

from __future__ import annotations

import inspect

import pytest

import handoff
import handoff.sim

# Dunders that are part of a class's interface, documented like its public attributes.
PROTOCOLS = {
    "__dlpack__",
    "__dlpack_device__",
    "__array_interface__",
    "__cuda_array_interface__",
    "__cuda_stream__",
    "__handoff_array__",
    "__len__",
}


def description(name: str, value: object) -> str:
    """The docstring of `value` without the signature line pybind11 leads it with."""
    lines = (getattr(value, "__doc__", None) or "").strip().splitlines()
    if lines and lines[0].startswith(f"{name}(") and " -> " in lines[0]:
        lines = lines[1:]
    return "\n".join(lines).strip()


def public_names() -> list[tuple[str, object]]:
    """(qualified name, value) of each callable in the modules' __all__ (not data such as __version__)."""
    out = []
    for module in (handoff, handoff.sim):
        for name in module.__all__:
            value = getattr(module, name)
            if callable(value):
                out.append((f"{module.__name__}.{name}", value))
    return out


def class_attributes() -> list[tuple[str, object]]:
    """(qualified name, descriptor) of each public attribute and protocol of the public classes."""
    out = []
    for qualified, value in public_names():
        if not isinstance(value, type):
            continue
        for name, attribute in vars(value).items():
            if name.startswith("_") and name not in PROTOCOLS:
                continue
            if callable(attribute) or inspect.isdatadescriptor(attribute):
                out.append((f"{qualified}.{name}", attribute))
    return out


def test_the_modules_have_docstrings():
    for module in (handoff, handoff.sim, handoff._handoff, handoff._handoff._sim):
        assert (module.__doc__ or "").strip(), module.__name__


@pytest.mark.parametrize("qualified, value", [pytest.param(q, v, id=q) for q, v in public_names()])
def test_public_names_have_docstrings(qualified: str, value: object):
    assert description(qualified.rpartition(".")[2], value), f"{qualified} has no docstring"


@pytest.mark.parametrize("qualified, attribute", [pytest.param(q, a, id=q) for q, a in class_attributes()])
def test_public_attributes_have_docstrings(qualified: str, attribute: object):
    assert description(qualified.rpartition(".")[2], attribute), f"{qualified} has no docstring"


def test_the_array_attributes_are_all_checked():
    checked = {q.rpartition(".")[2] for q, _ in class_attributes() if q.startswith("handoff.Array.")}
    assert checked == {
        "shape",
        "strides",
        "dtype",
        "device",
        "data_ptr",
        "readonly",
        "ndim",
        "size",
        "nbytes",
        "__array_interface__",
        "__cuda_array_interface__",
        "__dlpack__",
        "__dlpack_device__",
    }
