#include <handoff/event_pool.hpp>

#include <handoff/stats.hpp>

#include "log/logger.hpp"

namespace handoff {

pooled_event::~pooled_event()
{
  if (pool_ != nullptr) { pool_->give_back(device_, event_); }
}

event_pool::~event_pool()
{
  for (auto& events : idle_) {
    for (const auto event : events) { backend_.destroy_event(event); }
  }
}

pooled_event event_pool::acquire(int device)
{
  {
    std::lock_guard lock{mutex_};
    const auto slot = static_cast<std::size_t>(device);
    if (slot < idle_.size() && !idle_[slot].empty()) {
      const auto event = idle_[slot].back();
      idle_[slot].pop_back();
      count(counter::events_reused);
      return {*this, device, event};
    }
  }
  const auto event = backend_.create_event();  // outside the lock: may be slow, may throw
  count(counter::events_created);
  HANDOFF_LOG_DEBUG("event pool: created event {:#x} on device {}", static_cast<std::uintptr_t>(event), device);
  return {*this, device, event};
}

std::size_t event_pool::idle() const
{
  std::lock_guard lock{mutex_};
  std::size_t n = 0;
  for (const auto& events : idle_) { n += events.size(); }
  return n;
}

void event_pool::give_back(int device, device::event_handle event) noexcept
{
  try {
    std::lock_guard lock{mutex_};
    const auto slot = static_cast<std::size_t>(device);
    if (slot >= idle_.size()) { idle_.resize(slot + 1); }
    idle_[slot].push_back(event);
  } catch (...) {
    backend_.destroy_event(event);  // out of memory: drop the event rather than leak it
  }
}

}  // namespace handoff
