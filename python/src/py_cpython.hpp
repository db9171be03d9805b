// The few raw CPython idioms the bindings share, spelled once: Python's own rules for what counts
// as an int, and for an attribute that may be missing.
#pragma once

#include <pybind11/pybind11.h>

#include <utility>

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

/// A reference a C++ frame owns while it calls Python code. A daemon thread that finalization ends
/// in that code (CPython's pthread_exit, the GIL already given up) unwinds through the frame: a
/// py::object would then drop its reference without the GIL; this one leaves it to the ending
/// process. Move-only.
class call_argument {
 public:
  call_argument() noexcept = default;
  explicit call_argument(py::object object) noexcept : object_(object.release().ptr()) {}
  call_argument(call_argument&& other) noexcept : object_(std::exchange(other.object_, nullptr)) {}
  call_argument& operator=(call_argument&&) = delete;
  call_argument(const call_argument&) = delete;
  call_argument& operator=(const call_argument&) = delete;
  ~call_argument();

  [[nodiscard]] py::handle get() const noexcept { return object_ != nullptr ? object_ : Py_None; }

 private:
  PyObject* object_{nullptr};
};

}  // namespace handoff::python
