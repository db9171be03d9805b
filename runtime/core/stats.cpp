#include <handoff/internal/counters.hpp>
#include <handoff/stats.hpp>

#include "core/live_views.hpp"

#include <array>
#include <atomic>
#include <cstddef>

namespace handoff {
namespace {

constexpr std::size_t counter_count = static_cast<std::size_t>(counter::ipc_opens) + 1;

// Relaxed atomics: the counters are statistics, not synchronization.
std::array<std::atomic<std::uint64_t>, counter_count> counters{};
std::atomic<std::int64_t> live{0};
std::atomic<std::int64_t> pending{0};
std::atomic<std::int64_t> ipc_mappings{0};
std::atomic<std::int64_t> ipc_remote_pending{0};

std::uint64_t load(counter which) noexcept
{
  return counters[static_cast<std::size_t>(which)].load(std::memory_order_relaxed);
}

}  // namespace

void count(counter which, std::uint64_t n) noexcept
{
  counters[static_cast<std::size_t>(which)].fetch_add(n, std::memory_order_relaxed);
}

stats_snapshot stats() noexcept
{
  return {load(counter::exports),
          load(counter::imports),
          load(counter::waits_inserted),
          load(counter::waits_elided),
          load(counter::events_created),
          load(counter::events_reused),
          load(counter::deferred_releases),
          live.load(std::memory_order_relaxed),
          pending.load(std::memory_order_relaxed),
          load(counter::ipc_shares),
          load(counter::ipc_opens),
          ipc_mappings.load(std::memory_order_relaxed),
          ipc_remote_pending.load(std::memory_order_relaxed)};
}

void reset_stats() noexcept
{
  for (auto& c : counters) { c.store(0, std::memory_order_relaxed); }
}

namespace detail {
void live_view_added() noexcept
{
  live.fetch_add(1, std::memory_order_relaxed);
}
void live_view_released() noexcept
{
  live.fetch_sub(1, std::memory_order_relaxed);
}
void pending_releases_changed(int delta) noexcept
{
  pending.fetch_add(delta, std::memory_order_relaxed);
}
void ipc_mappings_changed(int delta) noexcept
{
  ipc_mappings.fetch_add(delta, std::memory_order_relaxed);
}
void set_ipc_pending_remote_releases(std::int64_t count) noexcept
{
  ipc_remote_pending.store(count, std::memory_order_relaxed);
}
}  // namespace detail

}  // namespace handoff
