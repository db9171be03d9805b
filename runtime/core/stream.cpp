#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>
#include <handoff/event_pool.hpp>
#include <handoff/internal/counters.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/stream.hpp>
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

}  // namespace

void stream_view::note_wait(int device, stream_view producer, bool inserted) const noexcept
{
  if (!trace::enabled()) { return; }
  if (trace::exchange_scope* scope = trace::exchange_scope::current()) {
    scope->note_wait(*backend_, device, static_cast<std::uint64_t>(producer.handle_),
                     static_cast<std::uint64_t>(handle_), inserted);
  }
}

void stream_view::wait(stream_view producer, int device, event_pool& events) const
{
  HANDOFF_EXPECTS(producer.backend_ == backend_, value_error, "cannot order streams of two different backends");
  device::backend& b = *backend_;
  if (producer.handle_ == handle_) {
    count(counter::waits_elided);
    note_wait(device, producer, false);
    return;
  }
  device_guard on_owner{b, device};  // default streams now resolve on the data's device
  const auto legacy = b.legacy_default_stream();
  const bool producer_legacy = producer.handle_ == legacy;
  const bool consumer_legacy = handle_ == legacy;

  // Graph capture: the legacy default stream must not be touched (it reports a capture while a
  // blocking stream of its device captures), and a capture can only be ordered with another
  // capture (an event recorded in one is not waitable from outside).
  const bool producer_captures = capturing(b, producer.handle_);
  const bool consumer_captures = capturing(b, handle_);
  if (producer_captures || consumer_captures) {
    HANDOFF_EXPECTS(!producer_legacy && !consumer_legacy, buffer_error,
                    fmt::format("cannot order stream {:#x} before stream {:#x}: one is the legacy default stream, "
                                "which a capture under way (on the other stream, or on a blocking stream of its "
                                "device) must not touch",
                                raw(producer.handle_), raw(handle_)));
    HANDOFF_EXPECTS(producer_captures && consumer_captures, buffer_error,
                    fmt::format("cannot order stream {:#x} before stream {:#x}: only one of them is capturing into "
                                "a graph",
                                raw(producer.handle_), raw(handle_)));
    // Asked before anything is recorded: a wait across two captures would invalidate both.
    HANDOFF_EXPECTS(b.stream_capture_id(producer.handle_) == b.stream_capture_id(handle_), buffer_error,
                    fmt::format("cannot order stream {:#x} before stream {:#x}: they are capturing into two "
                                "different graphs",
                                raw(producer.handle_), raw(handle_)));
  }

  // Work on the data may have been enqueued from a peer device (a stream of another device reading
  // or writing it): the event is recorded on the producer stream's own device.
  const int producer_device = b.stream_device(producer.handle_, producer_captures);
  std::optional<device_guard> on_producer;
  if (producer_device != device) { on_producer.emplace(b, producer_device); }
  const pooled_event event = events.record(producer_device, producer.handle_);
  on_producer.reset();  // a default consumer stream is the data's device's
  b.stream_wait_event(handle_, event.get());
  count(counter::waits_inserted);
  note_wait(device, producer, true);
  HANDOFF_LOG_TRACE("stream {:#x} waits for stream {:#x} on device {}", raw(handle_), raw(producer.handle_), device);
}

}  // namespace handoff
