// Shared pieces of the bindings: Python-owned producers, capsules, argument parsing, errors.
#pragma once

#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/stream_value.hpp>

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace handoff::python {

namespace py = pybind11;

/// Keeps `object` alive until the producer is released; the release takes the GIL and may run on
/// any thread. During interpreter finalization the reference is left alone.
[[nodiscard]] producer_ref python_owner(py::handle object);

/// Consumes a "dltensor_versioned" or "dltensor" capsule: renames it "used_..." and imports it.
/// @throws value_error if it was consumed already, type_error if it is not a DLPack capsule.
[[nodiscard]] array consume_capsule(py::handle capsule);

/// Wraps an exported tensor in a capsule whose destructor runs the deleter unless consumed.
[[nodiscard]] py::capsule make_capsule(DLManagedTensorVersioned* tensor);
[[nodiscard]] py::capsule make_capsule(DLManagedTensor* tensor);

/// A Python `stream` argument as an integer (None -> nullopt).
/// @throws type_error for bool and non-integers, value_error for integers outside int64.
[[nodiscard]] std::optional<std::int64_t> parse_stream_argument(py::handle stream);
[[nodiscard]] inline std::optional<std::int64_t> stream_argument(py::handle stream)
{
  return stream.is_none() ? std::nullopt : parse_stream_argument(stream);
}

/// What a device type DLPack does not define means for a device argument.
enum class unknown_device_type {
  invalid,      ///< a value_error: the argument is wrong (a consumer's `device`)
  unreachable,  ///< a buffer_error: the data cannot go there (a producer's `dl_device`)
};

/// A `device`/`dl_device` argument: None, a (device_type, device_id) tuple, or "cpu".
/// @throws type_error / value_error naming `field`; for a type DLPack does not define, what
///         `unknown` says.
[[nodiscard]] std::optional<DLDevice> parse_device_argument(py::handle device, const char* field,
                                                            unknown_device_type unknown);
[[nodiscard]] inline std::optional<DLDevice> device_argument(py::handle device, const char* field,
                                                             unknown_device_type unknown = unknown_device_type::invalid)
{
  return device.is_none() ? std::nullopt : parse_device_argument(device, field, unknown);
}

/// A `copy` argument: None, True or False. @throws type_error.
[[nodiscard]] std::optional<bool> parse_copy_argument(py::handle copy);
[[nodiscard]] inline std::optional<bool> copy_argument(py::handle copy)
{
  if (copy.ptr() == Py_True) { return true; }
  if (copy.ptr() == Py_False) { return false; }
  return copy.is_none() ? std::nullopt : parse_copy_argument(copy);
}

/// A compact copy of `view`: host data on the host; device data on its device, or on the host
/// when `to_host` (through the active backend, in stream order; the GIL is released while a copy
/// to the host is waited for).
/// @throws device_error when device data needs a backend and none is active.
[[nodiscard]] array copy_of(const array& view, bool to_host);

/// A reference to a stream object (anything but None or an int) for a stream_binding to keep it
/// alive; the last copy lets go of it under the GIL, from any thread. Empty for None and ints.
[[nodiscard]] std::shared_ptr<const void> stream_keep_alive(py::handle stream_object);

/// Keeps `object` alive until the work enqueued on `stream` (of `device`) so far is done: for
/// host memory a device copy may still write when a wait for it failed.
void keep_alive_until_done(context& ctx, int device, device::stream_handle stream, py::handle object) noexcept;

/// The deleter runner handoff uses in Python (set_deleter_runner): a producer's deleter runs holding
/// the GIL, since producers' deleters may take it; once the interpreter is finalizing, or other
/// threads may no longer enter it, the deleter is not run and the process keeps the memory.
void run_deleter_with_gil(void (*invoke)(void*) noexcept, void* tensor) noexcept;

/// The `__name__` of `object`'s type, for messages.
[[nodiscard]] std::string type_name(py::handle object);

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

/// Rethrows `thrown` unless it is a handoff exception, which it turns into its Python error (the
/// exception translator pybind11 uses for the functions it binds).
void translate_exception(std::exception_ptr thrown);

/// The parameters of a function called with METH_FASTCALL | METH_KEYWORDS whose signature is
/// `name(p0, ..., /, *, k0=None, ...)`: required positional-only parameters, then keyword-only
/// ones defaulting to None. Made once, at module initialization (it interns the names).
class signature {
 public:
  signature(const char* function, std::size_t positional, std::initializer_list<const char*> keywords);

  [[nodiscard]] std::size_t size() const noexcept { return positional_ + names_.size(); }

  /// Fills out[0, positional) with the positional arguments and the rest with the keyword
  /// arguments in declaration order, None where absent (borrowed references; `out` has size()
  /// entries). Returns false with CPython's TypeError set when the call does not match.
  [[nodiscard]] bool parse(PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames, PyObject** out) const noexcept;

 private:
  [[nodiscard]] Py_ssize_t keyword_index(PyObject* name) const noexcept;

  const char* function_;
  std::size_t positional_;
  std::vector<PyObject*> names_;  // interned, owned for the life of the process
  std::vector<std::string> texts_;
  // The last keyword-name tuple matched by text and where its names go: callers such as NumPy
  // pass the same tuple of non-interned names on every call. Guarded by the GIL.
  mutable PyObject* last_kwnames_{nullptr};  // a strong reference, so its address is not reused
  mutable std::array<Py_ssize_t, 8> last_indices_{};
};

}  // namespace handoff::python
