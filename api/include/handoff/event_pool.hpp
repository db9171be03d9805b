// Per-device pools of events, so a steady stream of exchanges creates no events.
#pragma once

#include <handoff/detail/spin_lock.hpp>
#include <handoff/device.hpp>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace handoff {

class event_pool;

/// An event borrowed from a pool; goes back on destruction. Move-only.
class pooled_event {
 public:
  pooled_event(event_pool& pool, int device, std::uint64_t context, device::event_handle event) noexcept
      : pool_(&pool), device_(device), context_(context), event_(event)
  {}
  pooled_event(pooled_event&& other) noexcept
      : pool_(std::exchange(other.pool_, nullptr)),
        device_(other.device_),
        context_(other.context_),
        event_(other.event_)
  {}
  pooled_event& operator=(pooled_event&&) = delete;
  pooled_event(const pooled_event&) = delete;
  pooled_event& operator=(const pooled_event&) = delete;
  ~pooled_event();

  [[nodiscard]] device::event_handle get() const noexcept { return event_; }
  /// Destroys the event instead of giving it back: a failed record may have left it unusable.
  void discard() noexcept;

 private:
  event_pool* pool_;
  int device_;
  std::uint64_t context_;  // the device context the event belongs to (backend::context_id)
  device::event_handle event_;
};

/// Events (timing disabled) of one backend, pooled per device and per device context: an event is
/// created in the context current where it is asked for (that device's primary context, or a context
/// the application made and made current), which its streams belong to, and is handed out again only
/// where that context is current. After a reset of a device's primary context (numba-cuda's
/// `cuda.close()`) the events of the old one are gone with it, and are neither handed out nor
/// destroyed again. A returned event may be re-recorded at once: a stream's wait captures the record
/// as of the wait call, as CUDA specifies.
class event_pool {
 public:
  explicit event_pool(device::backend& backend) : backend_(backend) {}
  event_pool(const event_pool&) = delete;
  event_pool& operator=(const event_pool&) = delete;
  event_pool(event_pool&&) = delete;
  event_pool& operator=(event_pool&&) = delete;
  ~event_pool();

  /// An event of the context current for `device` (made current where none, or another device's,
  /// is: the event must be of the device whose stream records it). Counted in events_reused or
  /// events_created. @throws device_error when creating one fails.
  [[nodiscard]] pooled_event acquire(int device);

  /// An event of `device` (the current device) recorded on `stream`: it captures the work enqueued
  /// there so far. An event whose record fails is destroyed, not pooled.
  /// @throws device_error when creating or recording the event fails.
  [[nodiscard]] pooled_event record(int device, device::stream_handle stream);

  /// Events currently idle in the pool (all devices).
  [[nodiscard]] std::size_t idle() const;

 private:
  friend class pooled_event;
  void give_back(int device, std::uint64_t context, device::event_handle event) noexcept;

  struct context_pool {
    std::uint64_t context{0};  // the context its events belong to
    std::vector<device::event_handle> events;
  };
  struct device_pools {
    std::uint64_t primary{0};  // the id of the device's primary context when last asked
    std::vector<context_pool> contexts;
  };
  [[nodiscard]] context_pool* find(int device, std::uint64_t context);  // call with lock_ held
  [[nodiscard]] std::optional<pooled_event> take_idle(int device, std::uint64_t context);

  device::backend& backend_;
  mutable detail::spin_lock lock_;  // held for a vector's push or pop
  std::vector<device_pools> idle_;  // by device
};

}  // namespace handoff
