// Private: the context's state and the machinery of its deferred releases, split by job over
//   context.cpp               the release queue: releases asked for, grouped by stream, polled, run
//   context_graphs.cpp        releases held while their stream captures, or until their graph goes
//   context_thread_exit.cpp   a thread's per-thread default stream ordered before the legacy one at its end
//   context_exit.cpp          drain(), and the exit's bounded wait in named steps
#pragma once

#include <handoff/context.hpp>

#include "core/release_count.hpp"

#include <chrono>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace handoff {
namespace detail {

// How soon the executor enqueues again a release whose stream captures (to look whether the capture
// has ended) or could not be asked.
inline constexpr std::chrono::milliseconds retry_interval{1};
// How often the exit drain looks at the streams it waits for.
inline constexpr std::chrono::milliseconds exit_poll{5};
// How often the executor looks at the events of pending releases: soon while they complete, backing
// off to the longest interval while the streams are busy.
inline constexpr std::chrono::microseconds min_release_poll{20};
inline constexpr std::chrono::milliseconds max_release_poll{1};
// A stream that cannot be asked about (a failed query, a device that cannot be made current) is
// asked again: the failure may pass. Only one that keeps failing this long, at least this often (a
// sticky device error), has its releases abandoned.
inline constexpr std::chrono::milliseconds failure_grace{100};
inline constexpr int min_failures_to_abandon = 3;

// Consecutive failures to ask about or wait for a stream (a failed query, record or synchronization,
// a device that cannot be made current), since the first of them.
struct failure_streak {
  int failures{0};
  std::chrono::steady_clock::time_point since{};

  // Counts a failure; true once the stream has failed long and often enough to be given up on.
  [[nodiscard]] bool keeps_failing() noexcept
  {
    const auto now = std::chrono::steady_clock::now();
    if (failures++ == 0) { since = now; }
    return failures >= min_failures_to_abandon && now - since >= failure_grace;
  }
  void reset() noexcept { failures = 0; }
};

// What the exception being handled says.
std::string what_failed();

}  // namespace detail

struct context::impl {
  impl(device::backend& backend, const embedding& hooks, event_pool& events, std::unique_ptr<executor> deferred);
  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;
  impl(impl&&) = delete;
  impl& operator=(impl&&) = delete;
  ~impl();

  using stream_key = detail::release_count::stream_key;
  struct pending_release;
  struct release_group;
  struct shared_state;
  struct thread_exit_orders;
  struct exit_probe;

  // The release queue (context.cpp).
  void release_after(int device, device::stream_handle stream, std::function<void()> release,
                     std::optional<device::stream_handle> producer) noexcept;
  void enqueue_unless_capturing(pending_release* pending) noexcept;
  void enqueue_release(pending_release* pending, bool device_is_current) noexcept;
  void wait_then_release(pending_release* pending) noexcept;
  void wait_for_stream(int device, device::stream_handle stream);  // blocks the calling thread
  void hold_back(device::stream_handle producer, device::stream_handle consumer, device::event_handle reached) noexcept;
  void poll_later(std::chrono::nanoseconds interval) noexcept;
  void poll_releases(std::chrono::nanoseconds interval) noexcept;
  void run_releases(std::vector<pending_release*>& releases) noexcept;
  void finished_one(const pending_release& pending) noexcept;

  // Captures (context_graphs.cpp).
  bool release_with_graph(pending_release* pending) noexcept;
  void enqueue_later(pending_release* pending) noexcept;

  // Threads' ends (context_thread_exit.cpp).
  [[nodiscard]] device::stream_handle thread_independent(int device, device::stream_handle stream) noexcept;
  void order_legacy_after_this_thread(int device) noexcept;

  // Draining, and the exit (context_exit.cpp).
  void drain();
  bool drain_for(std::chrono::nanoseconds limit);
  bool drain_at_exit(std::chrono::nanoseconds limit) noexcept;
  void refuse_to_wait_for_itself(const char* what) const;
  void look_at(exit_probe& probe) noexcept;
  void leave_outstanding_to_the_process() noexcept;

  device::backend& backend_;
  const embedding& hooks_;
  event_pool& events_;
  detail::release_count count_;  // every deferred release not yet run, and the exit's share of them
  std::mutex watch_mutex_;
  std::list<release_group> watched_;  // recorded; the executor polls their events
  bool polling_{false};               // a poll is scheduled (guarded by watch_mutex_)
  // What a host function still queued on a stream reaches: it outlives the context, so that a
  // release abandoned at exit touches nothing when its host function runs after all.
  std::shared_ptr<shared_state> shared_;
  std::unique_ptr<executor> deferred_;
};

// What queued host functions and executor jobs reach of their context. `owner` becomes null when
// the context goes with releases still pending: they are abandoned, and touch nothing if their
// host function runs after all.
struct context::impl::shared_state {
  explicit shared_state(impl* live) noexcept : owner(live) {}
  std::mutex mutex;
  impl* owner;
  // Every release not yet run (or deliberately kept), so that what the context abandons stays
  // reachable: it is left to the ending process on purpose, not lost.
  std::unordered_set<pending_release*> outstanding;
};

// Releases asked for on one stream between two polls share one event, re-recorded for each: a stream
// holds one event per poll its work outlasts, however many releases ask meanwhile, and one that never
// idles still releases its producers in steps, a poll apart.
struct context::impl::release_group {
  stream_key where;
  pooled_event reached;
  std::vector<pending_release*> releases;
  bool sealed{false};                   // a poll looked at the event: a release joining it now would not be seen
  detail::failure_streak failed_polls;  // that could not ask about the event
};

// A release waiting for a consumer stream: for the event of its group, which the executor polls.
struct context::impl::pending_release {
  std::shared_ptr<shared_state> shared;
  stream_key where;
  std::uint64_t sequence;  // in the order releases are asked for
  std::function<void()> release_producer;
  std::optional<device::stream_handle> producer;  // made to wait for the same work, once recorded
  bool graph_gone{false};                         // the graph its stream captured into when it was asked for is gone
  detail::failure_streak failed_waits;            // when no event can be recorded: of the waits for the stream

  // On the executor (or, failing that, where the stream reached it), while the context lives.
  void run(impl& owner) noexcept
  {
    release_producer();
    release_producer = nullptr;  // and what it holds (the consumer stream's owner), before drain() returns
    owner.finished_one(*this);
  }

  // The context, unless the release was abandoned. Call with shared->mutex held.
  [[nodiscard]] impl* live_owner() const noexcept { return shared->owner; }

  // Frees a release that has run. Call with shared->mutex held when `locked`.
  static void retire(pending_release* pending, bool locked = false) noexcept
  {
    if (locked) {
      pending->shared->outstanding.erase(pending);
    } else {
      std::lock_guard lock{pending->shared->mutex};
      pending->shared->outstanding.erase(pending);
    }
    delete pending;
  }
};

}  // namespace handoff
