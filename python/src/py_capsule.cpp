#include "py_capsule.hpp"

#include "py_cpython.hpp"
#include "py_errors.hpp"
#include "py_gil.hpp"

#include <handoff/error.hpp>

#include <fmt/format.h>

#include <cstring>
#include <string>
#include <string_view>

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
  const error_scope set_aside;  // the deleter may run Python code
  auto* tensor = static_cast<Managed*>(PyCapsule_GetPointer(capsule, name));
  if (tensor != nullptr && tensor->deleter != nullptr) { tensor->deleter(tensor); }
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

}  // namespace

array consume_capsule(const exchange& on, py::handle capsule)
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
    return on.take_tensor(tensor);
  }
  if (name != nullptr && std::strcmp(name, legacy_name) == 0) {
    auto* tensor = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(raw, name));
    if (tensor == nullptr) { throw py::error_already_set(); }
    PyCapsule_SetName(raw, used_legacy_name);
    return on.take_tensor(tensor);
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

}  // namespace handoff::python
