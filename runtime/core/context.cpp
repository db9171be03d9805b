#include <handoff/context.hpp>
#include <handoff/stats.hpp>

#include "core/device_guard.hpp"
#include "log/logger.hpp"

namespace handoff {

context::context(device::backend& backend, std::unique_ptr<executor> deferred)
  : backend_(backend), events_(backend), deferred_(std::move(deferred))
{
}

context::~context() = default;  // deferred_ (declared last) drains and joins before the pool goes

void context::release_after(int device, device::stream_handle stream, std::function<void()> release) noexcept
{
  try {
    detail::device_guard on_owner{backend_, device};
    auto event = std::make_shared<pooled_event>(events_.acquire(device));
    backend_.record_event(event->get(), stream);
    if (backend_.query_event(event->get())) {  // nothing pending on the stream
      release();
      return;
    }
    count(counter::deferred_releases);
    deferred_->post([this, event, release = std::move(release)]() noexcept {
      try {
        backend_.synchronize_event(event->get());
      } catch (const std::exception& e) {
        HANDOFF_LOG_ERROR("deferred release: waiting for the consumer stream failed ({}); releasing now", e.what());
      }
      release();
    });
    return;
  } catch (const std::exception& e) {
    HANDOFF_LOG_WARN("deferred release: cannot record on stream {:#x} ({}); waiting for the stream instead",
                     static_cast<std::uintptr_t>(stream), e.what());
  }
  // The event path failed: synchronize the stream itself, never release early.
  try {
    detail::device_guard on_owner{backend_, device};
    backend_.synchronize_stream(stream);
  } catch (const std::exception& e) {
    HANDOFF_LOG_ERROR("deferred release: synchronizing stream {:#x} failed ({}); releasing",
                      static_cast<std::uintptr_t>(stream), e.what());
  }
  release();
}

}  // namespace handoff
