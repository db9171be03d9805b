// The exchange services of one backend: its event pool and the executor of deferred releases.
#pragma once

#include <handoff/device.hpp>
#include <handoff/event_pool.hpp>

#include <functional>
#include <memory>

namespace handoff {

/// Runs work on another thread, in the order it was posted.
class executor {
 public:
  executor() = default;
  executor(const executor&) = delete;
  executor& operator=(const executor&) = delete;
  executor(executor&&) = delete;
  executor& operator=(executor&&) = delete;
  virtual ~executor() = default;
  /// Hands `work` over; it must not throw.
  virtual void post(std::function<void()> work) = 0;
  /// Blocks until the work posted before this call has run.
  virtual void drain() = 0;
};

/// What exchanges on one backend share. One per backend; outlives every view bound to it.
class context {
 public:
  /// @param deferred runs releases that must wait for a consumer stream (never the caller's thread)
  context(device::backend& backend, std::unique_ptr<executor> deferred);
  context(const context&) = delete;
  context& operator=(const context&) = delete;
  context(context&&) = delete;
  context& operator=(context&&) = delete;
  /// Finishes the pending releases, then destroys the pool's events.
  ~context();

  [[nodiscard]] device::backend& backend() const noexcept { return backend_; }
  [[nodiscard]] event_pool& events() noexcept { return events_; }

  /// Runs `release` once the work enqueued so far on `stream` (of `device`) is done, without
  /// blocking the caller: at once when the stream is idle, else on the executor after an event
  /// recorded on `stream` completes (counted in deferred_releases). If the event cannot be
  /// recorded, it waits for the whole stream on the executor instead: never early.
  void release_after(int device, device::stream_handle stream, std::function<void()> release) noexcept;

  /// Blocks until the releases deferred before this call have run.
  void drain() { deferred_->drain(); }

 private:
  device::backend& backend_;
  event_pool events_;
  std::unique_ptr<executor> deferred_;
};

}  // namespace handoff
