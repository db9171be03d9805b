// Private: the count of a context's deferred releases not yet run, and the waits on it.
#pragma once

#include <handoff/device.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace handoff::detail {

/// The deferred releases of a context not yet run, by the stream each waits for: what drain()
/// waits for and, once the exit's wait has begun, what that wait counts (the releases asked for
/// before it began: threads still exchanging keep asking for more). Releases that wait for a
/// captured graph the program still holds are counted apart: neither wait is for them.
class release_count {
 public:
  using stream_key = std::pair<int, device::stream_handle>;  // (device, stream)

  /// Counts a release asked for now, that waits for `where`. @return its sequence: the order
  /// releases are asked for in. @throws std::bad_alloc
  std::uint64_t add(stream_key where);
  /// The release `sequence`, waiting for `where`, has run or was given up.
  void remove(stream_key where, std::uint64_t sequence) noexcept;
  /// The release `sequence` now waits (`bound`), or no longer waits, for a captured graph.
  void bind_to_graph(std::uint64_t sequence, bool bound) noexcept;

  /// Blocks until nothing is pending but releases bound to graphs.
  void wait_drained();
  /// wait_drained(), for at most `limit`. @return true when drained.
  [[nodiscard]] bool wait_drained_for(std::chrono::nanoseconds limit);

  // --- the exit ---------------------------------------------------------------------------------

  /// Counts apart the releases pending now: the exit waits for them. @return the streams they wait
  /// for, in ascending order. @throws std::bad_alloc
  [[nodiscard]] std::vector<stream_key> begin_exit();
  /// Whether a release was asked for since begin_exit() (true when it never ran).
  [[nodiscard]] bool asked_since_exit_began() const;
  /// The sequence of the first release asked for after begin_exit(): a release whose sequence is
  /// not below it was asked for after the exit began (0, every release, when it never began).
  [[nodiscard]] std::uint64_t first_after_exit_began() const;

  /// What the exit's wait left pending.
  struct exit_outcome {
    std::size_t left{0};             // of the releases begin_exit() counted
    std::size_t bound_to_graphs{0};  // of them, those waiting for graphs the program holds
    std::size_t unreachable{0};      // of them, those whose streams will never get there
    std::size_t asked_meanwhile{0};  // asked for after begin_exit(), not waited for
    std::vector<std::pair<stream_key, std::size_t>> unreachable_by_stream;
  };
  /// Waits, until `deadline`, for the releases begin_exit() counted to run, but those bound to
  /// graphs and those whose stream `gave_up(stream)` says will never get there; between waits (each
  /// at most `interval`), `look()` looks at the streams, without the count's lock held.
  template <typename Look, typename GaveUp>
  exit_outcome wait_exit(std::chrono::steady_clock::time_point deadline, std::chrono::nanoseconds interval, Look look,
                         GaveUp gave_up) noexcept;

 private:
  struct tally {
    std::size_t pending{0};
    std::map<stream_key, std::size_t> by_stream;  // by the stream they wait for
    std::size_t bound_to_graphs{0};
    [[nodiscard]] bool drained() const noexcept { return pending <= bound_to_graphs; }
  };
  // Applies `change` to the tallies the release `sequence` is counted in. Call with mutex_ held.
  template <typename Change>
  void update(std::uint64_t sequence, Change change) noexcept;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  tally all_;                         // every release not yet run
  std::optional<tally> before_exit_;  // those asked for before begin_exit()
  std::uint64_t next_sequence_{0};
  std::uint64_t exit_cutoff_{0};  // the sequence of the first release asked for after begin_exit()
};

template <typename Change>
void release_count::update(std::uint64_t sequence, Change change) noexcept
{
  change(all_);
  if (before_exit_ && sequence < exit_cutoff_) { change(*before_exit_); }
  if (all_.drained() || (before_exit_ && before_exit_->drained())) { changed_.notify_all(); }
}

template <typename Look, typename GaveUp>
release_count::exit_outcome release_count::wait_exit(std::chrono::steady_clock::time_point deadline,
                                                     std::chrono::nanoseconds interval, Look look,
                                                     GaveUp gave_up) noexcept
{
  std::unique_lock lock{mutex_};
  const tally& waited = *before_exit_;
  const auto unreachable = [&] {
    std::size_t count = 0;
    for (const auto& [where, pending] : waited.by_stream) {
      if (gave_up(where)) { count += pending; }
    }
    return count;
  };
  while (waited.pending > unreachable() + waited.bound_to_graphs && std::chrono::steady_clock::now() < deadline) {
    changed_.wait_for(lock, interval);
    lock.unlock();
    look();
    lock.lock();
  }
  exit_outcome out{.left = waited.pending,
                   .bound_to_graphs = waited.bound_to_graphs,
                   .unreachable = unreachable(),
                   .asked_meanwhile = all_.pending - waited.pending,
                   .unreachable_by_stream = {}};
  try {
    for (const auto& [where, pending] : waited.by_stream) {
      if (gave_up(where)) { out.unreachable_by_stream.emplace_back(where, pending); }
    }
  } catch (...) {}  // out of memory: counted all the same, only not said by stream
  return out;
}

}  // namespace handoff::detail
