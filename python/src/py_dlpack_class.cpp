// Each method is a plain CPython function (METH_FASTCALL), bound to the class as an instance method
// the way pybind11 binds its own: the class's authors get handoff.Array's __dlpack__ at the cost of
// handoff.Array's, not at the cost of a general-purpose dispatcher's keyword matching.
#include "py_dlpack_class.hpp"

#include "py_arguments.hpp"
#include "py_array.hpp"
#include "py_array_exchange_api.hpp"
#include "py_cpython.hpp"
#include "py_errors.hpp"
#include "py_extension_views.hpp"
#include "py_view.hpp"

#include <handoff/error.hpp>

#include <memory>

namespace handoff::python {
namespace {

constexpr const char* capsule_name = "handoff.dlpack_class";
PyObject* class_attribute = nullptr;  // "__handoff_dlpack_class__": the shared capsule, on the type

// What a class's methods share: how to describe an instance.
struct described_class {
  handoff_describe_fn describe;
  void* context;
  py::object context_owner;
};

const described_class& class_of(PyObject* capsule)
{
  return *static_cast<const described_class*>(PyCapsule_GetPointer(capsule, capsule_name));
}

handoff_array_desc description(const described_class& cls, PyObject* self)
{
  handoff_array_desc desc{};
  if (cls.describe(self, cls.context, &desc) != 0) { throw py::error_already_set(); }
  return desc;
}

// The view of what `self` holds, holding `self`, as handoff.view makes it.
array view_of(const described_class& cls, PyObject* self)
{
  const handoff_array_desc desc = description(cls, self);
  const py::object stream = desc.stream == 0 ? py::object(py::none()) : py::object(py::int_(desc.stream));
  return described_view(layout_of(desc), self, stream);
}

// The instance is args[0]: an instance method passes it first.
const signature* dlpack_signature = nullptr;

PyObject* class_dlpack(PyObject* capsule, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) noexcept
{
  PyObject* arguments[5];  // self, stream, max_version, dl_device, copy
  if (!dlpack_signature->parse(args, nargsf, kwnames, arguments)) { return nullptr; }
  return python_entry([&] {
    return py::object(
      export_dlpack(view_of(class_of(capsule), arguments[0]), arguments[1], arguments[2], arguments[3], arguments[4]));
  });
}

PyObject* class_dlpack_device(PyObject* capsule, PyObject* const* args, Py_ssize_t nargsf) noexcept
{
  if (PyVectorcall_NARGS(static_cast<std::size_t>(nargsf)) != 1) {
    PyErr_SetString(PyExc_TypeError, "__dlpack_device__() takes no arguments");
    return nullptr;
  }
  return python_entry([&] {
    const DLDevice device = description(class_of(capsule), args[0]).device;
    return py::object(py::make_tuple(static_cast<int>(device.device_type), device.device_id));
  });
}

PyObject* class_cuda_array_interface(PyObject* capsule, PyObject* self) noexcept
{
  return python_entry([&] { return py::object(cuda_array_interface(view_of(class_of(capsule), self))); });
}

PyObject* class_array_interface(PyObject* capsule, PyObject* self) noexcept
{
  return python_entry([&] { return py::object(array_interface(view_of(class_of(capsule), self))); });
}

PyMethodDef class_methods[] = {
  {"__dlpack__", as_cfunction(class_dlpack), METH_FASTCALL | METH_KEYWORDS,
   "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
   "Exports the data as a DLPack capsule, ordered for the consumer's stream (handoff.Array.__dlpack__)."},
  {"__dlpack_device__", as_cfunction(class_dlpack_device), METH_FASTCALL,
   "__dlpack_device__()\n--\n\nThe (device_type, device_id) of the data, with DLPack's codes."},
  {"__cuda_array_interface__", as_cfunction(class_cuda_array_interface), METH_O,
   "CUDA Array Interface v3 of CUDA memory, with the stream the data is ready on."},
  {"__array_interface__", as_cfunction(class_array_interface), METH_O,
   "NumPy's array interface v3 of CPU memory (strides in bytes, None when row-major)."},
};

}  // namespace

void def_dlpack(py::handle type, handoff_describe_fn describe, void* context, py::handle context_owner)
{
  HANDOFF_EXPECTS(PyType_Check(type.ptr()) != 0 && describe != nullptr, type_error,
                  "def_dlpack: expected a type and a describe function");
  if (class_attribute == nullptr) {
    class_attribute = PyUnicode_InternFromString("__handoff_dlpack_class__");
    if (class_attribute == nullptr) { throw py::error_already_set(); }
    dlpack_signature = new signature("__dlpack__", 1, {"stream", "max_version", "dl_device", "copy"});
  }
  auto held = std::make_unique<described_class>(
    described_class{describe, context, py::reinterpret_borrow<py::object>(context_owner)});
  const py::capsule shared(held.get(), capsule_name, [](PyObject* capsule) {
    delete static_cast<described_class*>(PyCapsule_GetPointer(capsule, capsule_name));
  });
  static_cast<void>(held.release());  // the capsule owns it
  const py::object module_name = py::str("handoff");
  const auto checked = [](PyObject* made) {
    if (made == nullptr) { throw py::error_already_set(); }
    return py::reinterpret_steal<py::object>(made);
  };
  const auto function = [&](PyMethodDef& def) {
    return checked(PyCFunction_NewEx(&def, shared.ptr(), module_name.ptr()));
  };
  const auto method = [&](PyMethodDef& def) { return checked(PyInstanceMethod_New(function(def).ptr())); };
  const py::object property = py::module_::import("builtins").attr("property");
  py::setattr(type, "__dlpack__", method(class_methods[0]));
  py::setattr(type, "__dlpack_device__", method(class_methods[1]));
  py::setattr(type, "__cuda_array_interface__",
              property(function(class_methods[2]), py::none(), py::none(), class_methods[2].ml_doc));
  py::setattr(type, "__array_interface__",
              property(function(class_methods[3]), py::none(), py::none(), class_methods[3].ml_doc));
  // handoff.Array's table takes the class's instances too (described_instance): both forms.
  py::setattr(type, class_attribute, shared);
  py::setattr(type, "__dlpack_c_exchange_api__", array_exchange_api_capsule());
  py::setattr(
    type, "__c_dlpack_exchange_api__",
    py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(const_cast<DLPackExchangeAPI*>(&array_exchange_api()))));
}

std::optional<array> described_instance(PyObject* object)
{
  if (class_attribute == nullptr) { return std::nullopt; }  // no class was given the methods
  PyObject* shared = _PyType_Lookup(Py_TYPE(object), class_attribute);
  if (shared == nullptr || !PyCapsule_IsValid(shared, capsule_name)) { return std::nullopt; }
  return view_of(class_of(shared), object);
}

}  // namespace handoff::python
