#include "core/release_count.hpp"

#include "core/live_views.hpp"

namespace handoff::detail {

std::uint64_t release_count::add(stream_key where)
{
  std::lock_guard lock{mutex_};
  const std::uint64_t sequence = next_sequence_;
  ++all_.by_stream[where];  // first: an allocation that fails changes nothing (and the exit's tally
                            // counts only releases asked for before it began)
  ++all_.pending;
  ++next_sequence_;
  pending_releases_changed(+1);
  return sequence;
}

void release_count::remove(stream_key where, std::uint64_t sequence) noexcept
{
  std::lock_guard lock{mutex_};
  update(sequence, [where](tally& t) {
    if (const auto it = t.by_stream.find(where); it != t.by_stream.end() && --it->second == 0) {
      t.by_stream.erase(it);
    }
    --t.pending;
  });
  pending_releases_changed(-1);
}

void release_count::bind_to_graph(std::uint64_t sequence, bool bound) noexcept
{
  std::lock_guard lock{mutex_};
  update(sequence, [bound](tally& t) {
    if (bound) {
      ++t.bound_to_graphs;
    } else {
      --t.bound_to_graphs;
    }
  });
}

void release_count::wait_drained()
{
  std::unique_lock lock{mutex_};
  changed_.wait(lock, [this] { return all_.drained(); });
}

bool release_count::wait_drained_for(std::chrono::nanoseconds limit)
{
  std::unique_lock lock{mutex_};
  return changed_.wait_for(lock, limit, [this] { return all_.drained(); });
}

std::vector<release_count::stream_key> release_count::begin_exit()
{
  std::lock_guard lock{mutex_};
  std::vector<stream_key> streams;
  streams.reserve(all_.by_stream.size());
  for (const auto& [where, count] : all_.by_stream) { streams.push_back(where); }
  before_exit_ = all_;
  exit_cutoff_ = next_sequence_;
  return streams;
}

bool release_count::asked_since_exit_began() const
{
  std::lock_guard lock{mutex_};
  return !before_exit_ || next_sequence_ > exit_cutoff_;
}

std::uint64_t release_count::first_after_exit_began() const
{
  std::lock_guard lock{mutex_};
  return before_exit_ ? exit_cutoff_ : 0;
}

}  // namespace handoff::detail
