// handoff::exchange: the whole operations every front end runs, composed of the stream rules
// (ordering), the transfers and the device memory they need; each counted and traced here.
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/internal/counters.hpp>
#include <handoff/internal/device_memory.hpp>
#include <handoff/internal/ordering.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/internal/transfer.hpp>

#include <fmt/format.h>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

namespace handoff {

namespace {

// Pinned host memory said to be kDLCUDAHost (or kDLROCMHost) and described as kDLCPU in the capsule is
// the same memory (PyTorch's pinned tensors): a CPU consumer needs no stream for it.
bool same_memory(DLDevice claimed, DLDevice actual) noexcept
{
  const bool pinned_as_cpu =
    (claimed.device_type == kDLCUDAHost || claimed.device_type == kDLROCMHost) && actual.device_type == kDLCPU;
  return pinned_as_cpu || (claimed.device_type == actual.device_type && claimed.device_id == actual.device_id);
}

// The trace event of an operation: the front end's, when it opened one of the operation's kind (an
// import's spans the calls to the producer that come before the exchange's part), else its own.
class operation_trace {
 public:
  operation_trace(trace::event_kind kind, std::string_view protocol) noexcept
  {
    if (!trace::enabled()) { return; }
    trace::exchange_scope* open = trace::exchange_scope::current();
    if (open == nullptr || open->event().kind != kind) { own_.emplace(kind, protocol); }
  }

  /// The data of the operation's own event (a front end's sets its own).
  void set_view(const array& view) noexcept
  {
    if (own_ && own_->active()) { own_->set_view(view); }
  }

 private:
  std::optional<trace::exchange_scope> own_;
};

}  // namespace

context& exchange::require_device(const char* what) const
{
  if (context* ctx = device_context()) { return *ctx; }
  const absent_backend& why = absent();
  std::string detail = why.setting;
  if (!why.reason.empty()) { detail += fmt::format("{}{}", detail.empty() ? "" : "; ", why.reason); }
  throw device_error("none", error_names::no_backend,
                     fmt::format("{} needs a device backend, and none is active{}", what,
                                 detail.empty() ? std::string{} : fmt::format(" ({})", detail)));
}

void exchange::require_ordering(DLDeviceType type) const
{
  if (!is_cuda_device(type) || device_context() != nullptr) { return; }
  const absent_backend& why = absent();
  if (!why.refuses_unordered) { return; }  // the application asked for no backend
  throw device_error(
    "cuda", why.error_name,
    fmt::format("{} data needs ordering, and {} could not start the CUDA backend: {}. The "
                "exchange is refused rather than made unordered: pass stream=-1 where the consumer orders its "
                "work itself, or set HANDOFF_BACKEND=none to exchange device data with no ordering",
                device_type_name(type), why.setting, why.reason));
}

std::optional<bound_stream> exchange::consumer_binding(const array& view, const named_stream& consumer) const
{
  const DLDeviceType type = view.device().device_type;
  if (!has_streams(type)) { return std::nullopt; }
  const stream_request request = request_for(consumer, type);
  const bool ordered = request.order != stream_order::none;
  if (ordered) {
    require_ordering(type);
  } else if (trace::exchange_scope* scope = trace::traced()) {  // the consumer orders its work itself
    scope->note_unordered();
  }
  // Data the consumer orders itself needs no backend, but is checked where there is one.
  context* ctx = ordered ? device_context() : usable_context();
  if (ctx == nullptr) { return std::nullopt; }
  const int device = admit(*ctx, view);  // every import passes it, ordered or not
  if (!ordered) { return std::nullopt; }
  return bound_stream{
    .ctx = ctx, .device = device, .stream = *resolve_stream(ctx->backend(), request), .stream_owner = consumer.owner};
}

context* exchange::usable_context() const noexcept
{
  try {
    return device_context();
  } catch (...) {
    return nullptr;  // a backend that failed to start, or a forked child's parent's
  }
}

void exchange::bind_to_consumer(const array& view, const named_stream& consumer) const
{
  if (auto binding = consumer_binding(view, consumer)) { bind_import(view, *binding); }
}

array exchange::transfer(array view, std::optional<DLDevice> target, std::optional<bool> copy,
                         bool producer_copied) const
{
  if (!target && !copy) { return view; }
  const handoff::transfer how = plan_import(view, target, copy, producer_copied);
  if (how != handoff::transfer::none && view.device().device_type != kDLCPU) {
    (void)require_device(how == handoff::transfer::host_view ? "handing host-accessible device memory to the CPU"
                                                             : "copying device memory");
  }
  return transfer_array(context_for(view.device().device_type), view, how);
}

// --- imports ---------------------------------------------------------------------------------------

void exchange::import(array& view, const import_request& request, const producer_answer& answer)
{
  operation_trace trace{trace::event_kind::import_data, "dlpack"};
  if (answer.claimed) {
    // The consumer stream was passed in the numbering of the device the producer claimed (or of the
    // `device` it was asked for): data elsewhere may not have been ordered for the device it is on.
    const DLDevice expected = request.device && answer.honoured_arguments ? *request.device : *answer.claimed;
    const DLDevice actual = view.device();
    HANDOFF_EXPECTS(
      same_memory(expected, actual), value_error,
      fmt::format("{0}.__dlpack_device__() said {1} device {2} (({3}, {2})), but its capsule holds data on {4} "
                  "device {5} (({6}, {5})); refused, as the consumer stream could not be ordered",
                  answer.name, device_type_name(expected.device_type), expected.device_id,
                  static_cast<int>(expected.device_type), device_type_name(actual.device_type), actual.device_id,
                  static_cast<int>(actual.device_type)));
    if (expected.device_type != actual.device_type) {
      // Pinned memory the capsule calls host memory (PyTorch's pinned tensors): no binding will
      // read the consumer stream, which is checked here in the pinned device's numbering, as a
      // capsule that says so has it checked.
      (void)request_for(request.consumer, expected.device_type);
    }
  }
  if (answer.ordered_for_consumer) {
    if (trace::exchange_scope* scope = trace::traced()) { scope->note_ordered_by_producer(); }
  }
  if (!answer.ordered_for_default_stream) {
    bind_to_consumer(view, request.consumer);
  } else if (const auto binding = consumer_binding(view, request.consumer)) {
    // DLPack reads None as the default stream: the producer's work, if it orders any, comes before
    // that stream's later work, and the consumer stream's after it.
    bind_after_producer(view, *binding, classify_stream(view.device().device_type, std::nullopt));
  }
  if (request.device || request.copy) {
    view = transfer(std::move(view), request.device, request.copy, answer.honoured_arguments);
  }
  count(counter::imports);
  trace.set_view(view);
}

std::optional<array> exchange::import_from_table(DLManagedTensorVersioned* tensor, const named_stream& consumer,
                                                 table_producer& producer)
{
  operation_trace trace{trace::event_kind::import_data, "dlpack-c-api"};
  array view = take_tensor(tensor);  // its deleter runs exactly once from here on
  // Only complex data can be lazily conjugated; __dlpack__ refuses such data with a reason.
  if (view.dtype().code == kDLComplex) {
    if (producer.lazily_conjugated()) { return std::nullopt; }
  }
  if (const auto binding = consumer_binding(view, consumer)) {
    std::optional<std::int64_t> work_stream;
    if (!producer.current_work_stream(view.device(), work_stream)) { return std::nullopt; }
    bind_after_producer(view, *binding, classify_stream(view.device().device_type, work_stream));
  }
  count(counter::imports);
  trace.set_view(view);
  return view;
}

array exchange::import_interface(cuda_interface interface, shared_producer owner, const import_request& request,
                                 std::shared_ptr<const void> producer_stream_owner)
{
  operation_trace trace{trace::event_kind::import_data, "cuda-array-interface"};
  context& ctx = require_device("importing __cuda_array_interface__ data");
  device::backend& backend = ctx.backend();
  array_layout& layout = interface.layout;
  if (layout.data == nullptr) {  // an empty array (the interface asks for 0 then): on the current device
    layout.device = {backend.device_type(), backend.current_device()};
  } else {
    const device::pointer_attributes where = backend.attributes(layout.data);
    const auto device = dlpack_device_of(where, backend.device_type());
    HANDOFF_EXPECTS(device.has_value(), buffer_error,
                    "__cuda_array_interface__ 'data' points to memory the device does not know");
    layout.device = *device;
    if (where.device_pointer != nullptr) { layout.data = where.device_pointer; }
  }
  const DLDeviceType type = layout.device.device_type;
  array view{std::move(layout), std::move(owner)};
  const int device = [&] {  // every byte, as a DLPack import's
    try {
      return admit(ctx, view);
    } catch (const value_error& e) {
      throw value_error(fmt::format("__cuda_array_interface__ 'data': {}", e.what()));
    }
  }();
  const auto consumer_stream = resolve_stream(backend, request_for(request.consumer, type));
  // The interface numbers streams as CUDA does (1: legacy default, 2: per-thread default) on every
  // platform; the backend resolves those to its own default streams.
  const stream_request producer = interface.stream ? classify_stream(kDLCUDA, interface.stream) : stream_request{};
  if (!consumer_stream || !interface.stream) {  // no ordering asked for, or none possible
    if (trace::exchange_scope* scope = trace::traced()) {
      scope->note_unordered();
      if (const auto written_on = resolve_stream(backend, producer)) {  // the trace asks it whether it is idle
        scope->set_producer_stream({.ctx = &ctx, .device = device, .stream = *written_on, .stream_owner = nullptr});
      }
    }
  }
  if (consumer_stream) {
    bind_interface_import(
      view, {.ctx = &ctx, .device = device, .stream = *consumer_stream, .stream_owner = request.consumer.owner},
      producer, std::move(producer_stream_owner));
  }
  array made = transfer(std::move(view), request.device, request.copy, false);
  count(counter::imports);
  trace.set_view(made);
  return made;
}

array exchange::import_host(array view, const import_request& request)
{
  operation_trace trace{trace::event_kind::import_data, "host"};
  array made = transfer(std::move(view), request.device, request.copy, false);
  count(counter::imports);
  trace.set_view(made);
  return made;
}

void exchange::count_host_import() const noexcept
{
  count(counter::imports);
}

array exchange::share(const array& source, const named_stream& consumer)
{
  operation_trace trace{trace::event_kind::import_data, "dlpack"};
  array view{source.layout(), source.owner().derived()};
  if (const DLDeviceType type = view.device().device_type; has_streams(type)) {
    const stream_request request = request_for(consumer, type);
    if (request.order == stream_order::none) {
      note_unordered_export(source);
      bind_to_consumer(view, consumer);  // checked where there is a backend
    } else {
      // One admission for both halves, as a hand-over's: the consumer's stream waits for the
      // producer's on the device that owns the data, and the view is bound there.
      context& ctx = context_to_order(device_context(), source);
      const waiting_consumer on_consumer =
        consumer_waiting_for_ready(ctx, source, admit(ctx, source), request, consumer.owner);
      bind_import(view, on_consumer.binding, on_consumer.captures);
    }
  }
  count(counter::imports);
  trace.set_view(view);
  return view;
}

array exchange::adopt(array view, const named_stream& work_stream)
{
  operation_trace trace{trace::event_kind::import_data, "dlpack-c-api"};
  // The consumer made the data on its work stream: the view is ready there, and released after it.
  bind_to_consumer(view, work_stream);
  count(counter::imports);
  trace.set_view(view);
  return view;
}

// --- a library's own memory --------------------------------------------------------------------------

array exchange::view(array_layout layout, shared_producer owner, const named_stream& ready)
{
  validate_description(layout);  // the rest of the layout is checked as the view is made
  // Default: unknown, which is not DLPack's default stream (the stream is left to the exports).
  stream_request request{};
  if (!ready.is_default()) {
    request = request_for(ready, layout.device.device_type);
    if (request.order != stream_order::none) { require_ordering(layout.device.device_type); }
  }
  context* ctx = has_streams(layout.device.device_type) ? device_context() : nullptr;
  return make_view(ctx, std::move(layout), std::move(owner), request, ready.owner);
}

array exchange::allocate(const DLTensor& prototype, const named_stream& on)
{
  HANDOFF_EXPECTS(prototype.ndim >= 0 && (prototype.ndim == 0 || prototype.shape != nullptr), value_error,
                  fmt::format("the prototype's shape is missing or its ndim ({}) is negative", prototype.ndim));
  const std::span<const std::int64_t> shape{prototype.shape, static_cast<std::size_t>(prototype.ndim)};
  const DLDevice device = prototype.device;
  if (device.device_type == kDLCPU) { return allocate_host_array(prototype.dtype, shape); }
  context* ctx = device_context();
  HANDOFF_EXPECTS(
    ctx != nullptr && ctx->backend().device_type() == device.device_type, buffer_error,
    fmt::format("cannot allocate on device ({}, {}): the {} backend serves {}", static_cast<int>(device.device_type),
                device.device_id, ctx != nullptr ? ctx->backend().name() : "none",
                ctx != nullptr ? device_type_name(ctx->backend().device_type()) : "no device"));
  HANDOFF_EXPECTS(device.device_id >= 0, value_error, fmt::format("device id {} is negative", device.device_id));
  return allocate_device_array(binding_on(*ctx, device, on), prototype.dtype, shape);
}

// --- exports -----------------------------------------------------------------------------------------

exported_tensor exchange::export_dlpack(const array& view, const export_request& request)
{
  operation_trace trace{trace::event_kind::export_data, "dlpack"};
  trace.set_view(view);  // a refused export is traced too
  // CPU data asked for as it is, on no stream, has nothing to order, transfer or note: the common
  // export of host data goes straight to its tensor.
  const bool as_it_is =
    view.device().device_type == kDLCPU && request.stream.is_default() && !request.dl_device && !request.copy;
  const stream_request consumer = as_it_is ? stream_request{} : request_for(request.stream, view.device().device_type);
  const auto version = export_version(request.max_version);
  handoff::transfer how = handoff::transfer::none;
  std::unique_ptr<const array> made;
  if (!as_it_is) {
    if (request.dl_device || request.copy) { how = plan_export(view, request.dl_device, request.copy); }
    // A stream handle is certain to be alive when the export is released only if something holds it.
    made = prepare_export(consumer.order != stream_order::none || how != handoff::transfer::none
                            ? context_for(view.device().device_type)
                            : nullptr,
                          view, consumer, how, export_release_policy(),
                          consumer.order == stream_order::handle ? request.stream.owner : nullptr);
  }
  const array& handed = made ? *made : view;
  const bool copied = how == handoff::transfer::to_host || how == handoff::transfer::same_device;
  exported_tensor out;
  if (version) {
    out.versioned = export_versioned(handed, {.version = *version, .copied = copied});
  } else {
    out.legacy = export_legacy(handed);
  }
  count(counter::exports);
  return out;
}

DLManagedTensorVersioned* exchange::hand_over(const array& view, const named_stream& consumer)
{
  const operation_trace trace{trace::event_kind::export_data, "dlpack-c-api"};
  order_hand_over(view, consumer);
  DLManagedTensorVersioned* tensor = export_versioned(view);  // holds the producer until its deleter runs
  count(counter::exports);
  return tensor;
}

void exchange::lend(const array& view, const named_stream& consumer)
{
  operation_trace trace{trace::event_kind::export_data, "dlpack-c-api"};
  trace.set_view(view);  // no tensor of its own to track: the consumer borrows the view's
  order_hand_over(view, consumer);
  count(counter::exports);
}

void exchange::order_hand_over(const array& view, const named_stream& consumer) const
{
  const DLDeviceType type = view.device().device_type;
  const stream_request request = request_for(consumer, type);  // host data takes no stream, as exports
  if (!has_streams(type)) { return; }
  if (request.order == stream_order::none) {
    note_unordered_export(view);
    if (context* ctx = usable_context()) { (void)admit(*ctx, view); }  // checked where there is a backend
    return;
  }
  // One admission for both halves: it finds the device that owns the data, where the consumer's
  // stream waits for the producer's and the producer is kept until the consumer's work is done.
  context& ctx = context_to_order(device_context(), view);
  view.owner().release_after(consumer_waiting_for_ready(ctx, view, admit(ctx, view), request, consumer.owner).binding);
}

// --- streams and memory, for a front end that orders other libraries' exchanges -----------------------

std::optional<bound_stream> exchange::bind_stream(DLDevice data, const named_stream& stream) const
{
  if (!has_streams(data.device_type)) { return std::nullopt; }
  const stream_request request = request_for(stream, data.device_type);
  context* ctx = device_context();
  if (ctx == nullptr || (ctx->backend().device_type() == kDLROCM) != is_rocm_device(data.device_type)) {
    return std::nullopt;
  }
  device::backend& backend = ctx->backend();
  const auto handle = resolve_stream(backend, request);
  if (!handle) { return std::nullopt; }
  const int device = is_host_accessible(data.device_type) ? backend.stream_device(*handle) : data.device_id;
  return bound_stream{.ctx = ctx, .device = device, .stream = *handle, .stream_owner = stream.owner};
}

bool exchange::may_release_after(const named_stream& stream, DLDeviceType type) const
{
  return alive_at_release(request_for(stream, type), stream.owner, export_release_policy());
}

std::optional<DLDevice> exchange::device_of(const void* data) const
{
  const context* ctx = device_context();
  if (ctx == nullptr) { return std::nullopt; }
  return dlpack_device_of(ctx->backend().attributes(data), ctx->backend().device_type());
}

std::optional<std::int64_t> exchange::interface_stream(const array& view) const
{
  const auto ready = published_ready_stream(view);
  if (!ready) { return std::nullopt; }
  return stream_value_of(view.device().device_type, static_cast<std::uint64_t>(*ready));
}

producer_device_scope::producer_device_scope(const exchange& on, DLDevice claimed)
{
  if (claimed.device_type != kDLCUDA && claimed.device_type != kDLROCM) { return; }  // pinned, managed: device 0
  context* ctx = on.device_context();
  if (ctx == nullptr || ctx->backend().device_type() != claimed.device_type) { return; }
  device::backend& b = ctx->backend();
  if (claimed.device_id < 0 || claimed.device_id >= b.device_count()) { return; }  // refused with the capsule
  guard_.emplace(b, claimed.device_id);
}

}  // namespace handoff
