// Each method is a plain CPython method descriptor of the class (METH_FASTCALL), as a C type's own
// are: the class's authors get handoff.Array's __dlpack__ at the cost of handoff.Array's, not at the
// cost of a general-purpose dispatcher's keyword matching.
#include "py_dlpack_class.hpp"

#include "py_arguments.hpp"
#include "py_array.hpp"
#include "py_array_exchange_api.hpp"
#include "py_cpython.hpp"
#include "py_errors.hpp"
#include "py_extension_views.hpp"
#include "py_view.hpp"

#include <handoff/error.hpp>

#include <fmt/format.h>

#include <memory>

namespace handoff::python {
namespace {

constexpr const char* capsule_name = "handoff.dlpack_class";
PyObject* class_attribute = nullptr;  // "__handoff_dlpack_class__": the class's capsule, on the type

// How a class describes its instances, and the exchange its methods export through, held by a
// capsule on the class.
struct described_class {
  handoff_describe_fn describe;
  void* context;
  py::object context_owner;
  exchange* on;
};

// The description of `self`'s class (the type attribute cache answers the lookup); null for an
// object of another class.
const described_class* class_of(PyObject* self) noexcept
{
  PyObject* capsule = class_attribute != nullptr ? _PyType_Lookup(Py_TYPE(self), class_attribute) : nullptr;
  if (capsule == nullptr || !PyCapsule_IsValid(capsule, capsule_name)) { return nullptr; }
  return static_cast<const described_class*>(PyCapsule_GetPointer(capsule, capsule_name));
}

// `self`'s class, which a method descriptor of it has checked `self` to be an instance of.
const described_class& instance_class(PyObject* self)
{
  const described_class* cls = class_of(self);
  HANDOFF_EXPECTS(cls != nullptr, type_error,
                  fmt::format("{} has no description of its memory (def_dlpack)", type_name(py::handle{self})));
  return *cls;
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
  return described_view(*cls.on, layout_of(desc), self, ready_stream_of(desc));
}

const signature* dlpack_signature = nullptr;

// Not noexcept: the describe function and the consumer stream's owner lookup run Python code.
PyObject* class_dlpack(PyObject* self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames)
{
  PyObject* arguments[4];  // stream, max_version, dl_device, copy
  if (!dlpack_signature->parse(args, nargsf, kwnames, arguments)) { return nullptr; }
  return python_code_entry([&] {
    const described_class& cls = instance_class(self);
    return py::object(
      export_dlpack(*cls.on, view_of(cls, self), arguments[0], arguments[1], arguments[2], arguments[3]));
  });
}

PyObject* class_dlpack_device(PyObject* self, PyObject* /*unused*/) noexcept
{
  return python_entry([&] {
    const DLDevice device = description(instance_class(self), self).device;
    return py::object(py::make_tuple(static_cast<int>(device.device_type), device.device_id));
  });
}

PyObject* class_cuda_array_interface(PyObject* self, void* /*closure*/) noexcept
{
  return python_entry([&] {
    const described_class& cls = instance_class(self);
    return py::object(cuda_array_interface(*cls.on, view_of(cls, self)));
  });
}

PyObject* class_array_interface(PyObject* self, void* /*closure*/) noexcept
{
  return python_entry([&] { return py::object(array_interface(view_of(instance_class(self), self))); });
}

// Method descriptors of the class itself, as a C type's own methods are: a call on an instance
// makes no bound method, and a call on another object is refused by Python, naming both.
PyMethodDef class_methods[] = {
  {"__dlpack__", as_cfunction(class_dlpack), METH_FASTCALL | METH_KEYWORDS,
   "__dlpack__($self, /, *, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
   "Exports the data as a DLPack capsule, ordered for the consumer's stream (handoff.Array.__dlpack__)."},
  {"__dlpack_device__", as_cfunction(class_dlpack_device), METH_NOARGS,
   "__dlpack_device__($self, /)\n--\n\nThe (device_type, device_id) of the data, with DLPack's codes."},
};

PyGetSetDef class_getset[] = {
  {"__cuda_array_interface__", class_cuda_array_interface, nullptr,
   "CUDA Array Interface v3 of CUDA memory, with the stream the data is ready on.", nullptr},
  {"__array_interface__", class_array_interface, nullptr,
   "NumPy's array interface v3 of CPU memory (strides in bytes, None when row-major).", nullptr},
};

}  // namespace

void def_dlpack(exchange& on, py::handle type, handoff_describe_fn describe, void* context, py::handle context_owner)
{
  HANDOFF_EXPECTS(PyType_Check(type.ptr()) != 0 && describe != nullptr, type_error,
                  "def_dlpack: expected a type and a describe function");
  if (class_attribute == nullptr) {
    class_attribute = PyUnicode_InternFromString("__handoff_dlpack_class__");
    if (class_attribute == nullptr) { throw py::error_already_set(); }
    dlpack_signature = new signature("__dlpack__", 0, {"stream", "max_version", "dl_device", "copy"});
  }
  auto held = std::make_unique<described_class>(
    described_class{describe, context, py::reinterpret_borrow<py::object>(context_owner), &on});
  const py::capsule shared(held.get(), capsule_name, [](PyObject* capsule) {
    delete static_cast<described_class*>(PyCapsule_GetPointer(capsule, capsule_name));
  });
  static_cast<void>(held.release());  // the capsule owns it
  auto* cls = reinterpret_cast<PyTypeObject*>(type.ptr());
  const auto checked = [](PyObject* made) {
    if (made == nullptr) { throw py::error_already_set(); }
    return py::reinterpret_steal<py::object>(made);
  };
  py::setattr(type, class_attribute, shared);
  for (PyMethodDef& def : class_methods) { py::setattr(type, def.ml_name, checked(PyDescr_NewMethod(cls, &def))); }
  for (PyGetSetDef& def : class_getset) { py::setattr(type, def.name, checked(PyDescr_NewGetSet(cls, &def))); }
  // The class's table takes its instances (described_instance), in both forms.
  py::setattr(type, "__dlpack_c_exchange_api__", exchange_api_capsule(class_exchange_api()));
  py::setattr(type, "__c_dlpack_exchange_api__",
              checked(PyLong_FromVoidPtr(const_cast<DLPackExchangeAPI*>(&class_exchange_api()))));
}

std::optional<array> described_instance(PyObject* object)
{
  const described_class* cls = class_of(object);
  if (cls == nullptr) { return std::nullopt; }
  return view_of(*cls, object);
}

}  // namespace handoff::python
