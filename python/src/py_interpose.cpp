// The exchanges between other libraries that handoff's hooks see (handoff/_interpose.py): their
// trace events, classified as handoff's own are (an unordered hand-off is a hazard only while the
// producer's stream has work pending), and, in the ordering mode, the consumer stream's wait.
#include "py_exchange.hpp"
#include "py_gil.hpp"
#include "py_owners.hpp"
#include "py_trace.hpp"

#include <handoff/context.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/ordering.hpp>
#include <handoff/stream.hpp>

#include <pybind11/stl.h>

#include <fmt/format.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace handoff::python {
namespace {

// The context that orders `device`'s streams: started for device data (the data's library has
// started the device already), none for host data or where handoff has no backend for it.
context* context_for(DLDevice device)
{
  if (device.device_type == kDLCPU) { return nullptr; }
  try {
    context& ctx = module_exchange().require_device("an exchange between other libraries");
    return ctx.backend().device_type() == device.device_type ? &ctx : nullptr;
  } catch (const error&) {
    return nullptr;
  }
}

std::optional<stream_binding> bound(context* ctx, DLDevice device, std::optional<std::int64_t> stream)
{
  if (ctx == nullptr || !stream) { return std::nullopt; }
  return binding_on(*ctx, device, named_stream{.how = named_stream::form::dlpack_value, .value = *stream, .owner = {}});
}

DLDevice device_of(const py::tuple& device)
{
  HANDOFF_EXPECTS(device.size() == 2, value_error, "device must be a (type, id) pair");
  return {static_cast<DLDeviceType>(device[0].cast<int>()), device[1].cast<int>()};
}

// Orders the consumer's stream after the producer's (DLPack stream values of `device`), with a pooled
// event and no host wait. False when handoff cannot order that device's streams.
bool order_streams(const py::tuple& device_pair, std::int64_t producer, std::int64_t consumer)
{
  const DLDevice device = device_of(device_pair);
  context* ctx = context_for(device);
  if (ctx == nullptr) { return false; }
  const stream_binding from = *bound(ctx, device, producer);
  const stream_binding to = *bound(ctx, device, consumer);
  without_gil([&] {
    stream_view{ctx->backend(), to.stream}.wait(stream_view{ctx->backend(), from.stream}, device.device_id,
                                                ctx->events());
  });
  return true;
}

// Keeps `producer` alive until the work enqueued on the consumer's stream by now is done.
bool keep_until_done(py::handle producer, const py::tuple& device_pair, std::int64_t consumer)
{
  const DLDevice device = device_of(device_pair);
  context* ctx = context_for(device);
  if (ctx == nullptr) { return false; }
  const stream_binding on = *bound(ctx, device, consumer);
  keep_alive_until_done(*ctx, on.device, on.stream, producer);
  return true;
}

// The DLPack device of CUDA Array Interface data at `pointer`: the device that owns it; None where
// handoff has no CUDA backend or the backend does not know the memory.
py::object device_of_pointer(std::uintptr_t pointer)
{
  context* ctx = context_for(DLDevice{kDLCUDA, 0});
  if (ctx == nullptr) { return py::none(); }
  device::pointer_attributes found;
  try {
    found = ctx->backend().attributes(reinterpret_cast<const void*>(pointer));  // NOLINT(performance-no-int-to-ptr)
  } catch (const error&) {
    return py::none();
  }
  switch (found.kind) {
    case device::memory_kind::device:
      return py::make_tuple(static_cast<int>(kDLCUDA), found.device);
    case device::memory_kind::managed:
      return py::make_tuple(static_cast<int>(kDLCUDAManaged), found.device);
    case device::memory_kind::pinned_host:
      return py::make_tuple(static_cast<int>(kDLCUDAHost), 0);
    case device::memory_kind::unregistered:
      break;
  }
  return py::none();
}

// Whether the consumer's stream (a DLPack stream value of `device`) still has work queued; false where
// handoff cannot ask.
bool stream_busy(const py::tuple& device_pair, std::int64_t stream)
{
  const DLDevice device = device_of(device_pair);
  context* ctx = context_for(device);
  if (ctx == nullptr) { return false; }
  const stream_binding on = *bound(ctx, device, stream);
  device::backend& backend = ctx->backend();
  const device_guard on_device{backend, on.device};
  const relaxed_capture_mode relaxed{backend};  // a capture under way elsewhere neither fails nor breaks
  return backend.stream_capture_status(on.stream) == device::capture_status::none && !backend.query_stream(on.stream);
}

// The device current on the calling thread for data of `device_type`; None where handoff has no backend for it.
py::object current_device(int device_type)
{
  context* ctx = context_for(DLDevice{static_cast<DLDeviceType>(device_type), 0});
  return ctx != nullptr ? py::object(py::int_(ctx->backend().current_device())) : py::object(py::none());
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

trace::action action_named(const std::string& name)
{
  for (const auto what : {trace::action::none, trace::action::wait, trace::action::elided, trace::action::unordered,
                          trace::action::refused}) {
    if (trace::name(what) == name) { return what; }
  }
  throw value_error(fmt::format("'{}' is not a trace action", name));
}

struct exchange_seen {
  std::string kind;  // "import" (the consumer's), or "release" (of what it imported)
  std::string protocol;
  std::string producer;
  std::string consumer;
  py::tuple device;
  std::vector<std::int64_t> shape;
  std::string dtype;
  std::int64_t nbytes{0};
  std::optional<std::int64_t> producer_stream;  // DLPack stream values of `device`
  std::optional<std::int64_t> consumer_stream;
  std::optional<std::int64_t> stream_argument;
  std::string action;
  bool ordered{false};
  std::string hazard;  // what the hooks saw themselves (a release while the consumer's stream works)
  std::string detail;
};

// A hazard name the hooks report, as a static string (events point at it).
const char* hazard_named(const std::string& name)
{
  for (const char* known : {"unordered", "cross-device", "released early"}) {
    if (name == known) { return known; }
  }
  throw value_error(fmt::format("'{}' is not a hazard the trace knows", name));
}

// Records one exchange the hooks saw as an import by the consumer, classified as handoff's own are.
void record_exchange(const exchange_seen& seen)
{
  if (!trace::enabled()) { return; }
  const DLDevice device = device_of(seen.device);
  const trace::action what = action_named(seen.action);
  context* ctx = context_for(device);
  // The protocol is a static string in an event: the hooks use these.
  static constexpr std::string_view protocols[] = {"dlpack", "cuda-array-interface", "dlpack-c-api"};
  std::string_view protocol = "dlpack";
  for (const std::string_view known : protocols) {
    if (known == seen.protocol) { protocol = known; }
  }
  const auto kind = seen.kind == "release" ? trace::event_kind::release : trace::event_kind::import_data;
  trace::exchange_scope scope{kind, protocol};
  if (!scope.active()) { return; }
  trace::event& e = scope.event();
  e.producer = intern_library(seen.producer);
  e.consumer = intern_library(seen.consumer);
  e.device = device;
  e.shape = seen.shape;
  e.dtype = dtype_from_name(seen.dtype).value_or(DLDataType{kDLOpaqueHandle, 0, 0});
  e.nbytes = seen.nbytes;
  e.stream_argument = seen.stream_argument;
  e.interposed = seen.ordered ? "ordered" : "observed";
  e.detail = seen.detail;
  if (!seen.hazard.empty()) {  // classified by the hooks: the scope keeps what they said
    e.hazard = hazard_named(seen.hazard);
    e.action = what;
  }
  try {
    if (const auto producer = bound(ctx, device, seen.producer_stream)) { scope.set_producer_stream(*producer); }
    if (const auto consumer = bound(ctx, device, seen.consumer_stream)) { scope.set_consumer_stream(*consumer); }
  } catch (const error&) {  // a stream value the device does not take: the event names none
  }
  switch (what) {
    case trace::action::unordered:
      scope.note_unordered();
      break;
    case trace::action::wait:
      scope.note_ordered_by_producer();
      break;
    case trace::action::elided:
      if (ctx != nullptr && e.producer_stream && e.consumer_stream) {
        scope.note_wait(ctx->backend(), device.device_id, e.producer_stream->handle, e.consumer_stream->handle, false);
      }
      break;
    case trace::action::none:
    case trace::action::refused:
      e.action = what;
      break;
  }
}

}  // namespace

void bind_interpose(py::module_& m)
{
  m.def("_interposed_order", &order_streams, py::arg("device"), py::arg("producer_stream"), py::arg("consumer_stream"),
        "Makes the consumer stream wait for the producer's (DLPack stream values of `device`) with a pooled "
        "event; False when handoff cannot order that device's streams.");
  m.def("_interposed_keep", &keep_until_done, py::arg("producer"), py::arg("device"), py::arg("consumer_stream"),
        "Keeps `producer` until the work enqueued on the consumer stream by now is done; False when handoff "
        "cannot order that device's streams.");
  m.def("_interposed_device", &device_of_pointer, py::arg("pointer"),
        "The DLPack device of the CUDA memory at `pointer`, or None when handoff cannot tell.");
  m.def(
    "_interposed_record",
    [](std::string kind, std::string protocol, std::string producer, std::string consumer, py::tuple device,
       std::vector<std::int64_t> shape, std::string dtype, std::int64_t nbytes,
       std::optional<std::int64_t> producer_stream, std::optional<std::int64_t> consumer_stream,
       std::optional<std::int64_t> stream_argument, std::string action, bool ordered, std::string hazard,
       std::string detail) {
      record_exchange({std::move(kind), std::move(protocol), std::move(producer), std::move(consumer),
                       std::move(device), std::move(shape), std::move(dtype), nbytes, producer_stream, consumer_stream,
                       stream_argument, std::move(action), ordered, std::move(hazard), std::move(detail)});
    },
    py::arg("kind"), py::arg("protocol"), py::arg("producer"), py::arg("consumer"), py::arg("device"), py::arg("shape"),
    py::arg("dtype"), py::arg("nbytes"), py::arg("producer_stream"), py::arg("consumer_stream"),
    py::arg("stream_argument"), py::arg("action"), py::arg("ordered"), py::arg("hazard"), py::arg("detail"),
    "Records an exchange between two other libraries (the consumer's import, or the release of what it "
    "imported) as handoff's own are classified; a hazard the hooks saw is kept. No-op unless tracing.");
  m.def("_interposed_mute", &mute, py::arg("on"),
        "Mutes (True) or unmutes (False, the latest mute) the recording of handoff's own exchanges on this thread: "
        "the workings of an exchange between two other libraries that is recorded as one.");
  m.def("_interposed_stream_busy", &stream_busy, py::arg("device"), py::arg("stream"),
        "Whether a stream (a DLPack stream value of `device`) still has work queued; False where handoff cannot "
        "ask.");
  m.def("_interposed_current_device", &current_device, py::arg("device_type"),
        "The device current on the calling thread for data of `device_type`, or None.");
}

}  // namespace handoff::python
