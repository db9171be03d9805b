#include <handoff/event_pool.hpp>

#include <handoff/device_guard.hpp>
#include <handoff/internal/counters.hpp>

#include "log/logger.hpp"

#include <mutex>
#include <optional>

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
  for (const auto& device : idle_) {
    for (const auto& pool : device.contexts) {
      for (const auto event : pool.events) { backend_.destroy_event(event); }
    }
  }
}

event_pool::context_pool* event_pool::find(int device, std::uint64_t context)
{
  const auto slot = static_cast<std::size_t>(device);
  if (slot >= idle_.size()) { return nullptr; }
  for (context_pool& pool : idle_[slot].contexts) {
    if (pool.context == context) { return &pool; }
  }
  return nullptr;
}

std::optional<pooled_event> event_pool::take_idle(int device, std::uint64_t context)
{
  std::lock_guard lock{lock_};
  context_pool* pool = find(device, context);
  if (pool == nullptr || pool->events.empty()) { return std::nullopt; }
  const auto event = pool->events.back();
  pool->events.pop_back();
  count(counter::events_reused);
  return pooled_event{*this, device, context, event};
}

pooled_event event_pool::acquire(int device)
{
  // Pooled by the context they were made in, so that the context current now finds its own.
  if (auto idle = take_idle(device, backend_.current_context_id())) { return std::move(*idle); }
  // Made with `device` current (a no-op where one of its contexts is): none, or another device's,
  // may have been.
  const device_guard on_device{backend_, device};
  const std::uint64_t context = backend_.current_context_id();
  if (auto idle = take_idle(device, context)) { return std::move(*idle); }
  const std::uint64_t primary = backend_.context_id(device);  // asked on a miss only: a reset is rare
  const auto event = backend_.create_event();                 // outside the lock: may be slow, may throw
  count(counter::events_created);
  HANDOFF_LOG_DEBUG("event pool: created event {:#x} on device {}", static_cast<std::uintptr_t>(event), device);
  std::size_t forgotten = 0;
  try {
    std::lock_guard lock{lock_};
    const auto slot = static_cast<std::size_t>(device);
    if (slot >= idle_.size()) { idle_.resize(slot + 1); }
    device_pools& pools = idle_[slot];
    if (pools.primary != primary) {
      // The device's primary context was reset: its events went with it.
      std::erase_if(pools.contexts, [&](const context_pool& pool) {
        if (pool.context != pools.primary) { return false; }
        forgotten += pool.events.size();
        return true;
      });
      pools.primary = primary;
    }
    if (find(device, context) == nullptr) { pools.contexts.push_back({.context = context, .events = {}}); }
  } catch (...) {
    backend_.destroy_event(event);
    throw;
  }
  if (forgotten != 0) {
    HANDOFF_LOG_DEBUG("event pool: device {} has a new context; {} event(s) of the old one forgotten", device,
                      forgotten);
  }
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
  std::lock_guard lock{lock_};
  std::size_t n = 0;
  for (const auto& device : idle_) {
    for (const auto& pool : device.contexts) { n += pool.events.size(); }
  }
  return n;
}

void event_pool::give_back(int device, std::uint64_t context, device::event_handle event) noexcept
{
  try {
    std::lock_guard lock{lock_};
    context_pool* pool = find(device, context);  // made by the acquire
    if (pool == nullptr) { return; }             // of a context reset since: gone with it
    pool->events.push_back(event);
  } catch (...) {
    backend_.destroy_event(event);  // out of memory: drop the event rather than leak it
  }
}

}  // namespace handoff
