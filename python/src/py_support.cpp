#include "py_support.hpp"

#include <handoff/error.hpp>

#include <fmt/format.h>

#include <cstring>
#include <string_view>

namespace handoff::python {
namespace {

constexpr const char* versioned_name = "dltensor_versioned";
constexpr const char* used_versioned_name = "used_dltensor_versioned";
constexpr const char* legacy_name = "dltensor";
constexpr const char* used_legacy_name = "used_dltensor";

// Capsule destructors run with the GIL held, possibly while an exception is being raised: keep it.
template <typename Managed>
void capsule_destructor(PyObject* capsule, const char* live_name) noexcept
{
  if (interpreter_finalizing() || !PyCapsule_IsValid(capsule, live_name)) { return; }  // consumed
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  auto* tensor = static_cast<Managed*>(PyCapsule_GetPointer(capsule, live_name));
  if (tensor != nullptr && tensor->deleter != nullptr) { tensor->deleter(tensor); }
  PyErr_Restore(type, value, traceback);
}

void versioned_destructor(PyObject* capsule) noexcept
{
  capsule_destructor<DLManagedTensorVersioned>(capsule, versioned_name);
}

void legacy_destructor(PyObject* capsule) noexcept { capsule_destructor<DLManagedTensor>(capsule, legacy_name); }

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
  if (interpreter_finalizing()) { return; }
  const PyGILState_STATE state = PyGILState_Ensure();
  Py_DECREF(object);
  PyGILState_Release(state);
}

}  // namespace

bool interpreter_finalizing() noexcept
{
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

py::object wrap(array view) { return py::cast(py_array{std::move(view)}, py::return_value_policy::move); }

producer_ref python_owner(py::handle object)
{
  PyObject* raw = object.inc_ref().ptr();
  return producer_ref{[raw]() noexcept { release_reference(raw); }};
}

array consume_capsule(py::handle capsule)
{
  PyObject* raw = capsule.ptr();
  HANDOFF_EXPECTS(PyCapsule_CheckExact(raw) != 0, type_error,
                  fmt::format("expected a DLPack capsule, got {}",
                              py::str(py::type::handle_of(capsule).attr("__name__")).cast<std::string>()));
  if (PyCapsule_IsValid(raw, versioned_name) != 0) {
    auto* tensor = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(raw, versioned_name));
    PyCapsule_SetName(raw, used_versioned_name);  // before import: its deleter now belongs to us
    return import_dlpack(tensor);
  }
  if (PyCapsule_IsValid(raw, legacy_name) != 0) {
    auto* tensor = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(raw, legacy_name));
    PyCapsule_SetName(raw, used_legacy_name);
    return import_dlpack(tensor);
  }
  const char* name = PyCapsule_GetName(raw);
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

py::capsule make_capsule(DLManagedTensor* tensor) { return wrap_capsule(tensor, legacy_name, legacy_destructor); }

std::optional<std::int64_t> stream_argument(py::handle stream)
{
  if (stream.is_none()) { return std::nullopt; }
  HANDOFF_EXPECTS(PyLong_Check(stream.ptr()) && !PyBool_Check(stream.ptr()), type_error,
                  fmt::format("stream must be an int or None, not {}", py::str(py::type::handle_of(stream).attr("__name__")).cast<std::string>()));
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(stream.ptr(), &overflow);
  HANDOFF_EXPECTS(overflow == 0, value_error,
                  fmt::format("stream={} is out of range for a stream handle", py::str(stream).cast<std::string>()));
  return static_cast<std::int64_t>(value);
}

std::optional<DLDevice> device_argument(py::handle device, const char* field)
{
  if (device.is_none()) { return std::nullopt; }
  if (PyUnicode_Check(device.ptr())) {
    const auto text = device.cast<std::string>();
    HANDOFF_EXPECTS(text == "cpu", value_error,
                    fmt::format("{}='{}' is not a device handoff knows; pass a (device_type, device_id) tuple", field, text));
    return DLDevice{kDLCPU, 0};
  }
  HANDOFF_EXPECTS(PyTuple_Check(device.ptr()) && PyTuple_GET_SIZE(device.ptr()) == 2, type_error,
                  fmt::format("{} must be None, 'cpu' or a (device_type, device_id) tuple", field));
  const auto pair = py::reinterpret_borrow<py::tuple>(device);
  for (const auto item : pair) {
    HANDOFF_EXPECTS(PyLong_Check(item.ptr()) && !PyBool_Check(item.ptr()), type_error,
                    fmt::format("{} must hold two ints", field));
  }
  const auto type = pair[0].cast<long long>();
  const auto id = pair[1].cast<long long>();
  HANDOFF_EXPECTS(type >= kDLCPU && type <= kDLTrn && id >= 0 && id <= INT32_MAX, value_error,
                  fmt::format("{}=({}, {}) is not a valid DLPack device", field, type, id));
  return DLDevice{static_cast<DLDeviceType>(type), static_cast<std::int32_t>(id)};
}

std::optional<bool> copy_argument(py::handle copy)
{
  if (copy.is_none()) { return std::nullopt; }
  HANDOFF_EXPECTS(PyBool_Check(copy.ptr()), type_error, "copy must be None, True or False");
  return copy.ptr() == Py_True;
}

}  // namespace handoff::python
