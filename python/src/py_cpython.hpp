// The few raw CPython idioms the bindings share, spelled once: Python's own rules for what counts
// as an int, and for an attribute that may be missing.
#pragma once

#include <pybind11/pybind11.h>

namespace handoff::python {

namespace py = pybind11;

/// True for an int that is no bool: a bool is an int to CPython, but never a count, a pointer or a
/// stream to handoff.
[[nodiscard]] inline bool is_int(PyObject* value) noexcept
{
  return PyLong_Check(value) && !PyBool_Check(value);
}

/// getattr(object, name, <missing>): a null object when the attribute is missing. Only an
/// AttributeError means that; any other exception (a property that raises) propagates.
[[nodiscard]] inline py::object optional_attribute(py::handle object, PyObject* name)
{
  PyObject* value = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  if (PyObject_GetOptionalAttr(object.ptr(), name, &value) < 0) { throw py::error_already_set(); }
#else
  if (_PyObject_LookupAttr(object.ptr(), name, &value) < 0) { throw py::error_already_set(); }
#endif
  return py::reinterpret_steal<py::object>(value);
}

}  // namespace handoff::python
