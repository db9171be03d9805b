// The exchange services of one backend: its event pool and the executor of deferred releases.
#pragma once

#include <handoff/device.hpp>
#include <handoff/event_pool.hpp>

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>

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
  /// Waits for every device (so queued host functions have run), finishes the pending releases,
  /// then destroys the pool's events.
  ~context();

  [[nodiscard]] device::backend& backend() const noexcept { return backend_; }
  [[nodiscard]] event_pool& events() noexcept { return events_; }

  /// Runs `release` once the work enqueued so far on `stream` (of `device`) is done, without
  /// blocking the caller: a host function enqueued on `stream` hands it to the executor (counted
  /// in deferred_releases); no event is used. If that cannot be enqueued, the executor waits for
  /// the whole stream instead: never early.
  void release_after(int device, device::stream_handle stream, std::function<void()> release) noexcept;

  /// Blocks until no deferred release is pending (each waits for its stream, then runs).
  void drain();

 private:
  device::backend& backend_;
  struct pending_release;
  void finished_one() noexcept;

  event_pool events_;
  std::mutex pending_mutex_;
  std::condition_variable none_pending_;
  std::size_t pending_{0};  // deferred releases not yet run
  std::unique_ptr<executor> deferred_;
};

}  // namespace handoff
