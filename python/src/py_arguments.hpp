// Arguments as Python passes them: the array API's `stream`, `device` and `copy`, and the fast
// signature parser of the hot entry points.
#pragma once

#include <handoff/dlpack.h>
#include <handoff/array.hpp>

#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace handoff::python {

namespace py = pybind11;

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

/// A device the data is to go to (from_dlpack's `device`, __dlpack__'s `dl_device`): device_argument,
/// and a CPU other than DLPack's one CPU, 0, is a buffer_error, refused before any producer is asked.
[[nodiscard]] std::optional<DLDevice> target_device_argument(py::handle device, const char* field,
                                                             unknown_device_type unknown);

/// A `copy` argument: None, True or False. @throws type_error.
[[nodiscard]] std::optional<bool> parse_copy_argument(py::handle copy);
[[nodiscard]] inline std::optional<bool> copy_argument(py::handle copy)
{
  if (copy.ptr() == Py_True) { return true; }
  if (copy.ptr() == Py_False) { return false; }
  return copy.is_none() ? std::nullopt : parse_copy_argument(copy);
}

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
  [[nodiscard]] bool parse(PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames, PyObject** out) const noexcept
  {
    // The common call, the positional arguments alone, costs no call (x.__dlpack__() per exchange).
    if (kwnames != nullptr ||
        PyVectorcall_NARGS(static_cast<std::size_t>(nargsf)) != static_cast<Py_ssize_t>(positional_)) {
      return parse_named(args, nargsf, kwnames, out);
    }
    handoff::detail::copy_short(args, positional_, out);
    std::fill_n(out + positional_, names_.size(), Py_None);
    return true;
  }

 private:
  [[nodiscard]] bool parse_named(PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames,
                                 PyObject** out) const noexcept;
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
