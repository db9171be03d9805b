// Internal: bumping the counters behind handoff::stats().
#pragma once

#include <cstdint>

namespace handoff {

/// The monotonic counters, in the order of stats_snapshot.
enum class counter {
  exports,
  imports,
  waits_inserted,
  waits_elided,
  events_created,
  events_reused,
  deferred_releases,
  ipc_shares,
  ipc_opens,
};

/// Adds `n` to a counter. Lock-free.
void count(counter which, std::uint64_t n = 1) noexcept;

}  // namespace handoff
