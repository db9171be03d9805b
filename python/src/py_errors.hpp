// Errors across the boundary: each handoff exception to its one Python type, and messages that name
// what Python passed.
#pragma once

#include <pybind11/pybind11.h>

#include <cxxabi.h>
#include <exception>
#include <string>
#include <string_view>

namespace handoff::python {

namespace py = pybind11;

/// The `__name__` of `object`'s type, for messages: read as `type.__name__` reads it, without
/// making an object. Valid while the type is alive.
[[nodiscard]] std::string_view type_name(py::handle object) noexcept;

/// Sets `handoff.DeviceError`, the Python type `device_error` maps to (made by the module).
void set_device_error_type(PyObject* type) noexcept;

/// Sets the Python error that the C++ exception being handled maps to: each handoff exception to
/// its one Python type, pybind11's to theirs, `std::bad_alloc` to MemoryError, any other to
/// RuntimeError. Call it only from a `catch` block, in functions called from Python without
/// pybind11 (which would otherwise translate the exception itself).
void raise_current_exception() noexcept;

/// Runs `body` (returning a py::object) as a CPython entry point: a new reference, or nullptr with
/// the Python error its exception maps to.
template <typename Body>
PyObject* python_entry(Body&& body) noexcept
{
  try {
    return body().release().ptr();
  } catch (...) {
    raise_current_exception();
    return nullptr;
  }
}

/// python_entry for an entry point that runs Python code of another library's (a producer's, a stream
/// lookup's), where Python's exit may end a daemon thread with pthread_exit: its unwinding passes
/// through (a noexcept frame would abort the process), and the entry must not be noexcept either.
template <typename Body>
PyObject* python_code_entry(Body&& body)
{
  try {
    return body().release().ptr();
  } catch (abi::__forced_unwind&) {
    throw;
  } catch (...) {
    raise_current_exception();
    return nullptr;
  }
}

/// Rethrows `thrown` unless it is a handoff exception, which it turns into its Python error (the
/// exception translator pybind11 uses for the functions it binds).
void translate_exception(std::exception_ptr thrown);

}  // namespace handoff::python
