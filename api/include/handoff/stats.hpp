// Process-wide exchange counters (`handoff.stats()`).
#pragma once

#include <cstdint>

namespace handoff {

/// A snapshot of the counters. Each is monotonic except the gauges `live_views`, `pending_releases`,
/// `ipc_mappings_cached` and `ipc_pending_remote_releases`.
struct stats_snapshot {
  std::uint64_t exports{0};                     ///< tensors exported (__dlpack__)
  std::uint64_t imports{0};                     ///< producers imported (from_dlpack, asarray)
  std::uint64_t waits_inserted{0};              ///< streams made to wait on another's event: a consumer on its
                                                ///< producer's; at a CUDA Array Interface release, the reverse
  std::uint64_t waits_elided{0};                ///< orderings skipped: same stream, or already ordered
  std::uint64_t events_created{0};              ///< events created by the event pool
  std::uint64_t events_reused{0};               ///< events taken from the pool instead of created
  std::uint64_t deferred_releases{0};           ///< releases deferred until a consumer stream was done
  std::int64_t live_views{0};                   ///< producers currently kept alive by handoff
  std::int64_t pending_releases{0};             ///< deferred releases asked for and not yet run (nor given up)
  std::uint64_t ipc_shares{0};                  ///< arrays shared with other processes (ipc::share)
  std::uint64_t ipc_opens{0};                   ///< handles of other processes opened (ipc::open)
  std::int64_t ipc_mappings_cached{0};          ///< gauge: mappings of other processes' memory open in this process
  std::int64_t ipc_pending_remote_releases{0};  ///< gauge: opens of this process's shares by other
                                                ///< processes not yet released there
};

[[nodiscard]] stats_snapshot stats() noexcept;
/// Zeroes the monotonic counters; the gauges keep counting what is alive and pending.
void reset_stats() noexcept;
}  // namespace handoff
