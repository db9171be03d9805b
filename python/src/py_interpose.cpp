// The exchanges between other libraries that handoff's hooks see (handoff/_interpose.py), one object
// each: both libraries' streams, resolved once by the exchange from what their adapters said; in the
// ordering mode, the consumer stream's wait; and the trace events, classified as handoff's own are
// (an unordered hand-off is a hazard only while the producer's stream has work pending).
#include "py_cpython.hpp"
#include "py_exchange.hpp"
#include "py_gil.hpp"
#include "py_numpy.hpp"
#include "py_owners.hpp"
#include "py_streams.hpp"
#include "py_trace.hpp"

#include <handoff/context.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/stream.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/stl.h>

#include <array>
#include <functional>
#include <memory>
#include <numeric>
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

const char* hazard_name(interposed_hazard hazard) noexcept
{
  switch (hazard) {
    case interposed_hazard::unordered:
      return "unordered";
    case interposed_hazard::cross_device:
      return "cross-device";
    case interposed_hazard::released_early:
      return "released early";
    case interposed_hazard::none:
      break;
  }
  return nullptr;
}

std::string_view protocol_name(interposed_protocol protocol) noexcept
{
  return protocol == interposed_protocol::dlpack ? "dlpack" : "cuda-array-interface";
}

// The context that orders the streams of `type`'s data: none for host data, or where handoff has no
// backend for that device type (the data's library started the device already).
context* context_serving(DLDeviceType type)
{
  if (!has_streams(type)) { return nullptr; }
  try {
    context* ctx = module_exchange().device_context();
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

// --- what the hooks read of an array ------------------------------------------------------------

// An array as the trace describes it: its shape, its dtype's name (NumPy's, PyTorch's, CuPy's and
// JAX's float32 all read "float32"), its size, and where its data starts, where its library says so.
struct array_description {
  std::vector<std::int64_t> shape;
  std::string dtype;
  std::int64_t nbytes{0};
  std::optional<std::uintptr_t> data;
};

// The name of a dtype object ("torch.float32" reads "float32"), remembered per object: str() of a
// NumPy dtype costs microseconds. Holds a reference to each dtype it names, so that no address is
// reused while remembered; bounded (a program that makes a dtype per array would otherwise grow it).
std::optional<std::string> dtype_name_of(PyObject* dtype)
{
  static auto* known =
    new std::unordered_map<PyObject*, std::string>;  // NOLINT(cppcoreguidelines-owning-memory): leaked
  constexpr std::size_t most_remembered = 1024;
  if (const auto found = known->find(dtype); found != known->end()) { return found->second; }
  const auto text = py::reinterpret_steal<py::object>(PyObject_Str(dtype));
  Py_ssize_t size = 0;
  const char* utf8 = text ? PyUnicode_AsUTF8AndSize(text.ptr(), &size) : nullptr;
  if (utf8 == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  const std::string_view full{utf8, static_cast<std::size_t>(size)};
  std::string name{full.substr(full.rfind('.') + 1)};
  if (known->size() >= most_remembered) {
    for (const auto& [remembered, _] : *known) { Py_DECREF(remembered); }
    known->clear();
  }
  known->emplace(dtype, name);
  Py_INCREF(dtype);
  return name;
}

// How each library says where an array's data starts, without side effects.
enum class pointer_read : std::uint8_t {
  none,
  data_ptr,               // PyTorch: tensor.data_ptr()
  unsafe_buffer_pointer,  // JAX
  array_interface,        // NumPy's __array_interface__["data"][0]
  data_ptr_attribute,     // CuPy: array.data.ptr
};

std::optional<std::uintptr_t> read_pointer(PyObject* value, pointer_read how)
{
  static PyObject* const data_ptr = interned("data_ptr");
  static PyObject* const unsafe_buffer_pointer = interned("unsafe_buffer_pointer");
  static PyObject* const array_interface = interned("__array_interface__");
  static PyObject* const data = interned("data");
  static PyObject* const ptr = interned("ptr");
  py::object read;
  switch (how) {
    case pointer_read::data_ptr:
      read = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(value, data_ptr));
      break;
    case pointer_read::unsafe_buffer_pointer:
      read = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(value, unsafe_buffer_pointer));
      break;
    case pointer_read::array_interface:
      if (auto interface = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, array_interface))) {
        PyObject* entry = PyDict_Check(interface.ptr()) != 0 ? PyDict_GetItemWithError(interface.ptr(), data) : nullptr;
        if (entry != nullptr && PyTuple_Check(entry) != 0 && PyTuple_GET_SIZE(entry) > 0) {
          read = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry, 0));
        }
      }
      break;
    case pointer_read::data_ptr_attribute:
      if (auto memory = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, data))) {
        read = py::reinterpret_steal<py::object>(PyObject_GetAttr(memory.ptr(), ptr));
      }
      break;
    case pointer_read::none:
      break;
  }
  const unsigned long long pointer = read && PyLong_Check(read.ptr()) != 0 ? PyLong_AsUnsignedLongLong(read.ptr()) : 0;
  if (!read || PyLong_Check(read.ptr()) == 0 || PyErr_Occurred() != nullptr) {
    PyErr_Clear();  // not this library's way, or an array that cannot say it now (a deleted JAX array)
    return std::nullopt;
  }
  return static_cast<std::uintptr_t>(pointer);
}

// Where `value`'s data starts, read the way that works for its type, found once per type: trying
// each way costs an exception per library that is not the array's.
std::optional<std::uintptr_t> data_pointer(PyObject* value)
{
  static auto* read_of_type = new std::unordered_map<PyTypeObject*, pointer_read>;  // NOLINT: leaked, as above
  PyTypeObject* type = Py_TYPE(value);
  if (const auto found = read_of_type->find(type); found != read_of_type->end()) {
    return read_pointer(value, found->second);
  }
  for (const pointer_read how : {pointer_read::data_ptr, pointer_read::unsafe_buffer_pointer,
                                 pointer_read::array_interface, pointer_read::data_ptr_attribute}) {
    if (const auto pointer = read_pointer(value, how)) {
      read_of_type->emplace(type, how);
      Py_INCREF(type);  // no other type is made at its address while remembered
      return pointer;
    }
  }
  read_of_type->emplace(type, pointer_read::none);
  Py_INCREF(type);
  return std::nullopt;
}

std::optional<std::int64_t> as_int64(PyObject* value)
{
  if (value == nullptr || PyLong_Check(value) == 0) { return std::nullopt; }
  const int64_reading read = read_int64(value);
  if (read.overflow != 0) { return std::nullopt; }
  return read.value;
}

// `value` described from its `shape`, `dtype` and `nbytes`; nullopt for what is not array-like.
std::optional<array_description> describe_by_attributes(PyObject* value)
{
  static PyObject* const shape_name = interned("shape");
  static PyObject* const dtype_name = interned("dtype");
  static PyObject* const nbytes_name = interned("nbytes");
  array_description out;
  const auto shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, shape_name));
  const auto sizes = shape ? py::reinterpret_steal<py::object>(PySequence_Fast(shape.ptr(), "shape")) : py::object{};
  const auto dtype = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, dtype_name));
  const auto nbytes = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, nbytes_name));
  const auto size = nbytes ? as_int64(nbytes.ptr()) : std::nullopt;
  auto name = dtype ? dtype_name_of(dtype.ptr()) : std::nullopt;
  if (!sizes || !size || !name) {
    PyErr_Clear();
    return std::nullopt;
  }
  const Py_ssize_t rank = PySequence_Fast_GET_SIZE(sizes.ptr());
  out.shape.reserve(static_cast<std::size_t>(rank));
  for (Py_ssize_t i = 0; i < rank; ++i) {
    const auto extent = as_int64(PySequence_Fast_GET_ITEM(sizes.ptr(), i));
    if (!extent) { return std::nullopt; }
    out.shape.push_back(*extent);
  }
  out.dtype = std::move(*name);
  out.nbytes = *size;
  out.data = data_pointer(value);
  return out;
}

// `value` as the trace describes it; nullopt for what is not array-like. A NumPy array is read from
// the fields NumPy's C API documents (its __array_interface__ builds a dictionary per call).
std::optional<array_description> describe(py::handle value)
{
  if (is_numpy_array(value.ptr())) {
    if (const std::optional<array_layout> layout = numpy_fields_layout(value.ptr())) {
      array_description out;
      out.shape.assign(layout->shape.begin(), layout->shape.end());
      out.dtype = dtype_name(layout->dtype);
      out.nbytes =
        std::accumulate(out.shape.begin(), out.shape.end(), std::int64_t{layout->dtype.bits / 8}, std::multiplies<>{});
      out.data = reinterpret_cast<std::uintptr_t>(layout->data);
      return out;
    }
  }
  return describe_by_attributes(value.ptr());
}

// What the trace says when the consumer made a copy of the data it was handed rather than a view of
// it (JAX makes int32 of int64 data while x64 is off); empty when it made a view.
std::string copy_note(std::string_view consumer, const array_description& handed, const array_description& made)
{
  if (made.shape != handed.shape || made.dtype != handed.dtype) {
    return fmt::format("{} made a copy: {}[{}] of the {}[{}] it was handed", consumer, made.dtype,
                       fmt::join(made.shape, ", "), handed.dtype, fmt::join(handed.shape, ", "));
  }
  // An empty array's data pointer is whatever its library chose (NumPy's is an allocation, PyTorch's null).
  if (handed.nbytes > 0 && handed.data && made.data && handed.data != made.data) {
    return fmt::format("{} made a copy of the {}[{}] it was handed", consumer, handed.dtype,
                       fmt::join(handed.shape, ", "));
  }
  return {};
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
                      const py::tuple& device)
      : protocol_(protocol),
        producer_(intern_library(producer)),
        consumer_(intern_library(consumer)),
        device_(device_of(device))
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
    const stream_binding& to = *consumer_stream_;
    const stream_binding& from = *producer_stream_;
    device::backend& backend = to.ctx->backend();
    without_gil([&] {
      stream_view{backend, to.stream}.wait(stream_view{backend, from.stream}, to.device, to.ctx->events());
    });
    return true;
  }

  // Whether a release deferred behind the consumer's stream is certain to find it alive (export_release).
  [[nodiscard]] bool consumer_stream_outlives_releases() const
  {
    return consumer_named_ && module_exchange().may_release_after(*consumer_named_, device_.device_type);
  }

  // Whether the consumer's stream still has work queued; false where that cannot be asked safely (a
  // stream that may be destroyed by now, one capturing into a graph).
  [[nodiscard]] bool consumer_stream_busy() const
  {
    if (!consumer_stream_ || !consumer_stream_outlives_releases()) { return false; }
    const stream_binding& on = *consumer_stream_;
    device::backend& backend = on.ctx->backend();
    const device_guard on_device{backend, on.device};
    const relaxed_capture_mode relaxed{backend};  // a capture under way elsewhere neither fails nor breaks
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
      e.hazard = hazard_name(hazard);
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
    std::optional<array_description> handed = describe(argument);
    const std::optional<array_description> made = describe(result);
    if (!handed) { handed = made; }
    if (handed) {
      shape_ = handed->shape;
      dtype_ = dtype_from_name(handed->dtype).value_or(DLDataType{kDLOpaqueHandle, 0, 0});
      nbytes_ = handed->nbytes;
      if (made) {
        if (std::string copy = copy_note(consumer_, *handed, *made); !copy.empty()) {
          detail = detail.empty() ? std::move(copy) : fmt::format("{}; {}", detail, copy);
        }
      }
    }
    record(trace::event_kind::import_data, what, hazard, detail);
  }

  std::optional<std::int64_t> stream_argument;  // the `stream` the consumer passed, where seen
  bool ordered{false};                          // by handoff's hooks

 private:
  static std::optional<std::uintptr_t> handle_of(const std::optional<stream_binding>& stream)
  {
    return stream ? std::optional<std::uintptr_t>{raw(stream->stream)} : std::nullopt;
  }

  [[nodiscard]] std::optional<stream_binding> resolved(py::handle stream) const
  {
    if (stream.is_none() || context_serving(device_.device_type) == nullptr) { return std::nullopt; }
    return module_exchange().bind_stream(device_, stream_named_by(stream));
  }

  interposed_protocol protocol_;
  const char* producer_;
  const char* consumer_;
  DLDevice device_;
  std::optional<stream_binding> producer_stream_;
  std::optional<stream_binding> consumer_stream_;
  std::optional<named_stream> consumer_named_;  // as the consumer's adapter named it
  // What the trace says of the data, once the consumer returned.
  std::vector<std::int64_t> shape_;
  DLDataType dtype_{kDLOpaqueHandle, 0, 0};
  std::int64_t nbytes_{0};
};

// The DLPack device of CUDA Array Interface data at `pointer`, as handoff's own imports name it; None
// where handoff has no backend or the backend does not know the memory.
py::object device_of_pointer(std::uintptr_t pointer)
{
  std::optional<DLDevice> found;
  try {
    found = module_exchange().device_of(reinterpret_cast<const void*>(pointer));  // NOLINT(performance-no-int-to-ptr)
  } catch (const error&) {
    return py::none();
  }
  if (!found) { return py::none(); }
  return py::make_tuple(static_cast<int>(found->device_type), found->device_id);
}

// The device current on the calling thread for data of `device_type`; None where handoff has no backend for it.
py::object current_device(int device_type)
{
  const context* ctx = context_serving(static_cast<DLDeviceType>(device_type));
  return ctx != nullptr ? py::object(py::int_(ctx->backend().current_device())) : py::object(py::none());
}

// The device of native stream `handle`, as the backend knows it (a default stream's: the current
// device); None without a backend.
py::object stream_device(std::uint64_t handle)
{
  try {
    const context* ctx = module_exchange().device_context();
    if (ctx == nullptr) { return py::none(); }
    // Pinned memory is worked on by a stream of any device: bound on the stream's own.
    const DLDeviceType pinned = ctx->backend().device_type() == kDLROCM ? kDLROCMHost : kDLCUDAHost;
    const auto bound = module_exchange().bind_stream({pinned, 0}, named_stream::native(handle, {}));
    return bound ? py::object(py::int_(bound->device)) : py::object(py::none());
  } catch (const error&) {
    return py::none();
  }
}

void mute(bool on)
{
  thread_local std::vector<std::unique_ptr<trace::muted_scope>> mutes;  // this thread's, innermost last
  if (on) {
    mutes.push_back(std::make_unique<trace::muted_scope>());
  } else if (!mutes.empty()) {
    mutes.pop_back();
  }
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

void bind_interpose(py::module_& m)
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
  py::class_<interposed_exchange>(m, "_InterposedExchange",
                                  "One exchange between two other libraries that handoff's hooks saw.")
    .def(py::init<interposed_protocol, std::string_view, std::string_view, const py::tuple&>(), py::arg("protocol"),
         py::arg("producer"), py::arg("consumer"), py::arg("device"))
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
    .def_readwrite("stream_argument", &interposed_exchange::stream_argument)
    .def_readwrite("ordered", &interposed_exchange::ordered);
  m.def("_interposed_device", &device_of_pointer, py::arg("pointer"),
        "The DLPack device of the CUDA memory at `pointer`, or None when handoff cannot tell.");
  m.def("_interposed_current_device", &current_device, py::arg("device_type"),
        "The device current on the calling thread for data of `device_type`, or None.");
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
  m.def("_interposed_mute", &mute, py::arg("on"),
        "Mutes (True) or unmutes (False, the latest mute) the recording of handoff's own exchanges on this thread: "
        "the workings of an exchange between two other libraries that is recorded as one.");
}

}  // namespace handoff::python
