// Finding and calling producers' DLPack C exchange API tables. Every failure here means "use
// __dlpack__ instead", so errors are cleared and logged rather than raised.
#include "py_exchange_api.hpp"

#include "py_array_exchange_api.hpp"
#include "py_errors.hpp"

#include <handoff/log.hpp>

#include <fmt/format.h>

#include <array>
#include <cstring>

namespace handoff::python {
namespace {

constexpr const char* capsule_name = "dlpack_exchange_api";

PyObject* attribute_name = nullptr;      // "__dlpack_c_exchange_api__"
PyObject* is_conj_name = nullptr;        // "is_conj"
PyObject* requires_grad_name = nullptr;  // "requires_grad"

// The capsules seen last and their tables (nullptr: not usable). A type's capsule is normally one
// object for the life of the process, so a handful of entries serves every producer type in use.
struct cached_table {
  PyObject* capsule = nullptr;  // strong reference: the table stays valid and the address unique
  const DLPackExchangeAPI* api = nullptr;
};
std::array<cached_table, 8> cached_tables;  // guarded by the GIL
std::size_t next_slot = 0;

// Logs and clears the pending Python error of a failed call to a producer's table.
void log_failure(const char* call) noexcept
{
  std::string reason = "no Python error was set";
  if (PyErr_Occurred() != nullptr) {
    PyObject* type = nullptr;
    PyObject* error = nullptr;
    PyObject* traceback = nullptr;
    PyErr_Fetch(&type, &error, &traceback);
    PyErr_NormalizeException(&type, &error, &traceback);
    PyObject* text = error != nullptr ? PyObject_Str(error) : nullptr;
    const char* utf8 = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
    reason = fmt::format("{}: {}", type != nullptr ? reinterpret_cast<PyTypeObject*>(type)->tp_name : "?",
                         utf8 != nullptr ? utf8 : "?");
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(error);
    Py_XDECREF(traceback);
    PyErr_Clear();  // from str() failing
  }
  log_debug(fmt::format("DLPack C exchange API: {} failed ({}); using __dlpack__", call, reason));
}

const DLPackExchangeAPI* usable_table(PyObject* capsule) noexcept
{
  if (PyCapsule_IsValid(capsule, capsule_name) == 0) {
    log_debug("DLPack C exchange API: __dlpack_c_exchange_api__ is no 'dlpack_exchange_api' capsule; using __dlpack__");
    return nullptr;
  }
  const auto* api = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(capsule, capsule_name));
  if (api == &array_exchange_api()) {
    return nullptr;  // handoff's own arrays: __dlpack__ orders onto the consumer stream directly
  }
  if (api->header.version.major != DLPACK_MAJOR_VERSION) {
    log_debug(fmt::format("DLPack C exchange API: version {}.{} is not understood; using __dlpack__",
                          api->header.version.major, api->header.version.minor));
    return nullptr;
  }
  if (api->managed_tensor_from_py_object_no_sync == nullptr) {
    log_debug("DLPack C exchange API: no managed_tensor_from_py_object_no_sync; using __dlpack__");
    return nullptr;
  }
  return api;
}

}  // namespace

void init_exchange_api()
{
  attribute_name = PyUnicode_InternFromString("__dlpack_c_exchange_api__");
  is_conj_name = PyUnicode_InternFromString("is_conj");
  requires_grad_name = PyUnicode_InternFromString("requires_grad");
  if (attribute_name == nullptr || is_conj_name == nullptr || requires_grad_name == nullptr) {
    throw py::error_already_set();
  }
}

const DLPackExchangeAPI* exchange_api_of(PyTypeObject* type)
{
  PyObject* capsule = _PyType_Lookup(type, attribute_name);  // the type attribute cache answers
  if (capsule == nullptr) { return nullptr; }
  for (const cached_table& entry : cached_tables) {
    if (entry.capsule == capsule) { return entry.api; }
  }
  cached_table& slot = cached_tables[next_slot++ % cached_tables.size()];
  PyObject* evicted = slot.capsule;
  Py_INCREF(capsule);  // not Py_NewRef: Python 3.9 has none
  slot = {capsule, usable_table(capsule)};
  Py_XDECREF(evicted);  // last: its destructor may run Python code
  return slot.api;
}

bool is_lazy_conjugate(PyObject* x)
{
  PyObject* method = _PyType_Lookup(Py_TYPE(x), is_conj_name);
  if (method == nullptr || !PyType_HasFeature(Py_TYPE(method), Py_TPFLAGS_METHOD_DESCRIPTOR)) { return false; }
  PyObject* const args[] = {x};
  const py::object answer = py::reinterpret_steal<py::object>(PyObject_Vectorcall(method, args, 1, nullptr));
  if (!answer) { throw py::error_already_set(); }
  return answer.ptr() == Py_True;
}

bool requires_grad(PyObject* x)
{
  // A data descriptor of the type (PyTorch's getset): read without an instance dictionary lookup.
  PyObject* attribute = _PyType_Lookup(Py_TYPE(x), requires_grad_name);
  if (attribute == nullptr) { return false; }
  const descrgetfunc get = Py_TYPE(attribute)->tp_descr_get;
  if (get == nullptr) { return attribute == Py_True; }
  const py::object answer =
    py::reinterpret_steal<py::object>(get(attribute, x, reinterpret_cast<PyObject*>(Py_TYPE(x))));
  if (!answer) { throw py::error_already_set(); }
  return answer.ptr() == Py_True;
}

DLManagedTensorVersioned* managed_tensor_of(const DLPackExchangeAPI& api, PyObject* x) noexcept
{
  DLManagedTensorVersioned* tensor = nullptr;
  if (api.managed_tensor_from_py_object_no_sync(x, &tensor) != 0 || tensor == nullptr) {
    // A producer that failed after making the tensor still owns it: the call's contract gives it
    // to the caller only on success.
    log_failure("managed_tensor_from_py_object_no_sync");
    return nullptr;
  }
  return tensor;
}

bool current_work_stream(const DLPackExchangeAPI& api, DLDevice device, std::optional<std::int64_t>& value) noexcept
{
  if (api.current_work_stream == nullptr) {
    log_debug("DLPack C exchange API: no current_work_stream for device data; using __dlpack__");
    return false;
  }
  void* stream = nullptr;
  if (api.current_work_stream(device.device_type, device.device_id, &stream) != 0) {
    log_failure("current_work_stream");
    return false;
  }
  // A native handle: CUDA's 1 and 2 are its legacy and per-thread default streams, as in DLPack.
  value = stream == nullptr ? std::nullopt : std::optional<std::int64_t>(reinterpret_cast<std::intptr_t>(stream));
  return true;
}

}  // namespace handoff::python
