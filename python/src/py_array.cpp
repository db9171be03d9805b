// handoff.Array: a plain CPython type (no pybind11 instance machinery: creating one is a single
// object allocation) with its properties, and the producer side of DLPack and the array interfaces.
#include "py_array.hpp"

#include "py_arguments.hpp"
#include "py_array_exchange_api.hpp"
#include "py_capsule.hpp"
#include "py_cpython.hpp"
#include "py_errors.hpp"
#include "py_exchange.hpp"
#include "py_gil.hpp"
#include "py_owners.hpp"
#include "py_streams.hpp"
#include "py_trace.hpp"

#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/ownership.hpp>
#include <handoff/stream_value.hpp>
#include <handoff/trace.hpp>

#include <fmt/format.h>

#include <structmember.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace handoff::python {
namespace {

// value * scale as a Python int, exact: a stride in bytes may not fit in 64 bits where it never
// moves (an axis of extent 1, an empty array), though the stride in elements does.
py::object scaled(std::int64_t value, std::int64_t scale)
{
  std::int64_t product = 0;
  if (__builtin_mul_overflow(value, scale, &product)) { return py::int_(value) * py::int_(scale); }
  PyObject* made = PyLong_FromLongLong(product);
  if (made == nullptr) { throw py::error_already_set(); }
  return py::reinterpret_steal<py::object>(made);
}

py::tuple int_tuple(std::span<const std::int64_t> values, std::int64_t scale = 1)
{
  py::tuple out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), scaled(values[i], scale).release().ptr());
  }
  return out;
}

py::tuple byte_strides(const array& view)
{
  return int_tuple(view.strides(), static_cast<std::int64_t>(view.itemsize()));
}

// The consumer's `max_version`, saturated to DLPack's field range; nullopt for None.
std::optional<DLPackVersion> requested_version(py::handle max_version)
{
  if (max_version.is_none()) { return std::nullopt; }
  PyObject* raw = max_version.ptr();
  const bool pair = PyTuple_Check(raw) && PyTuple_GET_SIZE(raw) == 2 && PyLong_Check(PyTuple_GET_ITEM(raw, 0)) &&
                    PyLong_Check(PyTuple_GET_ITEM(raw, 1));
  HANDOFF_EXPECTS(pair, type_error, "max_version must be None or a (major, minor) tuple of ints");
  const auto field = [](PyObject* value) {
    return static_cast<std::uint32_t>(std::clamp<std::int64_t>(read_int64(value).saturated(), 0, UINT32_MAX));
  };
  return DLPackVersion{field(PyTuple_GET_ITEM(raw, 0)), field(PyTuple_GET_ITEM(raw, 1))};
}

// ---------------------------------------------------------------------------------------------
// The type

// A handoff.Array: the object header, its weak references and the view, built in place.
struct array_object {
  PyObject_HEAD PyObject* weakrefs;
  alignas(array) std::byte storage[sizeof(array)];
  alignas(tracked_view) std::byte node[sizeof(tracked_view)];  // the view's place in the ownership graph
};

PyTypeObject* array_type = nullptr;
// The exchange bind_array was given, which the type's slots export through: a slot has no closure.
exchange* bound_exchange = nullptr;
const signature* dlpack_signature = nullptr;

array& view_of(PyObject* self) noexcept
{
  return *std::launder(reinterpret_cast<array*>(reinterpret_cast<array_object*>(self)->storage));
}

void array_dealloc(PyObject* self) noexcept
{
  auto* object = reinterpret_cast<array_object*>(self);
  PyObject_GC_UnTrack(self);
  if (object->weakrefs != nullptr) { PyObject_ClearWeakRefs(self); }
  std::launder(reinterpret_cast<tracked_view*>(object->node))->~tracked_view();
  view_of(self).~array();  // may release the producer, running its deleter here
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_Del(self);
  Py_DECREF(type);
}

// The cyclic garbage collector: an array whose producer alone keeps a Python owner (an Exporter that
// caches its own view, owner=self) or stream objects may be part of a cycle through them.
int array_traverse(PyObject* self, visitproc visit, void* arg) noexcept
{
  Py_VISIT(Py_TYPE(self));  // instances of a heap type hold it
  return visit_kept_python_objects(view_of(self).owner(), visit, arg);
}

// The array lets go of its producer and becomes an empty view.
void let_go(PyObject* self) noexcept
{
  array_layout empty;
  empty.shape = extents{0};
  empty.strides = extents{1};
  view_of(self) = array{std::move(empty), shared_producer{}};  // the old producer goes last, here
}

// An array in a cycle the collector found: it lets go of its producer before the collector clears
// anything. Its release then waits for its consumer streams while they are certainly alive (the
// pending release keeps their stream objects), where clearing a stream object of the cycle first
// could have destroyed the stream under the release; and the cycle is broken.
void array_finalize(PyObject* self) noexcept
{
  const error_scope set_aside;
  let_go(self);
}

int array_clear(PyObject* self) noexcept
{
  let_go(self);
  return 0;
}

PyObject* array_repr(PyObject* self) noexcept
{
  return python_entry([self] {
    const array& view = view_of(self);
    const std::string text =
      fmt::format("handoff.Array(shape=({}{}), dtype={}, device=({}, {}))", fmt::join(view.shape(), ", "),
                  view.ndim() == 1 ? "," : "", dtype_name(view.dtype()), static_cast<int>(view.device().device_type),
                  view.device().device_id);
    return py::reinterpret_steal<py::object>(
      PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size())));
  });
}

// A new reference, or nullptr with the error already set by the CPython call that made it.
py::object checked(PyObject* made)
{
  if (made == nullptr) { throw py::error_already_set(); }
  return py::reinterpret_steal<py::object>(made);
}

py::object device_tuple(const array& view)
{
  return py::make_tuple(static_cast<int>(view.device().device_type), view.device().device_id);
}

PyObject* get_shape(PyObject* self, void* /*closure*/) noexcept
{
  return python_entry([self] { return py::object(int_tuple(view_of(self).shape())); });
}

PyObject* get_strides(PyObject* self, void* /*closure*/) noexcept
{
  return python_entry([self] { return py::object(byte_strides(view_of(self))); });
}

PyObject* get_dtype(PyObject* self, void* /*closure*/) noexcept
{
  return python_entry([self] {
    const std::string_view name = dtype_name(view_of(self).dtype());
    return checked(PyUnicode_FromStringAndSize(name.data(), static_cast<Py_ssize_t>(name.size())));
  });
}

PyObject* get_device(PyObject* self, void* /*closure*/) noexcept
{
  return python_entry([self] { return device_tuple(view_of(self)); });
}

PyObject* get_data_ptr(PyObject* self, void* /*closure*/) noexcept
{
  return PyLong_FromUnsignedLongLong(reinterpret_cast<std::uintptr_t>(view_of(self).data()));
}

PyObject* get_readonly(PyObject* self, void* /*closure*/) noexcept
{
  return PyBool_FromLong(view_of(self).readonly() ? 1 : 0);
}

PyObject* get_ndim(PyObject* self, void* /*closure*/) noexcept
{
  return PyLong_FromLong(view_of(self).ndim());
}

PyObject* get_size(PyObject* self, void* /*closure*/) noexcept
{
  return PyLong_FromLongLong(view_of(self).size());
}

PyObject* get_nbytes(PyObject* self, void* /*closure*/) noexcept
{
  return PyLong_FromLongLong(view_of(self).nbytes());
}

PyObject* get_array_interface(PyObject* self, void* /*closure*/) noexcept
{
  return python_entry([self] { return py::object(array_interface(view_of(self))); });
}

PyObject* get_cuda_array_interface(PyObject* self, void* /*closure*/) noexcept
{
  return python_entry([self] { return py::object(cuda_array_interface(*bound_exchange, view_of(self))); });
}

// Not noexcept: the owner of a bare consumer stream is looked up in Python (see python_code_entry).
PyObject* method_dlpack(PyObject* self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames)
{
  PyObject* arguments[4];  // stream, max_version, dl_device, copy
  if (!dlpack_signature->parse(args, nargsf, kwnames, arguments)) { return nullptr; }
  return python_code_entry([&] {
    return py::object(
      export_dlpack(*bound_exchange, view_of(self), arguments[0], arguments[1], arguments[2], arguments[3]));
  });
}

PyObject* method_dlpack_device(PyObject* self, PyObject* /*unused*/) noexcept
{
  return python_entry([self] { return device_tuple(view_of(self)); });
}

// Every pickle protocol and copy.copy: a view of memory another library owns has nothing to save.
PyObject* method_reduce(PyObject* /*self*/, PyObject* /*protocol*/) noexcept
{
  PyErr_SetString(PyExc_TypeError,
                  "cannot pickle 'handoff.Array' object: it views memory its producer owns; pickle an array "
                  "that owns its data instead (numpy.asarray(view) for CPU data)");
  return nullptr;
}

PyGetSetDef array_getset[] = {
  {"shape", get_shape, nullptr, "The extent of each axis, a tuple of ints.", nullptr},
  {"strides", get_strides, nullptr, "Strides in bytes, as NumPy reports them.", nullptr},
  {"dtype", get_dtype, nullptr, "The element type's NumPy-style name: 'float32', 'int8', 'bool', 'bfloat16', ...",
   nullptr},
  {"device", get_device, nullptr, "(device_type, device_id) with DLPack's codes.", nullptr},
  {"data_ptr", get_data_ptr, nullptr, "The address of the data (device memory for device arrays), an int.", nullptr},
  {"readonly", get_readonly, nullptr, "True when the producer exported the data read-only.", nullptr},
  {"ndim", get_ndim, nullptr, "The number of axes.", nullptr},
  {"size", get_size, nullptr, "The number of elements.", nullptr},
  {"nbytes", get_nbytes, nullptr, "The size of the elements in bytes (size times the item size).", nullptr},
  {"__array_interface__", get_array_interface, nullptr,
   "NumPy's array interface v3 of CPU arrays (elsewhere AttributeError: hasattr() is False).", nullptr},
  {"__cuda_array_interface__", get_cuda_array_interface, nullptr,
   "CUDA Array Interface v3 of CUDA memory, with `stream` naming the stream the data is ready on (elsewhere "
   "AttributeError: hasattr() is False).",
   nullptr},
  {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMethodDef array_methods[] = {
  {"__dlpack__", as_cfunction(method_dlpack), METH_FASTCALL | METH_KEYWORDS,
   "__dlpack__($self, /, *, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
   "Exports the array as a DLPack capsule (versioned when max_version >= (1, 0)), ordered after the data's stream "
   "for the consumer's `stream`. ValueError for a stream the device does not take; BufferError when the export "
   "cannot be made as asked (`dl_device`, `copy`)."},
  {"__dlpack_device__", as_cfunction(method_dlpack_device), METH_NOARGS,
   "__dlpack_device__($self, /)\n--\n\nThe (device_type, device_id) of the data, with DLPack's codes."},
  {"__reduce_ex__", as_cfunction(method_reduce), METH_O,
   "__reduce_ex__($self, protocol, /)\n--\n\nRefused (TypeError): a view of memory its producer owns cannot be "
   "pickled."},
  {nullptr, nullptr, 0, nullptr},
};

PyMemberDef array_members[] = {
  {"__weaklistoffset__", T_PYSSIZET, static_cast<Py_ssize_t>(offsetof(array_object, weakrefs)), READONLY, nullptr},
  {nullptr, 0, 0, 0, nullptr},
};

constexpr const char* array_doc =
  "A zero-copy view of an array imported into handoff. It keeps its producer alive; when the last view\n"
  "(and every capsule exported from it) is gone, the producer is released.";

}  // namespace

// CUDA Array Interface v3 of CUDA-resident data; `stream` is where the data is ready, so that the
// consumer can order its work after it (None when unknown: nothing to wait for).
py::dict cuda_array_interface(const exchange& on, const array& view)
{
  if (!is_cuda_device(view.device().device_type)) {
    throw py::attribute_error(
      fmt::format("__cuda_array_interface__ is for CUDA memory; this array is on {}", device_text(view.device())));
  }
  std::string type;
  try {
    type = typestr(view.dtype());
  } catch (const buffer_error& e) {
    throw py::attribute_error(e.what());
  }
  py::dict out;
  out["shape"] = int_tuple(view.shape());
  out["typestr"] = type;
  // "For zero-size arrays, use 0 here" (the interface's `data`).
  const std::uintptr_t data = view.size() == 0 ? 0 : reinterpret_cast<std::uintptr_t>(view.data());
  out["data"] = py::make_tuple(data, view.readonly());
  out["strides"] = view.is_c_contiguous() ? py::object(py::none()) : py::object(byte_strides(view));
  py::list descr;
  descr.append(py::make_tuple("", type));
  out["descr"] = descr;
  out["version"] = 3;
  const auto ready = on.interface_stream(view);
  out["stream"] = ready ? py::object(py::int_(*ready)) : py::object(py::none());
  return out;
}

py::dict array_interface(const array& view)
{
  if (view.device().device_type != kDLCPU) {
    throw py::attribute_error(
      fmt::format("__array_interface__ is for CPU arrays; this one is on {}", device_text(view.device())));
  }
  py::dict out;
  out["shape"] = int_tuple(view.shape());
  out["typestr"] = typestr(view.dtype());
  out["data"] = py::make_tuple(reinterpret_cast<std::uintptr_t>(view.data()), view.readonly());
  out["strides"] = view.is_c_contiguous() ? py::object(py::none()) : py::object(byte_strides(view));
  out["version"] = 3;
  return out;
}

namespace {

// The `__name__` of the module whose code `frame` runs; empty when unknown.
std::string module_of(PyFrameObject* frame)
{
  std::string name;
  if (PyObject* globals = PyFrame_GetGlobals(frame)) {
    PyObject* value = PyDict_GetItemString(globals, "__name__");  // borrowed
    if (const char* text = value != nullptr && PyUnicode_Check(value) ? PyUnicode_AsUTF8(value) : nullptr) {
      name = text;
    }
    Py_DECREF(globals);
  }
  PyErr_Clear();
  return name;
}

// True when PyTorch's torch.from_dlpack asked for the export: it is the nearest caller but
// handoff.Exporter's __dlpack__ (the one Python frame handoff puts between a consumer and here).
bool asked_by_torch_from_dlpack()
{
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed; null when no Python code called
  Py_XINCREF(frame);
  if (frame != nullptr && module_of(frame) == "handoff._exporter") {
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  if (frame == nullptr) { return false; }
  PyCodeObject* code = PyFrame_GetCode(frame);
  const char* name = PyUnicode_AsUTF8(code->co_name);
  const bool asked =
    name != nullptr && std::string_view{name} == "from_dlpack" && module_of(frame) == "torch.utils.dlpack";
  Py_DECREF(code);
  Py_DECREF(frame);
  PyErr_Clear();
  return asked;
}

// The newest PyTorch release known to import no pinned host memory: ATen's DLPack import
// (getATenDevice) refuses kDLCUDAHost and kDLROCMHost ("Unsupported device_type: 3").
constexpr std::pair<int, int> newest_torch_without_pinned_import{2, 13};

// The version of the imported PyTorch when it is one of those; nullopt otherwise.
std::optional<std::string> torch_without_pinned_import()
{
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
  PyObject* version = torch != nullptr ? PyObject_GetAttrString(torch, "__version__") : nullptr;
  const char* text = version != nullptr && PyUnicode_Check(version) ? PyUnicode_AsUTF8(version) : nullptr;
  std::optional<std::string> refusing;
  int major = 0;
  int minor = 0;
  if (text != nullptr && std::sscanf(text, "%d.%d", &major, &minor) == 2 &&
      std::pair{major, minor} <= newest_torch_without_pinned_import) {
    refusing = text;
  }
  Py_XDECREF(version);
  PyErr_Clear();
  return refusing;
}

// torch.from_dlpack asks for the data on the device `__dlpack_device__` says (`dl_device` only
// when its caller names that very device, and PyTorch has no device for pinned memory), and a
// PyTorch that cannot import pinned host memory would refuse the capsule with a message that says
// nothing of what to do: refused here, saying it.
void refuse_pinned_export_to_torch(const array& view)
{
  if (!asked_by_torch_from_dlpack()) { return; }
  const auto version = torch_without_pinned_import();
  if (!version) { return; }
  const DLDeviceType type = view.device().device_type;
  throw buffer_error(fmt::format(
    "torch.from_dlpack cannot import pinned host memory: PyTorch {} imports no {} capsule (DLPack device type {}) "
    "and never asks for the data on the CPU, not even with device='cpu'. For a CPU tensor of the same memory, "
    "without a copy: torch.from_dlpack(handoff.from_dlpack(x, device='cpu')) (which first waits for the data's "
    "pending writes)",
    *version, device_type_name(type), static_cast<int>(type)));
}

}  // namespace

py::capsule export_dlpack(exchange& on, const array& view, py::handle stream, py::handle max_version,
                          py::handle dl_device, py::handle copy)
{
  if (is_pinned_host(view.device().device_type) && dl_device.is_none()) { refuse_pinned_export_to_torch(view); }
  const std::optional<std::int64_t> stream_value = stream_argument(stream);
  export_request request;
  if (stream_value) { request.stream = named_stream::dlpack(*stream_value); }
  request.max_version = requested_version(max_version);
  if (!dl_device.is_none()) {
    request.dl_device = target_device_argument(dl_device, "dl_device", unknown_device_type::unreachable);
  }
  request.copy = copy_argument(copy);
  // A stream handle is certain to be alive when the export is released only if something holds it:
  // the stream object of the enclosing handoff.stream block, when the handle is that block's; else
  // that of the library whose current stream it is (the consumer passes its own: CuPy, PyTorch).
  if (stream_value) {
    const stream_request consumer = classify_stream(view.device().device_type, stream_value);
    if (consumer.order == stream_order::handle) {
      request.stream.owner = enclosing_stream_owner(consumer.handle);
      if (!request.stream.owner && on.export_release_policy() == export_release::known_streams) {
        request.stream.owner = framework_stream_owner(consumer.handle, view.device());
      }
    }
  }
  const exported_tensor made = on.export_dlpack(view, request);
  return made.versioned != nullptr ? make_capsule(made.versioned) : make_capsule(made.legacy);
}

py::object wrap(array&& view, const char* library)
{
  auto* object = PyObject_GC_New(array_object, array_type);  // holds the type
  if (object == nullptr) { throw py::error_already_set(); }
  PyObject* self = reinterpret_cast<PyObject*>(object);
  object->weakrefs = nullptr;
  const array* held = new (object->storage) array(std::move(view));
  if (library == nullptr) { library = producer_naming::current(); }
  const auto* node = new (object->node) tracked_view(*held, "handoff.Array", library);
  if (trace::enabled()) {
    if (trace::exchange_scope* scope = trace::exchange_scope::current();
        scope != nullptr && scope->event().kind == trace::event_kind::import_data) {
      scope->set_view(*held, node->id(), library);
    }
  }
  // Tracked only when it may be part of a cycle: most arrays hold no Python object of their own.
  if (keeps_python_objects(held->owner())) { PyObject_GC_Track(self); }
  return py::reinterpret_steal<py::object>(self);
}

array* as_array(py::handle object) noexcept
{
  return object && Py_TYPE(object.ptr()) == array_type ? &view_of(object.ptr()) : nullptr;
}

const char* library_of_array(py::handle object) noexcept
{
  if (!object || Py_TYPE(object.ptr()) != array_type) { return nullptr; }
  return std::launder(reinterpret_cast<tracked_view*>(reinterpret_cast<array_object*>(object.ptr())->node))->library();
}

void bind_array(py::module_& m, exchange& on)
{
  bound_exchange = &on;
  bind_exchange_api(on);
  dlpack_signature = new signature("__dlpack__", 0, {"stream", "max_version", "dl_device", "copy"});
  PyType_Slot slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(array_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(array_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(array_clear)},
    {Py_tp_finalize, reinterpret_cast<void*>(array_finalize)},
    {Py_tp_repr, reinterpret_cast<void*>(array_repr)},
    {Py_tp_getset, array_getset},
    {Py_tp_methods, array_methods},
    {Py_tp_members, array_members},
    {Py_tp_doc, const_cast<char*>(array_doc)},
    {0, nullptr},
  };
  unsigned int flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
#ifdef Py_TPFLAGS_DISALLOW_INSTANTIATION
  flags |= Py_TPFLAGS_DISALLOW_INSTANTIATION;  // made only by from_dlpack, asarray and handoff.sim
#endif
  PyType_Spec spec{"handoff.Array", static_cast<int>(sizeof(array_object)), 0, flags, slots};
  PyObject* type = PyType_FromSpec(&spec);
  if (type == nullptr) { throw py::error_already_set(); }
  array_type = reinterpret_cast<PyTypeObject*>(type);
  // Class attributes that no slot can hold, set while the type is still mutable: the C exchange API
  // in DLPack 1.3's form (a capsule) and in 1.2's (the table's address), which consumers still read.
  const py::object table_address =
    py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(const_cast<DLPackExchangeAPI*>(&array_exchange_api())));
  if (!table_address ||
      PyObject_SetAttrString(type, "__dlpack_c_exchange_api__", exchange_api_capsule(array_exchange_api()).ptr()) !=
        0 ||
      PyObject_SetAttrString(type, "__c_dlpack_exchange_api__", table_address.ptr()) != 0) {
    throw py::error_already_set();
  }
#ifdef Py_TPFLAGS_IMMUTABLETYPE
  array_type->tp_flags |= Py_TPFLAGS_IMMUTABLETYPE;
  PyType_Modified(array_type);
#endif
#ifndef Py_TPFLAGS_DISALLOW_INSTANTIATION
  array_type->tp_new = nullptr;
#endif
  m.attr("Array") = py::reinterpret_borrow<py::object>(type);  // `array_type` keeps its own reference
}

}  // namespace handoff::python
