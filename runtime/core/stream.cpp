#include <handoff/context.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>
#include <handoff/event_pool.hpp>
#include <handoff/internal/counters.hpp>
#include <handoff/internal/ordering.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/stream.hpp>
#include <handoff/stream_value.hpp>
#include <handoff/trace.hpp>

#include "log/logger.hpp"

#include <fmt/format.h>

#include <optional>

namespace handoff {
namespace {

bool capturing(device::backend& backend, device::stream_handle s)
{
  return backend.stream_capture_status(s) != device::capture_status::none;
}

// Tells the exchange being traced on this thread, if any, about a wait.
void note_wait(const bound_stream& consumer, device::stream_handle producer, bool inserted) noexcept
{
  if (!trace::enabled()) { return; }
  if (trace::exchange_scope* scope = trace::exchange_scope::current()) {
    scope->note_wait(consumer.ctx->backend(), consumer.device, static_cast<std::uint64_t>(producer),
                     static_cast<std::uint64_t>(consumer.stream), inserted);
  }
}

}  // namespace

void bound_stream::wait_for(const bound_stream& producer) const
{
  HANDOFF_EXPECTS(producer.ctx == ctx, value_error, "cannot order streams of two different contexts");
  wait_for(producer.stream);
}

void bound_stream::release_after(std::function<void()> release) const noexcept
{
  if (!stream_owner) {
    ctx->release_after(device, stream, std::move(release));
    return;
  }
  // The owner goes once the release has run, after the stream's last use.
  ctx->release_after(device, stream, [release = std::move(release), owner = stream_owner]() noexcept { release(); });
}

std::int64_t bound_stream::dlpack_value() const noexcept
{
  return stream_value_of(ctx->backend().device_type(), static_cast<std::uint64_t>(stream));
}

void bound_stream::wait_for(device::stream_handle producer) const
{
  (void)wait_telling_capture(*this, producer);
}

std::optional<bool> wait_telling_capture(const bound_stream& consumer, device::stream_handle producer)
{
  const device::stream_handle stream = consumer.stream;
  const int device = consumer.device;
  device::backend& b = consumer.ctx->backend();
  if (producer == stream) {
    count(counter::waits_elided);
    note_wait(consumer, producer, false);
    return std::nullopt;
  }
  device_guard on_owner{b, device};  // default streams now resolve on the data's device
  const auto legacy = b.legacy_default_stream();
  const bool producer_legacy = producer == legacy;
  const bool consumer_legacy = stream == legacy;

  // Graph capture: the legacy default stream must not be touched (it reports a capture while a
  // blocking stream of its device captures), and a capture can only be ordered with another
  // capture (an event recorded in one is not waitable from outside).
  const bool producer_captures = capturing(b, producer);
  const bool consumer_captures = capturing(b, stream);
  if (producer_captures || consumer_captures) {
    HANDOFF_EXPECTS(!producer_legacy && !consumer_legacy, buffer_error,
                    fmt::format("cannot order stream {:#x} before stream {:#x}: one is the legacy default stream, "
                                "which a capture under way (on the other stream, or on a blocking stream of its "
                                "device) must not touch",
                                raw(producer), raw(stream)));
    HANDOFF_EXPECTS(producer_captures && consumer_captures, buffer_error,
                    fmt::format("cannot order stream {:#x} before stream {:#x}: only one of them is capturing into "
                                "a graph",
                                raw(producer), raw(stream)));
    // Asked before anything is recorded: a wait across two captures would invalidate both.
    HANDOFF_EXPECTS(b.stream_capture_id(producer) == b.stream_capture_id(stream), buffer_error,
                    fmt::format("cannot order stream {:#x} before stream {:#x}: they are capturing into two "
                                "different graphs",
                                raw(producer), raw(stream)));
  }

  // Work on the data may have been enqueued from a peer device (a stream of another device reading
  // or writing it): the event is recorded on the producer stream's own device.
  const int producer_device = b.stream_device(producer, producer_captures);
  std::optional<device_guard> on_producer;
  if (producer_device != device) { on_producer.emplace(b, producer_device); }
  const pooled_event event = consumer.ctx->events().record(producer_device, producer);
  on_producer.reset();  // a default consumer stream is the data's device's
  b.stream_wait_event(stream, event.get());
  count(counter::waits_inserted);
  note_wait(consumer, producer, true);
  HANDOFF_LOG_TRACE("stream {:#x} waits for stream {:#x} on device {}", raw(stream), raw(producer), device);
  return consumer_captures;
}

}  // namespace handoff
