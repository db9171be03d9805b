// Per-device pools of events, so a steady stream of exchanges creates no events.
#pragma once

#include <handoff/device.hpp>

#include <mutex>
#include <utility>
#include <vector>

namespace handoff {

class event_pool;

/// An event borrowed from a pool; goes back on destruction. Move-only.
class pooled_event {
 public:
  pooled_event(event_pool& pool, int device, device::event_handle event) noexcept
      : pool_(&pool), device_(device), event_(event)
  {}
  pooled_event(pooled_event&& other) noexcept
      : pool_(std::exchange(other.pool_, nullptr)), device_(other.device_), event_(other.event_)
  {}
  pooled_event& operator=(pooled_event&&) = delete;
  pooled_event(const pooled_event&) = delete;
  pooled_event& operator=(const pooled_event&) = delete;
  ~pooled_event();

  [[nodiscard]] device::event_handle get() const noexcept { return event_; }

 private:
  event_pool* pool_;
  int device_;
  device::event_handle event_;
};

/// Events (timing disabled) of one backend, pooled per device. A returned event may be re-recorded
/// at once: a stream's wait captures the record as of the wait call, as CUDA specifies.
class event_pool {
 public:
  explicit event_pool(device::backend& backend) : backend_(backend) {}
  event_pool(const event_pool&) = delete;
  event_pool& operator=(const event_pool&) = delete;
  event_pool(event_pool&&) = delete;
  event_pool& operator=(event_pool&&) = delete;
  ~event_pool();

  /// An event of `device`, which must be the current device. Counted in events_reused or
  /// events_created. @throws device_error when creating one fails.
  [[nodiscard]] pooled_event acquire(int device);

  /// Events currently idle in the pool (all devices).
  [[nodiscard]] std::size_t idle() const;

 private:
  friend class pooled_event;
  void give_back(int device, device::event_handle event) noexcept;

  device::backend& backend_;
  mutable std::mutex mutex_;
  std::vector<std::vector<device::event_handle>> idle_;  // by device
};

}  // namespace handoff
