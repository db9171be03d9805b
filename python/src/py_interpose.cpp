// The exchanges between other libraries that handoff's hooks see (handoff/_interpose.py), one object
// each: both libraries' streams, resolved once by the exchange from what their adapters said; in the
// ordering mode, the consumer stream's wait; and the trace events, classified as handoff's own are
// (an unordered hand-off is a hazard only while the producer's stream has work pending).
#include "py_array_description.hpp"
#include "py_cpython.hpp"
#include "py_errors.hpp"
#include "py_exchange.hpp"
#include "py_gil.hpp"
#include "py_owners.hpp"
#include "py_streams.hpp"
#include "py_trace.hpp"

#include <handoff/activity.hpp>
#include <handoff/context.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/internal/enum_table.hpp>
#include <handoff/stream.hpp>

#include <fmt/format.h>
#include <pybind11/stl.h>
#include <structmember.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace handoff::python {
namespace {

// How the consumer read the producer's data.
enum class interposed_protocol : std::uint8_t { dlpack, cuda_array_interface };

// What the hooks saw themselves, beyond what the trace classifies.
enum class interposed_hazard : std::uint8_t {
  none,
  unordered,       // the ordering mode could not order it: a stream is unknown
  cross_device,    // the producer ordered another device's streams
  released_early,  // the consumer's array went, with the producer, while its stream still worked
};

// What the trace's `hazard` field says of each; none leaves it unset.
constexpr auto hazard_names = handoff::detail::make_enum_table<interposed_hazard, const char*>(
  {{interposed_hazard::none, nullptr},
   {interposed_hazard::unordered, "unordered"},
   {interposed_hazard::cross_device, "cross-device"},
   {interposed_hazard::released_early, "released early"}});

std::string_view protocol_name(interposed_protocol protocol) noexcept
{
  return protocol == interposed_protocol::dlpack ? "dlpack" : "cuda-array-interface";
}

// The exchange bind_interpose was given, which orders the exchanges the hooks see.
exchange* bound_exchange = nullptr;

// The context that orders the streams of `type`'s data: none for host data, or where handoff has no
// backend for that device type (the data's library started the device already).
context* context_serving(DLDeviceType type)
{
  if (!has_streams(type)) { return nullptr; }
  try {
    context* ctx = bound_exchange->device_context();
    return ctx != nullptr && (ctx->backend().device_type() == kDLROCM) == is_rocm_device(type) ? ctx : nullptr;
  } catch (const error&) {
    return nullptr;
  }
}

// The device whose current streams order data of `data`: its own, but for pinned and managed memory
// (which DLPack numbers device 0) the calling thread's current device. nullopt for host data, or
// where handoff has no backend for the data's device type.
std::optional<int> work_device_of(DLDevice data)
{
  const context* ctx = context_serving(data.device_type);
  if (ctx == nullptr) { return std::nullopt; }
  return is_host_accessible(data.device_type) ? ctx->backend().current_device() : data.device_id;
}

// handoff._adapters.stream_owner, which the package registers: the stream object of an imported
// library whose current stream a native handle is.
PyObject* stream_owner_lookup = nullptr;

DLDevice device_of(const py::tuple& device)
{
  HANDOFF_EXPECTS(device.size() == 2, value_error, "device must be a (type, id) pair");
  return {static_cast<DLDeviceType>(device[0].cast<int>()), device[1].cast<int>()};
}

// One exchange between two other libraries: made when the hooked consumer is called, ordered in the
// ordering mode, and recorded when the consumer returns (and again, in a trace, if its array goes
// while its stream still works). Holds the libraries' stream objects while it lives.
class interposed_exchange {
 public:
  interposed_exchange(interposed_protocol protocol, std::string_view producer, std::string_view consumer,
                      DLDevice device)
      : protocol_(protocol), producer_(intern_library(producer)), consumer_(intern_library(consumer)), device_(device)
  {}

  // The device whose current streams order the data: its own, but for pinned and managed memory
  // (which DLPack numbers device 0) the calling thread's current device. None for host data, or
  // where handoff has no backend for the data's device type.
  [[nodiscard]] std::optional<int> work_device() const { return work_device_of(device_); }

  // A library's current stream as its adapter said it (None: it has none; a DLPack stream value; a
  // stream object, held from now on), resolved by the exchange on the data's device.
  // @throws type_error or value_error for what names no stream of that device.
  void set_producer_stream(py::handle stream) { producer_stream_ = resolved(stream); }
  void set_consumer_stream(py::handle stream)
  {
    consumer_stream_ = resolved(stream);
    consumer_named_ = stream.is_none() ? std::nullopt : std::optional<named_stream>{stream_named_by(stream)};
  }
  [[nodiscard]] bool knows_streams() const noexcept { return producer_stream_ && consumer_stream_; }

  [[nodiscard]] interposed_protocol protocol() const noexcept { return protocol_; }
  [[nodiscard]] const char* producer() const noexcept { return producer_; }
  [[nodiscard]] const char* consumer() const noexcept { return consumer_; }
  // The native handles of the streams, as the trace names them; None where unknown.
  [[nodiscard]] std::optional<std::uintptr_t> producer_stream() const { return handle_of(producer_stream_); }
  [[nodiscard]] std::optional<std::uintptr_t> consumer_stream() const { return handle_of(consumer_stream_); }

  // Makes the consumer's stream wait for the producer's (a pooled event; the host never waits).
  // False when a stream is unknown.
  bool order()
  {
    if (!knows_streams()) { return false; }
    without_gil([&] { consumer_stream_->wait_for(*producer_stream_); });
    return true;
  }

  // Whether a release deferred behind the consumer's stream is certain to find it alive (export_release).
  [[nodiscard]] bool consumer_stream_outlives_releases() const
  {
    return consumer_named_ && bound_exchange->may_release_after(*consumer_named_, device_.device_type);
  }

  // Whether the consumer's stream still has work queued; false where that cannot be asked safely (a
  // stream that may be destroyed by now, one capturing into a graph).
  [[nodiscard]] bool consumer_stream_busy() const
  {
    if (!consumer_stream_ || !consumer_stream_outlives_releases()) { return false; }
    const bound_stream& on = *consumer_stream_;
    device::backend& backend = on.ctx->backend();
    const device_guard on_device{backend, on.device};
    const relaxed_capture_mode relaxed{backend};  // a capture under way elsewhere neither fails nor breaks
    const activity::bookkeeping own;              // the trace's question, not the program's
    return backend.stream_capture_status(on.stream) == device::capture_status::none && !backend.query_stream(on.stream);
  }

  // Records the consumer's import of the data (or its release), classified as handoff's own are; a
  // hazard the hooks saw is kept. No-op unless tracing.
  void record(trace::event_kind kind, trace::action what, interposed_hazard hazard, const std::string& detail) const
  {
    if (!trace::enabled()) { return; }
    trace::exchange_scope scope{kind, protocol_name(protocol_)};
    if (!scope.active()) { return; }
    trace::event& e = scope.event();
    e.producer = producer_;
    e.consumer = consumer_;
    e.device = device_;
    e.shape = shape_;
    e.dtype = dtype_;
    e.nbytes = nbytes_;
    e.stream_argument = stream_argument;
    e.interposed = ordered ? "ordered" : "observed";
    e.detail = detail;
    if (hazard != interposed_hazard::none) {  // classified by the hooks: the scope keeps what they said
      e.hazard = handoff::detail::look_up(hazard_names, hazard, nullptr);
      e.action = what;
    }
    if (producer_stream_) { scope.set_producer_stream(*producer_stream_); }
    if (consumer_stream_) { scope.set_consumer_stream(*consumer_stream_); }
    switch (what) {
      case trace::action::unordered:
        scope.note_unordered();
        break;
      case trace::action::wait:
        scope.note_ordered_by_producer();
        break;
      case trace::action::elided:
        if (knows_streams()) {
          scope.note_wait(consumer_stream_->ctx->backend(), consumer_stream_->device, raw(producer_stream_->stream),
                          raw(consumer_stream_->stream), false);
        }
        break;
      case trace::action::none:
      case trace::action::refused:
        e.action = what;
        break;
    }
  }

  // Records the consumer's import of `argument` as `result`, described as they say they are (the
  // argument's description, else the result's, is kept for a later release's event); a copy the
  // consumer made in place of a view is noted in the detail. No-op unless tracing.
  void record_import(py::handle argument, py::handle result, trace::action what, interposed_hazard hazard,
                     std::string detail)
  {
    if (!trace::enabled()) { return; }
    exchange_description described = describe_exchange(argument, result, consumer_);
    if (std::optional<array_description>& data = described.data) {
      shape_ = std::move(data->shape);
      dtype_ = dtype_from_name(data->dtype).value_or(DLDataType{kDLOpaqueHandle, 0, 0});
      nbytes_ = data->nbytes;
      if (!described.copy.empty()) {
        detail = detail.empty() ? std::move(described.copy) : fmt::format("{}; {}", detail, described.copy);
      }
    }
    record(trace::event_kind::import_data, what, hazard, detail);
  }

  std::optional<std::int64_t> stream_argument;  // the `stream` the consumer passed, where seen
  bool ordered{false};                          // by handoff's hooks

 private:
  static std::optional<std::uintptr_t> handle_of(const std::optional<bound_stream>& stream)
  {
    return stream ? std::optional<std::uintptr_t>{raw(stream->stream)} : std::nullopt;
  }

  [[nodiscard]] std::optional<bound_stream> resolved(py::handle stream) const
  {
    if (stream.is_none() || context_serving(device_.device_type) == nullptr) { return std::nullopt; }
    return bound_exchange->bind_stream(device_, stream_named_by(stream));
  }

  interposed_protocol protocol_;
  const char* producer_;
  const char* consumer_;
  DLDevice device_;
  std::optional<bound_stream> producer_stream_;
  std::optional<bound_stream> consumer_stream_;
  std::optional<named_stream> consumer_named_;  // as the consumer's adapter named it
  // What the trace says of the data, once the consumer returned.
  std::vector<std::int64_t> shape_;
  DLDataType dtype_{kDLOpaqueHandle, 0, 0};
  std::int64_t nbytes_{0};
};

// The device of native stream `handle`, as the backend knows it (a default stream's: the current
// device); None without a backend.
py::object stream_device(std::uint64_t handle)
{
  try {
    const context* ctx = bound_exchange->device_context();
    if (ctx == nullptr) { return py::none(); }
    // Pinned memory is worked on by a stream of any device: bound on the stream's own.
    const DLDeviceType pinned = ctx->backend().device_type() == kDLROCM ? kDLROCMHost : kDLCUDAHost;
    const auto bound = bound_exchange->bind_stream({pinned, 0}, named_stream::native(handle, {}));
    return bound ? py::object(py::int_(bound->device)) : py::object(py::none());
  } catch (const error&) {
    return py::none();
  }
}

// --- what the hooks' types share ---------------------------------------------------------------

// A hook's slots for its repr, the collector and its end, from its `original` and the Python objects
// `references_of(Hook*)` names (each a pointer to a member it owns a reference in).
template <class Hook>
struct hook_slots {
  static Hook* as(PyObject* self) noexcept { return reinterpret_cast<Hook*>(self); }

  static PyObject* repr(PyObject* self) noexcept
  {
    return PyUnicode_FromFormat("<handoff hook of %R>", as(self)->original);
  }
  static int traverse(PyObject* self, visitproc visit, void* arg)
  {
    Py_VISIT(Py_TYPE(self));
    for (PyObject** held : references_of(as(self))) { Py_VISIT(*held); }
    return 0;
  }
  static int clear(PyObject* self)
  {
    for (PyObject** held : references_of(as(self))) { Py_CLEAR(*held); }
    return 0;
  }
  static void dealloc(PyObject* self)
  {
    PyTypeObject* type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if constexpr (requires(Hook * hook) { hook->weakrefs; }) {
      if (as(self)->weakrefs != nullptr) { PyObject_ClearWeakRefs(self); }
    }
    clear(self);
    type->tp_free(self);
    Py_DECREF(type);
  }
};

// --- the exchange in progress -----------------------------------------------------------------

// The exchange in progress on this thread, from the consumer's call to its return: a consumer called
// inside it is part of it, a hooked producer's __dlpack__ reports to it the stream it was given, and
// handoff's own exchanges inside it are its workings, not events of their own.
struct in_flight_exchange {
  PyObject* argument;  // borrowed: the consumer's caller holds it for the call
  DLDevice device;
  std::optional<std::int64_t> stream_argument;  // what the producer's __dlpack__ was given
  std::optional<int> producer_device;           // the device current when it ran (device data only)
  trace::muted_scope muted;
};

// This thread's exchange in progress, or null; read and set with the GIL. A plain pointer, so that
// every consumer and producer call reaches it in one step (no initialization guard): a host exchange
// keeps its own on its stack, one begun from Python (handoff._interposed) is owned below.
// NOLINTNEXTLINE(cppcoreguidelines-avoid-non-const-global-variables)
thread_local in_flight_exchange* in_flight = nullptr;
// NOLINTNEXTLINE(cppcoreguidelines-avoid-non-const-global-variables): as above
thread_local std::unique_ptr<in_flight_exchange> begun_in_python;

// A hooked producer's __dlpack__ (handoff/_interpose.py installs it on the producer's class): notes
// the `stream` its caller passed, then calls the original with the same arguments. Called through
// vectorcall and bound as a method descriptor, so that neither the call nor its keywords make a tuple
// or a dict, where a Python wrapper's `*args, **kwargs` made both twice per exported array. Any
// other attribute (__name__, __doc__, ...) is the original's.
struct producer_hook {
  PyObject_HEAD vectorcallfunc vectorcall;
  PyObject* original;
};

// The `stream` a call of __dlpack__ passed (its first parameter, by position or by name), or None.
PyObject* stream_passed(PyObject* const* args, Py_ssize_t count, PyObject* kwnames) noexcept
{
  const Py_ssize_t named = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t i = 0; i < named; ++i) {
    if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), "stream") == 0) { return args[count + i]; }
  }
  return count >= 2 ? args[1] : Py_None;
}

PyObject* producer_hook_vectorcall(PyObject* callable, PyObject* const* args, std::size_t nargsf,
                                   PyObject* kwnames) noexcept
{
  auto* hook = reinterpret_cast<producer_hook*>(callable);
  const Py_ssize_t count = PyVectorcall_NARGS(nargsf);
  // Noted when called on the exchange's argument: the stream, and the device current then.
  if (in_flight_exchange* const now = in_flight; now != nullptr && count >= 1 && now->argument == args[0]) {
    PyObject* stream = stream_passed(args, count, kwnames);
    now->stream_argument.reset();  // None, or what no int64 holds, names no stream
    if (is_int(stream)) {
      if (const int64_reading read = read_int64(stream); read.fits()) { now->stream_argument = read.value; }
    }
    if (now->device.device_type != kDLCPU) {
      try {
        if (const context* ctx = context_serving(now->device.device_type)) {
          now->producer_device = ctx->backend().current_device();
        }
      } catch (const std::exception&) {  // the producer's call goes on; the device stays unseen
      }
    }
  }
  return PyObject_Vectorcall(hook->original, args, nargsf, kwnames);
}

// As a function is: looked up on an instance, bound to it; on the class, itself.
PyObject* producer_hook_get(PyObject* self, PyObject* instance, PyObject* /*type*/) noexcept
{
  if (instance == nullptr || instance == Py_None) {
    Py_INCREF(self);
    return self;
  }
  return PyMethod_New(self, instance);
}

PyObject* producer_hook_getattro(PyObject* self, PyObject* name) noexcept
{
  PyObject* found = PyObject_GenericGetAttr(self, name);
  if (found != nullptr || PyErr_ExceptionMatches(PyExc_AttributeError) == 0) { return found; }
  PyErr_Clear();
  return PyObject_GetAttr(reinterpret_cast<producer_hook*>(self)->original, name);
}

PyObject* producer_hook_wrapped(PyObject* self, void* /*closure*/) noexcept
{
  PyObject* original = reinterpret_cast<producer_hook*>(self)->original;
  Py_INCREF(original);
  return original;
}

PyObject* producer_hook_original_attribute(PyObject* self, void* name) noexcept
{
  return PyObject_GetAttrString(reinterpret_cast<producer_hook*>(self)->original, static_cast<const char*>(name));
}

std::array<PyObject**, 1> references_of(producer_hook* self) noexcept
{
  return {&self->original};
}

PyTypeObject* producer_hook_type()
{
  static PyTypeObject* type = [] {
    static PyMemberDef members[] = {
      {"__vectorcalloffset__", T_PYSSIZET, static_cast<Py_ssize_t>(offsetof(producer_hook, vectorcall)), READONLY,
       nullptr},
      {nullptr, 0, 0, 0, nullptr},
    };
    static PyGetSetDef properties[] = {
      {"__wrapped__", producer_hook_wrapped, nullptr, "The producer's own __dlpack__.", nullptr},
      // The type's own would be found first: these are the original's, as the rest are.
      {"__doc__", producer_hook_original_attribute, nullptr, nullptr, const_cast<char*>("__doc__")},
      {"__module__", producer_hook_original_attribute, nullptr, nullptr, const_cast<char*>("__module__")},
      {nullptr, nullptr, nullptr, nullptr, nullptr},
    };
    PyType_Slot slots[] = {
      {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
      {Py_tp_descr_get, reinterpret_cast<void*>(producer_hook_get)},
      {Py_tp_getattro, reinterpret_cast<void*>(producer_hook_getattro)},
      {Py_tp_repr, reinterpret_cast<void*>(hook_slots<producer_hook>::repr)},
      {Py_tp_members, members},
      {Py_tp_getset, properties},
      {Py_tp_traverse, reinterpret_cast<void*>(hook_slots<producer_hook>::traverse)},
      {Py_tp_clear, reinterpret_cast<void*>(hook_slots<producer_hook>::clear)},
      {Py_tp_dealloc, reinterpret_cast<void*>(hook_slots<producer_hook>::dealloc)},
      {0, nullptr},
    };
    PyType_Spec spec{
      "handoff._handoff._ProducerHook", static_cast<int>(sizeof(producer_hook)), 0,
      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR, slots};
    auto* made = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));
    if (made == nullptr) { throw py::error_already_set(); }
    return made;  // kept for the process
  }();
  return type;
}

py::object make_producer_hook(py::handle original)
{
  HANDOFF_EXPECTS(PyCallable_Check(original.ptr()) != 0, type_error,
                  fmt::format("a producer hook wraps a callable, not {}", type_name(original)));
  auto made = py::reinterpret_steal<py::object>(PyType_GenericAlloc(producer_hook_type(), 0));
  if (!made) { throw py::error_already_set(); }
  auto* hook = reinterpret_cast<producer_hook*>(made.ptr());
  hook->vectorcall = producer_hook_vectorcall;
  hook->original = py::reinterpret_borrow<py::object>(original).release().ptr();
  return made;
}

void begin_exchange(py::handle argument, const py::tuple& device)
{
  begun_in_python.reset(
    new in_flight_exchange{argument.ptr(), device_of(device), {}, {}, {}});  // NOLINT: muted_scope cannot move
  in_flight = begun_in_python.get();
}

// The stream the producer's __dlpack__ was given and the device current then, for the exchange begun last.
std::pair<std::optional<std::int64_t>, std::optional<int>> end_exchange()
{
  if (in_flight == nullptr) { return {}; }
  const auto seen = std::make_pair(in_flight->stream_argument, in_flight->producer_device);
  in_flight = nullptr;
  begun_in_python.reset();
  return seen;
}

// --- each array type's library ----------------------------------------------------------------

// An array type's library as handoff._adapters' registry finds it.
struct registered_library {
  py::object found;        // (name or None, adapter or None)
  py::object read_device;  // the adapter's `device`: its arrays' DLPack device, cheaper than asking them; or None
  bool host_only{false};   // the adapter's `host_only`: its arrays are host data, whatever the array
};

// Each array type's library, remembered per type until the registry changes.
object_cache<PyTypeObject*, registered_library>& libraries_of_types()
{
  // NOLINTNEXTLINE(cppcoreguidelines-owning-memory): never destroyed (object_cache)
  static auto* known = new object_cache<PyTypeObject*, registered_library>{
    1024, [](PyTypeObject* const& type) noexcept { return reinterpret_cast<PyObject*>(type); }};
  return *known;
}

void forget_libraries()
{
  libraries_of_types().forget();
}

// `value`'s type's library as `find(type)` says it, or nullptr with a Python error set.
const registered_library* registered_library_of(PyObject* value, PyObject* find)
{
  static PyObject* const device_name = interned("device");
  static PyObject* const host_only_name = interned("host_only");
  auto& known = libraries_of_types();
  PyTypeObject* type = Py_TYPE(value);
  if (const registered_library* found = known.find(type)) { return found; }
  auto said = py::reinterpret_steal<py::object>(PyObject_CallOneArg(find, reinterpret_cast<PyObject*>(type)));
  if (!said) { return nullptr; }
  if (PyTuple_Check(said.ptr()) == 0 || PyTuple_GET_SIZE(said.ptr()) != 2 ||
      (PyTuple_GET_ITEM(said.ptr(), 0) != Py_None && PyUnicode_Check(PyTuple_GET_ITEM(said.ptr(), 0)) == 0)) {
    PyErr_SetString(PyExc_TypeError, "a library finder must return (name or None, adapter or None)");
    return nullptr;
  }
  PyObject* adapter = PyTuple_GET_ITEM(said.ptr(), 1);
  auto read_device = py::reinterpret_borrow<py::object>(Py_None);
  bool host_only = false;
  if (adapter != Py_None) {
    read_device = py::reinterpret_steal<py::object>(PyObject_GetAttr(adapter, device_name));
    if (!read_device) { return nullptr; }
    const auto said_host_only = py::reinterpret_steal<py::object>(PyObject_GetAttr(adapter, host_only_name));
    if (!said_host_only) { return nullptr; }
    const int truth = PyObject_IsTrue(said_host_only.ptr());
    if (truth < 0) { return nullptr; }
    host_only = truth == 1;
  }
  return &known.remember(type, registered_library{std::move(said), std::move(read_device), host_only});
}

// --- the hooked consumer's call ---------------------------------------------------------------

// What the hooks are for now: set by handoff._interpose as traces and the ordering mode come and go.
struct interposed_mode {
  bool tracing{false};
  bool ordering{false};
};
interposed_mode mode;  // NOLINT(cppcoreguidelines-avoid-non-const-global-variables): read and set with the GIL

// A hooked consumer function's call (handoff/_interpose.py wraps each in a Python function that calls
// this): decides whether the call is an exchange between two libraries and of what data, records
// one of host data whole, and hands one of device data to handoff._interposed.exchange, whose streams
// its libraries' adapters are asked for. Decided here, in one call, as most exchanges a program
// makes are of host data and each Python step of a hook costs the program a fraction of a microsecond.
struct consumer_call {
  PyObject ob_base;
  PyObject* original;      // the consumer function
  PyObject* consumer;      // handoff._interposed.Consumer
  PyObject* find_library;  // handoff._adapters.registry's finder of a type's library
  PyObject* exchange;      // handoff._interposed.exchange
  PyObject* not_recorded;  // handoff._interposed._not_recorded
  PyObject* parameter;     // the array's keyword, or None
  const char* library;     // the consumer's, interned
  bool interface_first;    // the consumer reads the CUDA Array Interface before DLPack
  PyObject* dict;          // a function's attributes: functools.update_wrapper fills it from the original's
  PyObject* weakrefs;      // as a function's
};

PyObject* call_original(const consumer_call* self, PyObject* args, PyObject* kwargs)
{
  return PyObject_Call(self->original, args, kwargs);
}

// The array the call hands over (borrowed), or nullptr.
PyObject* argument_of(const consumer_call* self, PyObject* args, PyObject* kwargs)
{
  if (PyTuple_GET_SIZE(args) > 0) { return PyTuple_GET_ITEM(args, 0); }
  if (kwargs == nullptr || self->parameter == Py_None) { return nullptr; }
  PyObject* found = PyDict_GetItemWithError(kwargs, self->parameter);
  PyErr_Clear();
  return found;
}

bool has_attribute(PyObject* value, PyObject* name)
{
  const int found = PyObject_HasAttr(value, name);
  PyErr_Clear();
  return found == 1;
}

// The protocol the consumer reads `value` through; nullopt when it has neither (not an exchange).
std::optional<interposed_protocol> protocol_of(PyObject* value, bool interface_first)
{
  static PyObject* const dlpack_name = interned("__dlpack__");
  static PyObject* const interface_name = interned("__cuda_array_interface__");
  if (PyType_Check(value) != 0) { return std::nullopt; }
  const bool dlpack = has_attribute(value, dlpack_name);
  if (dlpack && !interface_first) { return interposed_protocol::dlpack; }  // a CPU tensor's interface raises
  if (has_attribute(value, interface_name)) { return interposed_protocol::cuda_array_interface; }
  if (dlpack) { return interposed_protocol::dlpack; }
  return std::nullopt;
}

// The data's device as the protocol says it (DLPack's as `read_device` says it, where the library's
// adapter has one); host where it cannot say (the consumer's own call will say what is wrong).
DLDevice data_device_of(PyObject* value, interposed_protocol protocol, PyObject* read_device)
{
  static PyObject* const dlpack_device_name = interned("__dlpack_device__");
  static PyObject* const interface_name = interned("__cuda_array_interface__");
  static PyObject* const data_name = interned("data");
  constexpr DLDevice host{kDLCPU, 0};
  const error_scope quiet;
  if (protocol == interposed_protocol::dlpack) {
    const auto said =
      py::reinterpret_steal<py::object>(read_device != Py_None ? PyObject_CallOneArg(read_device, value)
                                                               : PyObject_CallMethodNoArgs(value, dlpack_device_name));
    const auto pair = said ? py::reinterpret_steal<py::object>(PySequence_Fast(said.ptr(), "")) : py::object{};
    if (!pair || PySequence_Fast_GET_SIZE(pair.ptr()) != 2) { return host; }
    const long type = PyLong_AsLong(PySequence_Fast_GET_ITEM(pair.ptr(), 0));
    const long id = PyLong_AsLong(PySequence_Fast_GET_ITEM(pair.ptr(), 1));
    if (PyErr_Occurred() != nullptr) { return host; }
    return {static_cast<DLDeviceType>(type), static_cast<int>(id)};
  }
  const auto interface = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, interface_name));
  PyObject* data =
    interface && PyDict_Check(interface.ptr()) != 0 ? PyDict_GetItemWithError(interface.ptr(), data_name) : nullptr;
  if (data == nullptr || PyTuple_Check(data) == 0 || PyTuple_GET_SIZE(data) == 0) { return host; }
  const unsigned long long pointer = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(data, 0));
  if (PyErr_Occurred() != nullptr) { return host; }
  const auto* address = reinterpret_cast<const void*>(pointer);  // NOLINT(performance-no-int-to-ptr)
  try {
    return bound_exchange->device_of(address).value_or(host);
  } catch (const error&) {
    return host;
  }
}

// What a refused call's event says of its error: "TypeError: ...", at most 200 characters.
std::string refusal_of(PyObject* error)
{
  static PyObject* const name_name = interned("__name__");
  const auto name =
    py::reinterpret_steal<py::object>(PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(error)), name_name));
  const auto text =
    name ? py::reinterpret_steal<py::object>(PyUnicode_FromFormat("%S: %S", name.ptr(), error)) : py::object{};
  const auto cut = text ? py::reinterpret_steal<py::object>(PyUnicode_Substring(text.ptr(), 0, 200)) : py::object{};
  const char* utf8 = cut ? PyUnicode_AsUTF8(cut.ptr()) : nullptr;
  if (utf8 == nullptr) {
    PyErr_Clear();
    return Py_TYPE(error)->tp_name;
  }
  return utf8;
}

// Records the consumer's refusal of the exchange: every refused exchange, of host or device data.
void record_refusal(interposed_exchange& seen, PyObject* error)
{
  seen.record(trace::event_kind::import_data, trace::action::refused, interposed_hazard::none, refusal_of(error));
}

// Records an exchange of host data with `record`; what fails to be recorded is said (once per kind of
// failure, by handoff._interposed._not_recorded), never raised: a tracing tool does not break the program.
template <class Record>
void record_host_exchange(const consumer_call* self, Record&& record)
{
  try {
    record();
  } catch (const py::error_already_set& failure) {
    if (PyObject* said = PyObject_CallOneArg(self->not_recorded, failure.value().ptr())) { Py_DECREF(said); }
  } catch (const std::exception& failure) {
    const auto value =
      py::reinterpret_steal<py::object>(PyObject_CallFunction(PyExc_RuntimeError, "s", failure.what()));
    if (PyObject* said = value ? PyObject_CallOneArg(self->not_recorded, value.ptr()) : nullptr) { Py_DECREF(said); }
  }
  PyErr_Clear();
}

// An exchange of host data, recorded whole: no stream orders host data, so neither library is asked one.
PyObject* host_exchange(const consumer_call* self, PyObject* args, PyObject* kwargs, PyObject* argument,
                        interposed_protocol protocol, std::string_view producer)
{
  interposed_exchange seen{protocol, producer, self->library, DLDevice{kDLCPU, 0}};
  PyObject* result = nullptr;
  {
    in_flight_exchange here{argument, {kDLCPU, 0}, {}, {}, {}};
    in_flight = &here;
    result = call_original(self, args, kwargs);
    seen.stream_argument = here.stream_argument;
    in_flight = nullptr;
  }
  if (result == nullptr) {
    PyObject* type = nullptr;
    PyObject* value = nullptr;
    PyObject* traceback = nullptr;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    record_host_exchange(self, [&] { record_refusal(seen, value); });
    PyErr_Restore(type, value, traceback);
    return nullptr;
  }
  record_host_exchange(self,
                       [&] { seen.record_import(argument, result, trace::action::none, interposed_hazard::none, {}); });
  return result;
}

PyObject* consumer_call_call(PyObject* object, PyObject* args, PyObject* kwargs)
{
  auto* self = reinterpret_cast<consumer_call*>(object);
  if (in_flight != nullptr) {  // the outermost call of a nest is the exchange
    return call_original(self, args, kwargs);
  }
  PyObject* argument = argument_of(self, args, kwargs);
  if (argument == nullptr) { return call_original(self, args, kwargs); }  // the consumer says what is wrong
  const registered_library* found = registered_library_of(argument, self->find_library);
  if (found == nullptr) { return nullptr; }
  const interposed_mode now = mode;
  if (!now.tracing && found->host_only) {
    return call_original(self, args, kwargs);  // the ordering mode alone: host data needs nothing
  }
  // Held as references of this call's own: the array's protocol and device are asked below, Python
  // code that may empty the cache (a type past its bound, a library registered) and free its entry.
  const registered_library library = *found;
  PyObject* producer = PyTuple_GET_ITEM(library.found.ptr(), 0);
  const char* producer_name = producer != Py_None ? PyUnicode_AsUTF8(producer) : nullptr;
  if (producer != Py_None && producer_name == nullptr) { return nullptr; }
  const std::optional<interposed_protocol> protocol = protocol_of(argument, self->interface_first);
  if (!protocol || producer_name == nullptr || std::string_view{producer_name} == self->library ||
      std::string_view{producer_name} == "handoff") {
    // Not an exchange (a list, a host array read through __array__), one within a library, or one
    // handoff records itself.
    return call_original(self, args, kwargs);
  }
  const DLDevice device = data_device_of(argument, *protocol, library.read_device.ptr());
  if (device.device_type == kDLCPU) {
    if (!now.tracing) { return call_original(self, args, kwargs); }  // the ordering mode alone: host data needs nothing
    return host_exchange(self, args, kwargs, argument, *protocol, producer_name);
  }
  const auto device_tuple = py::make_tuple(static_cast<int>(device.device_type), device.device_id);
  const auto named = py::make_tuple(
    py::reinterpret_borrow<py::object>(argument), py::cast(*protocol), py::reinterpret_borrow<py::object>(producer),
    py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(library.found.ptr(), 1)), device_tuple);
  const auto keywords = py::reinterpret_borrow<py::object>(kwargs != nullptr ? kwargs : Py_None);
  return PyObject_CallFunctionObjArgs(self->exchange, self->original, self->consumer, args, keywords.ptr(), named.ptr(),
                                      now.tracing ? Py_True : Py_False, now.ordering ? Py_True : Py_False, nullptr);
}

// The Python objects a consumer_call holds, for the collector.
std::array<PyObject**, 7> references_of(consumer_call* self) noexcept
{
  return {&self->original,     &self->consumer,  &self->find_library, &self->exchange,
          &self->not_recorded, &self->parameter, &self->dict};
}

// Bound as the original is: a Python function looked up on an instance binds to it, a builtin does not.
PyObject* consumer_call_get(PyObject* object, PyObject* instance, PyObject* type) noexcept
{
  PyObject* original = reinterpret_cast<consumer_call*>(object)->original;
  const descrgetfunc bind = Py_TYPE(original)->tp_descr_get;
  if (bind == nullptr || instance == nullptr || instance == Py_None) {
    Py_INCREF(object);
    return object;
  }
  PyObject* bound = bind(original, instance, type);
  if (bound == nullptr) { return nullptr; }
  const bool binds = bound != original;
  Py_DECREF(bound);
  if (!binds) {
    Py_INCREF(object);
    return object;
  }
  return PyMethod_New(object, instance);
}

// Pickled as the global its __module__ and __qualname__ name (handoff/_interpose.py names the place
// it is installed), as a function is.
PyObject* consumer_call_reduce(PyObject* object, PyObject* /*unused*/) noexcept
{
  return PyObject_GetAttrString(object, "__qualname__");
}

PyTypeObject* consumer_call_type()
{
  static PyTypeObject* type = [] {
    static PyMemberDef members[] = {
      {"__dictoffset__", T_PYSSIZET, static_cast<Py_ssize_t>(offsetof(consumer_call, dict)), READONLY, nullptr},
      {"__weaklistoffset__", T_PYSSIZET, static_cast<Py_ssize_t>(offsetof(consumer_call, weakrefs)), READONLY, nullptr},
      {nullptr, 0, 0, 0, nullptr},
    };
    static PyMethodDef methods[] = {
      {"__reduce__", as_cfunction(consumer_call_reduce), METH_NOARGS, nullptr},
      {nullptr, nullptr, 0, nullptr},
    };
    static PyGetSetDef properties[] = {
      {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
      {nullptr, nullptr, nullptr, nullptr, nullptr},
    };
    PyType_Slot slots[] = {
      {Py_tp_call, reinterpret_cast<void*>(consumer_call_call)},
      {Py_tp_descr_get, reinterpret_cast<void*>(consumer_call_get)},
      {Py_tp_repr, reinterpret_cast<void*>(hook_slots<consumer_call>::repr)},
      {Py_tp_members, members},
      {Py_tp_methods, methods},
      {Py_tp_getset, properties},
      {Py_tp_traverse, reinterpret_cast<void*>(hook_slots<consumer_call>::traverse)},
      {Py_tp_clear, reinterpret_cast<void*>(hook_slots<consumer_call>::clear)},
      {Py_tp_dealloc, reinterpret_cast<void*>(hook_slots<consumer_call>::dealloc)},
      {0, nullptr},
    };
    PyType_Spec spec{"handoff._handoff._InterposedCall", static_cast<int>(sizeof(consumer_call)), 0,
                     Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, slots};
    auto* made = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));
    if (made == nullptr) { throw py::error_already_set(); }
    return made;  // kept for the process
  }();
  return type;
}

// A hooked consumer's call for `consumer` (handoff._interposed.Consumer), finding each array type's
// library with `find_library` and handing device data to `exchange`.
py::object make_consumer_call(py::handle original, py::handle consumer, py::handle find_library, py::handle exchange,
                              py::handle not_recorded)
{
  const py::object adapter = consumer.attr("adapter");
  const auto library = adapter.attr("name").cast<std::string>();
  const bool interface_first = consumer.attr("interface_first").cast<bool>();
  const py::object parameter = consumer.attr("parameter");
  auto made = py::reinterpret_steal<py::object>(PyType_GenericAlloc(consumer_call_type(), 0));
  if (!made) { throw py::error_already_set(); }
  auto* self = reinterpret_cast<consumer_call*>(made.ptr());
  self->original = py::reinterpret_borrow<py::object>(original).release().ptr();
  self->consumer = py::reinterpret_borrow<py::object>(consumer).release().ptr();
  self->find_library = py::reinterpret_borrow<py::object>(find_library).release().ptr();
  self->exchange = py::reinterpret_borrow<py::object>(exchange).release().ptr();
  self->not_recorded = py::reinterpret_borrow<py::object>(not_recorded).release().ptr();
  self->parameter = parameter.inc_ref().ptr();
  self->library = intern_library(library);
  self->interface_first = interface_first;
  return made;
}

// The enumerations the Python side names an exchange's parts with.
void bind_interposed_enums(py::module_& m)
{
  py::enum_<interposed_protocol>(m, "_InterposedProtocol")
    .value("dlpack", interposed_protocol::dlpack)
    .value("cuda_array_interface", interposed_protocol::cuda_array_interface);
  py::enum_<interposed_hazard>(m, "_InterposedHazard")
    .value("none", interposed_hazard::none)
    .value("unordered", interposed_hazard::unordered)
    .value("cross_device", interposed_hazard::cross_device)
    .value("released_early", interposed_hazard::released_early);
  py::enum_<trace::event_kind>(m, "_TraceKind")
    .value("import_data", trace::event_kind::import_data)
    .value("release", trace::event_kind::release);
  py::enum_<trace::action>(m, "_TraceAction")
    .value("none", trace::action::none)
    .value("wait", trace::action::wait)
    .value("elided", trace::action::elided)
    .value("unordered", trace::action::unordered)
    .value("refused", trace::action::refused);
}

// One exchange the hooks saw, as they build it up and hand it to the core.
void bind_interposed_exchange(py::module_& m)
{
  py::class_<interposed_exchange>(m, "_InterposedExchange",
                                  "One exchange between two other libraries that handoff's hooks saw.")
    .def(py::init([](interposed_protocol protocol, std::string_view producer, std::string_view consumer,
                     const py::tuple& device) {
           return interposed_exchange{protocol, producer, consumer, device_of(device)};
         }),
         py::arg("protocol"), py::arg("producer"), py::arg("consumer"), py::arg("device"))
    .def_property_readonly("work_device", &interposed_exchange::work_device,
                           "The device whose current streams order the data, or None.")
    .def("set_producer_stream", &interposed_exchange::set_producer_stream, py::arg("stream"),
         "The producer's current stream as its adapter said it; TypeError or ValueError for no stream.")
    .def("set_consumer_stream", &interposed_exchange::set_consumer_stream, py::arg("stream"),
         "The consumer's current stream as its adapter said it; TypeError or ValueError for no stream.")
    .def_property_readonly("protocol", &interposed_exchange::protocol)
    .def_property_readonly("producer", &interposed_exchange::producer)
    .def_property_readonly("consumer", &interposed_exchange::consumer)
    .def_property_readonly("producer_stream", &interposed_exchange::producer_stream,
                           "The producer's stream's native handle, or None.")
    .def_property_readonly("consumer_stream", &interposed_exchange::consumer_stream,
                           "The consumer's stream's native handle, or None.")
    .def_property_readonly("knows_streams", &interposed_exchange::knows_streams)
    .def("order", &interposed_exchange::order,
         "Makes the consumer's stream wait for the producer's; False when a stream is unknown.")
    .def_property_readonly("consumer_stream_outlives_releases", &interposed_exchange::consumer_stream_outlives_releases)
    .def("consumer_stream_busy", &interposed_exchange::consumer_stream_busy)
    .def("record", &interposed_exchange::record, py::arg("kind"), py::arg("action"), py::arg("hazard"),
         py::arg("detail"), "Records the exchange (no-op unless tracing).")
    .def("record_import", &interposed_exchange::record_import, py::arg("argument"), py::arg("result"),
         py::arg("action"), py::arg("hazard"), py::arg("detail"),
         "Records the consumer's import of argument as result (described, a copy noted); no-op unless tracing")
    .def(
      "record_refusal", [](interposed_exchange& seen, py::handle error) { record_refusal(seen, error.ptr()); },
      py::arg("error"), "Records the consumer's refusal, saying its error (no-op unless tracing).")
    .def_readwrite("stream_argument", &interposed_exchange::stream_argument)
    .def_readwrite("ordered", &interposed_exchange::ordered);
}

}  // namespace

std::shared_ptr<const void> framework_stream_owner(std::uint64_t handle, DLDevice data)
{
  // Once Python's exit has begun, no library's Python code is run: a daemon thread exporting then
  // would be ended inside it (and the export's caller may be noexcept). The release then does not wait.
  if (stream_owner_lookup == nullptr || python_is_closing()) { return {}; }
  const std::optional<int> device = work_device_of(data);
  if (!device) { return {}; }
  const py::object found =
    py::reinterpret_steal<py::object>(PyObject_CallFunction(stream_owner_lookup, "Ki", handle, *device));
  if (!found) {  // a lookup never fails an export: without an owner, the release does not wait
    PyErr_Clear();
    return {};
  }
  return stream_keep_alive(found);
}

void bind_interpose(py::module_& m, exchange& on)
{
  bound_exchange = &on;
  bind_interposed_enums(m);
  bind_interposed_exchange(m);
  m.def("_interposed_stream_device", &stream_device, py::arg("handle"),
        "The device of a native stream handle, or None when handoff cannot tell.");
  m.def(
    "_set_stream_owner_lookup",
    [](py::function lookup) {
      Py_XDECREF(stream_owner_lookup);
      stream_owner_lookup = lookup.release().ptr();  // kept for the process
    },
    py::arg("lookup"),
    "Registers `lookup(handle, device)`: the stream object of an imported library whose current stream on "
    "`device` is native stream `handle`, or None; asked for an export's consumer stream that nothing holds.");
  m.def("_interposed_forget_libraries", &forget_libraries,
        "Forgets each array type's library the hooked consumers' calls remember: the adapters changed.");
  m.def("_interposed_call", &make_consumer_call, py::arg("original"), py::arg("consumer"), py::arg("find_library"),
        py::arg("exchange"), py::arg("not_recorded"),
        "A hooked consumer's call: decides whether a call is an exchange and of what data, records one of host data, "
        "and hands one of device data to `exchange(original, consumer, args, kwargs, (argument, protocol, producer, "
        "adapter, device), tracing, ordering)`.");
  m.def(
    "_interposed_set_mode",
    [](bool tracing, bool ordering) {
      mode = {tracing, ordering};
      if (!tracing && !ordering) {  // the hooks go: the array types they remember are let go of
        forget_libraries();
        forget_array_types();
      }
    },
    py::arg("tracing"), py::arg("ordering"),
    "What the hooked consumers' calls are for: a trace, the ordering mode (neither: the array types the hooks "
    "remember are forgotten).");
  m.def("_interposed_begin", &begin_exchange, py::arg("argument"), py::arg("device"),
        "Begins an exchange of `argument`, on this thread: consumers called inside it are part of it, and handoff's "
        "own exchanges inside it are not recorded.");
  m.def("_interposed_end", &end_exchange,
        "Ends the exchange begun on this thread: (the stream its producer's __dlpack__ was given, the device "
        "current then), each None where unseen.");
  m.def("_interposed_producer_hook", &make_producer_hook, py::arg("original"),
        "A hooked producer's __dlpack__ for `original`: notes the `stream` argument of the exchange in flight, "
        "then calls `original` with the same arguments.");
}

}  // namespace handoff::python
