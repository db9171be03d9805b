// The stream rules of an exchange on one context: what a consumer's stream waits for, and what a
// producer is kept for (see <handoff/internal/ordering.hpp>).
#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/counters.hpp>
#include <handoff/internal/ordering.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/stream.hpp>

#include <fmt/format.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace handoff {

bool alive_at_release(stream_request consumer, const std::shared_ptr<const void>& owner, export_release policy) noexcept
{
  return consumer.order != stream_order::handle || owner || policy == export_release::every_stream;
}

// An export handed over with no ordering: the trace asks the producer's stream whether it is idle.
void note_unordered_export(const array& view) noexcept
{
  trace::exchange_scope* scope = trace::traced();
  if (scope == nullptr || view.device().device_type == kDLCPU) { return; }
  scope->note_unordered();
  if (const auto ready = view.owner().ready_on()) { scope->set_producer_stream(*ready); }
}

std::optional<device::stream_handle> resolve_stream(device::backend& backend, stream_request request)
{
  switch (request.order) {
    case stream_order::none:
      return std::nullopt;
    case stream_order::legacy_default:
    case stream_order::default_stream:
      return backend.legacy_default_stream();
    case stream_order::per_thread_default:
      return backend.per_thread_default_stream();
    case stream_order::handle:
      return static_cast<device::stream_handle>(request.handle);
  }
  return std::nullopt;
}

array make_view(context* ctx, array_layout&& layout, shared_producer owner, stream_request ready,
                std::shared_ptr<const void> ready_owner)
{
  array view{std::move(layout), std::move(owner)};
  const DLDeviceType type = view.device().device_type;
  if (ctx == nullptr || !has_streams(type)) { return view; }
  const int device = admit(*ctx, view);  // memory of the device it claims, on a device that exists
  if (const auto stream = resolve_stream(ctx->backend(), ready)) {
    view.owner().set_ready_on(
      {.ctx = ctx, .device = device, .stream = *stream, .stream_owner = std::move(ready_owner)});
  }
  return view;
}

context& context_to_order(context* ctx, const array& view)
{
  if (ctx == nullptr) {
    throw device_error(
      "none", error_names::no_backend,
      fmt::format("ordering {} memory for a consumer stream needs a device backend, and none is active",
                  device_type_name(view.device().device_type)));
  }
  return *ctx;
}

waiting_consumer consumer_waiting_for_ready(context& ctx, const array& view, int device, stream_request consumer,
                                            std::shared_ptr<const void> owner)
{
  bound_stream on_consumer{.ctx = &ctx,
                           .device = device,
                           .stream = *resolve_stream(ctx.backend(), consumer),
                           .stream_owner = std::move(owner)};
  const auto ready = view.owner().ready_on();
  const auto captures = wait_telling_capture(
    on_consumer, ready && ready->ctx == &ctx ? ready->stream : ctx.backend().legacy_default_stream());
  return {.binding = std::move(on_consumer), .captures = captures};
}

// The export half's ordering: the consumer stream `consumer` asks for waits for the stream `view`
// is ready on. Returns that consumer stream, bound on the data's device; nullopt when nothing is
// asked (stream=-1).
std::optional<bound_stream> order_for_consumer(context* ctx, const array& view, stream_request consumer)
{
  if (consumer.order == stream_order::none) {
    note_unordered_export(view);
    return std::nullopt;
  }
  context& on = context_to_order(ctx, view);
  require_stream_ordered(on, view);
  return consumer_waiting_for_ready(on, view, owning_device(on, view), consumer, nullptr).binding;
}

void order_export(context* ctx, const array& view, stream_request consumer, export_release policy,
                  std::shared_ptr<const void> consumer_owner)
{
  auto ordered = order_for_consumer(ctx, view, consumer);
  if (ordered && alive_at_release(consumer, consumer_owner, policy)) {
    ordered->stream_owner = std::move(consumer_owner);
    view.owner().release_after(*ordered);
  }
}

namespace {

// Whether `stream` captures into a graph of its own (the legacy default stream only takes part in
// another stream's capture). False where it cannot be asked: the import's wait would have failed.
bool captures_a_graph(device::backend& b, int device, device::stream_handle stream) noexcept
{
  if (stream == b.legacy_default_stream()) { return false; }
  try {
    const device_guard on_owner{b, device};
    return b.stream_capture_status(stream) != device::capture_status::none;
  } catch (...) {
    return false;
  }
}

// Makes `consumer` wait for the producer's stream (none: nothing is pending), telling whether the
// consumer's stream captures where the wait found it out (wait_telling_capture).
std::optional<bool> wait_for_producer(const bound_stream& consumer, stream_request producer)
{
  const auto producer_stream = resolve_stream(consumer.ctx->backend(), producer);
  return producer_stream ? wait_telling_capture(consumer, *producer_stream) : std::nullopt;
}

// `consumer_captures`: whether the consumer's stream captures, where the wait before found it out.
void bind_to(const array& view, const bound_stream& consumer, const std::optional<bound_stream>& producer,
             std::optional<bool> consumer_captures)
{
  if (trace::exchange_scope* scope = trace::traced()) { scope->set_consumer_stream(consumer); }
  view.owner().set_ready_on(consumer);
  view.owner().release_after(consumer, producer);
  if (consumer_captures.has_value() ? *consumer_captures
                                    : captures_a_graph(consumer.ctx->backend(), consumer.device, consumer.stream)) {
    // Every launch of the graph reads the data, however soon the consumer drops it: the producer is
    // kept until the graph is gone (and the stream's work then done), as a view dropped during the
    // capture is.
    consumer.ctx->release_after(consumer.device, consumer.stream, [kept = view.owner()]() noexcept {});
  }
}

// The producer stream of an interface import that the release makes wait for the consumer's work:
// only one that cannot be destroyed by then, and only where the device's rules do not already
// order it (see bind_interface_import). The same stream as the consumer's needs nothing, as at import.
std::optional<bound_stream> stream_to_hold_back(const bound_stream& on_consumer, stream_request producer,
                                                std::shared_ptr<const void> owner)
{
  device::backend& b = on_consumer.ctx->backend();
  const device::stream_handle consumer = on_consumer.stream;
  const device_guard on_owner{b, on_consumer.device};  // default streams resolve on the data's device
  const auto legacy = b.legacy_default_stream();
  std::optional<device::stream_handle> stream;
  bool ordered_by_the_device = false;
  switch (producer.order) {
    case stream_order::legacy_default:
    case stream_order::default_stream:
      stream = legacy;
      ordered_by_the_device = consumer != legacy && b.stream_is_blocking(consumer);
      break;
    case stream_order::per_thread_default:
      // Named through the legacy default stream, which is right from any thread; the importing
      // thread's per-thread stream is blocking, so it follows a legacy default consumer anyway.
      if (consumer == b.per_thread_default_stream()) { return std::nullopt; }
      stream = legacy;
      ordered_by_the_device = consumer == legacy;
      break;
    case stream_order::handle:
      if (!owner) { return std::nullopt; }  // nothing keeps it alive until the release
      stream = static_cast<device::stream_handle>(producer.handle);
      ordered_by_the_device = consumer == legacy && *stream != legacy && b.stream_is_blocking(*stream);
      break;
    case stream_order::none:
      break;
  }
  if (ordered_by_the_device) {
    count(counter::waits_elided);
    return std::nullopt;
  }
  if (!stream || *stream == consumer) { return std::nullopt; }
  return bound_stream{
    .ctx = on_consumer.ctx, .device = on_consumer.device, .stream = *stream, .stream_owner = std::move(owner)};
}

}  // namespace

void bind_import(const array& view, const bound_stream& consumer, std::optional<bool> consumer_captures)
{
  bind_to(view, consumer, std::nullopt, consumer_captures);
}

bound_stream binding_on(context& ctx, DLDevice device, named_stream stream)
{
  const auto handle = resolve_stream(ctx.backend(), request_for(stream, device.device_type));
  HANDOFF_EXPECTS(handle.has_value(), value_error, "stream=-1 names no stream to work on");
  return {.ctx = &ctx, .device = device.device_id, .stream = *handle, .stream_owner = std::move(stream.owner)};
}

void bind_interface_import(const array& view, const bound_stream& consumer, stream_request producer,
                           std::shared_ptr<const void> producer_owner)
{
  const auto captures = wait_for_producer(consumer, producer);
  bind_to(view, consumer, stream_to_hold_back(consumer, producer, std::move(producer_owner)), captures);
}

void bind_after_producer(const array& view, const bound_stream& consumer, stream_request producer)
{
  bind_to(view, consumer, std::nullopt, wait_for_producer(consumer, producer));
}

std::optional<device::stream_handle> published_ready_stream(const array& view)
{
  const auto ready = view.owner().ready_on();
  if (!ready) { return std::nullopt; }
  device::backend& b = ready->ctx->backend();
  if (ready->stream == b.legacy_default_stream()) {
    const device_guard on_owner{b, ready->device};
    if (b.stream_capture_status(ready->stream) == device::capture_status::none) {
      const pooled_event marker = ready->ctx->events().record(ready->device, ready->stream);
    }
  }
  return ready->stream;
}

}  // namespace handoff
