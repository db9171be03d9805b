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

PyObject* capsule_attribute = nullptr;   // "__dlpack_c_exchange_api__": DLPack 1.3's form, a capsule
PyObject* address_attribute = nullptr;   // "__c_dlpack_exchange_api__": DLPack 1.2's, the table's address
PyObject* is_conj_name = nullptr;        // "is_conj"
PyObject* requires_grad_name = nullptr;  // "requires_grad"

// The capsules seen last and their tables (nullptr: not usable). A type's capsule is normally one
// object for the life of the process, so a handful of entries serves every producer type in use.
struct cached_table {
  PyObject* attribute = nullptr;  // strong reference: the table stays valid and the address unique
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

// The table an attribute publishes: a "dlpack_exchange_api" capsule, or (DLPack 1.2) its address as
// an int, which handoff trusts as tvm-ffi does: the type keeps its table for the life of the process.
const DLPackExchangeAPI* published_table(PyObject* attribute) noexcept
{
  if (PyCapsule_IsValid(attribute, capsule_name) != 0) {
    return static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(attribute, capsule_name));
  }
  if (PyLong_CheckExact(attribute) != 0) {
    void* address = PyLong_AsVoidPtr(attribute);
    if (address == nullptr) { PyErr_Clear(); }  // 0, or out of range: no table either way
    return static_cast<const DLPackExchangeAPI*>(address);
  }
  return nullptr;
}

// The newest table of `api`'s chain (the table, then its prev_api, ...) of the major version handoff
// reads; a chain longer than any producer makes (a cycle) has none.
const DLPackExchangeAPI* understood_table(const DLPackExchangeAPI* api) noexcept
{
  constexpr int longest_chain = 16;
  const DLPackExchangeAPIHeader* header = &api->header;
  for (int i = 0; header != nullptr && i < longest_chain; ++i, header = header->prev_api) {
    // The header is a table's first member: a table's address is its header's.
    if (header->version.major == DLPACK_MAJOR_VERSION) { return reinterpret_cast<const DLPackExchangeAPI*>(header); }
  }
  return nullptr;
}

const DLPackExchangeAPI* usable_table(PyObject* attribute) noexcept
{
  const DLPackExchangeAPI* published = published_table(attribute);
  if (published == nullptr) {
    log_debug(
      "DLPack C exchange API: the type's attribute is neither a 'dlpack_exchange_api' capsule nor a table's "
      "address; using __dlpack__");
    return nullptr;
  }
  if (is_handoff_exchange_api(published)) {
    return nullptr;  // handoff's own arrays: __dlpack__ orders onto the consumer stream directly
  }
  const DLPackExchangeAPI* api = understood_table(published);
  if (api == nullptr) {
    log_debug(
      fmt::format("DLPack C exchange API: version {}.{} (and no older table of major version {}) is not "
                  "understood; using __dlpack__",
                  published->header.version.major, published->header.version.minor, DLPACK_MAJOR_VERSION));
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
  capsule_attribute = PyUnicode_InternFromString("__dlpack_c_exchange_api__");
  address_attribute = PyUnicode_InternFromString("__c_dlpack_exchange_api__");
  is_conj_name = PyUnicode_InternFromString("is_conj");
  requires_grad_name = PyUnicode_InternFromString("requires_grad");
  if (capsule_attribute == nullptr || address_attribute == nullptr || is_conj_name == nullptr ||
      requires_grad_name == nullptr) {
    throw py::error_already_set();
  }
}

const DLPackExchangeAPI* exchange_api_of(PyTypeObject* type)
{
  // The type attribute cache answers both lookups; the newer form wins where a type sets both.
  PyObject* attribute = _PyType_Lookup(type, capsule_attribute);
  if (attribute == nullptr) { attribute = _PyType_Lookup(type, address_attribute); }
  if (attribute == nullptr) { return nullptr; }
  for (const cached_table& entry : cached_tables) {
    if (entry.attribute == attribute) { return entry.api; }
  }
  cached_table& slot = cached_tables[next_slot++ % cached_tables.size()];
  PyObject* evicted = slot.attribute;
  Py_INCREF(attribute);  // not Py_NewRef: Python 3.9 has none
  slot = {attribute, usable_table(attribute)};
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
