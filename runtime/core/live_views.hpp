// Private: the gauges behind stats().live_views and stats().pending_releases.
#pragma once

#include <cstdint>

namespace handoff::detail {
void live_view_added() noexcept;
void live_view_released() noexcept;
/// A deferred release was asked for (`+1`), or has run or been given up (`-1`).
void pending_releases_changed(int delta) noexcept;
/// The gauges of the hand-off across processes: mappings of other processes' memory open here, and
/// consumers of this process's shares that have not told it they are done.
void ipc_mappings_changed(int delta) noexcept;
void set_ipc_pending_remote_releases(std::int64_t count) noexcept;
}  // namespace handoff::detail
