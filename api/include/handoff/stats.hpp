// Process-wide exchange counters (`handoff.stats()`).
#pragma once

#include <cstdint>

namespace handoff {

/// A snapshot of the counters. Each is monotonic except the gauges `live_views` and `pending_releases`.
struct stats_snapshot {
  std::uint64_t exports{0};            ///< tensors exported (__dlpack__)
  std::uint64_t imports{0};            ///< producers imported (from_dlpack, asarray)
  std::uint64_t waits_inserted{0};     ///< streams made to wait on another's event: a consumer on its
                                       ///< producer's; at a CUDA Array Interface release, the reverse
  std::uint64_t waits_elided{0};       ///< orderings skipped: same stream, or already ordered
  std::uint64_t events_created{0};     ///< events created by the event pool
  std::uint64_t events_reused{0};      ///< events taken from the pool instead of created
  std::uint64_t deferred_releases{0};  ///< releases deferred until a consumer stream was done
  std::int64_t live_views{0};          ///< producers currently kept alive by handoff
  std::int64_t pending_releases{0};    ///< deferred releases asked for and not yet run (nor given up)
};

[[nodiscard]] stats_snapshot stats() noexcept;
/// Zeroes the monotonic counters; the gauges keep counting what is alive and pending.
void reset_stats() noexcept;
}  // namespace handoff
