// The exchange services of one backend: its event pool and the executor of deferred releases.
#pragma once

#include <handoff/detail/immovable.hpp>
#include <handoff/device.hpp>
#include <handoff/embedding.hpp>
#include <handoff/event_pool.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>

namespace handoff {

/// Runs work on another thread, in the order it was posted.
class executor : detail::immovable {
 public:
  virtual ~executor() = default;
  /// Hands `work` over; it must not throw.
  virtual void post(std::function<void()> work) = 0;
  /// Hands `work` over to run once `delay` has passed (without holding the thread meanwhile).
  virtual void post_after(std::chrono::nanoseconds delay, std::function<void()> work) = 0;
  /// Blocks until the work posted before this call has run.
  virtual void drain() = 0;
  /// True on the thread that runs the posted work.
  [[nodiscard]] virtual bool runs_on_this_thread() const noexcept = 0;
};

/// An executor of its own: one thread that runs the posted work in order, and lets the pending work
/// finish before it is joined (the runtime's service thread). For a context's deferred releases.
[[nodiscard]] std::unique_ptr<executor> make_service_thread();

/// What exchanges on one backend share. One per backend; outlives every view bound to it.
class context {
 public:
  /// @param deferred runs releases that must wait for a consumer stream (never the caller's thread)
  /// @param hooks how the host waits (block_host) and how batches of releases run (run_releases)
  context(device::backend& backend, std::unique_ptr<executor> deferred, embedding hooks = {});
  context(const context&) = delete;
  context& operator=(const context&) = delete;
  context(context&&) = delete;
  context& operator=(context&&) = delete;
  /// drain_at_exit(exit_drain_limit), unless it ran and no release was asked for since; then
  /// destroys the pool's events. What is still pending is left to the ending process, and logged.
  ~context();

  /// How long the destructor waits for the pending releases.
  static constexpr std::chrono::seconds exit_drain_limit{10};

  [[nodiscard]] device::backend& backend() const noexcept { return backend_; }
  [[nodiscard]] event_pool& events() noexcept { return events_; }
  /// The embedding's hooks this context was made with.
  [[nodiscard]] const embedding& hooks() const noexcept { return hooks_; }

  /// A handle that names `stream` (of `device`) from any thread, for work or a release enqueued
  /// later elsewhere: the calling thread's per-thread default stream becomes the legacy default
  /// stream, which is ordered after the work of every blocking stream of its device. A driver may
  /// drop an ended thread's per-thread stream from that implicit ordering, so the legacy default
  /// stream is then also made to wait for the per-thread stream's work when the thread ends.
  [[nodiscard]] device::stream_handle thread_independent(int device, device::stream_handle stream) noexcept;

  /// Runs `release` once the work enqueued so far on `stream` (of `device`) is done, without
  /// blocking the caller or the stream: an event from the pool is recorded on `stream` (counted in
  /// deferred_releases) and the executor polls it, then runs `release`. Nothing is enqueued that
  /// the stream must wait for (a host function would hold it until a host thread ran it). If the
  /// event cannot be recorded, the executor waits for the whole stream instead: never early. A
  /// failure (a record, a query, a wait, the device made current) is tried again; only a stream that
  /// keeps failing (a sticky error) has the release abandoned and `release` kept unrun. It runs with
  /// `device` current. While
  /// `stream` captures into a graph, nothing goes into the graph (it would run at every launch, or
  /// never): the executor waits for the capture to end, then records.
  ///
  /// `producer`, when given, must run no later work until that same work on `stream` is done: it
  /// waits on the event where it is recorded (counted in waits_inserted), so it must be alive then
  /// (the caller keeps it so until `release` has run). A producer stream that is capturing, or that
  /// cannot be used (the legacy default stream while a blocking stream of its device captures: a
  /// wait would invalidate that capture), is left alone and the log says so; so is every producer
  /// when no event could be recorded.
  void release_after(int device, device::stream_handle stream, std::function<void()> release,
                     std::optional<device::stream_handle> producer = std::nullopt) noexcept;

  /// Blocks until no deferred release is pending (each waits for its stream, then runs), but those
  /// that wait for a captured graph the program still holds: they wait for the program.
  /// @throws error on the executor's own thread (a finalizer that a release ran): it would wait for
  ///         itself.
  void drain();
  /// drain(), for at most `limit`. @return true when nothing drain() waits for is pending.
  bool drain_for(std::chrono::nanoseconds limit);
  /// At exit: waits, at most `limit`, for the releases pending when it is called whose streams can
  /// still get there (not for those threads still exchanging ask for meanwhile). Only the streams
  /// that have releases pending are looked at (never whole devices: that would create a context on
  /// a device nothing used), through a polled event, never a blocking call; a stream that keeps
  /// failing (a sticky device error) will never get there, and its releases are abandoned. What is
  /// abandoned is logged, by stream and why. @return true when none of the releases it waited for
  /// is pending.
  bool drain_at_exit(std::chrono::nanoseconds limit) noexcept;

 private:
  struct impl;

  device::backend& backend_;
  embedding hooks_;
  event_pool events_;
  std::unique_ptr<impl> impl_;  // last: destroyed first, draining while the pool is alive
};

}  // namespace handoff
