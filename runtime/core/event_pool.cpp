#include <handoff/event_pool.hpp>

#include <handoff/internal/counters.hpp>

#include "log/logger.hpp"

namespace handoff {

pooled_event::~pooled_event()
{
  if (pool_ != nullptr) { pool_->give_back(device_, context_, event_); }
}

void pooled_event::discard() noexcept
{
  if (pool_ == nullptr) { return; }
  std::exchange(pool_, nullptr)->backend_.destroy_event(event_);
}

event_pool::~event_pool()
{
  for (const auto& pool : idle_) {
    for (const auto event : pool.events) { backend_.destroy_event(event); }
  }
}

pooled_event event_pool::acquire(int device)
{
  const std::uint64_t context = backend_.context_id(device);
  {
    std::lock_guard lock{mutex_};
    const auto slot = static_cast<std::size_t>(device);
    if (slot >= idle_.size()) { idle_.resize(slot + 1); }
    device_pool& pool = idle_[slot];
    if (pool.context != context) {
      if (!pool.events.empty()) {  // the device's context was reset: its events went with it
        HANDOFF_LOG_DEBUG("event pool: device {} has a new context; {} event(s) of the old one forgotten", device,
                          pool.events.size());
      }
      pool.events.clear();
      pool.context = context;
    }
    if (!pool.events.empty()) {
      const auto event = pool.events.back();
      pool.events.pop_back();
      count(counter::events_reused);
      return {*this, device, context, event};
    }
  }
  const auto event = backend_.create_event();  // outside the lock: may be slow, may throw
  count(counter::events_created);
  HANDOFF_LOG_DEBUG("event pool: created event {:#x} on device {}", static_cast<std::uintptr_t>(event), device);
  return {*this, device, context, event};
}

pooled_event event_pool::record(int device, device::stream_handle stream)
{
  pooled_event event = acquire(device);
  try {
    backend_.record_event(event.get(), stream);
  } catch (...) {
    event.discard();
    throw;
  }
  return event;
}

std::size_t event_pool::idle() const
{
  std::lock_guard lock{mutex_};
  std::size_t n = 0;
  for (const auto& pool : idle_) { n += pool.events.size(); }
  return n;
}

void event_pool::give_back(int device, std::uint64_t context, device::event_handle event) noexcept
{
  try {
    std::lock_guard lock{mutex_};
    device_pool& pool = idle_[static_cast<std::size_t>(device)];  // made by the acquire
    if (pool.context != context) { return; }                      // of a context reset since: gone with it
    pool.events.push_back(event);
  } catch (...) {
    backend_.destroy_event(event);  // out of memory: drop the event rather than leak it
  }
}

}  // namespace handoff
