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

/// Names of the counters, for bindings. Order matches stats_snapshot.
enum class counter { exports, imports, waits_inserted, waits_elided, events_created, events_reused, deferred_releases };

[[nodiscard]] stats_snapshot stats() noexcept;
/// Zeroes the monotonic counters; the gauges keep counting what is alive and pending.
void reset_stats() noexcept;
/// Adds `n` to a counter. Lock-free.
void count(counter which, std::uint64_t n = 1) noexcept;
/// Adds `n` to a counter whose updates its callers serialize themselves (the Python binding counts
/// its imports and exports holding the GIL): a plain load and store, where count()'s atomic
/// read-modify-write costs several nanoseconds on every exchange. A counter is updated one way only.
void count_serialized(counter which, std::uint64_t n = 1) noexcept;

}  // namespace handoff
