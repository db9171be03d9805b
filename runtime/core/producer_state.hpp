// Private: the shared state behind shared_producer, read by the ownership graph.
#pragma once

#include <handoff/array.hpp>
#include <handoff/detail/spin_lock.hpp>

#include "core/live_views.hpp"

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace handoff {
namespace detail {
/// A fresh ownership graph node id (buffers and views share one sequence, from 1).
std::uint64_t next_node_id() noexcept;
}  // namespace detail

struct shared_producer::state {
  explicit state(std::function<void()> release) noexcept : release_(std::move(release)) { detail::live_view_added(); }
  state(const state&) = delete;
  state& operator=(const state&) = delete;
  state(state&&) = delete;
  state& operator=(state&&) = delete;
  ~state();

  // A new state, in a block of one the calling thread destroyed if it kept one (producer.cpp): a
  // state comes and goes with every import. destroy() is its one way out.
  [[nodiscard]] static state* make(std::function<void()>&& release);

  // Runs `release` once the work enqueued on `consumer` by now is done; a held-back producer stream
  // of the same device waits for that work too.
  void defer(bound_stream& consumer, std::function<void()> release) noexcept;

  static void acquire(state* s) noexcept
  {
    if (s != nullptr) { s->references_.fetch_add(1, std::memory_order_relaxed); }
  }
  static void release(state* s) noexcept
  {
    if (s == nullptr) { return; }
    // The only reference (the usual case: one view) cannot be copied concurrently, so it needs no
    // atomic read-modify-write; acquire orders every use through other, gone references before.
    if (s->references_.load(std::memory_order_acquire) == 1 ||
        s->references_.fetch_sub(1, std::memory_order_acq_rel) == 1) {  // acq_rel: as above
      destroy(s);
    }
  }

  // Deletes `s`; while another state's deletion runs on this thread (a release dropping the last
  // reference of a producer it keeps, through any library's deleter), queues it for that deletion's
  // loop instead: a chain of producers, each keeping the next, is let go iteratively.
  static void destroy(state* s) noexcept;

  // The producer this one derives from (derived()): what it keeps alive, its root.
  [[nodiscard]] const state* root() const noexcept { return parent_ ? parent_.state_ : this; }
  [[nodiscard]] state* root() noexcept { return parent_ ? parent_.state_ : this; }

  // The buffer's node id in the ownership graph and the trace, assigned on first use.
  std::uint64_t id() noexcept;

  std::atomic<long> references_{1};
  std::function<void()> release_;
  std::atomic<std::uint64_t> id_{0};
  mutable detail::spin_lock lock_;  // guards the bindings
  // Set once a binding keeps a stream's owner: visit_stream_owners need not lock before then, as
  // most producers (host data, streams given as values) never do.
  std::atomic<bool> keeps_stream_owner_{false};
  std::optional<bound_stream> ready_on_;
  std::vector<bound_stream> release_after_;  // one per consumer stream, usually one
  std::optional<bound_stream> hold_back_;    // the producer stream that waits for the consumers' work
  shared_producer parent_;                   // set for a derived producer: the root it keeps
  state* next_to_destroy_{nullptr};          // queued by destroy()
};

}  // namespace handoff
