#include "py_support.hpp"

#include "py_gil.hpp"

#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/runtime.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <new>
#include <string_view>
#include <utility>

namespace handoff::python {
namespace {

constexpr const char* versioned_name = "dltensor_versioned";
constexpr const char* used_versioned_name = "used_dltensor_versioned";
constexpr const char* legacy_name = "dltensor";
constexpr const char* used_legacy_name = "used_dltensor";

// Capsule destructors run with the GIL held, possibly while an exception is being raised: keep it.
// A consumer that took the tensor renamed the capsule ("used_..."): its deleter is no longer ours.
template <typename Managed>
void capsule_destructor(PyObject* capsule, const char* live_name) noexcept
{
  const char* name = PyCapsule_GetName(capsule);  // cannot fail: the capsule is valid until it is freed
  const bool consumed = name != live_name && (name == nullptr || std::strcmp(name, live_name) != 0);
  if (consumed || interpreter_finalizing()) { return; }
  // An exception being raised is set aside while the deleter runs: it may run Python code.
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  const bool raising = PyErr_Occurred() != nullptr;
  if (raising) { PyErr_Fetch(&type, &value, &traceback); }
  auto* tensor = static_cast<Managed*>(PyCapsule_GetPointer(capsule, name));
  if (tensor != nullptr && tensor->deleter != nullptr) { tensor->deleter(tensor); }
  if (raising) { PyErr_Restore(type, value, traceback); }
}

void versioned_destructor(PyObject* capsule) noexcept
{
  capsule_destructor<DLManagedTensorVersioned>(capsule, versioned_name);
}

void legacy_destructor(PyObject* capsule) noexcept
{
  capsule_destructor<DLManagedTensor>(capsule, legacy_name);
}

template <typename Managed>
py::capsule wrap_capsule(Managed* tensor, const char* name, PyCapsule_Destructor destructor)
{
  PyObject* capsule = PyCapsule_New(tensor, name, destructor);
  if (capsule == nullptr) {
    tensor->deleter(tensor);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(capsule);
}

void release_reference(PyObject* object) noexcept
{
  with_gil([object] { Py_DECREF(object); });
}

}  // namespace

void run_deleter_with_gil(void (*invoke)(void*) noexcept, void* tensor) noexcept
{
  with_gil([invoke, tensor] { invoke(tensor); });
}

array copy_of(const array& view, bool to_host)
{
  if (view.device().device_type == kDLCPU) { return copy_to_host(view); }
  context& ctx = require_context("copying device memory");
  HANDOFF_EXPECTS(is_stream_ordered(ctx, view), buffer_error,
                  fmt::format("the {} backend cannot copy {} memory", ctx.backend().name(),
                              device_type_name(view.device().device_type)));
  if (!to_host) { return copy_device_array(ctx, view, false); }  // only enqueues
  return without_gil([&] { return copy_device_array(ctx, view, true); });
}

std::shared_ptr<const void> stream_keep_alive(py::handle stream_object)
{
  if (stream_object.is_none() || PyLong_Check(stream_object.ptr()) != 0) { return {}; }
  PyObject* raw = stream_object.inc_ref().ptr();
  return std::shared_ptr<const void>{raw, [](PyObject* object) noexcept { release_reference(object); }};
}

void keep_alive_until_done(context& ctx, int device, device::stream_handle stream, py::handle object) noexcept
{
  PyObject* raw = object.inc_ref().ptr();
  ctx.release_after(device, stream, [raw]() noexcept { release_reference(raw); });
}

producer_ref python_owner(py::handle object)
{
  PyObject* raw = object.inc_ref().ptr();
  return producer_ref{[raw]() noexcept { release_reference(raw); }};
}

array consume_capsule(py::handle capsule)
{
  PyObject* raw = capsule.ptr();
  HANDOFF_EXPECTS(PyCapsule_CheckExact(raw) != 0, type_error,
                  fmt::format("expected a DLPack capsule, got {}", type_name(capsule)));
  // The name is read once and compared here; PyCapsule_GetPointer compares it once more.
  const char* name = PyCapsule_GetName(raw);
  if (name != nullptr && std::strcmp(name, versioned_name) == 0) {
    auto* tensor = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(raw, name));
    if (tensor == nullptr) { throw py::error_already_set(); }
    PyCapsule_SetName(raw, used_versioned_name);  // before import: its deleter now belongs to us
    return import_dlpack(tensor);
  }
  if (name != nullptr && std::strcmp(name, legacy_name) == 0) {
    auto* tensor = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(raw, name));
    if (tensor == nullptr) { throw py::error_already_set(); }
    PyCapsule_SetName(raw, used_legacy_name);
    return import_dlpack(tensor);
  }
  PyErr_Clear();
  const std::string_view seen = name != nullptr ? name : "";
  HANDOFF_EXPECTS(seen != used_versioned_name && seen != used_legacy_name, value_error,
                  fmt::format("this DLPack capsule was already consumed (it is named '{}')", seen));
  throw type_error(fmt::format("capsule named '{}' is not a DLPack capsule", seen));
}

py::capsule make_capsule(DLManagedTensorVersioned* tensor)
{
  return wrap_capsule(tensor, versioned_name, versioned_destructor);
}

py::capsule make_capsule(DLManagedTensor* tensor)
{
  return wrap_capsule(tensor, legacy_name, legacy_destructor);
}

std::optional<std::int64_t> parse_stream_argument(py::handle stream)
{
  if (stream.is_none()) { return std::nullopt; }
  HANDOFF_EXPECTS(PyLong_Check(stream.ptr()) && !PyBool_Check(stream.ptr()), type_error,
                  fmt::format("stream must be an int or None, not {}", type_name(stream)));
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(stream.ptr(), &overflow);
  HANDOFF_EXPECTS(overflow == 0, value_error,
                  fmt::format("stream={} is out of range for a stream handle", py::str(stream).cast<std::string>()));
  return static_cast<std::int64_t>(value);
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
  long long values[2]{};
  bool representable = true;
  for (Py_ssize_t i = 0; i < 2; ++i) {
    PyObject* item = PyTuple_GET_ITEM(raw, i);
    HANDOFF_EXPECTS(PyLong_Check(item) && !PyBool_Check(item), type_error, fmt::format("{} must hold two ints", field));
    int overflow = 0;
    values[i] = PyLong_AsLongLongAndOverflow(item, &overflow);
    representable = representable && overflow == 0;
  }
  const auto [type, id] = values;
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

std::optional<bool> parse_copy_argument(py::handle copy)
{
  if (copy.is_none()) { return std::nullopt; }
  HANDOFF_EXPECTS(PyBool_Check(copy.ptr()), type_error, "copy must be None, True or False");
  return copy.ptr() == Py_True;
}

std::string type_name(py::handle object)
{
  return py::str(py::type::handle_of(object).attr("__name__")).cast<std::string>();
}

// ---------------------------------------------------------------------------------------------
// Errors

namespace {

PyObject* device_error_type = nullptr;

void raise_device_error(const device_error& e)
{
  py::object instance = py::reinterpret_borrow<py::object>(device_error_type)(e.what());
  instance.attr("backend") = e.backend();
  instance.attr("error_name") = e.error_name();
  PyErr_SetObject(device_error_type, instance.ptr());
}

}  // namespace

void set_device_error_type(PyObject* type) noexcept
{
  device_error_type = type;
}

void translate_exception(std::exception_ptr thrown)
{
  try {
    if (thrown) { std::rethrow_exception(std::move(thrown)); }
  } catch (const device_error& e) {
    raise_device_error(e);
  } catch (const value_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const buffer_error& e) {
    PyErr_SetString(PyExc_BufferError, e.what());
  } catch (const type_error& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const not_implemented_error& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what());
  }
}

void raise_current_exception() noexcept
{
  try {
    try {
      throw;
    } catch (py::error_already_set& e) {
      e.restore();
    } catch (const py::builtin_exception& e) {
      e.set_error();
    } catch (const error&) {
      translate_exception(std::current_exception());
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  } catch (py::error_already_set& e) {  // raised while building the Python exception
    e.restore();
  } catch (...) {
    PyErr_SetString(PyExc_SystemError, "an unknown C++ exception escaped from handoff");
  }
}

// ---------------------------------------------------------------------------------------------
// Argument parsing

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

bool signature::parse(PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames, PyObject** out) const noexcept
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
