// handoff.from_dlpack and handoff.asarray. The import of an array is the hot path: arguments are
// parsed without pybind11, names and constant arguments are made once, and `__dlpack__` is found
// on the type without creating a bound method.
#include "py_exchange.hpp"

#include "py_arguments.hpp"
#include "py_array.hpp"
#include "py_array_exchange_api.hpp"
#include "py_capsule.hpp"
#include "py_cpython.hpp"
#include "py_errors.hpp"
#include "py_exchange_api.hpp"
#include "py_interfaces.hpp"
#include "py_numpy.hpp"
#include "py_owners.hpp"
#include "py_streams.hpp"
#include "py_trace.hpp"

#include <handoff/context.hpp>
#include <handoff/device.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/stream.hpp>
#include <handoff/stream_value.hpp>

#include <fmt/format.h>

#include <cxxabi.h>
#include <array>
#include <cstring>
#include <exception>
#include <optional>
#include <utility>

namespace handoff::python {
namespace {

// Interned names and constant arguments, made once: the import path is hot.
struct cached_objects {
  PyObject* dlpack = nullptr;                // "__dlpack__"
  PyObject* dlpack_device = nullptr;         // "__dlpack_device__"
  PyObject* cuda_array_interface = nullptr;  // "__cuda_array_interface__"
  PyObject* array_interface = nullptr;       // "__array_interface__"
  PyObject* max_version = nullptr;           // (1, 1)
  PyObject* kw_max_version = nullptr;        // ("max_version",)
  PyTypeObject* ndarray = nullptr;           // numpy.ndarray, once one was seen
  // The keyword names of __dlpack__, interned: producers' argument parsers match them by identity
  // before comparing text.
  PyObject* max_version_name = nullptr;
  PyObject* stream_name = nullptr;
  PyObject* dl_device_name = nullptr;
  PyObject* copy_name = nullptr;
};
cached_objects cached;

}  // namespace

named_stream consumer_stream(py::handle stream)
{
  if (!stream.is_none()) { return stream_named_by(stream); }
  const py::object block = enclosing_stream();
  return block.is_none() ? named_stream{} : stream_named_by(block);  // None: the default stream
}

bool is_numpy_array(PyObject* x) noexcept
{
  PyTypeObject* type = Py_TYPE(x);
  if (type == cached.ndarray) { return true; }
  if (cached.ndarray != nullptr || std::strcmp(type->tp_name, "numpy.ndarray") != 0) { return false; }
  cached.ndarray = type;  // only NumPy names a type so; kept alive by the numpy module
  return true;
}

namespace {

// True when `x` has a `__dlpack__` attribute. Looked up on the type first (the type's attribute
// cache answers without allocating); only objects without it there pay for a full getattr.
bool has_dlpack(PyObject* x)
{
  if (_PyType_Lookup(Py_TYPE(x), cached.dlpack) != nullptr) { return true; }
  return PyObject_HasAttr(x, cached.dlpack) != 0;
}

// The plain method `x.__dlpack__` resolves to, when that needs no instance lookup: `x`'s type uses
// the generic getattr, its instances have no __dict__ and the type's attribute is a method
// descriptor (as NumPy's, PyTorch's and handoff's are). Then calling it with `x` first is what
// x.__dlpack__(...) does. Borrowed; nullptr otherwise (use has_dlpack and a method call).
PyObject* plain_dlpack_method(PyObject* x)
{
  PyTypeObject* type = Py_TYPE(x);
  if (type->tp_getattro != PyObject_GenericGetAttr || type->tp_dictoffset != 0) { return nullptr; }
  PyObject* method = _PyType_Lookup(type, cached.dlpack);
  return method != nullptr && PyType_HasFeature(Py_TYPE(method), Py_TPFLAGS_METHOD_DESCRIPTOR) ? method : nullptr;
}

// What x.__dlpack_device__() says; nullopt when `x` has none and it is not `required`.
// @throws type_error for anything but a pair of ints, value_error for ints that are no DLPack device.
std::optional<DLDevice> producer_device(py::handle x, bool required)
{
  const py::object device = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(x.ptr(), cached.dlpack_device));
  if (!device) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) { throw py::error_already_set(); }
    PyErr_Clear();  // a producer older than __dlpack_device__
    HANDOFF_EXPECTS(!required, type_error,
                    fmt::format("{} has no __dlpack_device__, so a consumer stream cannot be passed to its "
                                "__dlpack__: what a stream value means depends on the device of the data",
                                type_name(x)));
    return std::nullopt;
  }
  const bool pair = PyTuple_Check(device.ptr()) && PyTuple_GET_SIZE(device.ptr()) == 2;
  if (pair) {  // the common answer, read without building the messages that errors need
    PyObject* type = PyTuple_GET_ITEM(device.ptr(), 0);
    PyObject* id = PyTuple_GET_ITEM(device.ptr(), 1);
    if (PyLong_CheckExact(type) && PyLong_CheckExact(id)) {
      const int64_reading type_value = read_int64(type);
      const int64_reading id_value = read_int64(id);
      if (type_value.fits() && id_value.fits() && id_value.value >= 0 && id_value.value <= INT32_MAX &&
          is_dlpack_device_type(type_value.value)) {
        return on_one_cpu(
          DLDevice{static_cast<DLDeviceType>(type_value.value), static_cast<std::int32_t>(id_value.value)});
      }
    }
  }
  HANDOFF_EXPECTS(pair, type_error,
                  fmt::format("{}.__dlpack_device__() must return a (device_type, device_id) tuple, not {}",
                              type_name(x), type_name(device)));
  const std::string field = fmt::format("{}.__dlpack_device__()", type_name(x));
  return on_one_cpu(*parse_device_argument(device, field.c_str(), unknown_device_type::invalid));
}

// A keyword argument of __dlpack__: its interned name (from `cached`) and its value.
struct keyword {
  PyObject* name{nullptr};
  py::handle value;
};

// Calls x.__dlpack__ with keyword arguments only (at most the four it has).
py::object call_dlpack(py::handle x, std::span<const keyword> kwargs)
{
  std::array<PyObject*, 5> args{x.ptr()};
  const call_argument names{py::tuple(kwargs.size())};
  for (std::size_t i = 0; i < kwargs.size(); ++i) {
    args[i + 1] = kwargs[i].value.ptr();
    Py_INCREF(kwargs[i].name);
    PyTuple_SET_ITEM(names.get().ptr(), static_cast<Py_ssize_t>(i), kwargs[i].name);
  }
  PyObject* result = PyObject_VectorcallMethod(cached.dlpack, args.data(), 1 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                               kwargs.empty() ? nullptr : names.get().ptr());
  if (result == nullptr) { throw py::error_already_set(); }
  return py::reinterpret_steal<py::object>(result);
}

struct dlpack_result {
  py::object capsule;
  bool legacy;  // the producer refused max_version, so it could not honour dl_device or copy either
};

dlpack_result request_capsule(py::handle x, py::handle stream, py::handle device, py::handle copy)
{
  if (stream.is_none() && device.is_none() && copy.is_none()) {
    // The common case, with cached arguments: x.__dlpack__(max_version=(1, 1)).
    std::array<PyObject*, 2> args{x.ptr(), cached.max_version};
    PyObject* result =
      PyObject_VectorcallMethod(cached.dlpack, args.data(), 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, cached.kw_max_version);
    if (result != nullptr) { return {py::reinterpret_steal<py::object>(result), false}; }
  } else {
    std::array<keyword, 4> kwargs{keyword{cached.max_version_name, cached.max_version}};
    std::size_t given = 1;
    if (!stream.is_none()) { kwargs[given++] = {cached.stream_name, stream}; }
    if (!device.is_none()) { kwargs[given++] = {cached.dl_device_name, device}; }
    if (!copy.is_none()) { kwargs[given++] = {cached.copy_name, copy}; }
    try {
      return {call_dlpack(x, std::span{kwargs}.first(given)), false};
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_TypeError)) { throw; }
    }
  }
  if (PyErr_Occurred() != nullptr && !PyErr_ExceptionMatches(PyExc_TypeError)) { throw py::error_already_set(); }
  PyErr_Clear();
  // A producer older than DLPack 1.0: no max_version, dl_device or copy.
  if (stream.is_none()) { return {call_dlpack(x, {}), true}; }
  const std::array<keyword, 1> legacy_args{keyword{cached.stream_name, stream}};
  return {call_dlpack(x, legacy_args), true};
}

// The DLPack stream values of CUDA's default streams.
constexpr std::int64_t legacy_default_value = 1;
constexpr std::int64_t per_thread_default_value = 2;

// True when `argument`, passed to the producer of CUDA data, names the per-thread default stream.
bool names_the_per_thread_stream(const std::optional<DLDevice>& claimed, py::handle argument) noexcept
{
  if (!claimed || !is_cuda_device(claimed->device_type) || !is_int(argument.ptr())) { return false; }
  const int64_reading value = read_int64(argument.ptr());
  return value.fits() && value.value == per_thread_default_value;
}

// Asks a producer that refused the per-thread default stream (PyTorch's __dlpack__: BufferError
// "per-thread default stream is not supported.") for the legacy default stream instead, which it
// orders its work before; the consumer's per-thread stream is then ordered after the legacy one.
// Refused while a blocking stream of the current device (the data's) captures into a graph: the
// producer's use of the legacy stream would invalidate the capture.
dlpack_result request_through_the_legacy_stream(const exchange& on, py::handle x, const py::error_already_set& refusal,
                                                py::handle device, py::handle copy)
{
  if (context* ctx = on.device_context()) {
    device::backend& b = ctx->backend();
    HANDOFF_EXPECTS(
      b.stream_capture_status(b.legacy_default_stream()) == device::capture_status::none, buffer_error,
      fmt::format("{}.__dlpack__ refuses the per-thread default stream (stream=2: {}); it is not asked for the "
                  "legacy default stream instead while a blocking stream of the device captures into a graph, as "
                  "that use of the legacy stream would invalidate the capture: import outside the capture, or "
                  "consume on a non-blocking stream of your own",
                  type_name(x), py::str(refusal.value()).cast<std::string>()));
  }
  const call_argument legacy_stream{py::int_(legacy_default_value)};
  return request_capsule(x, legacy_stream.get(), device, copy);
}

// What a producer's DLPack C exchange API table cannot say, asked of its Python object.
class table_producer_object final : public table_producer {
 public:
  table_producer_object(const DLPackExchangeAPI& api, PyObject* x) noexcept : api_(api), x_(x) {}

  bool lazily_conjugated() override { return is_lazy_conjugate(x_); }
  bool current_work_stream(DLDevice device, std::optional<std::int64_t>& stream) noexcept override
  {
    return python::current_work_stream(api_, device, stream);
  }

 private:
  const DLPackExchangeAPI& api_;
  PyObject* x_;
};

// from_dlpack and asarray share one signature: (x, /, *, device=None, copy=None, stream=None).
const signature* from_dlpack_signature = nullptr;
const signature* asarray_signature = nullptr;

// The exchange init_exchange was given: a METH_FASTCALL function has no closure to hold it.
exchange* bound_exchange = nullptr;

// Not noexcept: an import runs producers' Python code, and a daemon thread that asks for the GIL
// back there while the interpreter finalizes is ended by CPython with pthread_exit, whose
// unwinding must pass through (std::terminate otherwise).
template <py::object (*Import)(exchange&, py::handle, py::handle, py::handle, py::handle), const signature** Signature>
PyObject* import_entry(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames)
{
  PyObject* arguments[4];  // x, device, copy, stream
  if (!(*Signature)->parse(args, nargsf, kwnames, arguments)) { return nullptr; }
  try {
    const producer_naming naming{arguments[0]};
    trace::exchange_scope scope{trace::event_kind::import_data, "dlpack"};
    if (scope.active()) { scope.event().consumer = "handoff"; }
    return Import(*bound_exchange, arguments[0], arguments[1], arguments[2], arguments[3]).release().ptr();
  } catch (abi::__forced_unwind&) {
    throw;
  } catch (...) {
    raise_current_exception();
    return nullptr;
  }
}

PyMethodDef import_functions[] = {
  {"from_dlpack", as_cfunction(import_entry<from_dlpack, &from_dlpack_signature>), METH_FASTCALL | METH_KEYWORDS,
   "from_dlpack(x, /, *, device=None, copy=None, stream=None)\n--\n\n"
   "Imports an object with __dlpack__ (or a DLPack capsule) as a handoff.Array, zero-copy.\n\n"
   "`stream` is the consumer's stream (an int in DLPack's convention or a stream object; None: the enclosing\n"
   "handoff.stream block's, else the default stream); the producer's pending work is ordered before it.\n"
   "`device` ((device_type, device_id) or 'cpu') and `copy` are the array API's. TypeError without\n"
   "__dlpack__, ValueError for an invalid stream, BufferError for data that cannot be exchanged as asked,\n"
   "handoff.DeviceError when the device fails."},
  {"asarray", as_cfunction(import_entry<asarray, &asarray_signature>), METH_FASTCALL | METH_KEYWORDS,
   "asarray(x, /, *, device=None, copy=None, stream=None)\n--\n\n"
   "Imports through DLPack, the CUDA Array Interface, __array_interface__ or the buffer protocol, zero-copy.\n\n"
   "The arguments and errors are from_dlpack's; TypeError when `x` supports none of these protocols."},
  {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void init_exchange(py::module_& m, exchange& on)
{
  bound_exchange = &on;
  cached.dlpack = PyUnicode_InternFromString("__dlpack__");
  cached.dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
  cached.cuda_array_interface = PyUnicode_InternFromString("__cuda_array_interface__");
  cached.array_interface = PyUnicode_InternFromString("__array_interface__");
  cached.max_version = Py_BuildValue("(ii)", DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION);
  cached.max_version_name = PyUnicode_InternFromString("max_version");
  cached.stream_name = PyUnicode_InternFromString("stream");
  cached.dl_device_name = PyUnicode_InternFromString("dl_device");
  cached.copy_name = PyUnicode_InternFromString("copy");
  cached.kw_max_version = Py_BuildValue("(O)", cached.max_version_name);
  if (cached.dlpack == nullptr || cached.dlpack_device == nullptr || cached.cuda_array_interface == nullptr ||
      cached.array_interface == nullptr || cached.max_version == nullptr || cached.max_version_name == nullptr ||
      cached.stream_name == nullptr || cached.dl_device_name == nullptr || cached.copy_name == nullptr ||
      cached.kw_max_version == nullptr) {
    throw py::error_already_set();
  }
  init_exchange_api();
  from_dlpack_signature = new signature("from_dlpack", 1, {"device", "copy", "stream"});
  asarray_signature = new signature("asarray", 1, {"device", "copy", "stream"});
  if (PyModule_AddFunctions(m.ptr(), import_functions) != 0) { throw py::error_already_set(); }
}

namespace {

// from_dlpack(x) through the C exchange table x's type offers (DLPack's; handoff's own is not asked:
// a def_dlpack class's __dlpack__ exports the same view). nullopt where it offers none, or its
// conversion failed: __dlpack__ is asked then, and what it refuses stays refused, that call saying why.
std::optional<py::object> import_through_table(exchange& on, py::handle x, const named_stream& consumer)
{
  const DLPackExchangeAPI* api = exchange_api_of(Py_TYPE(x.ptr()));
  if (api == nullptr || is_handoff_exchange_api(api) || requires_grad(x.ptr())) { return std::nullopt; }
  trace_protocol("dlpack-c-api");
  if (DLManagedTensorVersioned* tensor = managed_tensor_of(*api, x.ptr())) {
    table_producer_object producer{*api, x.ptr()};
    if (auto view = on.import_from_table(tensor, consumer, producer)) { return wrap(std::move(*view)); }
  }
  trace_protocol("dlpack");  // the table failed: __dlpack__ is asked instead
  return std::nullopt;
}

// The import of a DLPack capsule a producer handed over as `answer` says: its view completed in
// place by the exchange, then moved once, into the handoff.Array.
py::object import_capsule(exchange& on, py::handle capsule, const import_request& request,
                          const producer_answer& answer)
{
  array view = consume_capsule(on, capsule);
  on.import(view, request, answer);
  return wrap(std::move(view));
}

// What x.__dlpack_device__() said, once asked.
struct producer_claim {
  std::optional<DLDevice> device;
  bool asked{false};
};

// The common call, from_dlpack(x) outside any handoff.stream block, for data without streams: the
// general path with nothing to check, settle or resolve, and a producer whose __dlpack__ is a plain
// method. nullopt for device data, which goes the general way naming the default stream (an omitted
// `stream` is "no synchronization" to some producers: PyTorch), having asked its device (`claim`).
std::optional<py::object> import_without_streams(exchange& on, py::handle x, const named_stream& consumer,
                                                 bool numpy_array, producer_claim& claim)
{
  PyObject* method = plain_dlpack_method(x.ptr());
  if (method == nullptr) { return std::nullopt; }
  if (!numpy_array) {
    claim.device = producer_device(x, /*required=*/false);
    claim.asked = true;
  }
  if (claim.device && default_stream_value(claim.device->device_type)) { return std::nullopt; }
  std::array<PyObject*, 2> args{x.ptr(), cached.max_version};  // x.__dlpack__(max_version=(1, 1))
  py::object capsule =
    py::reinterpret_steal<py::object>(PyObject_Vectorcall(method, args.data(), 1, cached.kw_max_version));
  if (!capsule) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) { throw py::error_already_set(); }
    PyErr_Clear();
    capsule = call_dlpack(x, {});  // a producer older than DLPack 1.0
  }
  // Data on another device than claimed is refused; device data from a producer that hid its
  // device is bound to the consumer stream.
  return import_capsule(on, capsule, {.consumer = consumer, .device = {}, .copy = {}},
                        {.name = claim.device ? type_name(x) : std::string_view{},
                         .claimed = claim.device,
                         .honoured_arguments = true,
                         .ordered_for_consumer = false});
}

// A NumPy array's host data, read from the fields its __dlpack__ describes (numpy_array_layout) and
// holding a reference to the array as that capsule would: the same view, with no capsule made and
// consumed. nullopt where NumPy's __dlpack__ must answer: what it refuses or describes otherwise,
// data a DLPack capsule holds (maybe on a device), and a read-only array (refused before NumPy 2.1,
// whose capsules cannot say read-only). A trace records the same import either way.
std::optional<py::object> import_numpy_fields(exchange& on, py::handle ndarray)
{
  std::optional<array_layout> layout = numpy_array_layout(ndarray.ptr());
  if (!layout || layout->readonly) { return std::nullopt; }
  array view{std::move(*layout), python_owner(ndarray)};
  on.count_host_import();
  return wrap(std::move(view));
}

// Any call: a capsule, or a producer asked through __dlpack__ with the consumer's stream, `device`
// and `copy` (DLPack's fallbacks for producers that predate them included).
py::object import_through_dlpack(exchange& on, py::handle x, const import_request& request, py::handle copy,
                                 producer_claim claim)
{
  const std::optional<DLDevice>& target = request.device;
  if (PyCapsule_CheckExact(x.ptr())) {
    return import_capsule(
      on, x, request, {.name = "PyCapsule", .claimed = {}, .honoured_arguments = false, .ordered_for_consumer = false});
  }
  HANDOFF_EXPECTS(
    has_dlpack(x.ptr()), type_error,
    fmt::format("from_dlpack: {} object has no __dlpack__ method and is not a DLPack capsule", type_name(x)));
  // The stream value the producer gets depends on the device it says its data is on; for device
  // data the default stream is named explicitly, never left to the producer's reading of "omitted".
  const named_stream& consumer = request.consumer;
  if (!claim.asked) { claim.device = producer_device(x, /*required=*/!consumer.is_default()); }
  const std::optional<DLDevice>& claimed = claim.device;
  // Made here and held while the producer's Python code runs (see call_argument).
  const call_argument producer_arg{claimed ? stream_argument_for(consumer, claimed->device_type)
                                           : py::object(py::none())};
  // The producer gets the device as DLPack spells it, a (device_type, device_id) tuple, whatever
  // spelling the caller used ("cpu").
  const call_argument dl_device{target
                                  ? py::object(py::make_tuple(static_cast<int>(target->device_type), target->device_id))
                                  : py::object(py::none())};
  bool through_legacy_stream = false;
  auto [capsule, legacy] = [&] {
    std::optional<producer_device_scope> on_data;
    if (claimed) { on_data.emplace(on, *claimed); }
    try {
      return request_capsule(x, producer_arg.get(), dl_device.get(), copy);
    } catch (const py::error_already_set& e) {
      if (!e.matches(PyExc_BufferError) || !names_the_per_thread_stream(claimed, producer_arg.get())) { throw; }
      through_legacy_stream = true;
      return request_through_the_legacy_stream(on, x, e, dl_device.get(), copy);
    }
  }();
  // Pinned host memory is asked for with None (stream_argument_for), and a producer that refuses
  // the per-thread default stream with 1: the consumer stream then waits for the legacy default
  // stream, as DLPack reads both.
  const bool none_for_pinned = claimed && is_pinned_host(claimed->device_type) && producer_arg.get().is_none();
  return import_capsule(on, capsule, request,
                        {.name = type_name(x),
                         .claimed = claimed,
                         .honoured_arguments = !legacy,
                         .ordered_for_consumer = !producer_arg.get().is_none() && !through_legacy_stream,
                         .ordered_for_default_stream = none_for_pinned || through_legacy_stream});
}

}  // namespace

py::object from_dlpack(exchange& on, py::handle x, py::handle device, py::handle copy, py::handle stream)
{
  const named_stream consumer = consumer_stream(stream);
  // The C exchange API has no dl_device or copy: calls with them go through __dlpack__, whose
  // producer may honour them itself (a copy made by the producer, in its own stream order).
  const bool plain = device.is_none() && copy.is_none();
  if (const array* source = as_array(x); source != nullptr && plain) {
    return wrap(on.share(*source, consumer));  // shares its producer: re-imports never chain
  }
  const bool numpy_array = is_numpy_array(x.ptr());
  if (plain && !numpy_array) {
    if (auto view = import_through_table(on, x, consumer)) { return std::move(*view); }
  }
  producer_claim claim;
  if (plain && consumer.is_default()) {
    if (numpy_array) {
      if (auto view = import_numpy_fields(on, x)) { return std::move(*view); }
    }
    if (auto view = import_without_streams(on, x, consumer, numpy_array, claim)) { return std::move(*view); }
  }
  const import_request request{.consumer = consumer,
                               .device = target_device_argument(device, "device", unknown_device_type::invalid),
                               .copy = copy_argument(copy)};
  return import_through_dlpack(on, x, request, copy, claim);
}

py::object asarray(exchange& on, py::handle x, py::handle device, py::handle copy, py::handle stream)
{
  std::exception_ptr dlpack_refused;  // raised again when no other protocol is there to try
  if (PyCapsule_CheckExact(x.ptr()) || has_dlpack(x.ptr())) {
    try {
      return from_dlpack(on, x, device, copy, stream);
    } catch (py::error_already_set& e) {
      // DLPack could not express it (say, a byte-swapped array): another protocol may.
      if (!e.matches(PyExc_BufferError)) { throw; }
      dlpack_refused = std::current_exception();
    } catch (const buffer_error&) {
      dlpack_refused = std::current_exception();
    }
  }
  import_request request{.consumer = {},
                         .device = target_device_argument(device, "device", unknown_device_type::invalid),
                         .copy = copy_argument(copy)};
  // Held while the interface is read, which may run the producer's Python code (see call_argument).
  if (const call_argument cai{optional_attribute(x, cached.cuda_array_interface)}; !cai.get().is_none()) {
    trace_protocol("cuda-array-interface");
    request.consumer = consumer_stream(stream);
    return wrap(import_cuda_array_interface(on, x, cai.get(), request));
  }
  if (const call_argument ai{optional_attribute(x, cached.array_interface)}; !ai.get().is_none()) {
    trace_protocol("array-interface");
    return wrap(on.import_host(import_array_interface(x, ai.get()), request));
  }
  if (PyObject_CheckBuffer(x.ptr()) != 0) {
    trace_protocol("buffer");
    return wrap(on.import_host(import_buffer(x), request));
  }
  if (dlpack_refused) { std::rethrow_exception(dlpack_refused); }
  throw no_array_protocol(
    fmt::format("asarray: {} object supports no array protocol (DLPack, CUDA Array Interface, "
                "__array_interface__ or the buffer protocol)",
                type_name(x)));
}

}  // namespace handoff::python
