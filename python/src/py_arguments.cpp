#include "py_arguments.hpp"

#include "py_cpython.hpp"
#include "py_errors.hpp"

#include <handoff/error.hpp>
#include <handoff/stream_value.hpp>

#include <fmt/format.h>

#include <climits>
#include <cstring>
#include <string_view>

namespace handoff::python {

std::optional<std::int64_t> parse_stream_argument(py::handle stream)
{
  if (stream.is_none()) { return std::nullopt; }
  HANDOFF_EXPECTS(is_int(stream.ptr()), type_error,
                  fmt::format("stream must be an int or None, not {}", type_name(stream)));
  const int64_reading value = read_int64(stream.ptr());
  HANDOFF_EXPECTS(value.fits(), value_error,
                  fmt::format("stream={} is out of range for a stream handle", py::str(stream).cast<std::string>()));
  return value.value;
}

std::optional<DLDevice> parse_device_argument(py::handle device, const char* field, unknown_device_type unknown)
{
  if (device.is_none()) { return std::nullopt; }
  PyObject* raw = device.ptr();
  if (PyUnicode_Check(raw)) {
    const auto text = device.cast<std::string>();
    HANDOFF_EXPECTS(
      text == "cpu", value_error,
      fmt::format("{}='{}' is not a device handoff knows; pass a (device_type, device_id) tuple", field, text));
    return DLDevice{kDLCPU, 0};
  }
  HANDOFF_EXPECTS(PyTuple_Check(raw) && PyTuple_GET_SIZE(raw) == 2, type_error,
                  fmt::format("{} must be None, 'cpu' or a (device_type, device_id) tuple", field));
  int64_reading values[2]{};
  for (Py_ssize_t i = 0; i < 2; ++i) {
    PyObject* item = PyTuple_GET_ITEM(raw, i);
    HANDOFF_EXPECTS(is_int(item), type_error, fmt::format("{} must hold two ints", field));
    values[i] = read_int64(item);
  }
  const bool representable = values[0].fits() && values[1].fits();
  const std::int64_t type = values[0].value;
  const std::int64_t id = values[1].value;
  const auto text = [&] {
    return fmt::format("{}=({}, {})", field, py::str(PyTuple_GET_ITEM(raw, 0)).cast<std::string>(),
                       py::str(PyTuple_GET_ITEM(raw, 1)).cast<std::string>());
  };
  HANDOFF_EXPECTS(representable && id >= 0 && id <= INT32_MAX, value_error,
                  fmt::format("{} is not a valid DLPack device", text()));
  if (!is_dlpack_device_type(type)) {
    const std::string message = fmt::format("{}: {} is not a DLPack device type", text(), type);
    if (unknown == unknown_device_type::unreachable) { throw buffer_error(message + "; the data cannot go there"); }
    throw value_error(message);
  }
  return DLDevice{static_cast<DLDeviceType>(type), static_cast<std::int32_t>(id)};
}

std::optional<DLDevice> target_device_argument(py::handle device, const char* field, unknown_device_type unknown)
{
  const std::optional<DLDevice> target = device_argument(device, field, unknown);
  HANDOFF_EXPECTS(!target || target->device_type != kDLCPU || target->device_id == 0, buffer_error,
                  fmt::format("{}=(1, {}): the CPU is device 0", field, target ? target->device_id : 0));
  return target;
}

std::optional<bool> parse_copy_argument(py::handle copy)
{
  if (copy.is_none()) { return std::nullopt; }
  HANDOFF_EXPECTS(PyBool_Check(copy.ptr()), type_error, "copy must be None, True or False");
  return copy.ptr() == Py_True;
}

signature::signature(const char* function, std::size_t positional, std::initializer_list<const char*> keywords)
    : function_(function), positional_(positional)
{
  for (const char* keyword : keywords) {
    PyObject* name = PyUnicode_InternFromString(keyword);
    if (name == nullptr) { throw py::error_already_set(); }
    names_.push_back(name);
    texts_.emplace_back(keyword);
  }
}

Py_ssize_t signature::keyword_index(PyObject* name) const noexcept
{
  for (std::size_t i = 0; i < names_.size(); ++i) {
    if (names_[i] == name) { return static_cast<Py_ssize_t>(i); }  // interned: the common case
  }
  Py_ssize_t length = 0;
  const char* text = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, &length) : nullptr;
  if (text == nullptr) {
    PyErr_Clear();
    return -1;
  }
  const std::string_view wanted{text, static_cast<std::size_t>(length)};
  for (std::size_t i = 0; i < texts_.size(); ++i) {
    if (texts_[i] == wanted) { return static_cast<Py_ssize_t>(i); }
  }
  return -1;
}

bool signature::parse_named(PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames, PyObject** out) const noexcept
{
  const Py_ssize_t given = PyVectorcall_NARGS(static_cast<std::size_t>(nargsf));
  const auto wanted = static_cast<Py_ssize_t>(positional_);
  if (given != wanted) {
    if (given < wanted) {
      PyErr_Format(PyExc_TypeError, "%s() missing required positional argument (%zd given, %zd required)", function_,
                   given, wanted);
    } else if (wanted == 0) {
      PyErr_Format(PyExc_TypeError, "%s() takes no positional arguments (%zd given)", function_, given);
    } else {
      PyErr_Format(PyExc_TypeError, "%s() takes %zd positional argument%s but %zd were given", function_, wanted,
                   wanted == 1 ? "" : "s", given);
    }
    return false;
  }
  for (std::size_t i = 0; i < positional_; ++i) { out[i] = args[i]; }
  std::fill_n(out + positional_, names_.size(), Py_None);
  if (kwnames == nullptr) { return true; }
  const Py_ssize_t count = PyTuple_GET_SIZE(kwnames);
  if (kwnames == last_kwnames_) {
    for (Py_ssize_t k = 0; k < count; ++k) {
      out[positional_ + static_cast<std::size_t>(last_indices_[static_cast<std::size_t>(k)])] = args[given + k];
    }
    return true;
  }
  std::array<Py_ssize_t, 8> indices{};
  const bool remember = count <= static_cast<Py_ssize_t>(std::min(names_.size(), indices.size()));
  for (Py_ssize_t k = 0; k < count; ++k) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, k);
    const Py_ssize_t index = keyword_index(name);
    if (index < 0) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'%s", function_, name,
                   positional_ > 0 ? " (the first argument is positional-only)" : "");
      return false;
    }
    out[positional_ + static_cast<std::size_t>(index)] = args[given + k];
    if (remember) { indices[static_cast<std::size_t>(k)] = index; }
  }
  if (remember) {
    Py_INCREF(kwnames);
    Py_XDECREF(std::exchange(last_kwnames_, kwnames));
    last_indices_ = indices;
  }
  return true;
}

}  // namespace handoff::python
